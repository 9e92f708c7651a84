"""The README's hand-run block works as written after `opdcache demo` in the same work directory, and leaves what the
work directory depends on untouched: every stage the demo ran finds its work done with the demo's settings."""

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # run by .ci/run (pytest -m slow), not by the README's test command

README = Path(__file__).parent.parent / "README.md"


def _block() -> str:
    text = README.read_text()
    match = re.search(r"<!-- hand-run:[^\n]*-->\n```bash\n(.*?)```\n<!-- /hand-run -->", text, re.S)
    assert match, "README.md has no hand-run block"
    return match.group(1)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_the_hand_run_block_works_after_the_demo_and_changes_nothing_the_demo_built(tmp_path, demo_workdir):
    env = {**os.environ, "OPDCACHE_PROGRESS": "0"}
    work = tmp_path / "opdcache-demo"
    shutil.copytree(demo_workdir, work, symlinks=True)  # where `opdcache demo` ran (the session's fixture)
    def state():  # what the work directory depends on: pi_ref's weights, and each cache table's settings and shard bytes
        tables = {}
        for cache in ("sft", "rollouts"):
            manifest = json.loads((work / "caches" / cache / "opdcache.json").read_text())
            tables.update({f"{cache}:{name}": (t["config_fingerprint"], [s["sha256"] for s in t["shards"]])
                           for name, t in manifest["tables"].items()})
        shards = {p: _digest(p) for p in sorted((work / "caches").rglob("*.parquet"))}
        return _digest(work / "models" / "pi_ref" / "model.safetensors"), tables, shards

    kept = state()
    script = "set -euo pipefail\n" + _block()
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=1800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    assert "already fine-tuned from this model on this data with these settings" in out
    assert state() == kept  # pi_ref, both caches' tables and every shard are the demo's, untouched
    assert (work / "runs" / "lightning" / "model" / "config.json").is_file()
    assert (work / "runs" / "async" / "learner" / "model" / "config.json").is_file()
