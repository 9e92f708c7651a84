"""The embedded demo runs end to end (small sizes) and resumes by skipping finished stages."""

import json

import pytest

from opdcache.demo.pipeline import DemoConfig, run_demo
from opdcache.validate import validate


@pytest.mark.slow
def test_demo_pipeline_end_to_end_and_rerun_skips(tmp_path):
    cfg = DemoConfig(workdir=tmp_path / "demo", n_train=64, n_opd=32, n_heldout=40, sft_steps=20, opd_steps=2, samples=1)
    report = run_demo(cfg)
    w = cfg.workdir
    for name in ("teacher", "base", "pi_ref", "opd"):
        assert 0.0 <= report.figures[name]["accuracy"] <= 1.0 and report.figures[name]["reverse_kl"] >= 0
    assert report.figures["teacher"]["accuracy"] >= 0.95
    assert validate(w / "caches" / "rollouts") == [] and validate(w / "caches" / "sft") == []
    manifest = json.loads((w / "caches" / "rollouts" / "opdcache.json").read_text())
    assert set(manifest["tables"]) == {"rollouts", "teachers/teacher"}
    assert manifest["tables"]["teachers/teacher"]["consistency"]["verdict"] == "consistent"
    assert (w / "runs" / "lightning" / "metrics.jsonl").is_file()
    again = run_demo(cfg)
    assert sum("already done, skipped" in line for line in again.lines) == 5
