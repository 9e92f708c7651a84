"""One stage of an async run as a process: ``python -m opdcache.asyncopd.worker STAGE RUN_DIR PARENT_PID``.

The supervisor (opdcache/asyncopd/run.py) starts one per stage. A library error is one line on stderr, ``error: ...``,
with exit 2 (usage: a model or prompt file that cannot be used) or 1 (anything else); the supervisor shows that line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def die_with_parent() -> None:
    """Linux: the kernel sends this process SIGTERM when its parent (the supervisor) dies, even by SIGKILL, so no stage
    keeps stepping on its own (the stages' polling of the parent pid stays as the portable fallback)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    stage, run_dir, parent = argv[0], Path(argv[1]), int(argv[2])
    die_with_parent()
    if os.getppid() != parent:  # the supervisor died before the signal was armed
        print("error: the async supervisor is gone; rerun the command to resume", file=sys.stderr, flush=True)
        return 1
    threads = int(os.environ.get("OPDCACHE_STAGE_THREADS", "0"))
    import torch

    if threads:
        torch.set_num_threads(threads)
    from opdcache.asyncopd.config import AsyncConfig
    from opdcache.asyncopd.queue import RUN_FILE
    from opdcache.asyncopd.stages import run_stage
    from opdcache.errors import USAGE_ERRORS, OpdcacheError

    from opdcache.untrusted import read_json

    try:
        cfg = AsyncConfig.from_json(read_json(run_dir / RUN_FILE, str(run_dir / RUN_FILE), OpdcacheError)["config"])
    except (OpdcacheError, KeyError, TypeError) as exc:
        print(f"error: {run_dir / RUN_FILE}: not a usable run record ({str(exc)[:200]})", file=sys.stderr, flush=True)
        return 2
    try:
        run_stage(stage, cfg, parent)
    except OpdcacheError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2 if isinstance(exc, USAGE_ERRORS) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
