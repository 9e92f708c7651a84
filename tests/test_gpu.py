"""On a CUDA device: the streamed paths against their references there, and the exact arithmetic's bits equal to the
CPU's (papers/003: the numbers are a function of the mathematics, not of the device).

Marked ``gpu``: CI has no GPU and never runs them; on a CUDA machine run ``python -m pytest -m gpu tests/test_gpu.py``
(benchmarks/gpu_suite.sh does, before it measures)."""

import copy
import json

import pytest
import torch

from opdcache.exact import arith as X
from opdcache.logits.divergence import chunked_divergence, divergence_reference, KINDS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _no_tf32():
    """float32 matmuls in float32 (TF32 would round their inputs to 10 bits and the float32 tolerances would not hold)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _inputs(N, V, H, K, seed=0, device=CUDA, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape, s=1.0: (torch.randn(*shape, generator=g, dtype=torch.float64) * s)  # noqa: E731
    cpu = [make(N, H), make(V, H, s=0.5), make(V, s=0.1), make(N, K), make(V, K, s=0.5)]
    dev = [t.to(device, dtype).requires_grad_(i < 3) for i, t in enumerate(cpu)]
    return [t.requires_grad_(i < 3) for i, t in enumerate(cpu)], dev


# ------------------------------------------------------------------------------------------ streamed paths
@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_divergence_on_cuda_matches_the_float64_reference(kind, uniform, monkeypatch):
    import opdcache.logits.divergence as dv

    monkeypatch.setattr(dv, "UNIFORM_BLOCK_BYTES", 4 * 5003 * 8)  # blocks of 8 rows: 37 positions take 5 blocks
    monkeypatch.setattr(dv, "GPU_UNIFORM_BLOCK_BYTES", 4 * 5003 * 8)  # on CUDA too (the fused kernel's blocks)
    (hs, Ws, bs, ht, Wt), (hs_d, Ws_d, bs_d, ht_d, Wt_d) = _inputs(37, 5003, 64, 48)
    weights = torch.rand(37, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    weights[5] = 0.0
    got = chunked_divergence(kind, hs_d, Ws_d, ht_d, Wt_d, bs_d, uniform=uniform)
    assert got.device.type == "cuda"
    (got.mean() * 3 if uniform else (got * weights.to(CUDA, torch.float32)).sum()).backward()
    ref = divergence_reference(kind, hs, Ws, ht, Wt, bs)
    (ref.mean() * 3 if uniform else (ref * weights).sum()).backward()
    torch.testing.assert_close(got.double().cpu(), ref.detach(), atol=2e-5, rtol=2e-5)
    for a, t in zip((hs_d, Ws_d, bs_d), (hs, Ws, bs)):
        assert float((a.grad.double().cpu() - t.grad).norm() / t.grad.norm()) < 1e-4


@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_divergence_under_bf16_autocast_on_cuda_matches_the_full_logits_path(kind, uniform):
    from test_divergence import check_autocast_gradients

    check_autocast_gradients(kind, uniform, *_inputs(40, 3000, 64, 32)[1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_divergence_kernel_equals_the_torch_row_pass_on_cuda(kind, dtype, monkeypatch):
    """opdcache/logits/kernels.py compiled for the GPU against the torch pass it replaces (tests/test_kernels.py runs the same
    in Triton's interpreter): blocks of 8 rows, a vocabulary of 5,003 (ragged last tile), bias, non-uniform weights."""
    import opdcache.logits.divergence as dv
    from opdcache.logits import kernels

    assert kernels.available(CUDA)
    monkeypatch.setattr(dv, "GPU_UNIFORM_BLOCK_BYTES", 2 * 5003 * 8)
    hs, Ws, bs, ht, Wt = (t.detach() for t in _inputs(37, 5003, 64, 48)[1])
    weights = torch.rand(37, device=CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        got = dv._row_pass(kind, hs, Ws, bs, ht, Wt, None, weights, (True, True, True), fused=True)
        want = dv._row_pass(kind, hs, Ws, bs, ht, Wt, None, weights, (True, True, True), fused=False)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-4)
    for g, w in zip(got[1:], want[1:]):
        assert float((g - w).norm() / w.norm()) < (1e-2 if dtype == torch.bfloat16 else 1e-4)


class _ScaledHead:
    """A stand-in model on CUDA: a bf16 unembedding with bias, and a logit scale."""

    def __init__(self, V, H, scale):
        g = torch.Generator().manual_seed(0)
        self.head = torch.nn.Linear(H, V, bias=True)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(V, H, generator=g) * 0.4)
            self.head.bias.copy_(torch.randn(V, generator=g) * 0.3)
        self.head.to(CUDA, torch.bfloat16)
        self.config = type("C", (), {"final_logit_softcapping": None, "logit_scale": scale})()

    def get_output_embeddings(self):
        return self.head


@pytest.mark.parametrize("block", [1, None], ids=["1024-column slices", "as shipped"])
def test_the_fused_scoring_kernel_equals_the_torch_ops_on_cuda(block, monkeypatch):
    """streamed_logit_stats with its Triton kernel (opdcache/logits/kernels.py) against its torch ops on CUDA, a bf16 head of
    a 5,003-token vocabulary with bias and a logit scale: every figure a score-teacher pass keeps."""
    import opdcache.backends.streamed as st

    if block:
        monkeypatch.setattr(st, "GPU_LOGIT_BLOCK_BYTES", block)
        monkeypatch.setattr(st, "GPU_MIN_BLOCK_BYTES", block)
    model = _ScaledHead(5003, 64, 0.9)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(300, 64, generator=g).to(CUDA, torch.bfloat16)
    ids = [torch.randint(0, 5003, shape, generator=g).to(CUDA) for shape in ((300,), (300, 5), (300, 3))]
    u = torch.rand(300, 7, generator=g, dtype=torch.float64)
    with torch.no_grad():
        got = st.streamed_logit_stats(model, h, ids[0], 20, ids[1], ids[2], u, moments=True, fused=True)
        want = st.streamed_logit_stats(model, h, ids[0], 20, ids[1], ids[2], u, moments=True, fused=False)
    assert torch.equal(got["sampled_ids"], want["sampled_ids"])
    for key in ("logsumexp", "logprobs", "topk_logprobs", "ref_topk_logprobs", "mc_logprobs", "sampled_logprobs", "entropy", "variance"):
        torch.testing.assert_close(got[key].double(), want[key].double(), atol=2e-5, rtol=2e-5, msg=key)
    # bf16 logits tie, and a tie may be broken either way: each id's own log-prob is the value reported for it, no id
    # twice in a row (an H200 run: 88% of ids equal the torch ops' at 1,024-column slices, every value equal)
    with torch.no_grad():
        logp = torch.log_softmax((h @ model.head.weight.T + model.head.bias).float() * 0.9, -1)
    torch.testing.assert_close(logp.gather(1, got["topk_ids"]), got["topk_logprobs"], atol=2e-5, rtol=2e-5)
    assert all(len(set(row)) == 20 for row in got["topk_ids"].tolist())


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("block_rows", [None, 8])
def test_streamed_logprobs_on_cuda_match_the_float64_reference(block_rows, keep, monkeypatch):
    """The GPU layout (whole-vocabulary rows: one block, or blocks of 8 rows), repeated ids included; the backward from
    the forward's kept probabilities (within KEEP_BYTES) and from recomputed logits (KEEP_BYTES 0)."""
    from opdcache.logits import logprobs as LP
    from opdcache.logits.logprobs import chunked_logprobs

    if not keep:
        monkeypatch.setattr(LP, "KEEP_BYTES", 0)
    if block_rows:
        monkeypatch.setattr(LP, "GPU_BLOCK_BYTES", 4 * 7001 * block_rows)
        assert len(LP.layout(50, 7001, 1024, CUDA)[0]) == 7
    (h, W, b, _, _), (h_d, W_d, b_d, _, _) = _inputs(50, 7001, 64, 4, seed=3)
    ids = torch.randint(0, 7001, (50, 3), generator=torch.Generator().manual_seed(4))
    ids[1] = 17  # one row's ids all the same: their gradients add up
    lp, lse = chunked_logprobs(h_d, W_d, ids.to(CUDA), b_d, chunk=1024)
    assert (lp.grad_fn.kept is not None) == keep
    (lp.sum() + lse.sum()).backward()
    z = h @ W.T + b
    ref_lp, ref_lse = torch.log_softmax(z, -1).gather(1, ids), torch.logsumexp(z, -1)
    (ref_lp.sum() + ref_lse.sum()).backward()
    torch.testing.assert_close(lp.double().cpu(), ref_lp.detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double().cpu(), ref_lse.detach(), atol=2e-5, rtol=2e-5)
    for a, t in zip((h_d, W_d, b_d), (h, W, b)):
        assert float((a.grad.double().cpu() - t.grad).norm() / t.grad.norm()) < 1e-4


# ------------------------------------------------------------------------------------------ the exact arithmetic
@pytest.mark.parametrize("seed", range(4))
def test_exact_primitives_give_the_cpus_bits(seed):
    g = torch.Generator().manual_seed(seed)
    M, K, N = 37, int(torch.randint(1, 4000, (1,), generator=g)), 53  # wide K: some outputs take the fold
    a, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    assert torch.equal(X.linear(a.to(CUDA), w.to(CUDA), b.to(CUDA)).cpu(), X.linear(a, w, b))
    qk = torch.randn(2, 3, 9, 16, generator=g), torch.randn(2, 3, 16, 11, generator=g)
    assert torch.equal(X.matmul(qk[0].to(CUDA), qk[1].to(CUDA)).cpu(), X.matmul(*qk))
    x = torch.rand(5001, generator=g) * 30 - 15
    for name in X.FUNCTIONS:
        arg = x.abs() + 1e-3 if name in ("log", "rsqrt") else x
        assert torch.equal(X.unary(name, arg.to(CUDA)).cpu(), X.unary(name, arg)), name
    t = torch.randn(7, 3001, generator=g)
    assert torch.equal(X.sum_last(t.to(CUDA)).cpu(), X.sum_last(t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["student", "teacher"])
def test_exact_decoder_and_head_give_the_cpus_bits(weights, name, dtype):
    from opdcache.backends.loading import load_model
    from opdcache.exact.decoder import ExactDecoder
    from opdcache.exact.head import picks_and_stats

    model = load_model(weights / name, "float32", "cpu")
    ids = torch.randint(2, 64, (3, 29), generator=torch.Generator().manual_seed(0))
    on_gpu = copy.deepcopy(model).to(CUDA)
    with torch.no_grad():
        h_cpu = ExactDecoder(model, dtype).forward(ids)
        h_gpu = ExactDecoder(on_gpu, dtype).forward(ids.to(CUDA))
        assert h_gpu.device.type == "cuda" and torch.equal(h_gpu.cpu(), h_cpu)
        W = model.get_output_embeddings().weight
        picks = torch.randint(0, W.shape[0], (h_cpu.shape[0] * h_cpu.shape[1], 2), generator=torch.Generator().manual_seed(1))
        cpu = picks_and_stats(h_cpu.flatten(0, 1), W, None, dtype, picks, top_k=5)
        gpu = picks_and_stats(h_gpu.flatten(0, 1), W.to(CUDA), None, dtype, picks.to(CUDA), top_k=5)
    for c, d in zip((cpu[0], cpu[1], *cpu[2]), (gpu[0], gpu[1], *gpu[2])):
        assert torch.equal(d.cpu(), c)


@pytest.mark.parametrize("settings", [[], ["--dtype", "bfloat16"]])
def test_an_exact_cache_built_on_cpu_trains_on_cuda_with_weights_of_exactly_one(tmp_path, weights, settings, capsys, write_ragged_prompts):
    """build-rollouts --exact runs on the CPU (the exact engine's device); train --exact on this machine's GPU
    recomputes every stored log-prob bit for bit: at step 1 every importance weight is exactly 1."""
    from opdcache.cli.main import main

    prompts = write_ragged_prompts(tmp_path / "p.jsonl", (4, 4, 4, 4))  # prompts of 5-11 tokens: padded batches
    cache, run = tmp_path / "cache", tmp_path / "run"
    torch.cuda.reset_peak_memory_stats()
    for args in (["build-rollouts", "--model", weights / "student", "--prompts", prompts, "--out", cache, "--num-shards", 1,
                  "--samples", 2, "--temperature", 0.9, "--top-p", 0.95, "--max-new-tokens", 12, "--exact", *settings],
                 ["score-teacher", cache, "--teacher", weights / "teacher", "--store", "logprob", "--exact"],
                 ["train", "--model", weights / "student", "--cache", cache, "--loss", "lightning", "--steps", 1,
                  "--batch-size", 32, "--out", run, "--exact"]):  # --dtype auto: the rollouts' dtype
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in args])
        out = capsys.readouterr()
        assert e.value.code in (0, None), out.out + out.err
    assert torch.cuda.max_memory_allocated() > 0  # train ran on the GPU (the engine never touches it)
    step = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert step["is_weight_mean"] == 1.0 and step["is_weight_std"] == 0.0 and step["k1"] == 0.0, step


# ------------------------------------------------------------------------------------------ the GPU sampler
def test_the_samplers_uniforms_on_cuda_are_the_cpus():
    from opdcache.backends import draws

    seeds = torch.randint(0, 1 << 62, (64,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(draws.uniforms(seeds.to(CUDA), 3, 300, 5).cpu(), draws.uniforms(seeds, 3, 300, 5))


def test_generation_on_cuda_keeps_every_step_on_the_device_and_matches_the_cpu(weights):
    """The demo student in float32 on CUDA and on the CPU: same counter-based draws, so the same tokens wherever the
    two devices' logits round alike (all but a rare boundary case), and the stored values within float32 rounding."""
    import numpy as np

    from opdcache.backends.base import GenerateRequest, SamplingConfig
    from opdcache.backends.hf import TransformersBackend
    from opdcache.demo.evaluate import chat_prompt_ids
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(weights / "student")
    reqs = [GenerateRequest(chat_prompt_ids(tok, f"{a}+{b}"), seed=a * 1000 + b) for a, b in [(1, 2), (347, 589), (999, 1), (120, 305)]]
    s = SamplingConfig(temperature=0.9, top_p=0.95, max_new_tokens=30, ref_top_k=3, mc_samples=2)
    cpu = TransformersBackend(weights / "student", dtype="float32", device="cpu").generate(reqs, s)
    gpu = TransformersBackend(weights / "student", dtype="float32", device="cuda").generate(reqs, s)
    same = sum(np.array_equal(a.response_ids, b.response_ids) for a, b in zip(cpu, gpu))
    assert same >= 3
    for a, b in zip(cpu, gpu):
        if np.array_equal(a.response_ids, b.response_ids):
            np.testing.assert_allclose(a.ref_logprobs, b.ref_logprobs, atol=1e-4)
            np.testing.assert_array_equal(a.mc_ids, b.mc_ids)


# ------------------------------------------------------------------------------------------ the GPU's exact arithmetic
def test_the_gpu_arithmetic_refuses_float32_on_cuda(weights):
    from opdcache.backends.exact import FLOAT32_ON_GPU, ExactBackend
    from opdcache.errors import ConfigError

    with pytest.raises(ConfigError, match="not yet batch-invariant"):
        ExactBackend(weights / "student", dtype="float32", device="cuda")
    model = ExactBackend(weights / "student", device="cuda").model  # auto: bfloat16 on a GPU
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ConfigError) as e:
        ExactBackend.from_model(model.float())
    assert str(e.value) == FLOAT32_ON_GPU


@pytest.mark.parametrize("model,dtype", [("teacher", "bfloat16"), ("student", "bfloat16")])
def test_the_gpu_arithmetic_is_batch_invariant_on_cuda(weights, model, dtype):
    """--exact --device cuda: rows alone, in 7 and in 64 (reversed: other positions) give the same bits; scoring and
    the trainer's forward give back what KV-cache decoding stored (opdcache/exact/invariant.py's compiled kernels)."""
    from exact_checks import check_engine_invariance

    from opdcache.backends.exact import ExactBackend
    from opdcache.exact import GPU_ARITHMETIC

    engine = ExactBackend(weights / model, dtype=dtype, device="cuda")
    assert engine.arithmetic == GPU_ARITHMETIC and engine.device.type == "cuda"
    assert check_engine_invariance(engine, 64, batches=(7, 1), max_new_tokens=24, seed=3) > 500


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_invariant_primitive_gives_a_row_the_same_bits_in_any_batch_on_cuda(dtype):
    """Each primitive of the batch-invariant arithmetic and each sampler step, compiled on CUDA: a row alone, among 7
    and among 64 gets the same bits (names the ones that do not)."""
    from exact_checks import primitives_that_vary

    from opdcache.exact import invariant

    assert primitives_that_vary(invariant, CUDA, dtype) == []


def test_an_exact_cache_on_cuda_trains_and_audits_on_cuda(tmp_path, weights, capsys, write_ragged_prompts):
    """build-rollouts and score-teacher --exact --device cuda record the GPU arithmetic; train --exact recomputes
    every stored log-prob (importance weights exactly 1) and audit replays the table bit for bit."""
    from opdcache.cli.main import main
    from opdcache.exact import GPU_ARITHMETIC

    prompts = write_ragged_prompts(tmp_path / "p.jsonl", (4, 4, 4, 4))  # prompts of 5-11 tokens: padded batches
    cache, run = tmp_path / "cache", tmp_path / "run"
    for args in (["build-rollouts", "--model", weights / "student", "--prompts", prompts, "--out", cache, "--num-shards", 1,
                  "--samples", 2, "--temperature", 0.9, "--top-p", 0.95, "--max-new-tokens", 12, "--exact", "--device", "cuda",
                  "--dtype", "bfloat16"],
                 ["score-teacher", cache, "--teacher", weights / "teacher", "--store", "logprob", "--exact", "--device", "cuda"],
                 ["train", "--model", weights / "student", "--cache", cache, "--loss", "lightning", "--steps", 1,
                  "--batch-size", 32, "--out", run, "--exact"],
                 ["audit", cache, "--rows", "all"]):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in args])
        out = capsys.readouterr()
        assert e.value.code in (0, None), out.out + out.err
    manifest = json.loads((cache / "opdcache.json").read_text())
    assert manifest["tables"]["rollouts"]["model"]["exact"]["arithmetic"] == GPU_ARITHMETIC
    step = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert step["is_weight_mean"] == 1.0 and step["is_weight_std"] == 0.0 and step["k1"] == 0.0, step
