"""Exact primitives: float32 results that are a function of the mathematics only.

A float32 dot product computed by a BLAS kernel depends on the order of its additions, and that order depends on the
batch size, the padding, the kernel chosen for the shape and the thread count: the source of training-inference
mismatch (papers/003 section 2). Here every reduction is defined by one fixed order, and computed fast whenever the
fast computation provably rounds to the same float32:

* ``dot(a, b)`` := round32(F(a * b)), where the products are taken in float64 (exact: two float32 significands fit
  in 53 bits) and F is the *fold*: pad the terms with zeros to a power of two, then add the upper half to the lower
  half until one value is left. F does not change when zeros are appended (each extra level adds 0 to every term),
  so a dot product over a causal row padded with masked zeros equals the one over the unpadded row.
* Fast path: S = the same sum by float64 BLAS, in whatever order it likes. Any order of n float64 additions is within
  E = gamma_n * sum |a_k b_k| <= n u ||a|| ||b|| / (1 - n u) of the true value T (u = 2^-53, Higham, Accuracy and
  Stability, eq. 3.5), and so is F. So if round32(S - 2E) == round32(S + 2E), round32 (monotone) is constant on
  [S - 2E, S + 2E], which holds T, F and S: the fast result round32(S) *is* round32(F). Where the interval straddles a
  float32 rounding boundary (about K * 2^-27 of the outputs at width K), F is computed for that element alone.
* Transcendental functions (exp, log, silu, 1/sqrt) := round32(the C library's float64 value), computed by torch in
  float64 and kept where the interval y (1 +- 2^-45) rounds alike (libm and torch's vectorised float64 kernels are
  both within a few float64 ulps of the truth), else by Python's ``math`` for that element.

So the bits never depend on which kernel ran, in which order, on how many threads. Cost: float64 matmuls (half the
float32 rate on AVX-512) plus a few elementwise passes over each output. Memory: the float64 copies of a matmul's
inputs and output; weights are kept in float64 once per version (8 bytes per parameter; :func:`float64_of`).
Gradients are the ordinary ones (autograd through plain matmuls); only forward values are exact.
"""

from __future__ import annotations

import math

import torch

U = 2.0 ** -53  # float64 unit roundoff
SLACK = 4.0  # E = SLACK * n * U * ||a|| ||b||: covers gamma_n's 1/(1 - nu) and the rounding of the norms themselves
DELTA = 2.0 ** -45  # relative interval of a float64 transcendental value (libm and torch are within ~4 ulps = 2^-50)
FALLBACK_BYTES = 32 << 20  # float64 terms folded at once on the slow path


def fold(terms: torch.Tensor) -> torch.Tensor:
    """F: the sum over the last dimension in the fixed pairwise order (zeros appended to a power of two, upper half
    added to lower half). Invariant to appended zeros. float64 in, float64 out."""
    n = terms.shape[-1]
    if n == 0:
        return terms.new_zeros(terms.shape[:-1])
    half = 1 << (n - 1).bit_length() >> 1  # the padded width's half; the padding is never built
    if half and n > half:
        lower = terms[..., :half].clone()
        lower[..., : n - half] += terms[..., half:]  # the padded upper half's zeros add nothing
        terms = lower
    while terms.shape[-1] > 1:
        half = terms.shape[-1] // 2
        terms = terms[..., :half] + terms[..., half:]
    return terms[..., 0]


def _positive_zero(x: torch.Tensor) -> torch.Tensor:
    return x.add_(0.0)  # -0.0 + 0.0 = +0.0: a zero's sign depends on the order its terms cancelled in


def _rounds_alike(s64: torch.Tensor, e64: torch.Tensor) -> torch.Tensor:
    """True where round32 is constant on [s - e, s + e] (False for NaN)."""
    return (s64 - e64).float() == (s64 + e64).float()


def _chunks(count: int, width: int):
    step = max(1, FALLBACK_BYTES // (8 * max(width, 1)))
    for a in range(0, count, step):
        yield slice(a, min(a + step, count))


def float64_of(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 copy of ``weight`` [N, K], its row norms [N]), kept until the weight changes (its version counter
    moves) or is freed; recomputed every time for a weight being trained (it moves every step)."""
    if weight.requires_grad and torch.is_grad_enabled():
        w = weight.detach().double()
        return w, _norms(w, -1)[..., 0]
    hit = getattr(weight, "_opd_float64", None)  # kept on the tensor itself: freed with it
    if hit is not None and hit[0] == weight._version:
        return hit[1], hit[2]
    w = weight.detach().double()
    norms = _norms(w, -1)[..., 0]
    weight._opd_float64 = (weight._version, w, norms)
    return w, norms


def _norms(t64: torch.Tensor, dim: int) -> torch.Tensor:
    """Euclidean norms along ``dim`` (kept), float64: squares of float32 values are exact and cannot overflow in float64;
    the sum's rounding (relative K u) is inside SLACK. Several times faster than linalg.vector_norm's scaled loop."""
    return (t64 * t64).sum(dim, keepdim=True).sqrt_()


def _dot_exact(a64: torch.Tensor, b64: torch.Tensor, nb: torch.Tensor | None = None) -> torch.Tensor:
    """round32(F(a * b)) of the plain [..., M, K] x [..., K, N] matmul (float64 inputs), by the fast path and the fold.
    ``nb``: b's column norms [..., 1, N] when known."""
    with torch.autocast(a64.device.type, enabled=False):  # autocast would run the float64 matmul in bfloat16
        return _dot_exact_plain(a64, b64, nb)


def _dot_exact_plain(a64: torch.Tensor, b64: torch.Tensor, nb: torch.Tensor | None) -> torch.Tensor:
    s = a64 @ b64
    K = a64.shape[-1]
    na = _norms(a64, -1).mul_(2 * SLACK * K * U)  # [..., M, 1]
    if nb is None:
        nb = _norms(b64, -2)  # [..., 1, N]
    # 2E = na * nb: the interval that holds S, T and F. round32(S - 2E): where it equals round32(S + 2E), it is round32(F)
    # (round32 is monotone); each side one fused pass (addcmul) and one rounding
    out = torch.addcmul(s, na, nb, value=-1.0).float()
    good = out == torch.addcmul(s, na, nb).float()
    if not bool(good.all()):
        M, N = s.shape[-2:]
        A, B = a64.reshape(-1, M, K), b64.reshape(-1, K, N)  # a [M, K] with b [K, N], or both batched alike
        flat = out.view(-1, M, N)
        bi, m, n = (~good).view(-1, M, N).nonzero(as_tuple=True)
        vals = torch.empty(len(m), dtype=torch.float64, device=s.device)
        for sl in _chunks(len(m), K):
            vals[sl] = fold(A[bi[sl], m[sl]] * B[bi[sl], :, n[sl]])  # [F, K] terms each
        flat[bi, m, n] = vals.float()
    return _positive_zero(out)


class _Dot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _dot_exact(a.detach().double(), b.detach().double())

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = (g.to(a.dtype) @ b.transpose(-1, -2)).to(a.dtype) if ctx.needs_input_grad[0] else None
        gb = (a.transpose(-1, -2) @ g.to(a.dtype)).to(b.dtype) if ctx.needs_input_grad[1] else None
        return ga, gb


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        w64, norms = float64_of(weight)
        return _dot_exact(x.detach().double(), w64.T, norms[None, :])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ga = (g.to(w.dtype) @ w).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = (g.to(w.dtype).T @ x.to(w.dtype)) if ctx.needs_input_grad[1] else None
        return ga, gw


def matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a @ b in the exact arithmetic for batched [..., M, K] x [..., K, N] (attention): [..., M, N], each element
    round32(F(a_m * b_n)), then rounded to ``out_dtype``. Differentiable (ordinary gradients)."""
    return _Dot.apply(a, b).to(out_dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x @ weight.T (+ bias) in the exact arithmetic, [..., out] rounded to ``out_dtype``. The bias is added after
    rounding to float32 (one correctly rounded float32 addition), in every context alike. Differentiable (ordinary
    gradients)."""
    shape = x.shape
    y = _Linear.apply(x.reshape(-1, shape[-1]), weight)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).reshape(*shape[:-1], weight.shape[0])


def _sum_exact(t: torch.Tensor, nonnegative: bool) -> torch.Tensor:
    t64 = t.detach().double()
    s = t64.sum(-1)
    mag = s if nonnegative else t64.abs().sum(-1)
    good = _rounds_alike(s, mag.abs() * (2 * SLACK * t.shape[-1] * U))
    out = s.float()
    if not bool(good.all()):
        bad = (~good).nonzero(as_tuple=True)
        out[bad] = fold(t64[bad]).float()
    return _positive_zero(out)


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, nonnegative):
        ctx.shape, ctx.dtype = t.shape, t.dtype
        return _sum_exact(t, nonnegative)

    @staticmethod
    def backward(ctx, g):
        return g.unsqueeze(-1).expand(ctx.shape).to(ctx.dtype), None


def sum_last(t: torch.Tensor, nonnegative: bool = False) -> torch.Tensor:
    """The sum over the last dimension, round32(F(t)) (float32; invariant to appended zeros). ``nonnegative``: every
    term is >= 0, which saves the |t| pass of the bound. Differentiable."""
    return _Sum.apply(t, nonnegative)


# ------------------------------------------------------------------------------------ transcendental functions
def _m_exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _m_log(x: float) -> float:
    if x > 0:
        return math.log(x)
    return -math.inf if x == 0 else math.nan


def _m_silu(x: float) -> float:
    return x / (1.0 + _m_exp(-x))


def _m_rsqrt(x: float) -> float:
    return 1.0 / math.sqrt(x) if x > 0 else (math.inf if x == 0 else math.nan)


FUNCTIONS = {  # name: (float64 torch function, Python function, derivative from (x, y) for the backward)
    "exp": (torch.exp, _m_exp, lambda x, y: y),
    "log": (torch.log, _m_log, lambda x, y: 1 / x),
    "silu": (lambda x: x / (1 + torch.exp(-x)), _m_silu,
             lambda x, y: torch.sigmoid(x) * (1 + x * (1 - torch.sigmoid(x)))),
    "rsqrt": (lambda x: 1 / torch.sqrt(x), _m_rsqrt, lambda x, y: -0.5 * y * y * y),
}


def _unary_exact(name: str, x: torch.Tensor) -> torch.Tensor:
    f64, fpy, _ = FUNCTIONS[name]
    x64 = x.detach().double()
    y = f64(x64)
    good = _rounds_alike(y, y.abs() * (2 * DELTA))
    out = y.float()
    if not bool(good.all()):
        bad = (~good).nonzero(as_tuple=True)
        out[bad] = torch.tensor([fpy(v) for v in x64[bad].tolist()], dtype=torch.float64, device=out.device).float()
    return _positive_zero(out)


class _Unary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name):
        y = _unary_exact(name, x)
        ctx.save_for_backward(x, y)
        ctx.name = name
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return (g * FUNCTIONS[ctx.name][2](x.float(), y)).to(x.dtype), None


def unary(name: str, x: torch.Tensor) -> torch.Tensor:
    """round32(f(x)) for f in :data:`FUNCTIONS` (float32 out), whatever the element's position. Differentiable."""
    return _Unary.apply(x, name)


def cumsum64(t: torch.Tensor) -> torch.Tensor:
    """The float64 running sum over the last dimension, one sequential scan per row (torch's CPU cumsum)."""
    return t.double().cumsum(-1)


def exp(x):
    return unary("exp", x)


def log(x):
    return unary("log", x)


def silu(x):
    return unary("silu", x)


def rsqrt(x):
    return unary("rsqrt", x)


# ------------------------------------------------------------------------------------------- composites
# The decoder's norm, attention softmax and rotary embedding, composed of the primitives above and torch's elementwise
# ops (whose every element is one correctly rounded operation, wherever it sits); the GPU arithmetic
# (opdcache/exact/invariant.py) fuses each into kernels with the same interface.
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm: x / sqrt(mean(x^2) + eps) in float32 (the mean's sum by :func:`sum_last`, :func:`rsqrt`), then times the
    weight in ``dtype``. [..., C] -> [..., C] in ``dtype``. Memory: float32 copies of x."""
    x32 = x.float()
    var = sum_last(x32 * x32, nonnegative=True) / x32.shape[-1]
    scaled = x32 * rsqrt(var + eps)[..., None]
    return weight.to(dtype) * scaled.to(dtype)


def attention_probs(scores: torch.Tensor, pos: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Attention's softmax. scores: float32 [B, G, M, K], row m of group g being query m % Q (pos [B, Q], the queries'
    positions; Q divides M: grouped query heads stacked over a key head). Each row: its scores rounded to ``dtype``,
    times ``scale``, rounded again, over keys 0..its position (the rest weigh 0), shifted by the row's maximum,
    :func:`exp`, divided by their :func:`sum_last` and rounded to ``dtype``. Memory: float32 copies of the scores."""
    s = (scores.to(dtype) * scale).float().masked_fill(~visible(scores, pos), float("-inf"))
    e = exp(s - s.amax(-1, keepdim=True).detach())
    return (e / sum_last(e, nonnegative=True)[..., None]).to(dtype)


def visible(scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[B, 1, M, K] for scores [B, G, M, K]: True where row m's query (m % Q, at pos[b, m % Q]) sees key k, k <= its
    position (causal attention over a sequence's keys held at positions 0..K-1)."""
    B, M, K = scores.shape[0], scores.shape[2], scores.shape[-1]
    Q = pos.shape[1]
    at = pos[:, None, :].expand(B, M // Q, Q).reshape(B, 1, M)
    return torch.arange(K, device=scores.device) <= at[..., None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rotary embedding of x [B, Q, heads, D] at positions pos [B, Q]: x cos + rotate_half(x) sin, cos and sin
    (float32 tables [n, D]) rounded to ``dtype``, in ``dtype``. The result is a [B, Q, heads, D] view of a
    [B, heads, Q, D] tensor, attention's layout. Memory: the output and one temporary of its size."""
    xt = x.transpose(1, 2)
    c, s = cos[pos].to(dtype)[:, None], sin[pos].to(dtype)[:, None]
    return (xt * c + _rotate_half(xt) * s).transpose(1, 2)
