"""notebooks/quickstart.ipynb runs top to bottom (executed in CI, like a user would)."""

import re
import shutil
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch, demo_workdir):
    """Top to bottom in a copy of the work directory `opdcache demo` built (the session's fixture, which the README's
    block starts from too): the notebook's stages are the demo's, so each finds its work done, as a user's rerun does,
    and the notebook trains and evaluates its own run. A build from nothing is `opdcache demo`'s own test."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    shutil.copytree(demo_workdir, tmp_path / "work", symlinks=True)
    monkeypatch.setenv("OPDCACHE_NOTEBOOK_WORKDIR", str(tmp_path / "work"))
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


def test_the_committed_notebook_carries_its_outputs():
    """What a reader sees on GitHub without running it: every code cell's output, the figure, the two accuracies."""
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("outputs") for c in code)
    outputs = [o for c in code for o in c["outputs"]]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert [o for o in outputs if "image/png" in o.get("data", {})]
    text = "".join(o.get("text", "") for o in outputs)
    assert "pi_ref (SFT)   held-out accuracy 90.7%" in text and "Lightning OPD  held-out accuracy 92.3%" in text
    assert "/tmp" not in text  # no machine-specific paths
