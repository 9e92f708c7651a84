"""Chunked full-vocabulary divergences: parity with the naive float64 reference in values and gradients,
awkward shapes, and the properties every divergence has."""

import pytest
import torch

from opdcache.logits.divergence import chunked_divergence, divergence_reference, KINDS


def _inputs(N, V, H, K, dtype=torch.float64, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, H, generator=g, dtype=dtype, requires_grad=True)
    Ws = (torch.randn(V, H, generator=g, dtype=dtype) * 0.5).requires_grad_()
    bs = (torch.randn(V, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    ht = torch.randn(N, K, generator=g, dtype=dtype)
    Wt = torch.randn(V, K, generator=g, dtype=dtype) * 0.5
    return hs, Ws, bs, ht, Wt


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("N, V, H, K, chunk", [(1, 7, 3, 3, 2), (5, 37, 4, 6, 8), (6, 64, 8, 8, 64), (3, 50, 5, 2, 1000)])
def test_gradcheck_against_finite_differences(kind, N, V, H, K, chunk):
    hs, Ws, bs, ht, Wt = _inputs(N, V, H, K)
    f = lambda hs, Ws, bs: chunked_divergence(kind, hs, Ws, ht, Wt, bs, chunk=chunk)  # noqa: E731
    assert torch.autograd.gradcheck(f, (hs, Ws, bs), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_values_and_gradients_match_the_naive_reference(kind, dtype, tol):
    N, V, H, K = 13, 1003, 16, 12  # chunk 128 does not divide the vocabulary
    hs, Ws, bs, ht, Wt = _inputs(N, V, H, K, dtype=dtype)
    weights = torch.rand(N, dtype=dtype)
    weights[3] = 0.0  # a masked position
    got = chunked_divergence(kind, hs, Ws, ht, Wt, bs, chunk=128)
    (got * weights).sum().backward()
    grads = [t.grad.clone() for t in (hs, Ws, bs)]
    for t in (hs, Ws, bs):
        t.grad = None
    ref = divergence_reference(kind, hs, Ws, ht, Wt, bs)
    (ref * weights.double()).sum().backward()
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
    for a, t in zip(grads, (hs, Ws, bs)):
        torch.testing.assert_close(a.double(), t.grad.double(), atol=tol * 10, rtol=tol * 10)
    assert grads[0][3].abs().max() == 0  # the masked position gets no gradient


@pytest.mark.parametrize("kind", KINDS)
def test_zero_for_identical_distributions_and_never_negative(kind):
    hs, Ws, bs, _, _ = _inputs(9, 200, 6, 6)
    same = chunked_divergence(kind, hs, Ws, hs.detach(), Ws.detach(), bs, bs.detach(), chunk=64)
    assert same.abs().max() < 1e-12
    for seed in range(5):
        hs, Ws, bs, ht, Wt = _inputs(9, 200, 6, 4, seed=seed)
        d = chunked_divergence(kind, hs * 3, Ws, ht * 3, Wt, bs, chunk=64)
        assert (d >= -1e-12).all()
    if kind == "jsd":
        assert (d <= torch.log(torch.tensor(2.0, dtype=d.dtype)) + 1e-12).all()


def test_memory_stays_per_chunk(monkeypatch):
    """No tensor with a full vocabulary dimension is created by the chunked path."""
    import opdcache.logits.divergence as dv

    seen = []
    original = dv._logits
    monkeypatch.setattr(dv, "_logits", lambda *args: seen.append(original(*args).shape) or original(*args))
    hs, Ws, bs, ht, Wt = _inputs(4, 1000, 8, 8)
    chunked_divergence("jsd", hs, Ws, ht, Wt, bs, chunk=100).sum().backward()
    assert max(s[1] for s in seen) == 100


def test_shape_errors_are_explained():
    hs, Ws, bs, ht, Wt = _inputs(4, 50, 8, 8)
    with pytest.raises(ValueError, match="vocabularies differ: 50 vs 49"):
        chunked_divergence("fkl", hs, Ws, ht, Wt[:49])
    with pytest.raises(ValueError, match="kind must be one of"):
        chunked_divergence("kl", hs, Ws, ht, Wt)


@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_under_autocast_gradients_match_the_full_logits_path(kind, uniform):
    """Under bf16 autocast the chunked path runs its matmuls in bf16 in the backward too (the forward's dtype) and its
    gradients equal, to bf16 rounding, those of the plain full-logits path under the same autocast."""
    check_autocast_gradients(kind, uniform, *_inputs(40, 300, 16, 12, dtype=torch.float32), chunk=64)


def check_autocast_gradients(kind, uniform, hs, Ws, bs, ht, Wt, **options):
    """The chunked divergence's gradients under bf16 autocast on the inputs' device against the full-logits path's
    under the same autocast, to bf16 rounding (tests/test_gpu.py runs it on CUDA)."""
    device = hs.device.type
    with torch.autocast(device, dtype=torch.bfloat16):
        chunked_divergence(kind, hs, Ws, ht, Wt, bs, uniform=uniform, **options).sum().backward()
    got = (hs.grad.clone(), Ws.grad.clone())
    hs.grad = Ws.grad = bs.grad = None
    with torch.autocast(device, dtype=torch.bfloat16):
        zs, zt = (hs @ Ws.T).float() + bs, (ht @ Wt.T).float()
    lq, lp = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    q, p = lq.exp(), lp.exp()
    lm = torch.log(0.5 * (p + q))
    ref = {"fkl": (p * (lp - lq)), "rkl": (q * (lq - lp)), "jsd": 0.5 * (p * (lp - lm) + q * (lq - lm))}[kind].sum()
    ref.backward()
    for g, r in zip(got, (hs.grad, Ws.grad)):
        assert float((g - r).norm() / r.norm()) < 3e-2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_uniform_path_matches_the_reference_and_the_per_position_path(kind, dtype, tol, monkeypatch):
    """uniform=True (gradients computed in the forward) gives the reference's values and, for a mean over positions,
    its gradients; blocks of 5 rows (BLOCK_BYTES shrunk) do not divide the 13 positions."""
    import opdcache.logits.divergence as dv

    monkeypatch.setattr(dv, "UNIFORM_BLOCK_BYTES", 4 * 1003 * 5)
    monkeypatch.setattr(dv, "INNER_CHUNK", 64)  # 64 does not divide 1,003 either
    N, V, H, K = 13, 1003, 16, 12
    hs, Ws, bs, ht, Wt = _inputs(N, V, H, K, dtype=dtype)
    got = chunked_divergence(kind, hs, Ws, ht, Wt, bs, uniform=True)
    (got.mean() * 3).backward()
    grads = [t.grad.clone() for t in (hs, Ws, bs)]
    for t in (hs, Ws, bs):
        t.grad = None
    ref = divergence_reference(kind, hs, Ws, ht, Wt, bs)
    (ref.mean() * 3).backward()
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
    for a, t in zip(grads, (hs, Ws, bs)):
        torch.testing.assert_close(a.double(), t.grad.double(), atol=tol * 10, rtol=tol * 10)


@pytest.mark.parametrize("kind", KINDS)
def test_uniform_path_recomputes_an_exact_gradient_for_weights_that_are_not_uniform(kind):
    N, V, H, K = 7, 301, 8, 5
    hs, Ws, bs, ht, Wt = _inputs(N, V, H, K)
    weights = torch.rand(N, dtype=torch.float64)
    weights[2] = 0.0
    (chunked_divergence(kind, hs, Ws, ht, Wt, bs, uniform=True) * weights).sum().backward()
    grads = [t.grad.clone() for t in (hs, Ws, bs)]
    for t in (hs, Ws, bs):
        t.grad = None
    (divergence_reference(kind, hs, Ws, ht, Wt, bs) * weights).sum().backward()
    for a, t in zip(grads, (hs, Ws, bs)):
        torch.testing.assert_close(a, t.grad, atol=1e-10, rtol=1e-10)
    assert grads[0][2].abs().max() == 0


@pytest.mark.parametrize("kind", KINDS)
def test_uniform_path_gradcheck(kind):
    """gradcheck's one-hot output weights take the recomputing branch; a sum takes the scaled one (the test above)."""
    hs, Ws, bs, ht, Wt = _inputs(5, 37, 4, 6)
    f = lambda hs, Ws, bs: chunked_divergence(kind, hs, Ws, ht, Wt, bs, uniform=True)  # noqa: E731
    assert torch.autograd.gradcheck(f, (hs, Ws, bs), eps=1e-6, atol=1e-6)


def test_uniform_path_memory_stays_per_row_block(monkeypatch):
    """No logit block holds more than UNIFORM_BLOCK_BYTES // (4 V) positions, and the blocks are reused; without
    gradients none are computed; no positions give zero gradients."""
    import opdcache.logits.divergence as dv

    monkeypatch.setattr(dv, "UNIFORM_BLOCK_BYTES", 4 * 1000 * 3)
    monkeypatch.setattr(dv, "INNER_CHUNK", 300)
    seen = []
    original = dv._logits_online_
    monkeypatch.setattr(dv, "_logits_online_", lambda out, *args: seen.append((out.shape, out.data_ptr())) or original(out, *args))
    hs, Ws, bs, ht, Wt = _inputs(10, 1000, 8, 8)
    chunked_divergence("fkl", hs, Ws, ht, Wt, bs, uniform=True).sum().backward()
    assert max(shape[0] for shape, _ in seen) == 3 and len(seen) == 2 * 4  # 4 blocks of <= 3 rows, both sides, no recompute
    assert len({ptr for _, ptr in seen}) == 2  # one block per side, reused
    with torch.no_grad():
        assert chunked_divergence("fkl", hs, Ws, ht, Wt, bs, uniform=True).requires_grad is False
    Ws.grad = None
    chunked_divergence("fkl", hs[:0], Ws, ht[:0], Wt, bs, uniform=True).sum().backward()
    assert Ws.grad.abs().max() == 0


def test_uniform_path_layout_per_device(monkeypatch):
    """CPU: 128 MiB blocks in 2,048-column pieces; a GPU: 1 GiB blocks in one piece, at most a quarter of its free memory
    (no device needed to check it: the free memory is stubbed)."""
    import opdcache.logits.divergence as dv

    free = {"bytes": 80 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 << 30))
    assert dv._uniform_layout(151_936, torch.device("cpu")) == (220, 2048)
    assert dv._uniform_layout(151_936, torch.device("cuda")) == ((1 << 30) // (4 * 151_936), 151_936)
    free["bytes"] = 1 << 30
    assert dv._uniform_layout(151_936, torch.device("cuda")) == ((1 << 28) // (4 * 151_936), 151_936)
    assert dv._uniform_layout(10**9, torch.device("cpu"))[0] == 1  # a vocabulary larger than a block: one row a block


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_gradient_is_the_multiply_then_the_cast_bit_for_bit(dtype):
    """The uniform path's backward scales its float32 gradient and casts it to the weights' dtype in one pass: the same
    bits as the multiply in place followed by the cast (the product rounded once), and the cast alone without a scale."""
    from opdcache.logits.divergence import scaled

    g = torch.randn(257, 33, generator=torch.Generator().manual_seed(1)) * 3
    for scale in (torch.tensor(1 / 4096, dtype=torch.bfloat16), torch.tensor(0.3), torch.tensor(-7.0, dtype=torch.float64)):
        want = g.clone().mul_(scale.to(torch.float32)).to(dtype)
        got = scaled(g.clone(), scale, dtype)
        assert got.dtype == dtype and torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                                  want.view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert torch.equal(scaled(g.clone(), None, dtype), g.to(dtype))
