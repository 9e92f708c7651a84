"""The unembedding streamed over vocabulary slices: what scoring needs from the logits at response positions (the
sampled token's log-prob, the log-partition, a running top-k, log-probs at given ids, draws from the distribution)
without ever building a [positions, vocabulary] tensor. Memory: one [positions, slice] float32 block (LOGIT_BLOCK_BYTES
on a CPU, up to GPU_LOGIT_BLOCK_BYTES on a GPU: :func:`block_bytes`), a second one while the full distribution's
moments are summed (every score-teacher pass: opdcache/format/fidelity.py), and per-position running state. On a GPU with
triton the block stays in the head's dtype and one kernel (opdcache/logits/kernels.py) reads it for the log-sum-exp and the
moments: one block of at most the same bytes, no float32 copy."""

from __future__ import annotations

import torch

from opdcache.logits import kernels

LOGIT_BLOCK_BYTES = 8 << 20  # float32 logits per [positions, vocabulary slice] block (1,024 columns at 2,048 positions; measured best on CPU)
# on a GPU a 1,024-column slice is launch-bound, and fewer slices mean fewer top-k merges: at vocabulary 151,936,
# hidden 4,096 (benchmarks/bench_gpu.py, BENCHMARKS.md) 1 GiB scored 8.3x faster than 8 MiB on an H100, and 4 GiB
# 1.33x faster than 1 GiB on an H200 (0.86x the batched baseline's speed, 0.65x at 1 GiB) at the same peak: the
# block is capped at a quarter of the device's free memory, so a large teacher on a small card still fits
GPU_LOGIT_BLOCK_BYTES = 4 << 30
GPU_MIN_BLOCK_BYTES = 256 << 20


def block_bytes(device: torch.device) -> int:
    """The logit block for ``device``: LOGIT_BLOCK_BYTES on a CPU; on a GPU GPU_LOGIT_BLOCK_BYTES, at most a quarter
    of its free memory (at least GPU_MIN_BLOCK_BYTES)."""
    from opdcache.logits.logprobs import gpu_block_bytes

    if device.type != "cuda":
        return LOGIT_BLOCK_BYTES
    return gpu_block_bytes(device, GPU_LOGIT_BLOCK_BYTES, GPU_MIN_BLOCK_BYTES)


def head_transform(model):
    """Elementwise logit transforms some models apply after the head (scaling, then soft-capping)."""
    from opdcache.logits.logprobs import head_transform_of

    scale, cap = head_transform_of(model)

    def transform(x: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            x = x * scale
        if cap is not None:
            x = torch.tanh(x / cap) * cap
        return x

    return transform


TOPK_GROUP = 16  # columns per group in the running top-k merge


def _merge_top_k(z: torch.Tensor, offset: int, top_vals: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
    """Merge one [P, C] logit slice (columns ``offset``..) into each row's running top-k, in place; return the
    slice's maximum per row (from the group maxima, which saves the log-sum-exp a pass).

    An element can enter a row's top-k only if it beats the row's current k-th best, so only column groups
    (TOPK_GROUP wide) whose maximum does are gathered, padded per row next to the row's current k, and reduced
    with one narrow top-k. Once a few slices have passed, most rows gather nothing: far cheaper than a top-k
    over every [P, C] slice, which costs microseconds per row whatever its width.
    """
    P, C = z.shape
    k = top_vals.shape[1]
    g = TOPK_GROUP
    kth = top_vals[:, -1]
    if offset == 0 or C % g:  # the first slice (every row takes k new values), or a ragged last one
        slice_max = z.amax(-1)
        r = (slice_max > kth).nonzero(as_tuple=True)[0]
        if len(r):
            cv, ci = z[r].topk(min(k, C), -1)
            merged, order = torch.cat([top_vals[r], cv], 1).topk(k, -1)
            top_ids[r] = torch.cat([top_ids[r], ci + offset], 1).gather(1, order)
            top_vals[r] = merged
        return slice_max
    G = C // g
    groups = z.view(P, g, G)  # group j holds columns j, j + G, j + 2G, ...: its max is an elementwise max of g contiguous rows
    group_max = groups.amax(1)  # [P, G]
    r, gi = (group_max > kth[:, None]).nonzero(as_tuple=True)  # row-major: each row's groups are adjacent
    if not len(r):
        return group_max.amax(-1)
    rows, counts = torch.unique_consecutive(r, return_counts=True)
    R, most = len(rows), int(counts.max())
    slot = torch.arange(len(r), device=z.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    owner = torch.repeat_interleave(torch.arange(R, device=z.device), counts)
    vals = torch.full((R, most, g), float("-inf"), device=z.device)
    ids = torch.zeros((R, most, g), dtype=torch.long, device=z.device)
    vals[owner, slot] = groups[r, :, gi]
    ids[owner, slot] = (offset + gi)[:, None] + G * torch.arange(g, device=z.device)
    merged, order = torch.cat([top_vals[rows], vals.view(R, most * g)], 1).topk(k, -1)
    top_ids[rows] = torch.cat([top_ids[rows], ids.view(R, most * g)], 1).gather(1, order)
    top_vals[rows] = merged
    return group_max.amax(-1)


def streamed_logit_stats(model, hidden_PH: torch.Tensor, sampled_P: torch.Tensor, top_k: int | None,
                         ref_ids_PK: torch.Tensor | None = None, mc_ids_PM: torch.Tensor | None = None,
                         uniforms_PD: torch.Tensor | None = None, moments: bool = False,
                         rounded_PH: torch.Tensor | None = None, fused: bool | None = None) -> dict:
    """Log-prob of the sampled token, logsumexp, top-k and log-probs at given ids, streaming over the vocabulary.

    Logits are computed for all P positions against one slice of the unembedding at a time
    ([P, C] float32, C chosen so a block stays under LOGIT_BLOCK_BYTES), with an online log-sum-exp
    (running max m and sum s: lse = m + log s), a running top-k merged slice by slice, and the logits at
    the requested ids picked up in the slice that holds them. Each element is the model's own logit
    (head matmul in the model's dtype, then float32 and the model's transforms), so the values equal those
    of ``model(...).logits`` at those positions, up to the order of the log-sum-exp additions.

    With ``uniforms_PD`` ([P, D] float64 in [0, 1)), also D draws per position from the temperature-1 distribution by
    inverse CDF over the vocabulary order (:func:`_draw_from_slices`): "sampled_ids" / "sampled_logprobs" = the drawn ids and their log-probs.

    With ``moments``, also the full distribution's entropy "entropy" = -E_p[log p] and variance "variance" = Var_p[log p] per
    position (opdcache/format/fidelity.py turns them into each store's error against the full vocabulary). They are running
    sums about the running max, rescaled as it moves, kept in float64 per position. With ``rounded_PH`` (the hidden
    states as a store rounds them), also "rounding_kl" = KL(p || softmax of the rounded states' logits) = log E_p[exp(delta)] -
    E_p[delta] with delta = z_rounded - z = (h_rounded - h) W^T: a second head product per slice, of the small
    difference, so the KL is not lost to float32 cancellation between two log-partitions.

    ``fused`` (None: where opdcache.logits.kernels.available, for heads without soft-capping and without ``rounded_PH``):
    :func:`_fused_logit_stats`, the same figures with the slice's float32 passes replaced by one Triton kernel; this
    function's torch ops are its reference.
    """
    from opdcache.logits.logprobs import head_transform_of

    head = model.get_output_embeddings()
    W, b = head.weight, getattr(head, "bias", None)
    scale, cap = head_transform_of(model)
    if fused is None:
        fused = kernels.available(hidden_PH.device) and cap is None and rounded_PH is None
    if fused:
        return _fused_logit_stats(hidden_PH, W, b, scale, sampled_P, top_k, {"ref_topk_logprobs": ref_ids_PK, "mc_logprobs": mc_ids_PM}, uniforms_PD,
                                  moments, model)
    transform = head_transform(model)
    P, V = hidden_PH.shape[0], W.shape[0]
    C = max(1024, block_bytes(hidden_PH.device) // (4 * max(P, 1)))
    dev = hidden_PH.device
    m = torch.full((P,), float("-inf"), device=dev)
    s = torch.zeros(P, device=dev)
    target = torch.empty(P, device=dev)
    top_vals = torch.full((P, top_k or 0), float("-inf"), device=dev)
    top_ids = torch.zeros((P, top_k or 0), dtype=torch.long, device=dev)
    picks = {k: (ids, torch.empty(ids.shape, device=dev)) for k, ids in (("ref_topk_logprobs", ref_ids_PK), ("mc_logprobs", mc_ids_PM)) if ids is not None}
    rows = torch.arange(P, device=dev)
    slice_mass = []  # draws: each slice's log-mass per position, [P] float32 each
    mom = [torch.zeros(P, dtype=torch.float64, device=dev) for _ in range(2)] if moments or rounded_PH is not None else None
    if rounded_PH is not None:  # sum e * delta and sum e * expm1(delta), delta = z_rounded - z, e = exp(z - m)
        cross = [torch.zeros(P, dtype=torch.float64, device=dev) for _ in range(2)]
        offset_PH = (rounded_PH - hidden_PH).to(W.dtype)
    for a in range(0, V, C):
        z = hidden_PH @ W[a: a + C].T  # [P, C] in the model's dtype, as the model's own head computes it
        if b is not None:
            z = z + b[a: a + C]
        z = transform(z.float())
        cm = _merge_top_k(z, a, top_vals, top_ids) if top_k else z.amax(-1)
        new_m = torch.maximum(m, cm)
        hit = (sampled_P >= a) & (sampled_P < a + z.shape[1])
        target[hit] = z[rows[hit], sampled_P[hit] - a]
        for ids, out in picks.values():
            inside = (ids >= a) & (ids < a + z.shape[1])
            r, c = inside.nonzero(as_tuple=True)
            out[r, c] = z[r, ids[r, c] - a]
        if rounded_PH is not None:
            if cap is None:  # the head is linear: delta = (h_rounded - h) W^T (x scale), without cancellation
                delta = (offset_PH @ W[a: a + C].T).float() * (scale if scale is not None else 1.0)
            else:  # soft-capped logits: recompute them (float32 cancellation, ~1e-6 of a logit)
                z2 = rounded_PH.to(W.dtype) @ W[a: a + C].T
                delta = transform((z2 + b[a: a + C] if b is not None else z2).float()) - z
        # exp(z - m) in place, after every read of z. Clamping at -80 changes no float32 sum (each such term is
        # below 2e-35 while the sum is at least 1) and avoids exp's slow path for underflowing inputs.
        if mom is not None:  # one more [P, C] block (e), reused in place: exp, e * d, then a row-wise dot with d
            d = z.sub_(new_m[:, None]).clamp_(min=-80.0)
            e = d.exp()
            in_slice = e.sum(-1)
            if rounded_PH is not None:  # before e is overwritten
                rescale = torch.exp((m - new_m).double()).nan_to_num_(0.0)
                cross[0].mul_(rescale).add_(torch.bmm(e[:, None, :], delta[:, :, None]).view(-1).double())
                cross[1].mul_(rescale).add_(torch.bmm(e[:, None, :], torch.expm1(delta)[:, :, None]).view(-1).double())
            ed = e.mul_(d)
            _add_moments(mom, s, m - new_m, ed.sum(-1), torch.bmm(ed[:, None, :], d[:, :, None]).view(-1))
        else:
            in_slice = z.sub_(new_m[:, None]).clamp_(min=-80.0).exp_().sum(-1)
        s = s * torch.exp(m - new_m) + in_slice
        if uniforms_PD is not None:
            slice_mass.append(new_m + torch.log(in_slice))
        m = new_m
    out = _finish(m, s, target, top_vals if top_k else None, top_ids, picks, mom)
    if uniforms_PD is not None:
        out["sampled_ids"], out["sampled_logprobs"] = _draw_from_slices(hidden_PH, W, b, transform, C, torch.stack(slice_mass, 1), out["logsumexp"], uniforms_PD)
    if rounded_PH is not None:  # KL(p || p2) = log E_p[exp(delta)] - E_p[delta], delta = z2 - z
        s64 = s.double()
        out["rounding_kl"] = (torch.log1p(cross[1] / s64) - cross[0] / s64).clamp_(min=0.0)
    return out


def _finish(m: torch.Tensor, s: torch.Tensor, target: torch.Tensor, top_vals: torch.Tensor | None, top_ids: torch.Tensor,
            picks: dict, mom: list[torch.Tensor] | None) -> dict:
    """The figures both paths return from their running state (max m and sum s of exp(z - m) per position, the
    sampled token's logit, the running top-k, the picked logits, the moments' sums): log-partition, log-probs,
    entropy and variance of log p, all of the scored model's temperature-1 distribution at each position."""
    log_s = torch.log(s)
    # log-probs as (z - m) - log s, not z - (m + log s): the subtraction then rounds at |z - m|, not at |lse|
    out = {"logsumexp": m + log_s, "logprobs": (target - m) - log_s}
    if top_vals is not None:
        out["topk_ids"], out["topk_logprobs"] = top_ids, (top_vals - m[:, None]) - log_s[:, None]
    if mom is not None:
        s64 = s.double()
        mean_d = mom[0] / s64  # E_p[z - m]; log p = (z - m) - log s
        out["entropy"] = log_s.double() - mean_d
        out["variance"] = (mom[1] / s64 - mean_d * mean_d).clamp_(min=0.0)
    for key, (_, vals) in picks.items():
        out[key] = (vals - m[:, None]) - log_s[:, None]
    return out


def _fused_logit_stats(hidden_PH: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, scale: float | None, sampled_P: torch.Tensor,
                       top_k: int | None, pick_ids: dict, uniforms_PD: torch.Tensor | None, moments: bool, model) -> dict:
    """:func:`streamed_logit_stats` with each slice's logits kept in the head's dtype and read once by
    opdcache.logits.kernels.logit_stats_rows (the slice's maximum, sum of exponentials and both moments' sums) instead of a
    float32 copy and ~10 float32 passes; the top-k is torch's on the slice itself, the sampled token's and the given ids'
    logits are gathers from it (no host synchronisation). Slices as wide as :func:`block_bytes` allows in the head's dtype
    (a whole vocabulary row at 2,048 positions on a GPU). Each slice's sums are moved to the running maximum and added,
    as the torch path does (:func:`_add_moments`)."""
    P, V = hidden_PH.shape[0], W.shape[0]
    dev = hidden_PH.device
    C = max(1024, block_bytes(dev) // (W.element_size() * max(P, 1)))
    m = torch.full((P,), float("-inf"), device=dev)
    s = torch.zeros(P, device=dev)
    mom = [torch.zeros(P, dtype=torch.float64, device=dev) for _ in range(2)]
    target = torch.zeros(P, device=dev)
    picks = {k: (ids, torch.zeros(ids.shape, device=dev)) for k, ids in pick_ids.items() if ids is not None}
    top_vals = torch.full((P, top_k or 0), float("-inf"), device=dev)
    top_ids = torch.zeros((P, top_k or 0), dtype=torch.long, device=dev)
    slice_mass = []
    mul = 1.0 if scale is None else float(scale)

    def pick(z, ids, a, into):  # the logits at ``ids`` ([P] or [P, K]) that slice [a, a + C) holds, into ``into``
        inside = (ids >= a) & (ids < a + z.shape[1])
        got = z.gather(1, (ids - a).clamp(0, z.shape[1] - 1).view(P, -1)).view(ids.shape).float() * mul
        into.copy_(torch.where(inside, got, into))

    for a in range(0, V, C):
        z = hidden_PH @ W[a: a + C].T  # [P, C] in the head's dtype, as the model's own head computes it
        if b is not None:
            z += b[a: a + C]
        mc, sc, b1, b2 = kernels.logit_stats_rows(z, scale).double()
        new_m = torch.maximum(m, mc.float())
        shift = mc - new_m.double()  # <= 0: the slice's sums about the running maximum
        grow = torch.exp(shift)
        _add_moments(mom, s, m - new_m, grow * (b1 + shift * sc), grow * (b2 + 2 * shift * b1 + shift * shift * sc))
        s = s * torch.exp(m - new_m) + (grow * sc).float()
        if uniforms_PD is not None:
            slice_mass.append((mc + torch.log(sc)).float())
        m = new_m
        pick(z, sampled_P, a, target)
        for ids, out in picks.values():
            pick(z, ids, a, out)
        if top_k:
            cv, ci = z.topk(min(top_k, z.shape[1]), -1)
            merged, order = torch.cat([top_vals, cv.float() * mul], 1).topk(top_k, -1)
            top_ids = torch.cat([top_ids, ci + a], 1).gather(1, order)
            top_vals = merged
    out = _finish(m, s, target, top_vals if top_k else None, top_ids, picks, mom if moments else None)
    if uniforms_PD is not None:
        out["sampled_ids"], out["sampled_logprobs"] = _draw_from_slices(hidden_PH, W, b, head_transform(model), C, torch.stack(slice_mass, 1), out["logsumexp"],
                                                   uniforms_PD)
    return out


def _add_moments(mom: list[torch.Tensor], s_old: torch.Tensor, shift: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> None:
    """Move the running sums B1 = sum e (z - m), B2 = sum e (z - m)^2 (e = exp(z - m)) from the old max m to the new
    one m' (shift = m - m' <= 0: every old term scales by exp(shift) and its offset grows by shift), then add the
    slice's own sums about m'. float64 per position."""
    delta = shift.double().nan_to_num_(0.0, neginf=0.0)  # the first slice: no old terms (s_old = 0)
    scale = torch.exp(shift.double()).nan_to_num_(0.0)
    b1, b2, s0 = mom[0], mom[1], s_old.double()
    new_b2 = scale * (b2 + 2 * delta * b1 + delta * delta * s0) + second.double()
    mom[0] = scale * (b1 + delta * s0) + first.double()
    mom[1] = new_b2


def _draw_from_slices(hidden_PH, W, b, transform, C: int, slice_lm_PS: torch.Tensor, lse_P: torch.Tensor,
                      uniforms_PD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draws from softmax(logits) over the vocabulary order, in two levels: each uniform u first picks the
    vocabulary slice whose cumulative mass (from the first pass's per-slice log-masses, float64) passes u, then the
    token inside the slice from that slice's logits, recomputed for the positions that drew into it only. The token is
    min{v : F(v) > u} whatever the slice width, up to float rounding at a CDF boundary (~1e-7 of a draw), so draws do not
    depend on batching or device block sizes. Cost: the head rows of the hit (position, slice) pairs, a fraction of a
    pass when D is small. Memory: [P, slices] float64 and one [positions hitting a slice, C] block."""
    P, D = uniforms_PD.shape
    dev = hidden_PH.device
    lm = slice_lm_PS.double()
    tot = torch.logsumexp(lm, 1, keepdim=True)
    cum = torch.exp(lm - tot).cumsum(1)  # [P, S]
    u = uniforms_PD.to(dev, torch.float64)
    j = torch.searchsorted(cum, u, right=True).clamp_(max=cum.shape[1] - 1)  # [P, D]: the slice of each draw
    before = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(u))
    mass = torch.exp(lm.gather(1, j) - tot)
    frac = ((u - before) / mass).clamp_(0.0, 1.0)  # where inside the slice's own mass the draw falls
    ids = torch.empty((P, D), dtype=torch.long, device=dev)
    lps = torch.empty((P, D), dtype=torch.float32, device=dev)
    for sl in torch.unique(j).tolist():
        r, c = (j == sl).nonzero(as_tuple=True)
        rows, inverse = torch.unique(r, return_inverse=True)
        a = sl * C
        z = hidden_PH[rows] @ W[a: a + C].T
        if b is not None:
            z = z + b[a: a + C]
        z = transform(z.float())
        w = torch.exp((z - z.amax(-1, keepdim=True)).double()).cumsum(-1)
        w = w / w[:, -1:]
        col = torch.searchsorted(w[inverse], frac[r, c][:, None], right=True)[:, 0].clamp_(max=z.shape[1] - 1)
        ids[r, c] = a + col
        lps[r, c] = z[inverse, col] - lse_P[r]
    return ids, lps
