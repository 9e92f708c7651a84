"""notebooks/quickstart.ipynb is committed with its outputs (tests/test_readme.py executes it top to bottom, in the `slow`
group, after the session's `opdcache demo`)."""

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"


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
