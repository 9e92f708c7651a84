"""The Triton device code of the batch-invariant arithmetic (opdcache/exact/invariant.py launches it, checks its inputs
and states what each kernel guarantees). Imported on a kernel's first launch only: it needs triton.

Each output element is computed by one fixed sequence of operations that depends on nothing but the element's own
inputs and the kernel's block constants: never on how many rows the call has, where the row sits in its tile, or
how many zeros follow the row. No split-K, no atomics, no shape-dependent choice of algorithm; the launcher turns
off Triton's specialisation on the sizes that vary between a decode step and a full forward (rows, columns, the
reduced width), so one compiled kernel serves both.
"""

import triton
import triton.language as tl


@triton.jit
def rounded(x, ROUND: tl.constexpr):
    """float32 x rounded to bfloat16 (to nearest, ties to even) and held in float32, by its bits: the same on a GPU
    and in the interpreter (whose own float32 -> bfloat16 conversion truncates). x itself when not ROUND."""
    if ROUND:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    return x


@triton.jit(do_not_specialize=["M", "N", "K"])
def matmul_tiles(a_ptr, b_ptr, c_ptr, M, N, K, s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
                 IEEE: tl.constexpr, SPELLED: tl.constexpr, ROUND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
    """c[b] = a[b] @ b[b] in float32: element (m, n) is the float32 sum, over the K dimension in blocks of BK from 0
    up, of one block dot product each (tensor-core tf32 on values that tf32 holds exactly, bfloat16 or float16
    upcast; IEEE float32 for float32 inputs). Lanes past K load 0: appended zero terms change nothing. ROUND: the
    float32 result rounded to bfloat16 (:func:`rounded`), stored in c's dtype. ``SPELLED`` (Triton's CPU
    interpreter) writes the block dot product out as products and a sum over BK: the interpreter's tl.dot is numpy's
    BLAS, whose result for a row depends on the row's position in the tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_base = a_ptr + pid_b * s_ab
    b_base = b_ptr + pid_b * s_bb
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(a_base + rm[:, None].to(tl.int64) * s_am + kk[None, :] * s_ak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0).to(tl.float32)
        b = tl.load(b_base + kk[:, None].to(tl.int64) * s_bk + rn[None, :] * s_bn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0).to(tl.float32)
        if SPELLED:
            acc += tl.sum(a[:, :, None] * b[None, :, :], 1)
        elif IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b, input_precision="tf32")
    c_base = c_ptr + pid_b * s_cb
    tl.store(c_base + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn, rounded(acc, ROUND).to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["R", "C"])
def row_sums(x_ptr, out_ptr, R, C, stride, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """out[r] = the float32 sum of row r: lane j accumulates columns j, j + BLOCK, ... in order, then one tree sum
    over the BLOCK lanes; ROWS rows per program, each reduced alike. Appended zeros add 0 to a lane: a row's sum
    does not change when zeros follow it."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    base = x_ptr + rows[:, None].to(tl.int64) * stride
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for a in range(0, C, BLOCK):
        c = a + cols
        acc += tl.load(base + c[None, :], mask=(rows[:, None] < R) & (c[None, :] < C), other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, tl.sum(acc, 1), mask=rows < R)


@triton.jit(do_not_specialize=["C"])
def row_cumsums(x_ptr, out_ptr, C, stride, BLOCK: tl.constexpr):
    """out[r] = the float64 running sum of row r: a scan within each block of BLOCK columns, plus the carry from the
    blocks before it (the last running value, added once per block)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    carry = tl.sum(tl.zeros([BLOCK], dtype=tl.float64), 0)
    for a in range(0, C, BLOCK):
        c = a + cols
        x = tl.load(x_ptr + row * stride + c, mask=c < C, other=0.0).to(tl.float64)
        run = tl.cumsum(x, 0) + carry
        tl.store(out_ptr + row * C + c, run, mask=c < C)
        carry = tl.sum(tl.where(cols == BLOCK - 1, run, 0.0), 0)


@triton.jit(do_not_specialize=["R", "C"])
def rms_norm_rows(x_ptr, w_ptr, out_ptr, R, C, stride, eps, ROUND: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """out[r] = w * round(x[r] / sqrt(mean(x[r]^2) + eps)) in out's dtype (w in out's dtype; ROUND: bfloat16, else
    float32), each product rounded once: the squares summed as
    :func:`row_sums` sums a row (lane j takes columns j, j + BLOCK, ... in order, then one tree over the lanes), the
    reciprocal square root as a correctly rounded square root and division (the same bits on any device), each
    element then scaled, rounded to out's dtype and multiplied by its weight. ROWS rows per program, each alike."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    live = rows[:, None] < R
    base = x_ptr + rows[:, None].to(tl.int64) * stride
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for a in range(0, C, BLOCK):
        c = a + cols
        x = tl.load(base + c[None, :], mask=live & (c[None, :] < C), other=0.0).to(tl.float32)
        acc += x * x
    r = 1.0 / tl.sqrt_rn(tl.sum(acc, 1) / C + eps)
    out = out_ptr + rows[:, None].to(tl.int64) * C
    for a in range(0, C, BLOCK):
        c = a + cols
        m = live & (c[None, :] < C)
        x = tl.load(base + c[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c, mask=c < C, other=0.0).to(tl.float32)
        y = rounded(rounded(x * r[:, None], ROUND) * w[None, :], ROUND)
        tl.store(out + c[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["R", "K", "per_batch", "Q"])
def scores_shifted(s_ptr, pos_ptr, out_ptr, R, K, per_batch, Q, scale, ROUND: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK: tl.constexpr):
    """out[r, k] = t[r, k] - max_k t[r, k], t = (s rounded to bfloat16 if ROUND, times scale, rounded again)
    for k <= the row's query position and -inf beyond (the keys a query does not see): row r is query r % Q of batch
    row r // per_batch, at position pos[r // per_batch, r % Q]. Maxima and differences of two floats are exact in any
    order: each element depends on its own row only."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    live = rows < R
    lim = tl.load(pos_ptr + (rows // per_batch).to(tl.int64) * Q + rows % Q, mask=live, other=-1) + 1
    base = rows[:, None].to(tl.int64) * K
    top = tl.full([ROWS, BLOCK], float("-inf"), dtype=tl.float32)
    for a in range(0, K, BLOCK):
        c = a + cols
        seen = live[:, None] & (c[None, :] < lim[:, None])
        t = tl.load(s_ptr + base + c[None, :], mask=seen, other=0.0)
        t = rounded(rounded(t, ROUND) * scale, ROUND)
        top = tl.maximum(top, tl.where(seen, t, float("-inf")))
    m = tl.max(top, 1)
    for a in range(0, K, BLOCK):
        c = a + cols
        seen = live[:, None] & (c[None, :] < lim[:, None])
        t = tl.load(s_ptr + base + c[None, :], mask=seen, other=0.0)
        t = rounded(rounded(t, ROUND) * scale, ROUND)
        tl.store(out_ptr + base + c[None, :], tl.where(seen, t - m[:, None], float("-inf")), mask=live[:, None] & (c[None, :] < K))


@triton.jit(do_not_specialize=["R", "K"])
def rows_normalized(e_ptr, out_ptr, R, K, ROUND: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """out[r] = e[r] / sum(e[r]) in out's dtype (ROUND: bfloat16, rounded to nearest), the sum taken as :func:`row_sums` takes it (zeros appended to a row,
    the keys it does not see, change nothing)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    live = rows[:, None] < R
    base = rows[:, None].to(tl.int64) * K
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for a in range(0, K, BLOCK):
        c = a + cols
        acc += tl.load(e_ptr + base + c[None, :], mask=live & (c[None, :] < K), other=0.0)
    total = tl.where(rows < R, tl.sum(acc, 1), 1.0)  # rows past R: never stored, kept finite
    for a in range(0, K, BLOCK):
        c = a + cols
        m = live & (c[None, :] < K)
        e = tl.load(e_ptr + base + c[None, :], mask=m, other=0.0)
        tl.store(out_ptr + base + c[None, :], rounded(e / total[:, None], ROUND).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["R", "heads", "token_stride", "Q"])
def rotary_rows(x_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, R, heads, token_stride, Q, ROUND: tl.constexpr, D: tl.constexpr,
                ROWS: tl.constexpr):
    """The rotary embedding of one head's vector a row (row r: token r // heads of Q a batch row, head r % heads; x's
    heads D apart, its tokens token_stride apart; out laid out [batch, heads, Q, D], attention's layout): out = x * cos
    + rotate_half(x) * sin at the token's position, cos and
    sin (float32 tables of width D) rounded to bfloat16 if ROUND, each product and the sum rounded alike. Elementwise:
    each output depends on its own row only."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < R
    token = (rows // heads).to(tl.int64)
    head = rows % heads
    i = tl.arange(0, D)
    half = D // 2
    partner = tl.where(i < half, i + half, i - half)
    sign = tl.where(i < half, -1.0, 1.0)
    src = x_ptr + token[:, None] * token_stride + head[:, None] * D
    m = live[:, None]
    x = tl.load(src + i[None, :], mask=m, other=0.0).to(tl.float32)
    xr = tl.load(src + partner[None, :], mask=m, other=0.0).to(tl.float32) * sign[None, :]
    p = tl.load(pos_ptr + token, mask=live, other=0).to(tl.int64)
    c = rounded(tl.load(cos_ptr + p[:, None] * D + i[None, :], mask=m, other=0.0), ROUND)
    s = rounded(tl.load(sin_ptr + p[:, None] * D + i[None, :], mask=m, other=0.0), ROUND)
    y = rounded(rounded(x * c, ROUND) + rounded(xr * s, ROUND), ROUND)
    at = ((token // Q) * heads + head) * Q + token % Q  # [batch, heads, Q, D]
    tl.store(out_ptr + at[:, None] * D + i[None, :], y.to(out_ptr.dtype.element_ty), mask=m)
