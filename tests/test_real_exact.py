"""--exact on a real pretrained model, SmolLM2-135M-Instruct (marker ``real``; the model as tests/test_real.py has it)."""

import json

import numpy as np
import pytest
import torch
from realchat import SYSTEM

pytestmark = [pytest.mark.real, pytest.mark.slow]


def test_exact_mode_on_the_real_model(smollm2, real_prompts, tmp_path, capsys):
    """--exact on SmolLM2 (GQA, tied embeddings, 49,152 tokens): 32 sequences in 2 batches at temperature 0.9 and top-p
    0.95 whose stored numbers every recompute reproduces bit for bit; the engine invariant to batch size and threads, in
    float32 and bfloat16."""
    from opdcache.backends.base import GenerateRequest, SamplingConfig
    from opdcache.backends.exact import ExactBackend
    from opdcache.cli.main import main

    out = tmp_path / "exact"

    def cli(*args):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in args])
        text = capsys.readouterr()
        assert e.value.code in (0, None), text.out + text.err
        return text.out

    cli("build-rollouts", "--model", smollm2, "--prompts", real_prompts, "--messages-field", "messages", "--system-prompt", SYSTEM,
        "--out", out, "--num-shards", 2, "--samples", 8, "--temperature", 0.9, "--top-p", 0.95, "--max-new-tokens", 8,
        "--ref-top-k", 4, "--exact", "--batch-size", 16)
    cli("score-teacher", out, "--teacher", smollm2, "--store", "logprob,topk", "--top-k", 8, "--name", "smollm2",
        "--allow-inconsistent-teacher", "--exact")
    manifest = json.loads((out / "opdcache.json").read_text())
    assert sum(s["rows"] for s in manifest["tables"]["rollouts"]["shards"]) == 32
    cli("mismatch-report", out, "--exact", "--no-png", "--out", tmp_path / "mm", "--max-abs-delta", 0)
    rep = json.loads((tmp_path / "mm" / "mismatch_report.json").read_text())
    assert all(s["max_abs_delta"] == 0 for s in rep["sections"].values()) and len(rep["sections"]) == 2
    report = cli("audit", out, "--rows", 4, "--json")
    assert json.loads(report[report.index("{"):])["passed"]
    for dtype in ("float32", "bfloat16"):
        engine = ExactBackend(smollm2, dtype=dtype)
        reqs = [GenerateRequest([1, 9690, 2683, 28, 253, 2012, 2 + i], seed=i) for i in range(7)]
        s = SamplingConfig(temperature=0.9, top_p=0.95, max_new_tokens=6, ref_top_k=3)
        torch.set_num_threads(2)
        a = engine.generate(reqs, s)  # one batch of 7, on 2 threads; then batches of 3, 3 and 1 on one, in reverse order
        engine.generate_batch_size = 3
        torch.set_num_threads(1)
        b = engine.generate(reqs[::-1], s)[::-1]
        for x, y in zip(a, b):
            for f in ("response_ids", "sampling_logprobs", "ref_logprobs", "ref_topk_ids", "ref_topk_logprobs"):
                assert np.array_equal(getattr(x, f), getattr(y, f)), (dtype, f)
