"""The fused Triton kernels (opdcache/logits/kernels.py) against their torch references, on the CPU in Triton's interpreter.

Marked ``triton``: CI installs triton and runs ``TRITON_INTERPRET=1 python -m pytest -m triton``; tests/test_gpu.py runs
the same kernels compiled on CUDA. Without triton, or without TRITON_INTERPRET=1, these tests skip."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # read at triton's first import; set by the runner (CI), never here
    pytest.skip("the kernels run on the CPU in Triton's interpreter: TRITON_INTERPRET=1 python -m pytest -m triton",
                allow_module_level=True)
pytest.importorskip("triton")

import opdcache.logits.divergence as dv  # noqa: E402
from opdcache.logits import kernels  # noqa: E402
from opdcache.logits.divergence import KINDS, chunked_divergence, divergence_reference  # noqa: E402

pytestmark = pytest.mark.triton


def _inputs(N, V, H, K, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, H, generator=g).to(dtype)
    Ws = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    bs = (torch.randn(V, generator=g) * 0.3).to(dtype) if bias else None
    ht = torch.randn(N, K, generator=g).to(dtype)
    Wt = (torch.randn(V, K, generator=g) * 0.5).to(dtype)
    bt = (torch.randn(V, generator=g) * 0.3).to(dtype) if bias else None
    return hs, Ws, bs, ht, Wt, bt


@pytest.fixture
def small_tiles(monkeypatch):
    """64-column tiles, so a row of 1,003 takes 16 tiles and the last is ragged; blocks of 5 rows for 13 positions."""
    monkeypatch.setattr(kernels, "DIVERGENCE_BLOCK", 64)
    monkeypatch.setattr(kernels, "DIVERGENCE_WARPS", 1)
    monkeypatch.setattr(dv, "UNIFORM_BLOCK_BYTES", 4 * 1003 * 5)
    monkeypatch.setattr(dv, "INNER_CHUNK", 64)


def test_the_switch_needs_triton_and_cuda_or_the_interpreter(monkeypatch):
    assert kernels.available(torch.device("cpu"))  # the interpreter is on in this module
    monkeypatch.setenv("OPDCACHE_KERNELS", "0")
    assert not kernels.available(torch.device("cpu"))
    monkeypatch.delenv("OPDCACHE_KERNELS")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not kernels.available(torch.device("cpu"))
    monkeypatch.setattr(kernels, "_triton", lambda: None)
    assert not kernels.available(torch.device("cuda"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_row_pass_equals_the_torch_row_pass_in_float32(kind, bias, weighted, small_tiles):
    """Values and all three gradients of the fused pass equal the torch pass's to float32 rounding, with per-row
    weights (one zero) or none, and the float64 reference's values."""
    N, V, H, K = 13, 1003, 16, 12
    hs, Ws, bs, ht, Wt, bt = _inputs(N, V, H, K, torch.float32, bias)
    weights = torch.rand(N, generator=torch.Generator().manual_seed(3)) if weighted else None
    if weighted:
        weights[4] = 0.0
    needs = (True, True, bias)
    got = dv._row_pass(kind, hs, Ws, bs, ht, Wt, bt, weights, needs, fused=True)
    want = dv._row_pass(kind, hs, Ws, bs, ht, Wt, bt, weights, needs, fused=False)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=2e-6, rtol=2e-5)
    ref = divergence_reference(kind, hs.double(), Ws.double(), ht.double(), Wt.double(),
                               None if bs is None else bs.double(), None if bt is None else bt.double())
    torch.testing.assert_close(got[0].double(), ref, atol=2e-6, rtol=2e-5)


def test_fused_row_pass_of_no_positions_gives_zero_gradients(small_tiles):
    """grad W is written by the first block, not zero-filled first: with no positions there is no block, and it is 0."""
    hs, Ws, bs, ht, Wt, bt = _inputs(13, 1003, 16, 12, torch.float32, True)
    div, grad_h, grad_W, grad_b = dv._row_pass("fkl", hs[:0], Ws, bs, ht[:0], Wt, bt, None, (True, True, True), fused=True)
    assert div.shape == (0,) and grad_h.shape == (0, 16)
    assert torch.equal(grad_W, torch.zeros_like(Ws)) and torch.equal(grad_b, torch.zeros_like(bs))


@pytest.mark.parametrize("kind", KINDS)
def test_fused_row_pass_under_bf16_autocast_rounds_as_the_torch_pass(kind, small_tiles):
    """Under bf16 autocast the fused pass keeps the logits and dz in bf16, as the torch pass rounds them before its
    gradient matmuls: the two agree to bf16 rounding, and the values to float32 rounding of the same bf16 logits."""
    hs, Ws, bs, ht, Wt, bt = _inputs(13, 1003, 16, 12, torch.float32, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dv._row_pass(kind, hs, Ws, bs, ht, Wt, bt, None, (True, True, False), fused=True)
        want = dv._row_pass(kind, hs, Ws, bs, ht, Wt, bt, None, (True, True, False), fused=False)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-4)
    for g, w in zip(got[1:3], want[1:3]):
        assert float((g - w).norm() / w.norm()) < 1e-2


def test_the_uniform_divergence_dispatches_to_the_kernel_and_keeps_its_gradients(small_tiles, monkeypatch):
    """chunked_divergence(uniform=True) takes the kernel where it is available (here, the interpreter), with the float64
    reference's values and mean-gradient; float64 inputs keep the torch pass."""
    calls = []
    real = kernels.divergence_rows_
    monkeypatch.setattr(kernels, "divergence_rows_", lambda *a, **k: calls.append(1) or real(*a, **k))
    hs, Ws, bs, ht, Wt, _ = _inputs(13, 1003, 16, 12, torch.float64, True)
    leaves = [t.float().requires_grad_() for t in (hs, Ws, bs)]
    got = chunked_divergence("fkl", leaves[0], leaves[1], ht.float(), Wt.float(), leaves[2], uniform=True)
    (got.mean() * 3).backward()
    assert len(calls) == 3  # 13 positions in blocks of 5
    ref_leaves = [t.clone().requires_grad_() for t in (hs, Ws, bs)]
    ref = divergence_reference("fkl", ref_leaves[0], ref_leaves[1], ht, Wt, ref_leaves[2])
    (ref.mean() * 3).backward()
    torch.testing.assert_close(got.double(), ref.detach(), atol=2e-6, rtol=2e-5)
    for a, r in zip(leaves, ref_leaves):
        assert float((a.grad.double() - r.grad).norm() / r.grad.norm()) < 1e-5
    calls.clear()
    chunked_divergence("fkl", hs, Ws, ht, Wt, bs, uniform=True)
    assert not calls


def test_a_block_that_is_not_whole_rows_is_refused():
    z = torch.zeros(4, 10)
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.divergence_rows_("fkl", z[:, ::2], z[:, ::2], None, None, None, torch.empty(4), False)
    with pytest.raises(ValueError, match="float32"):
        kernels.divergence_rows_("fkl", z, z, None, None, None, torch.empty(4, dtype=torch.float64), False)


# ------------------------------------------------------------------------------------------ scoring's slice statistics
class _Head:
    """A stand-in model: an unembedding with bias and a logit scale (no soft-capping: the fused path does not take it)."""

    def __init__(self, V, H, dtype, scale=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.head = torch.nn.Linear(H, V, bias=True).to(dtype)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(V, H, generator=g) * 0.4)
            self.head.bias.copy_(torch.randn(V, generator=g) * 0.3)
        self.config = type("C", (), {"final_logit_softcapping": None, "logit_scale": scale})()

    def get_output_embeddings(self):
        return self.head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [None, 0.7])
def test_slice_statistics_equal_the_plain_float64_sums(dtype, scale, monkeypatch):
    """m, s, b1, b2 of a slice (64-column tiles: 1,003 columns in 16, the last ragged) against the same sums in float64."""
    monkeypatch.setattr(kernels, "STATS_BLOCK", 64)
    monkeypatch.setattr(kernels, "STATS_WARPS", 1)
    g = torch.Generator().manual_seed(1)
    z = (torch.randn(9, 1003, generator=g) * 3).to(dtype)
    z[2, 700] = 40.0  # a late maximum: every earlier tile's sums move to it
    got = kernels.logit_stats_rows(z, scale).double()
    x = z.double() * (1.0 if scale is None else scale)
    m = x.amax(-1)
    d = x - m[:, None]
    e = d.exp()
    want = torch.stack([m, e.sum(-1), (e * d).sum(-1), (e * d * d).sum(-1)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert kernels.logit_stats_rows(z[:0], scale).shape == (4, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [1, 1 << 20], ids=["1024-column slices", "whole rows"])
def test_fused_scoring_stats_equal_the_torch_path(dtype, block, monkeypatch):
    """streamed_logit_stats through the kernel against its torch ops: log-partition, sampled log-prob, top-k, log-probs
    at given ids, entropy and variance, and draws; slices of 1,024 columns (V 3,001: three and a ragged one) or one."""
    import opdcache.backends.streamed as st

    monkeypatch.setattr(kernels, "STATS_BLOCK", 256)
    monkeypatch.setattr(kernels, "STATS_WARPS", 1)
    monkeypatch.setattr(st, "LOGIT_BLOCK_BYTES", block)
    P, V, H = 11, 3001, 16
    model = _Head(V, H, dtype, scale=0.9)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(P, H, generator=g).to(dtype)
    sampled = torch.randint(0, V, (P,), generator=g)
    ref_ids, mc_ids = torch.randint(0, V, (P, 5), generator=g), torch.randint(0, V, (P, 3), generator=g)
    u = torch.rand(P, 7, generator=g, dtype=torch.float64)
    args = (model, h, sampled, 6, ref_ids, mc_ids, u)
    with torch.no_grad():
        got = st.streamed_logit_stats(*args, moments=True, fused=True)
        want = st.streamed_logit_stats(*args, moments=True, fused=False)
    assert set(got) == set(want)
    assert torch.equal(got["sampled_ids"], want["sampled_ids"])
    for key in ("logsumexp", "logprobs", "topk_logprobs", "ref_topk_logprobs", "mc_logprobs", "sampled_logprobs", "entropy", "variance"):
        torch.testing.assert_close(got[key].double(), want[key].double(), atol=2e-5, rtol=2e-5, msg=key)
    if dtype == torch.float32:
        assert torch.equal(got["topk_ids"], want["topk_ids"])
    else:  # bf16 logits tie: the same values, and each id's own log-prob is the value reported for it
        with torch.no_grad():
            logp = torch.log_softmax((h @ model.head.weight.T + model.head.bias).float() * 0.9, -1)
        torch.testing.assert_close(logp.gather(1, got["topk_ids"]), got["topk_logprobs"], atol=2e-5, rtol=2e-5)
        assert all(len(set(row)) == 6 for row in got["topk_ids"].tolist())


def test_scoring_takes_the_kernel_only_where_it_applies(monkeypatch):
    """The kernel where available; the torch ops for a soft-capped head or a rounded-hidden-state KL."""
    import opdcache.backends.streamed as st

    calls = []
    real = kernels.logit_stats_rows
    monkeypatch.setattr(kernels, "logit_stats_rows", lambda *a: calls.append(1) or real(*a))
    model = _Head(500, 8, torch.float32)
    h = torch.randn(4, 8)
    with torch.no_grad():
        st.streamed_logit_stats(model, h, torch.zeros(4, dtype=torch.long), 3)
        assert len(calls) == 1
        st.streamed_logit_stats(model, h, torch.zeros(4, dtype=torch.long), 3, moments=True, rounded_PH=h.bfloat16().float())
        model.config.final_logit_softcapping = 30.0
        st.streamed_logit_stats(model, h, torch.zeros(4, dtype=torch.long), 3)
    assert len(calls) == 1
