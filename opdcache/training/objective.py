"""One training step's objective: from a batch and the student's log-probs to the loss and what the step logs.

The trainer (opdcache/training/train.py) runs the forward passes; this module prepares the batch (padding slots, a damaged cache
refused, nothing outside the responses), names the ids at which the student's log-probs are needed, dispatches to the
chosen estimator (opdcache/training/losses.py) and computes the logged diagnostics (importance weights, K1/K3, advantage,
error tokens, the sampled store's standard error). Memory: [batch, length] and [batch, length, K] tensors of the
batch; nothing here grows with the vocabulary.
"""

from __future__ import annotations

import torch

from opdcache.errors import SchemaError
from opdcache.format.schema import PAD_ID
from opdcache.format.shards import PADDED
from opdcache.inputs.errortokens import error_token_mask
from opdcache.training import losses as L
from opdcache.training.estimators import ESTIMATORS, clip_stats, group_ends

PADDED_TEACHER = {"teacher_" + lp: "teacher_" + ids for lp, ids in PADDED.items()}


def zero_outside_responses(batch: dict) -> dict:
    """Every float [B, T, ...] column set to 0 outside the response mask: what a padded position holds (even a NaN
    from a damaged row's padding) never reaches a loss term or its gradient."""
    keep = batch["response_mask"].bool()
    out = dict(batch)
    for name, v in batch.items():
        if name != "response_mask" and v.is_floating_point() and v.shape[:2] == keep.shape:
            out[name] = torch.where(keep.view(*keep.shape, *[1] * (v.dim() - 2)), v, torch.zeros((), dtype=v.dtype, device=v.device))
    return out


def masked_mean_std(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    n = mask.sum().clamp_min(1)
    mean = (x * mask).sum() / n
    var = (((x - mean) ** 2) * mask).sum() / n
    return float(mean), float(var.sqrt())


def check_finite(batch: dict, cache) -> None:
    """Refuse a batch whose cached values are NaN or infinite at response positions (a damaged cache), before
    they reach the loss: no estimator may train through them."""
    mask = batch["response_mask"].bool()
    names = [n for n, v in batch.items() if v.is_floating_point() and n != "response_mask"]
    counts = torch.stack([(~torch.isfinite(batch[n][mask] if batch[n].shape[:2] == mask.shape else batch[n])).sum() for n in names])
    for name, bad in zip(names, counts.tolist()):  # one device sync per batch, not one per column
        if bad:
            raise SchemaError(f"the cache holds {bad} non-finite values in {name} at response positions of this batch; "
                              f"run `opdcache validate {cache}` to find the rows, then rebuild those shards")


PACKED_INPUTS = ("input_ids", "position_ids", "cu_seqlens", "logit_positions", "sequence_index", "cu_response")
"""A packed batch's model inputs and layout (opdcache/training/packing.py); its other columns are per token."""


def split_packed(batch: dict) -> tuple[dict, dict | None]:
    """(the per-token columns as [B, T, ...] with their response_mask, the packed model inputs) of a packed batch; a
    padded batch is returned as it is, with None. The losses then read the same [B, T] numbers either way; only the
    student's forward sees the packing. Memory: the per-token columns at [B, T], no [B, L] model inputs."""
    if "cu_seqlens" not in batch:
        return batch, None
    from opdcache.training.packing import BIT_COLUMNS, unpack

    cu = batch["cu_response"]
    n = cu[1:] - cu[:-1]
    T = max(1, int(n.max()) if len(n) else 1)
    out = {name: unpack(batch, name) for name in batch if name not in PACKED_INPUTS}
    for name, v in out.items():  # ids as the padded batch has them (int64); hidden and svd bits keep their dtype
        if not v.is_floating_point() and name not in BIT_COLUMNS:
            out[name] = v.long()
    out["response_mask"] = (torch.arange(T)[None] < n[:, None]).float()
    return out, {k: batch[k] for k in PACKED_INPUTS}


def prepare_batch(batch: dict, device, cache) -> dict:
    """The batch on the device, v3 padding slots finite with no mass, checked finite, zero outside the responses."""
    batch = {k: v.to(device) for k, v in batch.items()}
    for lp_name, id_name in PADDED_TEACHER.items():  # v3 padding slots (id -1, log-prob -inf): finite, and no mass
        if lp_name in batch:
            batch[lp_name] = batch[lp_name].masked_fill(batch[id_name] == PAD_ID, L.PAD_LOGPROB)
    check_finite(batch, cache)
    ends = group_ends(batch)
    if ends is not None:  # a teacher with its own tokenizer: tokens after a row's last group end (all of a row that
        # could not be aligned) have no teacher signal and leave the mask, so no mean counts them
        ends = ends.long()
        batch["response_mask"] = batch["response_mask"] * ((ends.cumsum(1) - ends) < ends.sum(1, keepdim=True))
    return zero_outside_responses(batch)


def support_ids(cfg, batch: dict, sel: torch.Tensor) -> torch.Tensor | None:
    """[N, K] ids besides the sampled token at which the estimator needs the student's log-probs (mc, topk-*, sampled)."""
    support = ESTIMATORS[cfg.loss].support
    return None if support is None else support(cfg, batch, sel)


def teacher_weights(cfg, batch: dict) -> list[torch.Tensor] | None:
    """Several teachers (``train --teacher a,b``): each one's weight at each token, [B, T]: 1 for the row's routed
    teacher (``row_teacher``), else --teacher-weights normalised to sum 1 (default equal). None for one teacher."""
    n = len(getattr(cfg, "teachers", ()))
    if n < 2:
        return None
    mask = batch["response_mask"]
    if "row_teacher" in batch:
        return [(batch["row_teacher"] == i).to(mask.dtype) for i in range(n)]
    weights = cfg.teacher_weights or (1.0,) * n
    return [torch.full_like(mask, w / sum(weights)) for w in weights]


def teacher_view(batch: dict, i: int) -> dict:
    """The batch as teacher ``i`` gives it: its ``teacher{i}_`` columns under the names ``teacher_`` (0: the batch)."""
    if i == 0:
        return batch
    prefix = f"teacher{i}_"
    return {**batch, **{"teacher_" + k[len(prefix):]: v for k, v in batch.items() if k.startswith(prefix)}}


def teacher_logprobs(cfg, batch: dict) -> torch.Tensor | None:
    """The teacher log-prob the step's advantage statistics and corrections read: the teacher's, or with several
    teachers their weighted sum."""
    weights = teacher_weights(cfg, batch)
    if weights is None:
        return batch.get("teacher_logprobs")
    return sum(w * teacher_view(batch, i)["teacher_logprobs"] for i, w in enumerate(weights))


def estimator_terms(cfg, batch: dict, s: torch.Tensor, lp_NK: torch.Tensor, sel: torch.Tensor, support: torch.Tensor | None,
                    div_N: torch.Tensor | None) -> tuple[torch.Tensor, dict, dict]:
    """(per-token loss terms [B, T], the estimator's own tensors, logged numbers) of ``cfg.loss``
    (opdcache/training/estimators.py). ``s`` [B, T] is the student's log-prob of each sampled token, ``lp_NK`` [N, 1 + K] its
    log-probs at the sampled token and the support, ``div_N`` the per-token divergence of a full-vocabulary loss."""
    s_K = None
    if support is not None:
        B, T = s.shape
        s_K = lp_NK.new_zeros(B, T, support.shape[1])
        s_K[sel] = lp_NK[:, 1:]  # [B, T, K] at the support ids
    weights = teacher_weights(cfg, batch)
    if weights is None:
        return ESTIMATORS[cfg.loss].terms(cfg, batch, s, s_K, div_N, support)
    # several teachers: the weighted sum of each teacher's terms; the per-token tensors the estimator returns mixed
    # the same way (so the logged clip_fraction is the mix's: its routed teacher's, or the weighted share), and each
    # teacher's own numbers logged under its table name (over its routed tokens, or all of them when mixed)
    terms, mixed, stats, mask = 0, {}, {}, batch["response_mask"]
    names = getattr(cfg, "teachers", ())
    for i, w in enumerate(weights):
        terms_i, st_i, stats_i = ESTIMATORS[cfg.loss].terms(cfg, teacher_view(batch, i), s, s_K, div_N, support)
        terms = terms + w * terms_i
        for k, v in st_i.items():  # the teachers' weights sum to 1 at each token: a number of the student alone stays itself
            if torch.is_tensor(v) and v.shape == mask.shape:
                mixed[k] = mixed.get(k, 0) + w * v
            else:
                mixed.setdefault(k, v)
        own = clip_stats(st_i, mask * (w > 0)) if "clipped" in st_i else stats_i
        stats.update({f"{names[i]}/{k}": v for k, v in own.items()})
    if "clipped" in mixed:
        stats.update(clip_stats(mixed, mask))
    return terms, mixed, stats


def merge_stats(parts: list[tuple[dict, float]]) -> dict:
    """One step's logged numbers from its parts (the groups --max-batch-tokens cuts a batch into, the micro-batches of
    --grad-accum), each with its weight (its share of the step's tokens; the weights sum to 1), defined as over the
    step's tokens at once whatever the cut: ``tokens`` adds up, a ``*_max`` is the largest, a ``*_std`` beside its
    ``*_mean`` is the standard deviation of the union (from each part's first and second moments: sqrt(sum w (std^2 +
    mean^2) - mean^2)), every other number the weighted mean."""
    out: dict = {}
    for key in dict.fromkeys(k for stats, _ in parts for k in stats):
        values = [(stats[key], w) for stats, w in parts if key in stats]
        if key == "tokens":
            out[key] = sum(v for v, _ in values)
        elif key.endswith("_max"):
            out[key] = max(v for v, _ in values)
        elif key.endswith("_std") and key[:-4] + "_mean" in parts[0][0]:
            mean_key = key[:-4] + "_mean"
            mean = sum(w * stats[mean_key] for stats, w in parts)
            second = sum(w * (stats[key] ** 2 + stats[mean_key] ** 2) for stats, w in parts)
            out[key] = max(second - mean * mean, 0.0) ** 0.5
        else:
            out[key] = sum(w * v for v, w in values)
    return out


def step_stats(batch: dict, s: torch.Tensor, st: dict, advantage: torch.Tensor, sel: torch.Tensor) -> dict:
    """What a step logs besides its loss and corrections (the module docstring of opdcache/training/train.py says what each is)."""
    mask = batch["response_mask"]
    stats: dict = {}
    if "ref_logprobs" in batch:
        log_ratio = (s - batch["ref_logprobs"]).detach()
        stats["is_weight_mean"], stats["is_weight_std"] = masked_mean_std(log_ratio.exp(), mask)
        stats["k1"] = float(((-log_ratio) * mask).sum() / mask.sum())
        stats["k3"] = float(((log_ratio.exp() - 1 - log_ratio) * mask).sum() / mask.sum())
    if "stderr" in st:  # the sampled store's per-position standard error of its forward-KL estimate, averaged
        stats["sampled_stderr"] = float((st["stderr"] * mask).sum() / mask.sum().clamp_min(1))
    if "rho" in st:  # the old-to-current ratio pi_theta / pi_old = exp(s - b) on the sampled (or mc) tokens
        stats["rho_mean"], stats["rho_std"] = masked_mean_std(st["rho"], mask)
        stats["rho_max"] = float(st["rho"][mask.bool()].max()) if mask.any() else 1.0
    if batch.get("teacher_logprobs") is not None:
        stats["advantage_mean"], stats["advantage_std"] = masked_mean_std(advantage, mask)
    # papers/004's error tokens, by opdcache/inputs/errortokens.py's rule, on the learner's forward: both sides at temperature
    # 1 (the engine's ref_logprobs, as mismatch-report compares them; an sft table has only its sampling log-probs)
    rollout_lp = batch.get("ref_logprobs", batch.get("sampling_logprobs"))
    if rollout_lp is not None:
        stats["error_token_share"] = float((error_token_mask(s.detach(), rollout_lp) & sel).sum() / mask.sum().clamp_min(1))
    stats["tokens"] = int(mask.sum())
    return stats
