"""The batch-invariant arithmetic: the exact arithmetic's contract on a GPU, through fixed-tile Triton kernels.

opdcache/exact/arith.py makes every float32 result a function of the mathematics only (float64 products, a fixed
fold, a proof that the fast path rounds alike): identical on any machine, but its float64 matmuls run at a GPU's
float64 rate. Here the contract is narrower and cheap: each result is a function of its own inputs and this module's
block constants only, so sampling, scoring and the trainer's recompute give the same bits whatever the batch size,
the padding, the row's position in the batch, or KV-cache decoding against a full forward; it is not the CPU
arithmetic's bits, and it is recorded as its own arithmetic (``opdcache.exact.GPU_ARITHMETIC`` and its constants).

* ``linear`` / ``matmul``: one kernel with fixed tiles (``MATMUL_BLOCKS``), no split-K; element (m, n) sums the
  K dimension in blocks of BK from 0 up, each block one tensor-core dot product. bfloat16 and float16 inputs are
  upcast to float32 in the kernel and multiplied in tf32, which holds them exactly (their significands are narrower
  than tf32's 10 bits), so the products are exact and the accumulation is float32; float32 inputs use IEEE float32
  products. cuBLAS, by contrast, picks its kernel (tile, split-K, stream-K) by the shape, which is the batch.
* ``sum_last``: one program per row, BLOCK lanes each summing a strided column set in order, then a tree over the
  lanes (the order depends on the row's own width only; appended zeros change nothing, as attention's masked keys
  need).
* ``cumsum64``: one program per row, a scan per block of columns plus the carry (the inverse-CDF draws, top-p).
* ``rms_norm``: one kernel a row block: the squares summed as ``sum_last`` sums, the reciprocal square root as a
  correctly rounded square root and division, each product rounded to the model's dtype (bfloat16 by its bits, the
  same rounding on a GPU and in the interpreter). ``attention_probs``: the scores scaled, masked past each row's
  limit and shifted by the row's maximum in one kernel, ``exp``, then the row sum and division in another.
  ``rotary``: the rotary embedding of a tensor in one kernel, rounded as torch rounds it in the model's dtype. And
  ``linear`` / ``matmul`` round their output to bfloat16 in the kernel when asked (``out_dtype``). The decoder
  (opdcache/exact/decoder.py) calls these where torch would launch a dozen small kernels a layer: a decode step of
  4 layers launches about 200 kernels, against about 370 before them (``benchmarks/count_kernels.py``).
* ``exp``, ``log``, ``silu``, ``rsqrt``: on CUDA torch's float32 elementwise kernels, which compute each element by
  the same device function wherever it sits (on the CPU, under the interpreter, the exact arithmetic's functions:
  torch's CPU kernels round a tensor's tail differently from its vectorised body). Maxima, gathers, sorts and comparisons are exact in any order.

Gradients are the ordinary ones (plain matmuls in the backward); only forward values carry the contract. Memory: each
kernel's output, nothing more (no float64 weight copies, unlike the CPU arithmetic).

Runs where :func:`unavailable_reason` finds nothing missing: a CUDA device of compute capability 8.0 or later (tf32 tensor cores) with triton,
or any device under Triton's CPU interpreter (``TRITON_INTERPRET=1``), where the tests check the same invariances at
small shapes (the interpreter's bits are numpy's, not the GPU's: the contract is invariance, not the bits).
"""

from __future__ import annotations

import functools
import os

import torch

from opdcache.exact import arith as X
MATMUL_BLOCKS = (64, 64, 32)  # (BM, BN, BK): BK fixes the accumulation order; part of the definition
SUM_BLOCK = 1024  # lanes of a row sum: part of the definition
SUM_ROWS = 16  # rows per program of a row sum (each reduced alike)
SCAN_BLOCK = 1024  # columns per scan block: part of the definition
MIN_CAPABILITY = (8, 0)


def constants() -> dict:
    """What fixes the arithmetic besides its name, for the manifest's record."""
    return {"matmul_blocks": list(MATMUL_BLOCKS), "sum_block": SUM_BLOCK, "scan_block": SCAN_BLOCK, "fp_fusion": False}


@functools.cache
def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable_reason(device: torch.device | str) -> str | None:
    """None where the kernels run on ``device``; else what is missing, in words (checked before any model loads)."""
    device = torch.device(device)
    if _triton_version() is None:
        return "the batch-invariant kernels need triton (pip install triton; it comes with CUDA builds of torch)"
    if interpreted():
        return None
    if device.type != "cuda":
        return f"the batch-invariant kernels run on a CUDA GPU (or under TRITON_INTERPRET=1), got device {device.type}"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = torch.cuda.get_device_capability(index)
    if cap < MIN_CAPABILITY:
        return (f"the batch-invariant kernels need compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later "
                f"(tf32 tensor cores), got {cap[0]}.{cap[1]} on {torch.cuda.get_device_name(index)}")
    return None


COMPILE_OPTIONS = {"enable_fp_fusion": False}
"""Every kernel compiled without floating-point contraction: a product and the sum it enters round apart (as in
Triton's interpreter), whatever Triton's default (which is to contract, and is to change): part of the definition."""


def _launch(name: str, grid: tuple, *args, **constants) -> None:
    from opdcache.exact import invariantkernels

    getattr(invariantkernels, name)[grid](*args, **constants, **COMPILE_OPTIONS)


def _rounds(dtype: torch.dtype) -> bool:
    """Whether a composite's kernels round to bfloat16 (True) or keep float32 (False)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the batch-invariant composites compute in float32 or bfloat16, got {dtype}")
    return dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------- matmul
def _matmul_forward(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., M, K] x [..., K, N] (the same leading dims, or b without them) -> [..., M, N], the float32 result
    (rounded to bfloat16 in the kernel for ``out_dtype`` bfloat16)."""
    if a.dtype != b.dtype:
        raise ValueError(f"matmul operands must share a dtype, got {a.dtype} and {b.dtype}")
    M, K = a.shape[-2:]
    N = b.shape[-1]
    lead = a.shape[:-2]
    A = a.reshape(-1, M, K)
    Bt = b.reshape(-1, K, N) if b.dim() > 2 else b[None]
    if Bt.shape[0] not in (1, A.shape[0]):
        raise ValueError(f"matmul batch shapes differ: {tuple(a.shape)} and {tuple(b.shape)}")
    out = torch.empty((A.shape[0], M, N), dtype=out_dtype, device=a.device)
    if out.numel():
        BM, BN, BK = MATMUL_BLOCKS
        sbb = Bt.stride(0) if Bt.shape[0] > 1 else 0
        grid = (_cdiv(M, BM), _cdiv(N, BN), A.shape[0])
        _launch("matmul_tiles", grid, A, Bt, out, M, N, K, A.stride(0), A.stride(1), A.stride(2), sbb, Bt.stride(1),
                                      Bt.stride(2), out.stride(0), out.stride(1), out.stride(2),
                                      IEEE=a.dtype == torch.float32, SPELLED=interpreted(), ROUND=_rounds(out_dtype),
                                      BM=BM, BN=BN, BK=BK)
    return out.reshape(*lead, M, N)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, out_dtype=torch.float32):
        ctx.save_for_backward(a, b)
        return _matmul_forward(a.detach(), b.detach(), out_dtype)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = (g.to(a.dtype) @ b.transpose(-1, -2)).to(a.dtype) if ctx.needs_input_grad[0] else None
        gb = None
        if ctx.needs_input_grad[1]:
            gb = a.transpose(-1, -2) @ g.to(a.dtype)
            if b.dim() == 2 and gb.dim() > 2:
                gb = gb.reshape(-1, *gb.shape[-2:]).sum(0)
            gb = gb.to(b.dtype)
        return ga, gb, None


def matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a @ b for [..., M, K] x [..., K, N] (attention), [..., M, N], each element a function of its own row and
    column: the float32 result, rounded to ``out_dtype`` (bfloat16: in the kernel). Differentiable (ordinary
    gradients)."""
    return _Matmul.apply(a, b, out_dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x @ weight.T (+ bias, added to the float32 result) [..., out], rounded to ``out_dtype`` (without a bias, in the
    kernel). Differentiable."""
    shape = x.shape
    if bias is None:
        return _Matmul.apply(x.reshape(-1, shape[-1]), weight.T, out_dtype).reshape(*shape[:-1], weight.shape[0])
    y = _Matmul.apply(x.reshape(-1, shape[-1]), weight.T) + bias.float()
    return y.to(out_dtype).reshape(*shape[:-1], weight.shape[0])


# ------------------------------------------------------------------------------------------- reductions
def _row_sums(t: torch.Tensor) -> torch.Tensor:
    C = t.shape[-1]
    rows = t.reshape(-1, C)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=t.device)
    if rows.shape[0]:
        R = rows.shape[0]
        _launch("row_sums", (_cdiv(R, SUM_ROWS),), rows, out, R, C, rows.stride(0), ROWS=SUM_ROWS, BLOCK=SUM_BLOCK)
    return out.reshape(t.shape[:-1])


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        ctx.shape, ctx.dtype = t.shape, t.dtype
        return _row_sums(t.detach())

    @staticmethod
    def backward(ctx, g):
        return g.unsqueeze(-1).expand(ctx.shape).to(ctx.dtype)


def sum_last(t: torch.Tensor, nonnegative: bool = False) -> torch.Tensor:
    """The float32 sum over the last dimension, by the fixed lane order (invariant to appended zeros).
    ``nonnegative`` is accepted for the CPU arithmetic's signature and changes nothing here. Differentiable."""
    return _Sum.apply(t)


def cumsum64(t: torch.Tensor) -> torch.Tensor:
    """The float64 running sum over the last dimension of a 2-d tensor, by the fixed block scan."""
    C = t.shape[-1]
    rows = t.reshape(-1, C).contiguous()
    out = torch.empty(rows.shape, dtype=torch.float64, device=t.device)
    if rows.numel():
        _launch("row_cumsums", (rows.shape[0],), rows, out, C, rows.stride(0), BLOCK=SCAN_BLOCK)
    return out.reshape(t.shape)


# ------------------------------------------------------------------------------------------- the decoder's composites
class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        C = x.shape[-1]
        rows = x.detach().reshape(-1, C)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape, dtype=w.dtype, device=x.device)
        if rows.shape[0]:
            _launch("rms_norm_rows", (_cdiv(rows.shape[0], SUM_ROWS),), rows, w.detach().contiguous(), out, rows.shape[0], C,
                                                                        rows.stride(0), eps, ROUND=_rounds(w.dtype),
                                                                        ROWS=SUM_ROWS, BLOCK=SUM_BLOCK)
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        with torch.enable_grad():  # the ordinary gradient: the plain formula's
            x32, w_ = x.detach().float().requires_grad_(), w.detach().requires_grad_()
            y = w_ * (x32 * torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + ctx.eps)).to(w.dtype)
            gx, gw = torch.autograd.grad(y, (x32, w_), g)
        return gx.to(x.dtype), gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm in one kernel: weight (in ``dtype``) times x / sqrt(mean(x^2) + eps) rounded to ``dtype``, the mean's
    sum as :func:`sum_last` takes it and the reciprocal square root as a correctly rounded square root and division.
    [..., C] -> [..., C] in ``dtype``. Differentiable (ordinary gradients). Memory: the output."""
    return _RMSNorm.apply(x, weight.to(dtype), float(eps))


class _AttentionProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, pos, scale, dtype):
        ctx.save_for_backward(scores, pos)
        ctx.scale, ctx.dtype = scale, dtype
        B, Q, K = scores.shape[0], pos.shape[1], scores.shape[-1]
        s = scores.detach().reshape(-1, K).contiguous()
        p = pos.contiguous()
        R = s.shape[0]
        shifted = torch.empty_like(s)
        out = torch.empty(s.shape, dtype=dtype, device=s.device)
        if R:
            grid = (_cdiv(R, SUM_ROWS),)
            _launch("scores_shifted", grid, s, p, shifted, R, K, R // B, Q, scale, ROUND=_rounds(dtype), ROWS=SUM_ROWS,
                                            BLOCK=SUM_BLOCK)
            e = exp(shifted)
            _launch("rows_normalized", grid, e, out, R, K, ROUND=_rounds(dtype), ROWS=SUM_ROWS, BLOCK=SUM_BLOCK)
        return out.reshape(scores.shape)

    @staticmethod
    def backward(ctx, g):
        scores, pos = ctx.saved_tensors
        with torch.enable_grad():  # the ordinary gradient: the plain softmax's
            s = scores.detach().requires_grad_()
            t = (s.to(ctx.dtype) * ctx.scale).float()
            p = torch.softmax(t.masked_fill(~X.visible(scores, pos), float("-inf")), -1).to(ctx.dtype)
            (gs,) = torch.autograd.grad(p, s, g)
        return gs, None, None, None


def attention_probs(scores: torch.Tensor, pos: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Attention's softmax in three launches. scores: float32 [B, G, M, K], row m of group g being query m % Q (pos
    [B, Q], the queries' positions; Q divides M: grouped query heads stacked over a key head). Each row: its scores
    rounded to ``dtype``, times ``scale``, rounded again, over keys 0..its position (the rest weigh 0), shifted by the
    row's maximum, :func:`exp`, then divided by their sum (taken as :func:`sum_last` takes it) and rounded to
    ``dtype``. A row's keys past its position add exact zeros, so a decode step's row and the same row in a full
    forward agree. Differentiable in ``scores`` (ordinary gradients). Memory: two float32 copies of the scores."""
    return _AttentionProbs.apply(scores, pos, float(scale), dtype)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pos, cos, sin, dtype):
        ctx.save_for_backward(pos, cos, sin)
        ctx.dtype = dtype
        B, Q, heads, D = x.shape
        xd = x.detach()
        # each token's heads side by side and tokens evenly apart (a size-1 dimension's stride is any: a decode step's Q)
        token_stride = xd.stride(0) if Q == 1 else xd.stride(1)
        if xd.stride(-1) != 1 or xd.stride(-2) != D or (B > 1 and xd.stride(0) != Q * token_stride):
            xd = xd.contiguous()
            token_stride = heads * D
        p = pos.reshape(-1).contiguous()
        out = torch.empty((B, heads, Q, D), dtype=dtype, device=x.device)
        R = B * Q * heads
        if R:
            _launch("rotary_rows", (_cdiv(R, SUM_ROWS),), xd, p, cos.contiguous(), sin.contiguous(), out, R, heads, token_stride,
                    Q, ROUND=_rounds(dtype), D=D, ROWS=SUM_ROWS)
        return out

    @staticmethod
    def backward(ctx, g):
        pos, cos, sin = ctx.saved_tensors
        g = g.transpose(1, 2)  # [B, Q, heads, D], as x
        c, s = cos[pos][:, :, None].to(ctx.dtype), sin[pos][:, :, None].to(ctx.dtype)
        gc, gs = g * c, g * s  # out = x c + rotate_half(x) s: the gradient rotates back
        half = g.shape[-1] // 2
        return gc + torch.cat((gs[..., half:], -gs[..., :half]), -1), None, None, None, None


def rotary(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rotary embedding of x [B, Q, heads, D] at positions pos [B, Q] in one kernel: x cos + rotate_half(x) sin,
    cos and sin (float32 tables [n, D]) rounded to ``dtype``, each product and the sum rounded to ``dtype`` (as torch
    computes it in that dtype); a D that is not a power of two takes torch's ops (``arith.rotary``). The result is a
    [B, Q, heads, D] view of a [B, heads, Q, D] tensor, attention's layout (its transpose is contiguous).
    Differentiable in x (ordinary gradients). Memory: the output."""
    if x.shape[-1] & (x.shape[-1] - 1):  # torch's elementwise ops: the same bits wherever an element sits
        return X.rotary(x, pos, cos, sin, dtype)
    return _Rotary.apply(x, pos, cos, sin, dtype).transpose(1, 2)


# ------------------------------------------------------------------------------------------- elementwise
def _elementwise(name: str, f, x: torch.Tensor) -> torch.Tensor:
    """f(x) in float32. On CUDA, torch's kernel computes every element by one device function wherever it sits. torch's
    CPU kernels do not (a vectorised body and a scalar tail that can round differently, so a value depends on its
    offset in the tensor): on the CPU (Triton's interpreter) the exact arithmetic's correctly rounded function."""
    if x.device.type == "cpu":
        return X.unary(name, x)
    return f(x.float())


def exp(x: torch.Tensor) -> torch.Tensor:
    return _elementwise("exp", torch.exp, x)


def log(x: torch.Tensor) -> torch.Tensor:
    return _elementwise("log", torch.log, x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return _elementwise("silu", torch.nn.functional.silu, x)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    return _elementwise("rsqrt", torch.rsqrt, x)
