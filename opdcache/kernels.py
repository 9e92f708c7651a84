"""Fused Triton kernels for the GPU's whole-vocabulary row blocks: everything between two head matmuls in one read.

On a GPU the head products run at the chip's matmul rate, and what is left of a fused loss's time is the elementwise
work on the [rows, V] logit block between them: on an H200 at 4,096 positions, hidden 4,096, V 151,936, the torch ops
of opdcache/divergence.py's uniform path (float32 copies of the bf16 logits, online log-sum-exp, log-probs in place,
the totals, dz, the cast back) made it 1.65-1.69x ``kl_div``'s time with the same four head matmuls (BENCHMARKS.md).
A kernel here reads each logit of a block in the matmul's own dtype twice (the online log-sum-exp and totals, then the
values that need them) and writes dz once, in that dtype, over the student's logits: the buffer the gradient matmuls
read next. Arithmetic is float32 throughout, as the torch path's.

Each kernel has its torch reference in the module that calls it (the same function with ``fused=False``) and parity
tests: on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``, the ``triton`` test group) and on CUDA
(tests/test_gpu.py). :func:`available` is the one switch: a CUDA tensor and an importable triton.
"""

from __future__ import annotations

import functools
import os

import torch

DIVERGENCE_BLOCK = 8192  # columns per tile of a row; one program per row walks the row in tiles
DIVERGENCE_WARPS = 16


@functools.cache
def _triton():
    """The triton module, or None where it is not installed (CPU-only torch wheels do not bring it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return triton


def available(device: torch.device) -> bool:
    """True where the fused kernels run: a CUDA device with triton importable, or any device under Triton's CPU
    interpreter (``TRITON_INTERPRET=1``, which the parity tests use); never with ``OPDCACHE_KERNELS=0`` in the
    environment (the torch ops then, for a comparison or to rule a kernel out)."""
    if os.environ.get("OPDCACHE_KERNELS") == "0" or _triton() is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _divergence_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rows(zs_ptr, zt_ptr, bs_ptr, bt_ptr, w_ptr, div_ptr, V, stride_s, stride_t,
             KIND: tl.constexpr, HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, HAS_W: tl.constexpr,
             GRAD: tl.constexpr, BLOCK: tl.constexpr):
        # KIND: 0 fkl, 1 rkl, 2 jsd. One program per row of the block.
        row = tl.program_id(0).to(tl.int64)
        zs_row = zs_ptr + row * stride_s
        zt_row = zt_ptr + row * stride_t
        cols = tl.arange(0, BLOCK)
        ms = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
        mt = ms
        ss = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        st = ss
        acc = ss
        # pass 1: online log-sum-exp of both sides; for fkl / rkl also the expectation the value needs, rescaled as
        # the running maximum of its side grows (as opdcache/divergence.py's _online_kl)
        for a in range(0, V, BLOCK):
            c = a + cols
            inside = c < V
            xs = tl.load(zs_row + c, mask=inside, other=0.0).to(tl.float32)
            xt = tl.load(zt_row + c, mask=inside, other=0.0).to(tl.float32)
            if HAS_BS:
                xs += tl.load(bs_ptr + c, mask=inside, other=0.0).to(tl.float32)
            if HAS_BT:
                xt += tl.load(bt_ptr + c, mask=inside, other=0.0).to(tl.float32)
            new_s = tl.maximum(ms, tl.max(tl.where(inside, xs, float("-inf")), 0))
            new_t = tl.maximum(mt, tl.max(tl.where(inside, xt, float("-inf")), 0))
            es = tl.where(inside, tl.exp(xs - new_s), 0.0)  # lanes past V: 0 (their x is 0, not -inf: no inf - inf)
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
        else:  # jsd: a second pass for the mixture terms, given both log-partitions
            kl_qm = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
            kl_pm = kl_qm
            for a in range(0, V, BLOCK):
                c = a + cols
                inside = c < V
                lq = tl.load(zs_row + c, mask=inside, other=0.0).to(tl.float32)
                lp = tl.load(zt_row + c, mask=inside, other=0.0).to(tl.float32)
                if HAS_BS:
                    lq += tl.load(bs_ptr + c, mask=inside, other=0.0).to(tl.float32)
                if HAS_BT:
                    lp += tl.load(bt_ptr + c, mask=inside, other=0.0).to(tl.float32)
                lq = lq - lse_s
                lp = lp - lse_t
                hi = tl.maximum(lq, lp)
                lm = hi + tl.log(1.0 + tl.exp(tl.minimum(lq, lp) - hi)) - 0.6931471805599453
                kl_qm += tl.sum(tl.where(inside, tl.exp(lq) * (lq - lm), 0.0), 0)
                kl_pm += tl.sum(tl.where(inside, tl.exp(lp) * (lp - lm), 0.0), 0)
            div = 0.5 * (kl_pm + kl_qm)
            e_q = 0.5 * kl_qm  # E_q[g], g = log(q / m) / 2
        tl.store(div_ptr + row, div)
        if GRAD:  # dz = d divergence / d z_s, scaled by the row's weight, written over the student's logits
            w = 1.0
            if HAS_W:
                w = tl.load(w_ptr + row)
            for a in range(0, V, BLOCK):
                c = a + cols
                inside = c < V
                lq = tl.load(zs_row + c, mask=inside, other=0.0).to(tl.float32)
                lp = tl.load(zt_row + c, mask=inside, other=0.0).to(tl.float32)
                if HAS_BS:
                    lq += tl.load(bs_ptr + c, mask=inside, other=0.0).to(tl.float32)
                if HAS_BT:
                    lp += tl.load(bt_ptr + c, mask=inside, other=0.0).to(tl.float32)
                lq = lq - lse_s
                lp = lp - lse_t
                q = tl.exp(lq)
                if KIND == 0:
                    dz = q - tl.exp(lp)
                elif KIND == 1:
                    dz = q * (lq - lp - div)
                else:
                    hi = tl.maximum(lq, lp)
                    lm = hi + tl.log(1.0 + tl.exp(tl.minimum(lq, lp) - hi)) - 0.6931471805599453
                    dz = q * (0.5 * (lq - lm) - e_q)
                tl.store(zs_row + c, (dz * w).to(zs_ptr.dtype.element_ty), mask=inside)

    return rows


DIVERGENCE_KINDS = {"fkl": 0, "rkl": 1, "jsd": 2}


def divergence_rows_(kind: str, zs_RV: torch.Tensor, zt_RV: torch.Tensor, bs_V: torch.Tensor | None,
                     bt_V: torch.Tensor | None, weights_R: torch.Tensor | None, div_R: torch.Tensor, grad: bool) -> None:
    """One block of whole-vocabulary rows: ``div_R`` (float32) <- the divergence of softmax(zt + bt) and softmax(zs + bs)
    per row (opdcache/divergence.py's formulas); with ``grad``, ``zs_RV`` <- dz = d div / d z_s times the row's weight
    (None: 1), in zs's dtype. zs and zt hold the logits in the matmul's dtype, rows contiguous."""
    R, V = zs_RV.shape
    if zt_RV.shape != (R, V) or zs_RV.stride(1) != 1 or zt_RV.stride(1) != 1:
        raise ValueError(f"logit blocks must be [rows, V] with contiguous rows, got {tuple(zs_RV.shape)} and {tuple(zt_RV.shape)}")
    if div_R.dtype != torch.float32 or not div_R.is_contiguous():
        raise ValueError("div_R must be a contiguous float32 tensor")
    if R == 0:
        return
    dummy = div_R  # an unused pointer argument (HAS_* False) still needs a tensor
    _divergence_kernel()[(R,)](
        zs_RV, zt_RV, dummy if bs_V is None else bs_V.contiguous(), dummy if bt_V is None else bt_V.contiguous(),
        dummy if weights_R is None else weights_R.to(torch.float32).contiguous(), div_R, V, zs_RV.stride(0), zt_RV.stride(0),
        KIND=DIVERGENCE_KINDS[kind], HAS_BS=bs_V is not None, HAS_BT=bt_V is not None, HAS_W=weights_R is not None,
        GRAD=grad, BLOCK=DIVERGENCE_BLOCK, num_warps=DIVERGENCE_WARPS)


STATS_BLOCK = 8192
STATS_WARPS = 16


@functools.cache
def _stats_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rows(z_ptr, out_ptr, C, stride, P, scale, BLOCK: tl.constexpr):
        # One program per row: the maximum m, s = sum e, b1 = sum e d and b2 = sum e d^2 (d = scale z - m, e = exp d)
        # of one logit slice, online over tiles (each tile's sums about the running maximum; the old ones moved to a
        # new maximum M as in opdcache/backends/streamed.py's _add_moments: every old term scales by exp(delta) and
        # its offset grows by delta = m - M <= 0, so no sum changes sign and none cancels).
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
            x = tl.load(base + c, mask=inside, other=0.0).to(tl.float32) * scale
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

    return rows


def logit_stats_rows(z_PC: torch.Tensor, scale: float | None) -> torch.Tensor:
    """[4, P] float32 for one slice of logits [P, C] (any float dtype, rows contiguous), each multiplied by ``scale``
    (None: 1): per row the maximum m, s = sum_c exp(z_c - m), b1 = sum_c exp(z_c - m)(z_c - m) and b2 = sum_c
    exp(z_c - m)(z_c - m)^2 -- a slice's log-sum-exp (m + log s) and the moments of the full distribution's log-probs
    (opdcache/backends/streamed.py), from one read of the slice."""
    P, C = z_PC.shape
    if z_PC.stride(1) != 1:
        raise ValueError(f"a logit slice must have contiguous rows, got strides {z_PC.stride()}")
    out = torch.empty(4, P, dtype=torch.float32, device=z_PC.device)
    if P:
        _stats_kernel()[(P,)](z_PC, out, C, z_PC.stride(0), P, 1.0 if scale is None else float(scale), BLOCK=STATS_BLOCK,
                              num_warps=STATS_WARPS)
    return out
