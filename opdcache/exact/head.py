"""The unembedding in the exact arithmetic: logits, the log-partition, log-probs at ids, top-k and draws.

The vocabulary is cut into fixed slices of VOCAB_BLOCK columns (a constant of the arithmetic, never a function of how
many positions are scored). For slice b: m_b = its largest logit and S_b = sum exp(z - m_b), both exact; then
M = max m_b, s = sum_b exp(m_b - M) S_b (exact) and log p(v) = (z_v - M) - log s. One pass over the head whatever
the number of positions; the numbers of a position are the same in a [1, V] decode step, a [2048, slice] scoring
block and the trainer's recompute. Memory: one [positions, VOCAB_BLOCK] float64 block (positions bounded by
ROW_BLOCK_BYTES) and [positions, slices] statistics.
"""

from __future__ import annotations

import torch

from opdcache.exact import arith as X

VOCAB_BLOCK = 8192  # columns per vocabulary slice: part of the arithmetic's definition (recorded as "vocab_block")
ROW_BLOCK_BYTES = 64 << 20  # float64 [rows, VOCAB_BLOCK] working block


def row_blocks(n: int) -> list[slice]:
    rows = max(1, ROW_BLOCK_BYTES // (8 * VOCAB_BLOCK * 4))  # s, bounds and the float32 copies of one block
    return [slice(a, min(a + rows, n)) for a in range(0, n, rows)] or [slice(0, 0)]


def logits(hidden_PH: torch.Tensor, weight_VH: torch.Tensor, bias_V, a: int, dtype: torch.dtype, arith=X) -> torch.Tensor:
    """Exact logits of slice [a, a + VOCAB_BLOCK) as float32, rounded through the model's dtype as its head rounds them."""
    w = weight_VH[a: a + VOCAB_BLOCK]
    return arith.linear(hidden_PH.to(dtype), w.to(dtype), None if bias_V is None else bias_V[a: a + VOCAB_BLOCK], out_dtype=dtype).float()


def slice_stats(z_PC: torch.Tensor, arith=X) -> tuple[torch.Tensor, torch.Tensor]:
    """(m_b, S_b) of one slice: its largest logit and sum exp(z - m_b), exact; float32 [P] each. A slice masked whole
    (every logit -inf: outside a top-p nucleus) has m_b = -inf and S_b = 0, and adds nothing in :func:`combine`."""
    m = z_PC.amax(-1).detach()
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # -inf - -inf would be NaN
    return m, arith.sum_last(arith.exp(z_PC - shift[:, None]), nonnegative=True)


def combine(m_PS: torch.Tensor, s_PS: torch.Tensor, arith=X) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, log s) from the slices' statistics [P, slices]: M = max m_b, s = sum_b exp(m_b - M) S_b."""
    M = m_PS.amax(-1).detach()
    s = arith.sum_last(arith.exp(m_PS - M[:, None]) * s_PS, nonnegative=True)
    return M, arith.log(s)


def log_softmax(z_PV: torch.Tensor, arith=X) -> torch.Tensor:
    """Exact log-softmax of whole rows [P, V] (float32), by the same slices as the streamed head: every slice's
    statistics in one call, the last slice padded with -inf (terms exp(-inf) = 0 appended to its sum, which change
    nothing), so a decode step runs a fixed handful of kernels whatever the number of slices."""
    P, V = z_PV.shape
    slices = max(1, -(-V // VOCAB_BLOCK))
    z_RC = torch.nn.functional.pad(z_PV, (0, slices * VOCAB_BLOCK - V), value=float("-inf")).reshape(P * slices, VOCAB_BLOCK)
    m, s = slice_stats(z_RC, arith)
    M, log_s = combine(m.reshape(P, slices), s.reshape(P, slices), arith)
    return (z_PV - M[:, None]) - log_s[:, None]


def full_logits(hidden_PH, weight_VH, bias_V, dtype, arith=X) -> torch.Tensor:
    """[P, V] float32 exact logits (decode steps: P is the batch). The batch-invariant arithmetic's matmul computes
    each element from its own row and column alone, so one call over the whole vocabulary gives the slices' bits."""
    if arith is not X:
        return arith.linear(hidden_PH.to(dtype), weight_VH.to(dtype), bias_V, out_dtype=dtype).float()
    return torch.cat([logits(hidden_PH, weight_VH, bias_V, a, dtype, arith) for a in range(0, weight_VH.shape[0], VOCAB_BLOCK)], -1)


def picks_and_stats(hidden_PH, weight_VH, bias_V, dtype, ids_PK: torch.Tensor, top_k: int | None = None, moments: list | None = None,
                    arith=X):
    """One pass over the vocabulary: (log-probs at ids_PK [P, K], lse [P], top-k (values, ids) or None), exact.

    With ``moments`` (an empty list), also appends the full distribution's entropy and Var_p[log p] per position
    ([P] float64 each). They are statistics for the recorded error against the full vocabulary (opdcache/format/fidelity.py),
    summed in float64, not part of the exact arithmetic."""
    P, V = hidden_PH.shape[0], weight_VH.shape[0]
    device = hidden_PH.device
    ids_PK = ids_PK.to(device)
    picked = torch.zeros(ids_PK.shape, dtype=torch.float32, device=device)
    ms, ss = [], []
    top_vals = torch.full((P, 0), float("-inf"), device=device)
    top_ids = torch.zeros((P, 0), dtype=torch.long, device=device)
    for a in range(0, V, VOCAB_BLOCK):
        z = logits(hidden_PH, weight_VH, bias_V, a, dtype, arith)
        r, k = ((ids_PK >= a) & (ids_PK < a + z.shape[1])).nonzero(as_tuple=True)
        picked[r, k] = z[r, ids_PK[r, k] - a]
        m, s = slice_stats(z, arith)
        ms.append(m)
        ss.append(s)
        if moments is not None:
            d = (z.double() - torch.where(torch.isfinite(m), m, torch.zeros_like(m)).double()[:, None])
            e = torch.exp(d)
            d = torch.where(e > 0, d, torch.zeros_like(d))
            moments.append(((e * d).sum(-1), (e * d * d).sum(-1)))
        if top_k:  # merge the slice into the running top-k, ties in the canonical order
            cv, ci = canonical_top_k(z, top_k)
            top_vals, top_ids = canonical_top_k(torch.cat([top_vals, cv], 1), top_k, torch.cat([top_ids, ci + a], 1))
    M, log_s = combine(torch.stack(ms, -1), torch.stack(ss, -1), arith)
    lp = (picked - M[:, None]) - log_s[:, None]
    top = None if not top_k else ((top_vals - M[:, None]) - log_s[:, None], top_ids)
    if moments is not None:  # move each slice's sums about m_b to sums about M, then E_p[z - M] and E_p[(z - M)^2]
        delta = torch.stack(ms, -1).double() - M.double()[:, None]
        delta = torch.where(torch.isfinite(delta), delta, torch.zeros_like(delta))
        w = torch.exp(delta) * torch.stack(ss, -1).double()  # each slice's mass about M
        b1 = torch.stack([b for b, _ in moments], -1)
        b2 = torch.stack([b for _, b in moments], -1)
        scale = torch.exp(delta)
        total = w.sum(-1)
        m1 = (scale * b1 + delta * w).sum(-1) / total
        m2 = (scale * (b2 + 2 * delta * b1) + delta * delta * w).sum(-1) / total
        moments[:] = [torch.log(total) - m1, (m2 - m1 * m1).clamp(min=0.0)]
    return lp, M + log_s, top


def canonical_top_k(values_PC: torch.Tensor, k: int, ids_PC: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values per row and their ids, in the canonical order (value descending, id ascending), so ties
    (common in bfloat16 logits) resolve alike in a [B, V] decode row and in slice-by-slice merges. ``ids_PC``: the
    columns' ids (default 0..C-1)."""
    k = min(k, values_PC.shape[1])
    if ids_PC is None and values_PC.is_cuda:
        return canonical_top_k_by_sort(values_PC, k)
    if ids_PC is None:
        ids_PC = torch.arange(values_PC.shape[1], device=values_PC.device).expand_as(values_PC)
    kth = values_PC.topk(k, -1).values[:, -1:]
    width = int((values_PC >= kth).sum(-1).max())  # every value tied with the k-th is a candidate
    cand, at = values_PC.topk(width, -1)
    cid = ids_PC.gather(1, at)
    by_id = cid.argsort(dim=-1, stable=True)
    cand, cid = cand.gather(1, by_id), cid.gather(1, by_id)
    vals, order = cand.sort(dim=-1, descending=True, stable=True)
    return vals[:, :k], cid.gather(1, order[:, :k])


def canonical_top_k_by_sort(values_PC: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`canonical_top_k` of rows whose columns are the ids 0..C-1, by one stable descending sort (ties keep
    ascending id order): the same result with no read back to the host (the candidate count the topk path needs),
    which on a GPU would be one host round trip per decode step."""
    vals, order = values_PC.sort(dim=-1, descending=True, stable=True)
    return vals[:, :k], order[:, :k]


def draw(logprobs_PV: torch.Tensor, uniforms_PD: torch.Tensor, arith=X) -> torch.Tensor:
    """Inverse-CDF draws [P, D] from exp(logprobs) (exact float32 probabilities, cumulated in float64 in vocabulary
    order by one sequential scan per row): the token whose cumulative mass first exceeds u * total."""
    cdf = arith.cumsum64(arith.exp(logprobs_PV))
    target = uniforms_PD.double() * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=logprobs_PV.shape[1] - 1)


def top_p_mask(logprobs_PV: torch.Tensor, top_p: float, arith=X) -> torch.Tensor:
    """True outside the top-p nucleus: a token is dropped when the tokens before it in (probability desc, id asc)
    order already hold top_p of the mass (float64 sequential cumulative sum of exact probabilities)."""
    probs = arith.exp(logprobs_PV).double()
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    drop_sorted = arith.cumsum64(sorted_p) - sorted_p >= top_p
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
