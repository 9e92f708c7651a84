"""QaRL (papers/004) on the demo models: low-bit rollouts recorded exactly, the learner aligned to them
(``train --rollout-aligned``), error tokens counted, and the KL-penalty and loss mends."""

import json

import numpy as np
import pytest
import torch

from opdcache.backends import EngineConfig
from opdcache.backends.base import SamplingConfig
from opdcache.cli.main import main
from opdcache.errors import ConfigError
from opdcache.format.cache import Cache
from opdcache.inputs.prompts import PromptConfig
from opdcache.teacher import mismatch as MM
from opdcache.teacher.rollouts import GenerateJob, run_generate
from opdcache.teacher.scoring import run_score, ScoreJob
from opdcache.training import losses as L
from opdcache.training.train import TrainConfig, Trainer


def run(args) -> int:
    """The CLI's exit code (main exits through SystemExit)."""
    with pytest.raises(SystemExit) as e:
        main(args)
    return e.value.code


def _cache(root, weights, prompts, quantize):
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(prompts, limit=12), out=root, num_shards=2,
                             sampling=SamplingConfig(temperature=1.0, max_new_tokens=40, samples=2),
                             engine=EngineConfig(quantize=quantize), sft_teacher=weights / "teacher"))
    run_score(ScoreJob(cache=root, teacher=weights / "teacher", stores=("logprob",)))
    return root


@pytest.fixture(scope="module")
def w4_cache(tmp_path_factory, weights, opd_prompts):
    return _cache(tmp_path_factory.mktemp("w4") / "cache", weights, opd_prompts, "w4a16:g32")


def _student_logprobs(cache, weights, tmp_path, aligned: bool, **settings):
    """The trainer's own forward of pi_ref on one batch of the cache: (its log-probs, the stored sampling log-probs, mask)."""
    trainer = Trainer(TrainConfig(model=weights / "student", cache=cache, out=tmp_path / f"run-{aligned}-{len(settings)}", batch_size=8,
                                  rollout_aligned=aligned, pack=False, **settings))
    batch = trainer.source.next_batch()
    sel = batch["response_mask"].bool()
    with torch.no_grad():
        lp, _, _ = trainer.forward(batch["input_ids"], batch["attention_mask"], batch["logit_positions"], sel,
                                   batch["response_ids"][sel][:, None])
    return lp[:, 0].double().numpy(), batch["sampling_logprobs"][sel].double().numpy()


def test_the_manifest_records_the_whole_scheme(w4_cache, capsys):
    model = Cache(w4_cache).table("rollouts")["model"]
    assert model["quantization"] == "w4a16:g32:sym:compressed-tensors:keep=lm_head"
    assert run(["info", str(w4_cache)]) == 0
    assert "computed by transformers/float32/w4a16:g32:sym:compressed-tensors:keep=lm_head" in " ".join(capsys.readouterr().out.split())


def test_vllm_fp8_rollouts_are_refused_alike_by_train_and_mismatch_report(hf_cache, weights, tmp_path, capsys):
    """vLLM's dynamic fp8 scales activations per tensor over the batch: no learner reproduces it, so neither the trainer
    nor the measurement claims an alignment (a copy of the cache whose manifest records vLLM's fp8)."""
    import json
    import shutil

    cache = tmp_path / "vllm-fp8"
    shutil.copytree(hf_cache, cache)
    manifest = json.loads((cache / "opdcache.json").read_text())
    manifest["tables"]["rollouts"]["model"] |= {"engine": "vllm", "quantization": "fp8"}
    (cache / "opdcache.json").write_text(json.dumps(manifest))
    want = "ran vLLM's 'fp8' kernels, which opdcache does not emulate"
    with pytest.raises(ConfigError, match=want):
        Trainer(TrainConfig(model=weights / "student", cache=cache, out=tmp_path / "t", rollout_aligned=True))
    assert run(["mismatch-report", str(cache), "--rollout-aligned", "--out", str(tmp_path / "m"), "--no-png"]) == 2
    err = capsys.readouterr().err
    assert want in err and "--engine transformers --quantize" in err and len(err.strip().splitlines()) == 1


def test_the_aligned_learner_reproduces_the_rollout_engine(w4_cache, weights, tmp_path):
    """pi_ref's forward under alignment reproduces the cached sampling log-probs of w4a16
    rollouts (temperature 1) to <= 1e-5; the unaligned forward differs by >= 1e-2 on average."""
    aligned, stored = _student_logprobs(w4_cache, weights, tmp_path, True)
    plain, stored2 = _student_logprobs(w4_cache, weights, tmp_path, False)
    assert np.array_equal(stored, stored2) and stored.size > 100
    assert np.abs(aligned - stored).max() <= 1e-5
    assert np.abs(plain - stored).mean() >= 1e-2


def test_a_lora_student_aligns_its_frozen_base_and_merges_onto_the_base_itself(w4_cache, weights, tmp_path):
    """QaRL with LoRA: the frozen base computes in the rollouts' scheme (once, in place), the float32 adapters outside
    it. Before any update the LoRA learner is the aligned pi_ref (its lora_B are 0), so it reproduces the cached
    sampling log-probs as the full aligned learner does; it trains on-policy at step 1; and its merged output is the
    base's own weights plus the adapters (B A, rank <= r), not the quantized weights it trained against."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    aligned, stored = _student_logprobs(w4_cache, weights, tmp_path, True, lora_rank=8)
    assert np.abs(aligned - stored).max() <= 1e-5
    out = tmp_path / "lora"
    assert run(["train", "--model", str(weights / "student"), "--cache", str(w4_cache), "--out", str(out), "--steps", "2",
                "--batch-size", "4", "--loss", "is", "--rollout-aligned", "--lora-rank", "8", "--lr", "1e-2",
                "--save", "merged", "--no-progress"]) == 0
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["rho_mean"] == pytest.approx(1.0, abs=1e-5)
    base = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float64)
    merged = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float64)
    name = next(n for n, _ in base.named_modules() if n.endswith("layers.0.self_attn.q_proj"))
    delta = merged.get_submodule(name).weight - base.get_submodule(name).weight
    s = torch.linalg.svdvals(delta)
    # rank 8: the 9th singular value is float32 rounding of the merged weights (~1e-7 of them), far below the 8th; a
    # merge onto the w4 weights would add their rounding, a full-rank error ~1/16 of a weight's group scale
    assert float(s[0]) > 0 and float(s[8]) < 1e-4 * float(s[0]), s[:10]
    from opdcache.backends.quant import parse_quantize

    w = base.get_submodule(name).weight.float()
    onto_w4 = delta + (parse_quantize("w4a16:g32").weight(w) - w).double()  # what a merge onto the trained weights gives
    s4 = torch.linalg.svdvals(onto_w4)
    assert float(s4[8]) > 1e-2 * float(s4[0]), s4[:10]


def test_mismatch_report_measures_both(w4_cache, tmp_path, capsys):
    rep, _ = MM.report(w4_cache, aligned=True)
    plain, aligned = rep["sections"]["rollouts"], rep["sections"]["rollouts, aligned"]
    assert aligned["max_abs_delta"] <= 1e-5 and plain["mean_abs_delta"] >= 1e-2
    assert "w4a16:g32:sym:compressed-tensors:keep=lm_head" in aligned["description"]
    e = plain["error_tokens"]
    assert e["rule"].startswith("error token: p_learner < 0.001") and 0 <= e["token_share"] <= 1
    assert aligned["error_tokens"]["tokens"] == 0  # an exact learner sees no token the engine made likelier than it would
    assert run(["mismatch-report", str(w4_cache), "--rollout-aligned", "--out", str(tmp_path / "r"), "--no-png"]) == 0
    out = capsys.readouterr().out
    assert "rollouts, aligned" in out and "error tokens (papers/004)" in out


def test_error_token_rule_by_hand():
    from opdcache.inputs.errortokens import error_token_mask, is_error_sequence, tail_repetition

    learner = np.log(np.array([0.5, 1e-4, 1e-4, 0.2, 1e-5]))
    rollout = np.log(np.array([0.5, 1e-4, 5e-3, 0.2, 1e-3]))
    assert error_token_mask(learner, rollout).tolist() == [False, False, True, False, True]  # exploration (ratio 1) is not one
    assert is_error_sequence(np.arange(5), error_token_mask(learner, rollout))  # two: a cluster
    one = np.array([False, True] + [False] * 10)
    assert tail_repetition([1, 2, 3, 4] * 3, 1) == pytest.approx(5 / 8)
    assert is_error_sequence(np.array([9, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]), one)
    assert not is_error_sequence(np.arange(12), one)


def test_aligned_training_runs_and_logs_error_tokens(w4_cache, weights, tmp_path):
    out = tmp_path / "run"
    assert run(["train", "--model", str(weights / "student"), "--cache", str(w4_cache), "--out", str(out), "--steps", "2",
                 "--batch-size", "4", "--loss", "is", "--rollout-aligned", "--trust-band"]) == 0
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("error_token_share" in r for r in rows)
    # step 1 is on-policy for the aligned learner: every importance weight is 1 and nothing is outside the band
    assert rows[0]["rho_mean"] == pytest.approx(1.0, abs=1e-5) and rows[0]["band_rejected_fraction"] == 0.0


def test_alignment_refusals(hf_cache, weights, tmp_path, capsys):
    with pytest.raises(ConfigError, match="records no quantization .*nothing to align to"):
        Trainer(TrainConfig(model=weights / "student", cache=hf_cache, out=tmp_path / "a", rollout_aligned=True))
    assert run(["mismatch-report", str(hf_cache), "--rollout-aligned", "--out", str(tmp_path / "m"), "--no-png"]) == 2
    assert "nothing to align to; run without --rollout-aligned" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--online samples the student in full precision"):
        TrainConfig(model=weights / "student", cache=hf_cache, out=tmp_path / "b", rollout_aligned=True, online=True,
                    teacher_model=weights / "teacher")
    with pytest.raises(ConfigError, match=r"group size 128 does not divide the 64 input columns of .*w4a16:g64"):
        EngineConfig(quantize="w4a16")  # parses; the model check is at load time
        from opdcache.backends.loading import load_model

        load_model(weights / "student", quantize="w4a16")


def test_online_k1_penalty_is_refused_with_the_reason(weights, tmp_path):
    with pytest.raises(ConfigError, match="zero expected gradient"):
        TrainConfig(model=weights / "student", cache=tmp_path, out=tmp_path / "o", online=True, teacher_model=weights / "teacher",
                    kl_coef=0.1, kl_estimator="k1")


def test_the_k3_penalty_is_capped():
    s = torch.tensor([[0.0, 25.0, -1.0]], requires_grad=True)
    r = torch.zeros(1, 3)
    uncapped = L.kl_penalty_terms(s, r, "k3")
    assert float(uncapped[0, 1].detach()) > 1e8  # exp(20): one token outweighs any batch
    capped = L.kl_penalty_terms(s, r, "k3", cap=10.0)
    assert float(capped[0, 1].detach()) == 10.0 and torch.equal(capped[0, [0, 2]], uncapped[0, [0, 2]])
    capped.sum().backward()
    assert s.grad[0, 1] == 0  # a clamped term pulls no further
    assert TrainConfig.__dataclass_fields__["kl_cap"].default == 10.0


def test_non_finite_values_at_masked_positions_do_not_leak(hf_cache, weights, tmp_path):
    """A NaN or inf in padding (outside the response mask) changes neither the loss nor any gradient."""
    for loss in ("lightning", "is"):
        trainer = Trainer(TrainConfig(model=weights / "student", cache=hf_cache, out=tmp_path / loss, batch_size=4, loss=loss, kl_coef=0.1, pack=False))
        batch = trainer.source.next_batch()
        mask = batch["response_mask"].clone()
        last = mask.cumsum(-1) > mask.sum(-1, keepdim=True) - 3  # each row's last 3 response tokens become padding
        batch["response_mask"] = mask * ~last
        pad = ~batch["response_mask"].bool()
        assert pad.any() and batch["response_mask"].any()
        dirty = dict(batch)
        for name in ("teacher_logprobs", "sampling_logprobs", "ref_logprobs"):
            dirty[name] = batch[name].masked_fill(pad, float("nan"))
        dirty["teacher_logprobs"] = dirty["teacher_logprobs"].masked_fill(pad & (torch.arange(pad.shape[1]) % 2 == 0), float("inf"))
        grads = []
        for b in (batch, dirty):
            trainer.opt.zero_grad(set_to_none=True)
            value, _ = trainer.loss_and_stats(b)
            value.backward()
            grads.append((float(value.detach()), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]))
        assert np.isfinite(grads[1][0]) and grads[0][0] == grads[1][0]
        assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1]))
