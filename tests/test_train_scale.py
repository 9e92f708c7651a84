"""The trainer at scale: fused student log-probs equal the full-logits path, precision, checkpointing, schedules,
the KL penalty, and FSDP2 over two CPU processes (gloo) against one process."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from opdcache.errors import ConfigError
from opdcache.training import losses as L
from opdcache.training.train import learning_rate, run_train, TrainConfig, Trainer

pytestmark = pytest.mark.slow  # run by .ci/run (pytest -m slow), not by the README's test command


def _batch(trainer):
    return trainer.source.next_batch()


@pytest.mark.parametrize("loss", ["lightning", "mc", "topk-rkl", "full-rkl", "full-fkl", "jsd"])
def test_fused_step_equals_the_full_logits_step(hf_cache, weights, tmp_path, loss):
    """Loss and every parameter gradient of a step equal those of a plain log_softmax over [B, T, V] logits (the
    full-vocabulary losses through the divergence's uniform path, its gradient computed in the forward)."""
    trainer = Trainer(TrainConfig(model=weights / "student", cache=hf_cache, out=tmp_path, loss=loss, batch_size=6, chunk=7, pack=False))
    batch = _batch(trainer)
    fused, _ = trainer.loss_and_stats(batch)
    fused.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.model.zero_grad()

    model, cfg = trainer.model, trainer.cfg
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    pos = batch["logit_positions"]
    logp = torch.log_softmax(out.gather(1, pos[..., None].expand(-1, -1, out.shape[-1])).float(), -1)  # [B, T, V]
    s = logp.gather(-1, batch["response_ids"][..., None]).squeeze(-1)
    mask = batch["response_mask"]
    if loss == "lightning":
        terms, _ = L.lightning_terms(s, batch["teacher_logprobs"], cfg.tau)
    elif loss == "mc":
        terms, _ = L.mc_terms(logp.gather(-1, batch["mc_ids"]), batch["mc_sampling_logprobs"], batch["teacher_mc_logprobs"])
    elif loss == "topk-rkl":
        terms, _ = L.topk_terms(logp.gather(-1, batch["teacher_topk_ids"]), batch["teacher_topk_logprobs"], "rkl")
    else:
        head = trainer.teacher_w
        t_logp = torch.log_softmax(batch["teacher_hidden"].float() @ head.T, -1)
        q, p = logp.exp(), t_logp.exp()
        lm = torch.log(0.5 * (p + q))
        terms = {"full-rkl": q * (logp - t_logp), "full-fkl": p * (t_logp - logp),
                 "jsd": 0.5 * (p * (t_logp - lm) + q * (logp - lm))}[loss].sum(-1)
    plain = L.reduce(terms, mask)
    plain.backward()
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_gradient_checkpointing_gives_the_same_gradients(hf_cache, weights, tmp_path):
    common = dict(model=weights / "student", cache=hf_cache, out=tmp_path, loss="lightning", batch_size=4)
    plain, ckpt = Trainer(TrainConfig(**common)), Trainer(TrainConfig(gradient_checkpointing=True, **common))
    def checkpointing(m):  # transformers >= 5 renamed the flag
        return m.is_activation_checkpointing if hasattr(type(m), "is_activation_checkpointing") else m.is_gradient_checkpointing
    assert checkpointing(ckpt.model) and not checkpointing(plain.model)
    assert plain.allocator is None and ckpt.allocator.startswith("buffers over 128 KiB mapped")  # on CPU with glibc
    batch = _batch(plain)
    for t in (plain, ckpt):
        t.loss_and_stats(batch)[0].backward()
    for (n, a), b in zip(plain.model.named_parameters(), ckpt.model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_bfloat16_autocast_keeps_float32_masters_and_tracks_float32(hf_cache, weights, tmp_path):
    common = dict(model=weights / "student", cache=hf_cache, loss="lightning", batch_size=4, steps=1)
    f32, bf16 = Trainer(TrainConfig(out=tmp_path / "a", **common)), Trainer(TrainConfig(out=tmp_path / "b", dtype="bfloat16", **common))
    batch = _batch(f32)
    a, b = f32.loss_and_stats(batch)[0].detach(), bf16.loss_and_stats(batch)[0].detach()
    assert bf16.autocast == torch.bfloat16 and f32.autocast is None
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert float(a) != float(b) and abs(float(a) - float(b)) < 0.05 * abs(float(a)) + 0.05  # computed in bf16, close to fp32


def test_learning_rate_schedules():
    cfg = TrainConfig(model="m", cache="c", out="o", lr=1.0, steps=10, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    lrs = [learning_rate(cfg, i) for i in range(10)]
    assert lrs[:3] == [0.5, 1.0, 1.0] and lrs[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    const = TrainConfig(model="m", cache="c", out="o", lr=0.5, steps=4)
    assert [learning_rate(const, i) for i in range(4)] == [0.5] * 4
    with pytest.raises(ConfigError, match="--lr-schedule must be one of constant, cosine, got 'linear'"):
        TrainConfig(model="m", cache="c", out="o", lr_schedule="linear")


def test_logged_lr_follows_the_schedule(hf_cache, weights, tmp_path):
    run_train(TrainConfig(model=weights / "student", cache=hf_cache, out=tmp_path, steps=3, batch_size=4, lr=1e-4, warmup_steps=2))
    lrs = [json.loads(l)["lr"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([5e-5, 1e-4, 1e-4])


def test_kl_penalty_estimators():
    r = torch.log(torch.tensor([[0.5, 0.2, 0.1]]))
    s = torch.log(torch.tensor([[0.25, 0.2, 0.3]])).requires_grad_()
    l = (s - r).detach()
    torch.testing.assert_close(L.kl_penalty_terms(s, r, "k1"), -l)
    torch.testing.assert_close(L.kl_penalty_terms(s, r, "k2"), 0.5 * l * l)
    k3 = L.kl_penalty_terms(s, r, "k3")
    torch.testing.assert_close(k3, l.exp() - 1 - l)
    assert bool((k3[:, 1] == 0).all()) and bool((k3 >= 0).all())
    k3.sum().backward()
    torch.testing.assert_close(s.grad, l.exp() - 1)  # (exp(l) - 1) grad s: E_ref of it is -E_ref[grad s]
    with pytest.raises(ConfigError, match="--kl-estimator must be one of k1, k2, k3, got 'k4'"):
        TrainConfig(model="m", cache="c", out="o", kl_estimator="k4")


def test_online_kl_forms_have_the_cached_forms_expected_gradient():
    """On the student's own samples (online) k3 = exp(-l) - 1 + l; in expectation over pi_theta its gradient equals the
    cached k3's expectation over pi_ref, grad KL(pi_ref || pi_theta), computed here exactly on a 5-token distribution."""
    torch.manual_seed(0)
    z = torch.randn(5, dtype=torch.float64, requires_grad=True)
    r = torch.log_softmax(torch.randn(5, dtype=torch.float64), 0)
    s = torch.log_softmax(z, 0)
    p, q = s.exp().detach(), r.exp()
    l = (s - r).detach()
    student = L.kl_penalty_terms(s, r, "k3", samples="student")
    torch.testing.assert_close(student.detach(), (-l).exp() - 1 + l)
    torch.testing.assert_close(L.kl_penalty_terms(s, r, "k1", samples="student").detach(), l)
    online = torch.autograd.grad((p * student).sum(), z, retain_graph=True)[0]  # E_theta[grad k3], samples held fixed
    cached = torch.autograd.grad((q * L.kl_penalty_terms(s, r, "k3")).sum(), z, retain_graph=True)[0]  # E_ref[grad k3]
    exact = torch.autograd.grad((q * (r - s)).sum(), z)[0]  # grad KL(pi_ref || pi_theta)
    torch.testing.assert_close(online, exact)
    torch.testing.assert_close(cached, exact)
    with pytest.raises(ValueError, match="samples must be 'ref' or 'student'"):
        L.kl_penalty_terms(s, r, "k3", samples="teacher")


def test_kl_penalty_is_logged_and_pulls_toward_pi_ref(hf_cache, weights, tmp_path):
    common = dict(model=weights / "student", cache=hf_cache, loss="lightning", steps=6, batch_size=8, lr=3e-3, deterministic=True)
    run_train(TrainConfig(out=tmp_path / "free", kl_coef=0.0, **common))
    run_train(TrainConfig(out=tmp_path / "kl", kl_coef=5.0, **common))
    free = [json.loads(l) for l in (tmp_path / "free" / "metrics.jsonl").read_text().splitlines()]
    kl = [json.loads(l) for l in (tmp_path / "kl" / "metrics.jsonl").read_text().splitlines()]
    assert "kl_penalty" in kl[0] and "kl_penalty" not in free[0]
    assert kl[0]["kl_penalty"] == pytest.approx(0.0, abs=1e-6)  # step 1: the student is pi_ref
    assert kl[-1]["k3"] < free[-1]["k3"]  # the penalty keeps the student nearer pi_ref


@pytest.mark.parametrize("bad,message", [(dict(chunk=0), "--chunk"), (dict(dtype="fp8"), "--dtype must be one of auto, float32, bfloat16"),
                                         (dict(kl_coef=-1.0), "--kl-coef must be >= 0")])
def test_bad_settings_are_clear_errors(bad, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(model="m", cache="c", out="o", **bad)


def _why(run) -> str:
    """Both streams' tails: whether the ranks got through their steps tells a crash in training from one at exit."""
    return f"stdout: {run.stdout[-1500:]}\nstderr: {run.stderr[-3000:]}"


def _torchrun(script, nproc, tmp_path):
    """torchrun on a free port (--standalone), its logs under tmp_path (torchrun's default is a new folder in /tmp)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                           "--log-dir", str(tmp_path / "torchrun"), "-m", "opdcache.cli.main", *script],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)


FSDP_TOLERANCE = 2e-5  # per-step loss, two FSDP processes against one plain process (float32; reduction order differs)


@pytest.mark.slow
def test_fsdp_on_two_cpu_processes_matches_one_process_and_resumes(hf_cache, weights, tmp_path):
    """torchrun --nproc-per-node 2 ... train --fsdp --batch-size 4: rank r takes rows r, r + 2, ... of the data order, so
    a step sees the same 8 rows as one process at --batch-size 8, and the loss is normalised by the tokens of all ranks."""
    args = ["train", "--model", str(weights / "student"), "--cache", str(hf_cache), "--loss", "lightning", "--steps", "4",
            "--lr", "1e-3", "--deterministic", "--checkpoint-every", "2", "--no-progress"]
    single = _torchrun([*args, "--batch-size", "8", "--out", str(tmp_path / "one")], 1, tmp_path)
    assert single.returncode == 0, _why(single)
    first = _torchrun([*args, "--batch-size", "4", "--fsdp", "--out", str(tmp_path / "two"), "--stop-after", "2"], 2, tmp_path)
    assert first.returncode == 0, _why(first)
    second = _torchrun([*args, "--batch-size", "4", "--fsdp", "--out", str(tmp_path / "two")], 2, tmp_path)
    assert second.returncode == 0, _why(second)
    assert "4 steps of lightning (resumed from its checkpoint)" in second.stdout
    one = [json.loads(l) for l in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    two = [json.loads(l) for l in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in two] == [1, 2, 3, 4]
    assert (tmp_path / "two" / "model" / "model.safetensors").is_file()
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) < FSDP_TOLERANCE, (a, b)


@pytest.mark.slow
def test_ddp_trains_a_lora_student_on_two_cpu_processes_as_one_process_does_and_resumes(hf_cache, weights, tmp_path):
    """torchrun --nproc-per-node 2 ... train --lora-rank 4 (DDP over the adapters alone: the frozen base takes no
    gradient and is never reduced): the same per-step losses as one process over the same rows, and a resume."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    args = ["train", "--model", str(weights / "student"), "--cache", str(hf_cache), "--loss", "lightning", "--steps", "4",
            "--lr", "1e-3", "--deterministic", "--checkpoint-every", "2", "--no-progress", "--lora-rank", "4"]
    single = _torchrun([*args, "--batch-size", "8", "--out", str(tmp_path / "one")], 1, tmp_path)
    assert single.returncode == 0, _why(single)
    first = _torchrun([*args, "--batch-size", "4", "--out", str(tmp_path / "two"), "--stop-after", "2"], 2, tmp_path)
    assert first.returncode == 0, _why(first)
    second = _torchrun([*args, "--batch-size", "4", "--out", str(tmp_path / "two")], 2, tmp_path)
    assert second.returncode == 0, _why(second)
    assert "4 steps of lightning (resumed from its checkpoint)" in second.stdout
    one = [json.loads(l) for l in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    two = [json.loads(l) for l in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in two] == [1, 2, 3, 4]
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) < FSDP_TOLERANCE, (a, b)
    a, b = (load_file(str(tmp_path / run / "model" / "adapter_model.safetensors")) for run in ("one", "two"))
    assert a.keys() == b.keys() and not (tmp_path / "two" / "model" / "model.safetensors").exists()  # adapters only


def test_label_smoothing_term_equals_the_full_logits_reference(weights):
    """SFT's label smoothing: CE(uniform, p) = lse - mean logit from the fused pass equals -mean log_softmax over the
    full logits, in value and gradient; and SFTConfig(label_smoothing=e) trains on (1 - e) CE(target) + e CE(uniform)."""
    from transformers import AutoModelForCausalLM

    from opdcache.training.student import StudentForward

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(weights / "teacher", dtype=torch.float64)
    ids = torch.randint(5, 20, (3, 9))
    mask = torch.ones_like(ids)
    select = torch.zeros_like(ids, dtype=torch.bool)
    select[:, 4:] = True
    positions = torch.arange(9).expand(3, 9)
    targets = ids.roll(-1, 1)[select][:, None]
    _, _, got = StudentForward(model, chunk=7)(ids, mask, positions, select, targets, divergence="uniform")
    grads = torch.autograd.grad(got.sum(), [model.lm_head.weight])[0]
    logits = model(input_ids=ids, attention_mask=mask).logits[select]
    want = -torch.log_softmax(logits, -1).mean(-1)
    ref_grads = torch.autograd.grad(want.sum(), [model.lm_head.weight])[0]
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)  # the fused pass keeps its log-partition in float32
    torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


def test_label_smoothing_keeps_every_token_above_the_floor(weights):
    """A model fitted with label smoothing e keeps wrong tokens near log(e / V), not near -inf."""
    from transformers import AutoModelForCausalLM

    from opdcache.training.sft import SFTConfig, train_sft

    pairs = [([3, 5, 6], [7, 8, 1])] * 8
    floor = {}
    for eps in (0.0, 0.05):
        model = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float32)
        train_sft(model, pairs, SFTConfig(steps=150, batch_size=8, lr=1e-2, warmup=5, label_smoothing=eps), pad_id=0, progress=False)
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([[3, 5, 6, 7, 8]])).logits[0, 2:], -1)
        floor[eps] = lp.min().item()
    V = 64
    assert floor[0.05] > math.log(0.05 / V) - 1.5  # near the smoothing floor (about -7.2)
    assert floor[0.0] < floor[0.05] - 3  # without smoothing, wrong tokens fall far lower
    with pytest.raises(ConfigError, match="--label-smoothing must be in"):
        SFTConfig(label_smoothing=1.0)
