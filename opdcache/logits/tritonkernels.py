"""The Triton device code behind opdcache/logits/kernels.py (which launches it, checks its inputs and documents each kernel).
Imported on a kernel's first launch only: it needs triton, which CPU-only torch wheels do not bring.

Every kernel runs one program per row of a [rows, columns] logit block and walks the row in tiles of ``BLOCK``
columns; arithmetic is float32 whatever the logits' dtype. Lanes past the row's end load 0 (never -inf, so no
inf - inf) and are masked out of every sum and maximum.
"""

import triton
import triton.language as tl

@triton.jit
def _tile(row_ptr, bias_ptr, c, inside, HAS_BIAS: tl.constexpr):
    """One tile of a row's logits in float32, plus the bias where there is one."""
    x = tl.load(row_ptr + c, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + c, mask=inside, other=0.0).to(tl.float32)
    return x


@triton.jit
def _mixture_log(lq, lp):
    """log((q + p) / 2) from log q and log p, as log-add-exp about the larger of the two."""
    hi = tl.maximum(lq, lp)
    return hi + tl.log(1.0 + tl.exp(tl.minimum(lq, lp) - hi)) - 0.6931471805599453  # - log 2


@triton.jit
def divergence_rows(zs_ptr, zt_ptr, bs_ptr, bt_ptr, w_ptr, div_ptr, V, stride_s, stride_t,
                    KIND: tl.constexpr, HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, HAS_W: tl.constexpr,
                    GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """KIND 0 fkl, 1 rkl, 2 jsd (opdcache/logits/divergence.py's formulas). Pass 1: both online log-sum-exps, and for fkl /
    rkl the expectation the value needs, rescaled as the running maximum of its side grows (as divergence.py's
    _online_kl); jsd's value takes a second pass over the mixture terms. With GRAD a last pass writes dz (times the
    row's weight) over the student's logits."""
    row = tl.program_id(0).to(tl.int64)
    zs_row = zs_ptr + row * stride_s
    zt_row = zt_ptr + row * stride_t
    cols = tl.arange(0, BLOCK)
    ms = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    mt = ms
    ss = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    st = ss
    acc = ss
    for a in range(0, V, BLOCK):
        c = a + cols
        inside = c < V
        xs = _tile(zs_row, bs_ptr, c, inside, HAS_BS)
        xt = _tile(zt_row, bt_ptr, c, inside, HAS_BT)
        new_s = tl.maximum(ms, tl.max(tl.where(inside, xs, float("-inf")), 0))
        new_t = tl.maximum(mt, tl.max(tl.where(inside, xt, float("-inf")), 0))
        es = tl.where(inside, tl.exp(xs - new_s), 0.0)
        et = tl.where(inside, tl.exp(xt - new_t), 0.0)
        ss = ss * tl.exp(ms - new_s) + tl.sum(es, 0)
        st = st * tl.exp(mt - new_t) + tl.sum(et, 0)
        if KIND == 0:
            acc = acc * tl.exp(mt - new_t) + tl.sum(et * (xt - xs), 0)
        elif KIND == 1:
            acc = acc * tl.exp(ms - new_s) + tl.sum(es * (xs - xt), 0)
        ms = new_s
        mt = new_t
    lse_s = ms + tl.log(ss)
    lse_t = mt + tl.log(st)
    if KIND == 0:  # KL(p || q) = E_p[z_t - z_s] - (m_t - m_s) - (log s_t - log s_s)
        div = acc / st - (mt - ms) - (tl.log(st) - tl.log(ss))
    elif KIND == 1:
        div = acc / ss - (ms - mt) - (tl.log(ss) - tl.log(st))
    else:
        kl_qm = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        kl_pm = kl_qm
        for a in range(0, V, BLOCK):
            c = a + cols
            inside = c < V
            lq = _tile(zs_row, bs_ptr, c, inside, HAS_BS) - lse_s
            lp = _tile(zt_row, bt_ptr, c, inside, HAS_BT) - lse_t
            lm = _mixture_log(lq, lp)
            kl_qm += tl.sum(tl.where(inside, tl.exp(lq) * (lq - lm), 0.0), 0)
            kl_pm += tl.sum(tl.where(inside, tl.exp(lp) * (lp - lm), 0.0), 0)
        div = 0.5 * (kl_pm + kl_qm)
        e_q = 0.5 * kl_qm  # E_q[g], g = log(q / m) / 2
    tl.store(div_ptr + row, div)
    if GRAD:
        w = 1.0
        if HAS_W:
            w = tl.load(w_ptr + row)
        for a in range(0, V, BLOCK):
            c = a + cols
            inside = c < V
            lq = _tile(zs_row, bs_ptr, c, inside, HAS_BS) - lse_s
            lp = _tile(zt_row, bt_ptr, c, inside, HAS_BT) - lse_t
            q = tl.exp(lq)
            if KIND == 0:
                dz = q - tl.exp(lp)
            elif KIND == 1:
                dz = q * (lq - lp - div)
            else:
                dz = q * (0.5 * (lq - _mixture_log(lq, lp)) - e_q)
            tl.store(zs_row + c, (dz * w).to(zs_ptr.dtype.element_ty), mask=inside)


@triton.jit
def logit_stats_rows(z_ptr, out_ptr, C, stride, P, scale, BLOCK: tl.constexpr):
    """The maximum m, s = sum e, b1 = sum e d and b2 = sum e d^2 (d = scale z - m, e = exp d) of one logit slice, online
    over tiles: each tile's sums about the running maximum, the old ones moved to a new maximum M as
    opdcache/backends/streamed.py's _add_moments does (every old term scales by exp(delta) and its offset grows by
    delta = m - M <= 0, so no sum changes sign and none cancels). Written as out[0..3, row]."""
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    b1 = s
    b2 = s
    for a in range(0, C, BLOCK):
        c = a + cols
        inside = c < C
        x = _tile(base, base, c, inside, False) * scale
        new = tl.maximum(m, tl.max(tl.where(inside, x, float("-inf")), 0))
        delta = tl.where(m == float("-inf"), 0.0, m - new)  # the first tile: no old terms
        grow = tl.exp(m - new)
        d = tl.where(inside, x - new, 0.0)
        e = tl.where(inside, tl.exp(d), 0.0)
        ed = e * d
        b2 = grow * (b2 + 2.0 * delta * b1 + delta * delta * s) + tl.sum(ed * d, 0)
        b1 = grow * (b1 + delta * s) + tl.sum(ed, 0)
        s = s * grow + tl.sum(e, 0)
        m = new
    tl.store(out_ptr + row, m)
    tl.store(out_ptr + P + row, s)
    tl.store(out_ptr + 2 * P + row, b1)
    tl.store(out_ptr + 3 * P + row, b2)
