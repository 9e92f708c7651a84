"""The student's streamed log-probs (opdcache/logits/logprobs.py) against the plain full-logits reference."""

import pytest
import torch

from opdcache.errors import ConfigError
from opdcache.logits.logprobs import chunked_logprobs, logprobs_reference


def _inputs(N, H, V, K, dtype=torch.float64, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    W = (torch.randn(V, H, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    ids = torch.randint(0, V, (N, K), generator=g)
    return h, W, b, ids


@pytest.mark.parametrize("N,H,V,K,chunk", [(7, 5, 37, 3, 8), (1, 4, 19, 1, 19), (5, 3, 50, 6, 64), (4, 6, 31, 2, 1)])
@pytest.mark.parametrize("transform", [{}, {"logit_scale": 0.7}, {"softcap": 3.0}])
def test_values_and_gradients_match_full_logits(N, H, V, K, chunk, transform):
    h, W, b, ids = _inputs(N, H, V, K)
    ids[0, -1] = V - 1  # the last id lives in the ragged last slice
    g_lp, g_lse = torch.randn(N, K, dtype=torch.float64), torch.randn(N, dtype=torch.float64)
    lp, lse = chunked_logprobs(h, W, ids, b, chunk=chunk, **transform)
    (lp * g_lp).sum().add((lse * g_lse).sum()).backward()
    got = (h.grad.clone(), W.grad.clone(), b.grad.clone())
    for t in (h, W, b):
        t.grad = None
    ref_lp, ref_lse = logprobs_reference(h, W, ids, b, **transform)
    (ref_lp * g_lp).sum().add((ref_lse * g_lse).sum()).backward()
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    for mine, ref in zip(got, (h.grad, W.grad, b.grad)):
        torch.testing.assert_close(mine, ref, rtol=1e-10, atol=1e-12)


def test_gradcheck_with_repeated_ids():
    h, W, b, ids = _inputs(3, 4, 11, 4)
    ids[1] = torch.tensor([2, 2, 7, 2])  # the same id several times in one row accumulates
    assert torch.autograd.gradcheck(lambda h, W, b: chunked_logprobs(h, W, ids, b, chunk=4), (h, W, b))


def test_padded_rows_get_zero_gradient_when_masked():
    h, W, _, ids = _inputs(6, 4, 23, 1, bias=False)
    mask = torch.tensor([1.0, 1, 0, 1, 0, 0], dtype=torch.float64)
    lp, _ = chunked_logprobs(h, W, ids, chunk=5)
    (lp.squeeze(-1) * mask).sum().backward()
    assert torch.all(h.grad[mask == 0] == 0) and torch.any(h.grad[mask == 1] != 0)


def test_float32_and_bfloat16_inputs():
    h, W, b, ids = _inputs(9, 16, 300, 2, dtype=torch.float32)
    lp, lse = chunked_logprobs(h, W, ids, b, chunk=64)
    ref_lp, ref_lse = logprobs_reference(h.double(), W.double(), ids, b.double())
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-5)
    hb, Wb = h.detach().bfloat16().requires_grad_(), W.detach().bfloat16().requires_grad_()
    lpb, _ = chunked_logprobs(hb, Wb, ids, chunk=64)
    ref_b, _ = logprobs_reference(hb.double(), Wb.double(), ids)
    assert lpb.dtype == torch.bfloat16
    torch.testing.assert_close(lpb.double(), ref_b, rtol=0.02, atol=0.05)
    lpb.sum().backward()
    assert hb.grad.dtype == torch.bfloat16 and torch.isfinite(Wb.grad.float()).all()


def test_float32_rounds_at_the_logit_not_at_the_partition():
    """log-probs near 0 next to a large log-partition keep their precision ((z - m) - log s)."""
    V = 5000
    h = torch.ones(2, 1)
    W = torch.zeros(V, 1)
    W[0] = 90.0  # logit 90 for id 0; lse ~ 90
    ids = torch.tensor([[0], [1]])
    lp, _ = chunked_logprobs(h, W, ids, chunk=1024)
    ref, _ = logprobs_reference(h.double(), W.double(), ids)
    assert abs(float(lp[0, 0]) - float(ref[0, 0])) < 1e-10


@pytest.mark.parametrize("chunk", [0, -3, 2.5])
def test_bad_chunk_is_a_clear_error(chunk):
    h, W, _, ids = _inputs(2, 3, 10, 1)
    with pytest.raises(ConfigError, match="--chunk .* must be a positive integer"):
        chunked_logprobs(h, W, ids, chunk=chunk)
    from opdcache.logits.divergence import chunked_divergence

    with pytest.raises(ConfigError, match="--chunk .* must be a positive integer"):
        chunked_divergence("rkl", h, W, h, W, chunk=chunk)


def test_out_of_range_ids_are_refused():
    h, W, _, ids = _inputs(2, 3, 10, 1)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 10\)"):
        chunked_logprobs(h, W, ids + 10)


def test_position_blocks_give_the_same_values_and_gradients(monkeypatch):
    """With blocks of 3 rows (BLOCK_BYTES shrunk), values and gradients equal the one-block computation."""
    from opdcache.logits import logprobs as LP
    from opdcache.logits.divergence import chunked_divergence

    h, W, b, ids = _inputs(10, 4, 29, 2)
    ht, Wt = torch.randn(10, 5, dtype=torch.float64), torch.randn(29, 5, dtype=torch.float64)
    lp, lse = chunked_logprobs(h, W, ids, b, chunk=8)
    div = chunked_divergence("rkl", h, W, ht, Wt, b, chunk=8)
    (lp.sum() + lse.sum() + div.sum()).backward()
    whole = (lp.detach(), lse.detach(), div.detach(), h.grad.clone(), W.grad.clone())
    h.grad = W.grad = b.grad = None
    monkeypatch.setattr(LP, "BLOCK_BYTES", 3 * 4 * 8)
    assert len(LP.row_blocks(10, 8)) == 4
    lp, lse = chunked_logprobs(h, W, ids, b, chunk=8)
    div = chunked_divergence("rkl", h, W, ht, Wt, b, chunk=8)
    (lp.sum() + lse.sum() + div.sum()).backward()
    for got, want in zip((lp, lse, div, h.grad, W.grad), whole):
        torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-12)


def test_a_gpu_takes_whole_vocabulary_rows_in_blocks_capped_by_its_free_memory(monkeypatch):
    """layout: a CPU keeps --chunk slices in row_blocks; a CUDA device takes the whole vocabulary in one slice, in
    blocks of GPU_BLOCK_BYTES of float32 logits, or a quarter of the free memory when that is less (at least a row)."""
    from opdcache.logits import logprobs as LP

    assert LP.layout(5000, 151_936, 8192, torch.device("cpu")) == (LP.row_blocks(5000, 8192), 8192)
    free = {"bytes": 80 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 << 30))
    blocks, chunk = LP.layout(5000, 151_936, 8192, torch.device("cuda"))
    assert chunk == 151_936 and [b.stop - b.start for b in blocks] == [1766, 1766, 1468]  # 1 GiB // (4 x 151,936)
    free["bytes"] = 1 << 30  # a quarter: 256 MiB
    assert LP.layout(5000, 151_936, 8192, torch.device("cuda"))[0][0] == slice(0, 441)
    free["bytes"] = 0
    assert len(LP.layout(3, 151_936, 8192, torch.device("cuda"))[0]) == 3


@pytest.mark.parametrize("K", [1, 5])
def test_the_gpu_layout_gives_the_reference_values_and_gradients(monkeypatch, K):
    """The GPU's layout (whole-vocabulary slices, here in blocks of 3 rows), run on the CPU: the same log-probs,
    log-partitions and gradients as the full-logits reference, repeated ids included (their gradients add up)."""
    from opdcache.logits import logprobs as LP

    monkeypatch.setattr(LP, "layout", lambda n, V, chunk, device: ([slice(a, min(a + 3, n)) for a in range(0, n, 3)], V))
    h, W, b, ids = _inputs(10, 4, 29, K)
    ids[0] = 7  # every id of row 0 the same
    lp, lse = chunked_logprobs(h, W, ids, b, chunk=8)
    (lp.sum() * 0.7 + lse.sum()).backward()
    grads = [t.grad.clone() for t in (h, W, b)]
    for t in (h, W, b):
        t.grad = None
    ref_lp, ref_lse = logprobs_reference(h, W, ids, b)
    (ref_lp.sum() * 0.7 + ref_lse.sum()).backward()
    torch.testing.assert_close(lp, ref_lp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    for got, t in zip(grads, (h, W, b)):
        torch.testing.assert_close(got, t.grad, rtol=1e-10, atol=1e-10)


def test_under_autocast_the_backward_matmuls_run_in_the_forward_dtype(monkeypatch):
    """Autocast is off inside a backward: the gradient matmuls must still run in bf16, as the forward's and the model's
    own head do (in float32 they made the fused train step 3x slower than the full-logits step on an H100), and the
    gradients must equal the full-logits path's under the same autocast to bf16 rounding."""
    import opdcache.logits.logprobs as lpm

    h, W, b, ids = _inputs(33, 16, 300, 2, dtype=torch.float32)
    seen = []
    original = lpm._slice_logits
    monkeypatch.setattr(lpm, "_slice_logits", lambda hh, *a: seen.append(hh.dtype) or original(hh, *a))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, lse = chunked_logprobs(h, W, ids, b, chunk=64)
    forward_calls = len(seen)
    (lp.sum() + lse.sum()).backward()
    assert set(seen[forward_calls:]) == {torch.bfloat16} and len(seen) > forward_calls
    got = (h.grad.clone(), W.grad.clone())
    h.grad = W.grad = b.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = (h @ W.T).float() + b  # the model's head under autocast, then a float32 log_softmax
    ref = torch.log_softmax(z, -1)
    (ref.gather(-1, ids).sum() + torch.logsumexp(z, -1).sum()).backward()
    for g, r in zip(got, (h.grad, W.grad)):
        assert float((g - r).norm() / r.norm()) < 2e-2


def test_matmul_dtype_follows_autocast():
    from opdcache.logits.logprobs import matmul_dtype

    x = torch.zeros(2, 2)
    assert matmul_dtype(x) == torch.float32 and matmul_dtype(x.double()) == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert matmul_dtype(x) == torch.bfloat16


def test_the_head_gradient_is_one_buffer_whatever_the_number_of_position_blocks(monkeypatch):
    """The streamed head's backward (log-probs, and the per-position divergences) writes every block of positions into
    one [V, H] gradient: a node per block handed autograd a [V, H] gradient each, two alive while it summed them,
    which made training memory step up with the number of blocks (2 at 2,048 tokens, 4 at 8,192)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from opdcache.logits import logprobs as LP
    from opdcache.logits.divergence import chunked_divergence

    class HeadShaped(TorchDispatchMode):
        def __init__(self, shape):
            super().__init__()
            self.shape, self.storages = shape, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # [V, H] results, by storage (a view is no buffer)
            out = func(*args, **(kwargs or {}))
            self.storages |= {t.untyped_storage().data_ptr() for t in (out if isinstance(out, (tuple, list)) else [out])
                              if isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape}
            return out

    monkeypatch.setattr(LP, "BLOCK_BYTES", 3 * 4 * 8)
    h, W, b, ids = _inputs(10, 4, 29, 2)
    ht, Wt = torch.randn(10, 5, dtype=torch.float64), torch.randn(29, 5, dtype=torch.float64)
    assert len(LP.row_blocks(10, 8)) == 4
    for loss in (lambda: chunked_logprobs(h, W, ids, b, chunk=8)[0].sum(), lambda: chunked_divergence("jsd", h, W, ht, Wt, b, chunk=8).sum()):
        W.grad = None
        value = loss()
        with HeadShaped(tuple(W.shape)) as seen:
            value.backward()
        assert len(seen.storages) == 1 and W.grad is not None


@pytest.mark.parametrize("transform", [{}, {"logit_scale": 0.7}])
@pytest.mark.parametrize("block_rows", [1, 3, 100])
def test_kept_probabilities_give_the_recomputed_gradients(monkeypatch, transform, block_rows):
    """The backward from the forward's kept probabilities (on a GPU within KEEP_BYTES: no recomputed logit matmul),
    forced here on the CPU with one vocabulary slice a block: the reference's values and gradients, the recomputing
    backward's to float64's rounding, and the kept blocks released as the backward uses them."""
    import opdcache.logits.logprobs as LP

    N, H, V, K = 7, 5, 37, 3
    monkeypatch.setattr(LP, "BLOCK_BYTES", 4 * V * block_rows)
    assert not LP.keeps_probabilities(N, V, V, torch.device("cpu"), None)  # never on a CPU by itself
    results, seen = [], []
    for keep in (False, True):
        monkeypatch.setattr(LP, "keeps_probabilities", lambda n, v, chunk, device, softcap: keep and chunk >= v and softcap is None)
        h, W, b, ids = _inputs(N, H, V, K)
        g = torch.Generator().manual_seed(1)
        g_lp, g_lse = torch.randn(N, K, dtype=torch.float64, generator=g), torch.randn(N, dtype=torch.float64, generator=g)
        lp, lse = chunked_logprobs(h, W, ids, b, chunk=V, **transform)
        seen.append(lp.grad_fn.kept)
        (lp * g_lp).sum().add((lse * g_lse).sum()).backward()
        results.append((lp.detach(), lse.detach(), h.grad, W.grad, b.grad))
    (recomputed, kept), (no_keep, keep_list) = results, seen
    assert no_keep is None and len(keep_list) == -(-N // block_rows) and all(x is None for x in keep_list)
    for a, b_ in zip(recomputed, kept):
        torch.testing.assert_close(b_, a, rtol=1e-12, atol=1e-13)
    h, W, b, ids = _inputs(N, H, V, K)
    ref_lp, ref_lse = logprobs_reference(h, W, ids, b, **transform)
    torch.testing.assert_close(kept[0], ref_lp.detach(), rtol=0, atol=1e-12)
