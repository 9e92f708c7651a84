"""One stage of an async run as a process: ``python -m opdcache.asyncopd.worker STAGE RUN_DIR PARENT_PID``.

The supervisor (opdcache/asyncopd/run.py) starts one per stage. A library error is one line on stderr, ``error: ...``,
with exit 2 (usage: a model or prompt file that cannot be used) or 1 (anything else); the supervisor shows that line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    stage, run_dir, parent = argv[0], Path(argv[1]), int(argv[2])
    threads = int(os.environ.get("OPDCACHE_STAGE_THREADS", "0"))
    import torch

    if threads:
        torch.set_num_threads(threads)
    from opdcache.asyncopd.config import AsyncConfig
    from opdcache.asyncopd.queue import RUN_FILE
    from opdcache.asyncopd.stages import run_stage
    from opdcache.cli.main import USAGE_ERRORS
    from opdcache.errors import OpdcacheError

    cfg = AsyncConfig.from_json(json.loads((run_dir / RUN_FILE).read_text())["config"])
    try:
        run_stage(stage, cfg, parent)
    except OpdcacheError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2 if isinstance(exc, USAGE_ERRORS) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
