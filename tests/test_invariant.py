"""The batch-invariant GPU arithmetic (opdcache/exact/invariant.py) on the CPU, in Triton's interpreter: its kernels
against plain float64 references, their invariance to the batch, a row's position and appended zeros, and the exact
engine in this arithmetic: decoding alone, in a batch of 7 and of 16 (8) gives the same bits, and teacher-forced scoring
and the trainer's recompute give back what decoding stored.

Marked ``triton``: CI runs ``TRITON_INTERPRET=1 python -m pytest -m triton``; tests/test_gpu.py runs the compiled
kernels on CUDA (the interpreter's bits are numpy's, not a GPU's: what carries over is the invariance)."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # read at triton's first import; set by the runner (CI), never here
    pytest.skip("the kernels run on the CPU in Triton's interpreter: TRITON_INTERPRET=1 python -m pytest -m triton",
                allow_module_level=True)
pytest.importorskip("triton")

from opdcache.backends.exact import ExactBackend  # noqa: E402
from opdcache.exact import GPU_ARITHMETIC  # noqa: E402
from opdcache.exact import invariant as I  # noqa: E402
from exact_checks import (check_engine_invariance, check_grouped_query_decoder, check_packed_has_padded_bits,  # noqa: E402
                          compile_for_gpu, log_softmax_slice_by_slice, primitives_that_vary, wide_logits)

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_is_close_to_the_float64_product(dtype):
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(70, 100, generator=g).to(dtype), torch.randn(130, 100, generator=g).to(dtype)
    reference = a.double() @ w.double().T  # bfloat16 inputs: the products are exact, only the float32 sums round
    y = I.linear(a, w)
    assert y.dtype == torch.float32
    assert (y.double() - reference).abs().max() < 100 * 2 ** -24 * reference.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_in_7_and_in_64(dtype):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 96, generator=g).to(dtype), torch.randn(80, 96, generator=g).to(dtype)
    full = I.linear(x, w)
    for rows in (slice(0, 1), slice(9, 10), slice(3, 10), slice(57, 64)):
        assert torch.equal(I.linear(x[rows], w), full[rows])
    moved = torch.cat([x[5:], x[:5]])  # every row at another position of its tile
    assert torch.equal(I.linear(moved, w), torch.cat([full[5:], full[:5]]))


def test_a_product_rounded_to_bfloat16_in_the_kernel_is_torchs_rounding_of_the_float32_product():
    """The kernel's bfloat16 rounding (by the bits: the interpreter's own conversion truncates) is torch's, ties to even
    included, over a million products; halfway cases forced through the same rounding agree too."""
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(1000, 64, generator=g).bfloat16(), torch.randn(1000, 64, generator=g).bfloat16()
    assert torch.equal(I.linear(x, w, out_dtype=torch.bfloat16), I.linear(x, w).to(torch.bfloat16))
    p, v = torch.rand(2, 3, 5, 40, generator=g).bfloat16(), torch.randn(2, 3, 40, 16, generator=g).bfloat16()
    assert torch.equal(I.matmul(p, v, out_dtype=torch.bfloat16), I.matmul(p, v).to(torch.bfloat16))
    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 ** -100 * (1 + 2 ** -8), 3.0]).reshape(5, 1)
    one = torch.ones(1, 1)
    assert torch.equal(I.linear(ties, one, out_dtype=torch.bfloat16), ties.to(torch.bfloat16))  # float32 x 1: exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_primitive_gives_a_row_the_same_bits_in_any_batch(dtype):
    """Each primitive and sampler step, row by row: torch's CPU elementwise kernels alone would fail this (silu's
    vectorised body and scalar tail round differently), hence the exact functions on the CPU."""
    assert primitives_that_vary(I, "cpu", dtype) == []


def test_the_heads_one_call_paths_equal_slice_by_slice():
    """log_softmax's statistics in one call, and the logits in one matmul over the whole vocabulary, give the bits of
    the slice-by-slice computation (what scoring streams)."""
    from opdcache.exact import head as H

    z = wide_logits()
    assert torch.equal(H.log_softmax(z, I), log_softmax_slice_by_slice(z, I))
    g = torch.Generator().manual_seed(3)
    h, W = torch.randn(5, 32, generator=g).bfloat16(), torch.randn(2 * H.VOCAB_BLOCK + 9, 32, generator=g).bfloat16()
    by_slice = torch.cat([H.logits(h, W, None, a, torch.bfloat16, I) for a in range(0, W.shape[0], H.VOCAB_BLOCK)], -1)
    assert torch.equal(H.full_logits(h, W, None, torch.bfloat16, I), by_slice)


def test_attention_products_ignore_masked_keys():
    # the KV cache's t + 1 keys against the same query inside a longer, zero-weighted key set (a full forward)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 3, 1, 16, generator=g), torch.randn(2, 3, 9, 16, generator=g)
    p, v = torch.rand(2, 3, 1, 9, generator=g), torch.randn(2, 3, 9, 16, generator=g)
    longer_k = torch.cat([k, torch.randn(2, 3, 40, 16, generator=g)], 2)
    longer_p = torch.nn.functional.pad(p, (0, 40))
    longer_v = torch.cat([v, torch.randn(2, 3, 40, 16, generator=g)], 2)
    assert torch.equal(I.matmul(q, longer_k.transpose(-1, -2))[..., :9], I.matmul(q, k.transpose(-1, -2)))
    assert torch.equal(I.matmul(longer_p, longer_v), I.matmul(p, v))
    assert (I.matmul(p, v).double() - p.double() @ v.double()).abs().max() < 1e-5


def test_sums_and_scans_against_plain_references():
    g = torch.Generator().manual_seed(3)
    x = torch.rand(37, 3000, generator=g)
    s = I.sum_last(x)
    assert (s.double() - x.double().sum(-1)).abs().max() < 3000 * 2 ** -24 * s.abs().max()
    assert torch.equal(I.sum_last(torch.nn.functional.pad(x, (0, 1500))), s)  # appended zeros
    assert torch.equal(I.sum_last(x[4:5]), s[4:5]) and torch.equal(I.sum_last(x[20:]), s[20:])  # rows alone, elsewhere
    c = I.cumsum64(x[:5])
    assert torch.allclose(c, x[:5].double().cumsum(-1), rtol=1e-12, atol=0)
    assert torch.equal(I.cumsum64(x[3:4]), c[3:4])


def test_gradients_are_the_ordinary_ones():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 24, generator=g, requires_grad=True)
    w = torch.randn(7, 24, generator=g, requires_grad=True)
    (I.linear(x, w) * torch.arange(7.0)).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ((x @ w.T) * torch.arange(7.0)).sum().backward()
    assert torch.allclose(gx, x.grad) and torch.allclose(gw, w.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_in_one_kernel_is_the_formula_within_its_rounding_and_ignores_the_batch(dtype):
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(37, 3000, generator=g) * 3).to(dtype)  # wider than a block of lanes: three passes a row
    w = (torch.rand(3000, generator=g) + 0.5).to(dtype)
    y = I.rms_norm(x, w, 1e-6, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    x64 = x.double()
    scaled = (x64 * torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6)).to(dtype).double()  # rounded, as the kernel rounds
    ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -7
    assert ((y.double() - w.double() * scaled).abs() <= 2 * ulp * (w.double() * scaled).abs() + 1e-30).all()
    assert torch.equal(I.rms_norm(x[5:6], w, 1e-6, dtype), y[5:6]) and torch.equal(I.rms_norm(x[20:], w, 1e-6, dtype), y[20:])
    assert torch.equal(I.rms_norm(x.reshape(37, 3, 1000)[:, 1], w[:1000], 1e-6, dtype),  # strided rows
                       I.rms_norm(x.reshape(37, 3, 1000)[:, 1].contiguous(), w[:1000], 1e-6, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_probs_are_the_masked_softmax_and_a_rows_unseen_keys_change_nothing(dtype):
    """The three-launch softmax against torch's in float64 (of the same rounded, scaled scores), exact zeros past a
    query's position, and a decode step's row (its keys so far) against the same row among more keys it does not see;
    rows alone and the batch's other rows."""
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(2, 3, 2 * 5, 1200, generator=g) * 4  # [B, kv heads, 2 query heads x 5 queries, 1,200 keys]
    pos = torch.randint(0, 1200, (2, 5), generator=g)
    p = I.attention_probs(scores, pos, 0.125, dtype)
    assert p.dtype == dtype and p.shape == scores.shape
    t = (scores.to(dtype) * 0.125).double()
    at = pos[:, None, None, :].expand(2, 3, 2, 5).reshape(2, 3, 10)  # row m is query m % 5
    seen = torch.arange(1200) <= at[..., None]
    want = torch.softmax(t.masked_fill(~seen, float("-inf")), -1)
    assert (p[~seen] == 0).all()
    assert ((p.double() - want).abs() <= (2.0 ** -20 if dtype == torch.float32 else 2.0 ** -8) * want + 1e-30).all()
    short = int(pos.max()) + 1
    assert torch.equal(I.attention_probs(scores[..., :short].contiguous(), pos, 0.125, dtype), p[..., :short])
    assert torch.equal(I.attention_probs(scores[1:, 2:], pos[1:], 0.125, dtype), p[1:, 2:])  # a batch row alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_one_kernel_is_torchs_rotation_in_its_dtype(dtype):
    """The kernel against the decoder's torch ops in the same dtype (each product and the sum rounded alike): equal bits
    in bfloat16 (the roundings are the whole difference, and both round to nearest), float32 within a fused
    multiply-add's rounding; a strided input (q as a view of the fused q, k, v output) and rows alone give the same."""
    from opdcache.exact import arith as X
    from opdcache.exact.decoder import RotaryTable

    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(3, 5, 6 * 16, generator=g).to(dtype)  # [B, Q, (4 q heads + 2 k heads) x 16]
    q = qkv[..., :64].reshape(3, 5, 4, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [2, 3, 4, 5, 6]])
    table = RotaryTable(10000.0, 16)
    cos, sin = table.tables(pos)
    got = I.rotary(q, pos, cos, sin, dtype)
    want = X.rotary(q, pos, cos, sin, dtype)  # the CPU arithmetic's torch ops
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got, want, rtol=2 ** -22, atol=1e-7)
    assert torch.equal(I.rotary(q.contiguous(), pos, cos, sin, dtype), got)
    assert torch.equal(I.rotary(q[1:2, 2:], pos[1:2, 2:], cos, sin, dtype), got[1:2, 2:])
    step = qkv[:, 3:4, :64].reshape(3, 1, 4, 16)  # a decode step: one token a row, a view of the fused output
    assert torch.equal(I.rotary(step, pos[:, 3:4], cos, sin, dtype), got[:, 3:4])
    assert I.rotary(step, pos[:, 3:4], cos, sin, dtype).transpose(1, 2).is_contiguous()  # attention's layout
    x = q.float().detach().requires_grad_()
    weights = torch.randn(3, 5, 4, 16, generator=g)
    (I.rotary(x, pos, cos, sin, torch.float32) * weights).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    (X.rotary(x, pos, cos, sin, torch.float32) * weights).sum().backward()
    assert torch.allclose(gx, x.grad, atol=1e-6)


def test_the_composites_gradients_are_the_ordinary_ones():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 50, generator=g, requires_grad=True)
    w = (torch.rand(50, generator=g) + 0.5).requires_grad_()
    weights = torch.randn(6, 50, generator=g)
    (I.rms_norm(x, w, 1e-6, torch.float32) * weights).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (w * x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * weights).sum().backward()
    assert torch.allclose(gx, x.grad, atol=1e-6) and torch.allclose(gw, w.grad, atol=1e-5)
    s = torch.randn(1, 1, 4, 30, generator=g, requires_grad=True)  # one batch row, one group, 4 queries
    pos = torch.tensor([[0, 6, 29, 11]])
    (I.attention_probs(s, pos, 0.5, torch.float32) * weights[:4, :30]).sum().backward()
    gs = s.grad.clone()
    s.grad = None
    seen = torch.arange(30) <= pos[0, :, None]
    (torch.softmax((s * 0.5).masked_fill(~seen, float("-inf")), -1) * weights[:4, :30]).sum().backward()
    assert torch.allclose(gs, s.grad, atol=1e-6) and (gs[0, 0][~seen] == 0).all()


# ----------------------------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("dtype,n", [("float32", 16), ("bfloat16", 8)])
def test_engine_rows_alone_and_batched_agree_and_scoring_and_the_trainer_give_them_back(weights, dtype, n):
    """The demo student (the teacher is 4x wider: the interpreter's time), 16 rows in float32, 8 in bfloat16."""
    engine = ExactBackend(weights / "student", dtype=dtype, arithmetic=GPU_ARITHMETIC)
    assert engine.model_info()["exact"]["arithmetic"] == GPU_ARITHMETIC
    assert check_engine_invariance(engine, n, batches=(7, 1), max_new_tokens=5, seed=n) >= 3 * n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_sequences_have_their_padded_rows_bits_in_the_gpu_arithmetic(weights, dtype):
    """train --pack --exact on a GPU: each packed sequence's attention alone gives its right-padded row's bits."""
    from opdcache.backends.loading import load_model
    from opdcache.exact.decoder import ExactDecoder

    check_packed_has_padded_bits(ExactDecoder(load_model(weights / "student", "float32", "cpu"), dtype, arith=I))


def test_a_decode_step_launches_each_composite_once_where_it_is_used(weights):
    """benchmarks/count_kernels.py's count of one decode step of the demo student (2 layers): one RMSNorm kernel a norm
    (2 a layer and the final one), one rotary kernel for q and one for k, the softmax's two kernels a layer, every
    matmul's output rounded in its kernel (no dtype conversion left in the layers but the silu's), and fewer kernels
    than the default engine's step."""
    import sys
    from pathlib import Path

    from opdcache.backends.hf import TransformersBackend

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import count_kernels

    exact = count_kernels.per_step(ExactBackend(weights / "student", dtype="bfloat16", arithmetic=GPU_ARITHMETIC), 3)
    layers = 2
    assert exact["triton.rms_norm_rows"] == 2 * layers + 1
    assert exact["triton.rotary_rows"] == 2 * layers
    assert exact["triton.scores_shifted"] == exact["triton.rows_normalized"] == layers
    assert exact.get("aten.rsqrt", 0) == 0 and exact.get("aten.masked_fill", 0) <= 1  # the sampler's top-p mask only
    assert exact["aten._to_copy"] <= 3 * layers  # the silu's two and the head's float32 logits, no matmul's
    default = count_kernels.per_step(TransformersBackend(weights / "student", dtype="bfloat16"), 3)
    assert sum(exact.values()) < sum(default.values())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_grouped_query_attention_in_the_gpu_arithmetic(family):
    check_grouped_query_decoder(family, I)


@pytest.mark.parametrize("capability", [80, 90])
def test_every_kernel_compiles_for_a_gpu(capability):
    """Each batch-invariant kernel, float32 and bfloat16, compiled to a cubin for an A100 (8.0) and an H100/H200 (9.0)
    by the installed triton, with the arithmetic's compile options; no GPU needed."""
    out = compile_for_gpu(capability).splitlines()
    assert len(out) == 14 and all(f"sm_{capability}" in line for line in out), out
