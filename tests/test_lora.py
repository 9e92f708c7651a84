"""LoRA students (`train --lora-rank R`, PEFT): the base frozen, the adapters trained, checkpoints of the adapters and
their moments only, a resume that ends with the uninterrupted run's adapters, an adapter folder PEFT loads, a merged
model equal to the adapters applied, and every setting LoRA does not take refused in one line."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("peft")

from opdcache.cli.main import main  # noqa: E402
from opdcache.errors import ConfigError  # noqa: E402
from opdcache.training.train import TrainConfig, run_train  # noqa: E402


def _cfg(weights, cache, out, **kw):
    return TrainConfig(model=weights / "student", cache=cache, out=out, **{"steps": 4, "batch_size": 8, "lr": 1e-3, "lora_rank": 8,
                                                                         "deterministic": True, "checkpoint_every": 2, **kw})


@pytest.fixture(scope="module")
def lora_run(hf_cache, weights, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    run_train(_cfg(weights, hf_cache, out))
    return out


def test_only_the_adapters_train_and_the_checkpoint_holds_them_alone(lora_run, weights):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = lora_run / "checkpoint"
    adapters = load_file(str(ckpt / "adapter.safetensors"))
    assert adapters and all(".lora_" in k for k in adapters)
    assert not (ckpt / "model").exists()
    moments = load_file(str(ckpt / "optimizer.safetensors"))
    n_adapter = sum(t.numel() for t in adapters.values())
    n_moment = sum(t.numel() for k, t in moments.items() if k.endswith(("exp_avg", "exp_avg_sq")))
    assert n_moment == 2 * n_adapter  # AdamW's two moments of the adapters, none of the frozen base
    base = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float32)
    n_base = sum(p.numel() for p in base.parameters())
    written = sum((ckpt / f).stat().st_size for f in ("adapter.safetensors", "optimizer.safetensors"))
    assert written < 0.5 * 16 * n_base  # a full checkpoint writes 16 bytes a parameter
    # the run's output: a PEFT adapter folder, loaded by PEFT onto the base, equal to the adapters trained
    model = PeftModel.from_pretrained(base, lora_run / "model")
    loaded = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    assert len(loaded) == len(adapters)
    final = {k.replace(".default", ""): v for k, v in loaded.items()}
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in final.items() if "lora_B" in k)  # they trained


def test_a_killed_and_resumed_lora_run_ends_with_the_same_adapters(lora_run, hf_cache, weights, tmp_path):
    out = tmp_path / "run"
    first = run_train(_cfg(weights, hf_cache, out, stop_after=3))
    assert first["stopped_at"] == 3
    second = run_train(_cfg(weights, hf_cache, out))
    assert second["resumed"] is True
    a, b = (load_file(str(p / "model" / "adapter_model.safetensors")) for p in (lora_run, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert run_train(_cfg(weights, hf_cache, out)) == {"already_done": True, "steps": 4}


def test_the_merged_model_is_the_base_with_the_adapters_applied(lora_run, hf_cache, weights, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    shutil.copytree(lora_run, out)
    shutil.rmtree(out / "model")
    run_train(_cfg(weights, hf_cache, out, save="merged"))  # the finished checkpoint: only the output is written
    merged = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, lora_run / "model").eval()
    from tolerance import position_error

    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        want, got = peft(ids).logits[0], merged(ids).logits[0]
        exact = peft.double()(ids).logits[0]  # base plus adapters in float64: the function both should compute
        merged_exact = merged.double()(ids).logits[0]  # the merged float32 weights, evaluated in float64
    # the merged model's logits against the exact function: its own arithmetic's float32 error (measured, against its
    # weights in float64) plus the rounding of the merged weights to float32, an error of the same kind as one float32
    # evaluation's, allowed twice the larger measured one (tests/tolerance.py's argument); a merge that drops, doubles
    # or mis-scales the adapters moves the logits by |BA x|, orders of magnitude beyond it
    e_merged, e_peft = position_error(got, merged_exact), position_error(want, exact)
    bound = e_merged + 2 * torch.maximum(e_merged, e_peft)
    assert bool(((got.double() - exact).abs() <= bound[:, None]).all()), float((got.double() - exact).abs().max())
    plain = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float64).eval()
    with torch.no_grad():
        moved = (plain(ids).logits[0] - exact).abs().amax(-1)  # what the adapters change: the bound must be far below it
    assert bool((moved > 100 * bound).all()), (moved, bound)


def test_lora_settings_changed_on_resume_are_refused(lora_run, hf_cache, weights, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(lora_run, out)
    with pytest.raises(ConfigError, match=r"different settings \(lora_rank: 8 -> 4\)"):
        run_train(_cfg(weights, hf_cache, out, lora_rank=4, steps=6))


@pytest.mark.parametrize("args, want", [
    (["--lora-rank", "-1"], "--lora-rank must be a positive integer (0: full fine-tuning), got -1"),
    (["--lora-rank", "8", "--exact"], "--exact with --lora-rank is not supported: the exact arithmetic re-implements"),
    (["--lora-rank", "8", "--fsdp"], "--fsdp with --lora-rank is not supported"),
    (["--lora-rank", "8", "--lora-dropout", "1.5"], "--lora-dropout must be in [0, 1), got 1.5"),
    (["--save", "adapter"], "--save adapter writes a LoRA adapter: train with --lora-rank R, or --save merged"),
    (["--lora-rank", "8", "--save", "both"], "--save must be auto, adapter or merged, got 'both'"),
], ids=["negative", "exact", "fsdp", "dropout", "adapter-without-lora", "save"])
def test_lora_settings_it_cannot_take_are_one_line_before_anything_loads(tmp_path, capsys, args, want):
    with pytest.raises(SystemExit) as e:
        main(["train", "--model", str(tmp_path / "not-loaded"), "--cache", str(tmp_path / "no-cache"), "--out", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and want in err[0], err


@pytest.mark.parametrize("settings, want", [
    (dict(lora_targets="q_proj,w_gate"), "--lora-targets w_gate: LlamaForCausalLM has no such linear layer; its decoder's linear "
                                          "layers are q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
    (dict(lora_rank=4096), "--lora-rank 4096 is larger than the smallest targeted layer's rank"),
], ids=["target", "rank"])
def test_targets_and_ranks_the_model_does_not_have_are_one_line(hf_cache, weights, tmp_path, settings, want):
    with pytest.raises(ConfigError) as e:
        run_train(_cfg(weights, hf_cache, tmp_path / "run", **settings))
    assert want in str(e.value)


@pytest.mark.parametrize("loss", ["lightning", "topk-fkl", "full-fkl", "sampled-fkl", "mc", "is"])
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_every_loss_trains_a_lora_student_packed_and_padded(hf_cache, weights, tmp_path, loss, pack):
    """One step of each loss: a finite loss, the adapters moved, the base weights untouched (bit for bit)."""
    from opdcache.training.train import Trainer

    cfg = _cfg(weights, hf_cache, tmp_path / "run", loss=loss, pack=pack, steps=1, checkpoint="none", checkpoint_every=0,
               **({"tail": True} if loss == "topk-fkl" else {}))
    trainer = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.fit()
    assert torch.isfinite(torch.tensor(result["last"]["loss"]))
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert moved and moved <= trainable and all(".lora_" in n for n in trainable)


def test_gradient_checkpointing_and_corrections_train_a_lora_student_to_the_same_adapters(hf_cache, weights, tmp_path):
    """Recomputing each layer in the backward changes no number; the corrections' frozen pi_ref beside the adapters."""
    plain = run_train(_cfg(weights, hf_cache, tmp_path / "plain", steps=2, checkpoint_every=0))
    ckpt = run_train(_cfg(weights, hf_cache, tmp_path / "ckpt", steps=2, checkpoint_every=0, gradient_checkpointing=True))
    assert plain["last"]["loss"] == pytest.approx(ckpt["last"]["loss"], rel=1e-6)
    a, b = (load_file(str(tmp_path / n / "model" / "adapter_model.safetensors")) for n in ("plain", "ckpt"))
    # recomputing a layer in the backward runs the same kernels on the same inputs (--deterministic): the same bits
    assert all(torch.equal(a[k], b[k]) for k in a)
    from opdcache.training.losses import Corrections

    corrected = run_train(_cfg(weights, hf_cache, tmp_path / "tis", steps=2, checkpoint_every=0, corrections=Corrections(tis_cap=2.0)))
    assert "tis_clip_fraction" in corrected["last"] and torch.isfinite(torch.tensor(corrected["last"]["loss"]))


def test_pi_ref_from_the_adapters_disabled_agrees_with_the_cache_and_the_first_weight_is_exactly_one(hf_cache, weights, tmp_path):
    """--lora-ref: at step 1 the adapters add exact zeros (B = 0), so the student's and the recomputed pi_ref's
    log-probs are the same numbers: every importance weight exactly 1. The recomputed pi_ref agrees with the cache's
    ref_logprobs (the rollout engine's, the same model) within float32's rounding of two evaluations
    (tests/tolerance.py, from a float64 forward of each row)."""
    from transformers import AutoModelForCausalLM

    from opdcache.training import objective as O
    from opdcache.training.train import Trainer
    from tolerance import logprob_tolerance

    cfg = _cfg(weights, hf_cache, tmp_path / "run", steps=1, checkpoint="none", checkpoint_every=0, lora_ref=True, pack=False)
    trainer = Trainer(cfg)
    batch = trainer.source.next_batch()
    _, stats = trainer.loss_and_stats(batch)
    assert stats["is_weight_mean"] == 1.0 and stats["is_weight_std"] == 0.0
    prepared = O.prepare_batch(batch, trainer.device, cfg.cache)
    sel = prepared["response_mask"].bool()
    inputs = (prepared["input_ids"], prepared["attention_mask"], prepared["logit_positions"], sel)
    recomputed = trainer._adapters_off_logprobs(inputs, prepared["response_ids"][sel][:, None].long(), {}, sel)
    base = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float64).eval()
    checked = 0
    for i in range(sel.shape[0]):
        n = int(sel[i].sum())
        if n == 0:
            continue
        ids = prepared["input_ids"][i][prepared["attention_mask"][i].bool()][None]
        start = int(prepared["logit_positions"][i][sel[i]][0]) - int((~prepared["attention_mask"][i].bool()).sum())
        with torch.no_grad():
            z64 = base(ids).logits[0, start: start + n]
            z32 = base.float()(ids).logits[0, start: start + n].float()
            base.double()
        tol = logprob_tolerance(z32, z64)[:, 0]
        got, cached = recomputed[i][sel[i]].double(), prepared["ref_logprobs"][i][sel[i]].double()
        assert bool(((got - cached).abs() <= tol).all()), float((got - cached).abs().max())
        checked += n
    assert checked > 100
