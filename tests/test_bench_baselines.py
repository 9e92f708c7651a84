"""The benchmarks' baselines do the work they claim: bench_scale's full-logits train step (``logits_to_keep`` from the
first response position; the GPU suite's train baseline too) gives the fused step's loss and gradients, and
bench_scale's per-command peak is the child's anonymous memory, sampled from outside it."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))


def _staggered(batch: dict) -> dict:
    """The batch with row i's prompt i tokens longer (its first prompt tokens repeated in front): the responses start
    at different positions, as in a cache of prompts of different lengths."""
    B, L = batch["input_ids"].shape
    out = {k: v.clone() for k, v in batch.items()}
    out["input_ids"] = torch.zeros(B, L + B - 1, dtype=batch["input_ids"].dtype)
    out["attention_mask"] = torch.zeros_like(out["input_ids"])
    for i in range(B):
        n = int(batch["attention_mask"][i].sum())
        row = torch.cat([batch["input_ids"][i, :i], batch["input_ids"][i, :n]])
        out["input_ids"][i, : n + i], out["attention_mask"][i, : n + i] = row, 1
        out["logit_positions"][i] = torch.where(batch["response_mask"][i] > 0, batch["logit_positions"][i] + i, 0)
    return out


@pytest.mark.parametrize("loss", ["lightning", "full-rkl", "full-fkl"])
def test_the_full_logits_baseline_is_the_fused_steps_loss_and_gradients(hf_cache, weights, tmp_path, loss):
    from bench_scale import full_logits_loss

    from opdcache.training.train import TrainConfig, Trainer

    trainer = Trainer(TrainConfig(model=weights / "student", cache=hf_cache, out=tmp_path, loss=loss, batch_size=6, kl_coef=0.0, pack=False))  # the main loss
    batch = _staggered(trainer.source.next_batch())
    starts = batch["logit_positions"][:, 0]
    assert int(starts.min()) > 0 and int(starts.max()) > int(starts.min())  # logits are cut before the earliest response
    fused, _ = trainer.loss_and_stats(batch)
    fused.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.model.zero_grad()
    plain = full_logits_loss(trainer, batch, loss)
    plain.backward()
    torch.testing.assert_close(plain, fused, rtol=1e-5, atol=1e-6)
    for n, p in trainer.model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_run_measured_reports_the_childs_anonymous_peak_and_its_own_rusage(tmp_path):
    from bench_scale import run_measured

    child = ("import time; block = bytearray(96 << 20); block[::4096] = b'x' * len(block[::4096]); time.sleep(0.3); "
             "print('done')")
    m = run_measured([sys.executable, "-c", child])
    assert m["stdout"] == "done\n"
    assert 96 << 20 <= m["peak_anon"] < 200 << 20  # the bytearray, sampled while it lived, plus the interpreter
    assert m["peak_rss"] >= m["peak_anon"] and m["cpu_seconds"] > 0
    small = run_measured([sys.executable, "-c", "print('small')"])
    assert small["peak_anon"] < 40 << 20  # its own process's, not the larger child's before it
    with pytest.raises(SystemExit, match="failed \\(3\\)"):
        run_measured([sys.executable, "-c", "import sys; sys.exit(3)"])
