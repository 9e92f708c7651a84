"""The examples under examples/ run as a user would run them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.trl
def test_trl_trainer_trains_from_the_cache_and_its_loss_decreases(hf_cache, weights, tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "trl_cache_trainer.py"), "--model", str(weights / "student"), "--cache", str(hf_cache),
                           "--out", str(out), "--loss", "full-rkl", "--steps", "20", "--batch-size", "16", "--lr", "3e-4"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads((out / "losses.json").read_text())
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
