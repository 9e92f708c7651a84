"""What a user runs after `opdcache demo`, in copies of the work directory it built (one demo a session, the fixture
``demo_workdir``; this file runs on one pytest-xdist worker, so the demo runs once): the README's hand-run block works as
written and leaves what the work directory depends on untouched (every stage the demo ran finds its work done with the
demo's settings), and the quickstart notebook runs top to bottom."""

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
NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"


def _blocks(path: Path) -> list[str]:
    """The bash blocks of ``path`` marked to be run as written after `opdcache demo`."""
    return re.findall(r"<!-- hand-run:[^\n]*-->\n```bash\n(.*?)```\n<!-- /hand-run -->", path.read_text(), re.S)


def _block() -> str:
    blocks = _blocks(README)
    assert blocks, "README.md has no hand-run block"
    return blocks[0]


DOCS_WITH_BLOCKS = ("teachers.md",)
"""docs/ pages whose commands are the demo's work directory's, run as written (each block in its own copy)."""


@pytest.mark.parametrize("page", DOCS_WITH_BLOCKS)
def test_the_docs_blocks_run_as_written_after_the_demo(tmp_path, demo_workdir, user_threads, page):
    blocks = _blocks(README.parent / "docs" / page)
    assert blocks, f"docs/{page} has no hand-run block"
    env = {**os.environ, "OPDCACHE_PROGRESS": "0"}
    for i, block in enumerate(blocks):
        here = tmp_path / str(i)
        shutil.copytree(demo_workdir, here / "opdcache-demo", symlinks=True)
        proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block], cwd=here, capture_output=True, text=True,
                              env=env, timeout=1200)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "Traceback" not in out, f"docs/{page} block {i}: " + out[-3000:]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_hand_run_block_works_after_the_demo_and_changes_nothing_the_demo_built(tmp_path, demo_workdir, user_threads):
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


def test_quickstart_notebook_executes(tmp_path, monkeypatch, demo_workdir, user_threads):
    """Top to bottom in a copy of the work directory `opdcache demo` built (the session's fixture, which the README's
    block starts from too): the notebook's stages are the demo's, so each finds its work done, as a user's rerun does,
    and the notebook trains and evaluates its own run (on the machine's threads, as the figures it states were). A build
    from nothing is `opdcache demo`'s own test."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    shutil.copytree(demo_workdir, tmp_path / "work", symlinks=True)
    monkeypatch.setenv("OPDCACHE_NOTEBOOK_WORKDIR", str(tmp_path / "work"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))  # its datasets cell reads this copy, never an older one
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=None,  # no per-cell clock: a busy machine is slow, not broken
                           kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert (tmp_path / "work" / "dynamics.png").stat().st_size > 10_000
    text = "".join(o.get("text", "") for o in outputs)
    assert "teacher consistency: consistent" in text
    assert [o for o in outputs if "image/png" in o.get("data", {})]  # the figure is shown, not only saved
    acc = dict(re.findall(r"^(pi_ref \(SFT\)|Lightning OPD)\s+held-out accuracy ([\d.]+)%", text, re.M))
    assert float(acc["Lightning OPD"]) > float(acc["pi_ref (SFT)"])  # the demo's settings move 90.7% -> 92.3% on 2 threads
