"""notebooks/quickstart.ipynb runs top to bottom (executed in CI, like a user would)."""

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("OPDCACHE_NOTEBOOK_WORKDIR", str(tmp_path / "work"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=None,  # no per-cell clock: a busy machine is slow, not broken
                           kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert (tmp_path / "work" / "dynamics.png").stat().st_size > 10_000
    text = "".join(o.get("text", "") for o in outputs)
    assert "teacher consistency: consistent" in text
