"""Exact full-vocabulary divergences between student and teacher, computed in vocabulary chunks (papers/002).

Student logits z_s = h_s W_s^T (+ b_s) and teacher logits z_t = h_t W_t^T (+ b_t) exist only one vocabulary
slice at a time ([N, C]); neither the forward nor the backward ever holds a [tokens, vocabulary] tensor.
The teacher side is the stored hidden state with ``head.safetensors``, or the svd state z with the svd
decoder; the student side is fused the same way from the student's final hidden state and its own head.

With q = softmax(z_s) (student), p = softmax(z_t) (teacher), m = (p + q) / 2, per position:

* ``fkl``: KL(p || q) = sum_v p_v (log p_v - log q_v);     d/dz_s = q - p
* ``rkl``: KL(q || p) = sum_v q_v (log q_v - log p_v);     d/dz_s = q * (log q - log p - KL(q || p))
* ``jsd``: (KL(p || m) + KL(q || m)) / 2;                   d/dz_s = q * (g - sum_u q_u g_u), g = log(q / m) / 2

Forward: FKL and RKL in one online pass (running maxima, rescaled accumulators); JSD in two (log-partitions
first, then the mixture terms, which need them). Backward: one pass recomputing each slice. Values and gradients match :func:`divergence_reference` (naive float64) -- see the parity tests.
"""

from __future__ import annotations

import torch

from opdcache.logprobs import matmul_dtype

KINDS = ("fkl", "rkl", "jsd")
DEFAULT_CHUNK = 4096


def _logits(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, a: int, c: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits of vocabulary slice [a, a + c): the matmul in h's dtype, the result in ``dtype`` (default h's)."""
    dtype = dtype or h.dtype
    z = (h @ W[a: a + c].T.to(h.dtype)).to(dtype)
    if b is not None:
        z = z + b[a: a + c].to(dtype)
    return z


def _lse(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """[N, 2]: the running maximum m and log s of the online log-sum-exp (lse = m + log s, kept apart so that a
    log-prob is computed as (z - m) - log s and rounds at |z - m| rather than at |lse|)."""
    m = torch.full((h.shape[0],), float("-inf"), dtype=dtype, device=h.device)
    s = torch.zeros(h.shape[0], dtype=dtype, device=h.device)
    for a in range(0, W.shape[0], chunk):
        z = _logits(h, W, b, a, chunk, dtype)
        new_m = torch.maximum(m, z.amax(-1))
        s = s * torch.exp(m - new_m) + torch.exp(z - new_m[:, None]).sum(-1)
        m = new_m
    return torch.stack([m, torch.log(s)], -1)


def _log_probs(z: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """log softmax of a slice in place: (z - m) - log s, with lse2 = [m, log s] per row."""
    return z.sub_(lse2[:, :1]).sub_(lse2[:, 1:])


def _slice_terms(zs: torch.Tensor, zt: torch.Tensor, lse_s: torch.Tensor, lse_t: torch.Tensor):
    """(log q, log p, q, p) of one slice (zs and zt are overwritten)."""
    lq, lp = _log_probs(zs, lse_s), _log_probs(zt, lse_t)
    return lq, lp, lq.exp(), lp.exp()


def _mixture_log(lq: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    return torch.logaddexp(lq, lp) - torch.log(torch.tensor(2.0, dtype=lq.dtype))


def _online_kl(kind: str, hs, Ws, bs, ht, Wt, bt, chunk: int, dtype: torch.dtype):
    """One pass over the vocabulary for KL(p || q) or KL(q || p), with running maxima (papers/002's online form).

    KL(p || q) = sum_v p_v (z_t - z_s)_v - lse_t + lse_s; the expectation under p is accumulated as
    sum_v exp(z_t - m_t)(z_t - z_s) and rescaled whenever the running max m_t grows (and symmetrically for q).
    """
    N = hs.shape[0]
    ms = torch.full((N,), float("-inf"), dtype=dtype, device=hs.device)
    mt = ms.clone()
    ss, st, acc = (torch.zeros(N, dtype=dtype, device=hs.device) for _ in range(3))
    for a in range(0, Ws.shape[0], chunk):
        zs, zt = _logits(hs, Ws, bs, a, chunk, dtype), _logits(ht, Wt, bt, a, chunk, dtype)
        new_s, new_t = torch.maximum(ms, zs.amax(-1)), torch.maximum(mt, zt.amax(-1))
        es, et = torch.exp(zs - new_s[:, None]), torch.exp(zt - new_t[:, None])
        ss = ss * torch.exp(ms - new_s) + es.sum(-1)
        st = st * torch.exp(mt - new_t) + et.sum(-1)
        if kind == "fkl":
            acc = acc * torch.exp(mt - new_t) + (et * (zt - zs)).sum(-1)
        else:
            acc = acc * torch.exp(ms - new_s) + (es * (zs - zt)).sum(-1)
        ms, mt = new_s, new_t
    lse_s, lse_t = torch.stack([ms, torch.log(ss)], -1), torch.stack([mt, torch.log(st)], -1)
    # KL = E[z_a - z_b] - (m_a - m_b) - (log s_a - log s_b): the maxima and log-sums cancel separately
    if kind == "fkl":
        return lse_s, lse_t, acc / st - (mt - ms) - (lse_t[:, 1] - lse_s[:, 1])
    return lse_s, lse_t, acc / ss - (ms - mt) - (lse_s[:, 1] - lse_t[:, 1])


class _ChunkedDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hs, Ws, bs, ht, Wt, bt, kind: str, chunk: int):
        # the logit matmuls in the dtype the model's own head would use (autocast's, else the inputs'); everything
        # after them in float32 at least (float64 stays float64 for gradcheck)
        dtype = torch.float64 if hs.dtype == torch.float64 else torch.float32
        mm = matmul_dtype(hs)
        hs_, ht_ = hs.to(mm), ht.to(mm)
        if kind in ("fkl", "rkl"):
            lse_s, lse_t, div = _online_kl(kind, hs_, Ws, bs, ht_, Wt, bt, chunk, dtype)
            aux = div
        else:
            lse_s, lse_t = _lse(hs_, Ws, bs, chunk, dtype), _lse(ht_, Wt, bt, chunk, dtype)
            div = torch.zeros(hs.shape[0], dtype=dtype, device=hs.device)
            aux = torch.zeros_like(div)  # sum_v q_v g_v with g = log(q / m) / 2 (needed by the backward)
            for a in range(0, Ws.shape[0], chunk):
                lq, lp, q, p = _slice_terms(_logits(hs_, Ws, bs, a, chunk, dtype), _logits(ht_, Wt, bt, a, chunk, dtype), lse_s, lse_t)
                lm = _mixture_log(lq, lp)
                kl_qm = (q * (lq - lm)).sum(-1)
                div += 0.5 * ((p * (lp - lm)).sum(-1) + kl_qm)
                aux += 0.5 * kl_qm
        ctx.save_for_backward(hs, Ws, bs if bs is not None else torch.empty(0), ht, Wt, bt if bt is not None else torch.empty(0),
                              lse_s, lse_t, aux)
        ctx.kind, ctx.chunk, ctx.has_bs, ctx.has_bt, ctx.mm = kind, chunk, bs is not None, bt is not None, mm
        return div.to(hs.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        hs, Ws, bs, ht, Wt, bt, lse_s, lse_t, aux = ctx.saved_tensors
        bs = bs if ctx.has_bs else None
        bt = bt if ctx.has_bt else None
        dtype, mm = lse_s.dtype, ctx.mm
        hs_, ht_ = hs.to(mm), ht.to(mm)
        g = grad_out.to(dtype)
        need_h, need_W, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.zeros(hs.shape, dtype=dtype, device=hs.device) if need_h else None
        grad_W = torch.zeros(Ws.shape, dtype=dtype, device=Ws.device) if need_W else None
        grad_b = torch.zeros(Ws.shape[0], dtype=dtype, device=Ws.device) if need_b and bs is not None else None
        for a in range(0, Ws.shape[0], ctx.chunk):
            # in place: one [N, C] buffer per side, so the backward holds ~3 slices at a time
            lq = _log_probs(_logits(hs_, Ws, bs, a, ctx.chunk, dtype), lse_s)
            lp = _log_probs(_logits(ht_, Wt, bt, a, ctx.chunk, dtype), lse_t)
            if ctx.kind == "fkl":
                dz = lq.exp_().sub_(lp.exp_())  # q - p
            elif ctx.kind == "rkl":
                q = lq.exp()
                dz = lq.sub_(lp).sub_(aux[:, None]).mul_(q)  # q (log q - log p - KL)
            else:
                q = lq.exp()
                dz = lq.sub_(_mixture_log(lq, lp)).mul_(0.5).sub_(aux[:, None]).mul_(q)  # q (g - E_q g)
            dz.mul_(g[:, None])  # [N, C]
            dzm = dz.to(mm)  # the gradient matmuls in the forward's matmul dtype, accumulated in float32
            if grad_h is not None:
                grad_h += dzm @ Ws[a: a + ctx.chunk].to(mm)
            if grad_W is not None:
                grad_W[a: a + ctx.chunk] += dzm.T @ hs_
            if grad_b is not None:
                grad_b[a: a + ctx.chunk] += dz.sum(0)
        return (None if grad_h is None else grad_h.to(hs.dtype), None if grad_W is None else grad_W.to(Ws.dtype),
                None if grad_b is None else grad_b.to(Ws.dtype), None, None, None, None, None)


def chunked_divergence(kind: str, student_hidden_NH: torch.Tensor, student_weight_VH: torch.Tensor, teacher_hidden_NK: torch.Tensor,
                       teacher_weight_VK: torch.Tensor, student_bias_V: torch.Tensor | None = None,
                       teacher_bias_V: torch.Tensor | None = None, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Per-position divergence [N] between student and teacher distributions over the full vocabulary.

    Differentiable with respect to the student hidden states, head weight and bias; the teacher is fixed.
    ``chunk`` is the vocabulary slice width; positions go in blocks of opdcache.logprobs.row_blocks, so transient
    memory is a few [rows, chunk] blocks whatever N and V.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if student_weight_VH.shape[0] != teacher_weight_VK.shape[0]:
        raise ValueError(f"student and teacher vocabularies differ: {student_weight_VH.shape[0]} vs {teacher_weight_VK.shape[0]}")
    if student_hidden_NH.shape[0] != teacher_hidden_NK.shape[0]:
        raise ValueError(f"positions differ: {student_hidden_NH.shape[0]} student vs {teacher_hidden_NK.shape[0]} teacher")
    from opdcache.logprobs import check_chunk, row_blocks

    check_chunk(chunk)
    tb = None if teacher_bias_V is None else teacher_bias_V.detach()
    parts = [_ChunkedDivergence.apply(student_hidden_NH[r], student_weight_VH, student_bias_V, teacher_hidden_NK[r].detach(),
                                      teacher_weight_VK.detach(), tb, kind, chunk) for r in row_blocks(student_hidden_NH.shape[0], chunk)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def divergence_reference(kind: str, hs, Ws, ht, Wt, bs=None, bt=None) -> torch.Tensor:
    """The plain implementation: full logits, full softmax, float64. For tests and benchmarks only."""
    zs = (hs.double() @ Ws.double().T) + (0 if bs is None else bs.double())
    zt = (ht.double() @ Wt.double().T) + (0 if bt is None else bt.double())
    lq, lp = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    q, p = lq.exp(), lp.exp()
    if kind == "fkl":
        return (p * (lp - lq)).sum(-1)
    if kind == "rkl":
        return (q * (lq - lp)).sum(-1)
    lm = torch.log(0.5 * (p + q))
    return 0.5 * ((p * (lp - lm)).sum(-1) + (q * (lq - lm)).sum(-1))
