"""Compact top-k encodings: what the v3 compact top-k store writes (:func:`compact_topk`, fixed width,
padded), the distortion it records (:func:`distortion_sums`), and a ragged codec (:class:`TopkCodec`) that
benchmarks/bench_storage.py uses to measure the alternatives the store did not take (ascending ids, q8).

Per response position the exact top-k store holds k ids in rank order and their float32 log-probs. A
:class:`TopkCodec` keeps instead:

* **support**: the highest-probability entries until the residual teacher mass 1 - sum(p_kept) is at most ``mass``
  (at least one entry, at most k); ``mass=None`` keeps all k. At a mean teacher entropy of 0.84 nats most of 128
  entries carry < 1e-6 of probability, so a mass threshold keeps a handful where the teacher is sure and more where
  it is not;
* **ids** ascending within the position (log-probs permuted alongside): sorted ids differ by small gaps, which
  Parquet's DELTA_BINARY_PACKED bit-packs, while every reader still sees plain int32 ids;
* **log-probs** in ``float32`` (exact), ``float16`` (|error| <= |lp| * 2^-11 + 2^-25, the last for float16's
  subnormals near 0), or ``q8``: a uint8 code c with
  lp = -c * step (default step 1/16 nat, so lp in [-15.9375, 0] to within step / 2; code 255 means "at most -255 *
  step": the entry's probability is below e^-15.9 = 1.2e-7);
* **tail**: 1 - sum of the kept entries' probabilities (float32), so an estimator with one extra "tail" bin sums
  to 1 on what is kept. Here it is computed in float64 from the float32 log-probs, so its absolute error is ~1e-7;
  a writer should take it from the streamed log-partition instead (1 - sum cancels where the teacher is sure).

:func:`distortion` measures a setting against the exact top-k: the |log-prob| error of kept entries and
KL(exact || compact) over the k entries plus the tail bin (a dropped entry's mass moves into the tail).
Everything here is numpy on one row [T, k] at a time: memory O(T x k).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from opdcache.errors import ConfigError
from opdcache.stores.base import FIELD_DTYPE, PAD_ID, PROB14_STEP

PRECISIONS = ("float32", "float16", "q8")
Q8_STEP = 1.0 / 16
Q8_FLOOR = 255  # the code of "at or below -255 * step"


def support(lps_TK: np.ndarray, mass: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The residual-mass support of one row's exact top-k [T, k]: the rank order (most likely first, stable), how many
    entries each position keeps (the shortest prefix leaving at most ``mass`` outside, at least 1, at most k; all k
    with ``mass=None``), and the tail 1 - kept probability (float32, summed in float64 from the float32 log-probs)."""
    T, k = lps_TK.shape
    order = np.argsort(-lps_TK, axis=1, kind="stable")
    cum = np.cumsum(np.exp(np.take_along_axis(lps_TK, order, 1).astype(np.float64)), axis=1)
    if mass is None or k == 0:
        counts = np.full(T, k, dtype=np.int32)
    else:
        reached = (1.0 - cum) <= mass  # the residual after keeping entries 0..j
        counts = np.where(reached.any(1), reached.argmax(1) + 1, k).astype(np.int32)
    kept_mass = np.take_along_axis(cum, np.maximum(counts - 1, 0)[:, None], 1)[:, 0] if k else np.zeros(T)
    return order, counts, np.clip(1.0 - kept_mass, 0.0, 1.0).astype(np.float32)


@dataclass(frozen=True)
class TopkCodec:
    precision: str = "float32"
    """float32, float16 or q8."""
    mass: float | None = None
    """Stop adding entries once the residual teacher mass is at most this (None: keep all k)."""
    step: float = Q8_STEP
    """q8: nats per code."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--topk-precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.mass is not None and not 0 <= self.mass < 1:
            raise ConfigError(f"--topk-mass must be in [0, 1), got {self.mass}")
        if not self.step > 0:
            raise ConfigError(f"the q8 step must be positive, got {self.step}")

    def encode(self, ids_TK: np.ndarray, lps_TK: np.ndarray) -> dict:
        """One row's exact top-k (ids [T, k], log-probs [T, k], any order) -> {counts [T], ids [n], values [n], tail [T]}
        with n = counts.sum(): each position's kept ids ascending, values in the codec's precision."""
        ids_TK, lps_TK = np.asarray(ids_TK), np.asarray(lps_TK, dtype=np.float32)
        if ids_TK.shape != lps_TK.shape or ids_TK.ndim != 2:
            raise ValueError(f"ids and log-probs must both be [T, k], got {ids_TK.shape} and {lps_TK.shape}")
        T = ids_TK.shape[0]
        order, counts, tail = support(lps_TK, self.mass)
        ids_out, vals_out = [], []
        for t in range(T):
            n = counts[t]
            sel = order[t, :n]
            asc = np.argsort(ids_TK[t, sel], kind="stable")
            ids_out.append(ids_TK[t, sel][asc].astype(np.int32))
            vals_out.append(lps_TK[t, sel][asc])
        ids_flat = np.concatenate(ids_out) if T else np.zeros(0, np.int32)
        lp_flat = np.concatenate(vals_out) if T else np.zeros(0, np.float32)
        return {"counts": counts, "ids": ids_flat, "values": self.quantize(lp_flat), "tail": tail}

    def quantize(self, lp: np.ndarray) -> np.ndarray:
        if self.precision == "float32":
            return lp.astype(np.float32)
        if self.precision == "float16":
            return lp.astype(np.float16)
        with np.errstate(invalid="ignore"):
            code = np.rint(-lp.astype(np.float64) / self.step)
        return np.where(np.isfinite(code), np.clip(code, 0, Q8_FLOOR), Q8_FLOOR).astype(np.uint8)

    def dequantize(self, values: np.ndarray) -> np.ndarray:
        """Stored values -> float32 log-probs (q8's floor code decodes to -255 * step)."""
        if self.precision == "q8":
            return (-values.astype(np.float32) * np.float32(self.step)).astype(np.float32)
        return values.astype(np.float32)

    def decode(self, enc: dict) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per position (ids ascending, float32 log-probs)."""
        lp = self.dequantize(enc["values"])
        bounds = np.concatenate([[0], np.cumsum(enc["counts"])])
        return [(enc["ids"][a:b], lp[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    def error_bound(self) -> str:
        """The declared |log-prob| error of a kept entry."""
        return {"float32": "0", "float16": "|lp| * 2^-11 + 2^-25 (float16 rounding)",
                "q8": f"{self.step / 2:g} nats for lp >= {-Q8_FLOOR * self.step:g}; below, p < e^{-Q8_FLOOR * self.step:g}"}[self.precision]


def distortion(codec: TopkCodec, ids_TK: np.ndarray, lps_TK: np.ndarray) -> dict:
    """The setting's error on one row against its exact top-k: max and mean |log-prob error| over kept finite entries
    within the precision's range (float64; q8 entries below it are counted in ``below_range``), and KL(exact || compact) per position over the kept entries plus the tail bin, max and mean (nats)."""
    enc = codec.encode(ids_TK, lps_TK)
    decoded = codec.decode(enc)
    errs, kls, below = [], [], 0
    for t, (ids, lp) in enumerate(decoded):
        exact = dict(zip(ids_TK[t].tolist(), lps_TK[t].astype(np.float64).tolist()))
        ref = np.array([exact[i] for i in ids.tolist()])
        finite = np.isfinite(ref)
        if codec.precision == "q8":  # below q8's range the entry is the floor code: counted apart, not as an error
            below += int((finite & (ref < -Q8_FLOOR * codec.step)).sum())
            finite &= ref >= -Q8_FLOOR * codec.step
        errs.append(np.abs(lp[finite] - ref[finite]))
        p = np.exp(ref)  # the kept entries' exact probabilities, and the rest of the mass as one tail bin
        p_tail = max(0.0, 1.0 - p.sum())
        q, q_tail = np.exp(lp.astype(np.float64)), float(enc["tail"][t])
        total = q.sum() + q_tail  # the compact side renormalised: quantisation moves a little mass
        q, q_tail = q / total, q_tail / total
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0)
        tail_term = p_tail * (np.log(p_tail) - np.log(q_tail)) if p_tail > 0 and q_tail > 0 else 0.0
        kls.append(float(terms.sum() + tail_term))
    err = np.concatenate(errs) if errs else np.zeros(0)
    kl = np.array(kls)
    return {"max_abs_logprob_error": float(err.max()) if err.size else 0.0, "mean_abs_logprob_error": float(err.mean()) if err.size else 0.0,
            "max_kl": float(kl.max()) if kl.size else 0.0, "mean_kl": float(kl.mean()) if kl.size else 0.0,
            "mean_entries": float(enc["counts"].mean()) if enc["counts"].size else 0.0, "below_range": below}


# ---------------------------------------------------------------- the v3 compact top-k store (fixed width, padded)

DISTORTION_META = b"opdcache.topk_distortion"
"""Parquet key-value metadata of a compact top-k shard: its distortion sums (:func:`distortion_sums`), merged by finalize."""


def compact_topk(ids_TK: np.ndarray, lps_TK: np.ndarray, precision: str, mass: float | None) -> dict:
    """One row's exact top-k -> the compact store's fixed-width form, vectorised: the kept support in rank order (most
    likely first, as the exact store; ``prob14``: ascending id), the remaining slots id -1 / log-prob -inf, values
    rounded to ``precision``, and the tail (1 - the kept entries' exact probability, float64 from the float32 log-probs,
    so its error is ~1e-7 at most).

    ``prob14`` (v4): probabilities as uint16 codes c = round(p x 2^14); an entry whose code would be 0 leaves the
    support (its mass joins the tail), except the most likely one, which keeps at least code 1.

    Returns ids [T, k] int32, logprobs [T, k] float32 (what a reader decodes), stored [T, k] (float32, or uint16: float16
    bits or prob14 codes: what the column holds), tail [T] float32, counts [T], exact [T, k] (the exact log-prob of each
    slot, aligned with ids). Memory O(T x k)."""
    ids_TK = np.asarray(ids_TK)
    lps_TK = np.asarray(lps_TK, dtype=np.float32)
    order, counts, tail = support(lps_TK, mass)
    lp = np.take_along_axis(lps_TK, order, 1)
    ids = np.take_along_axis(ids_TK, order, 1).astype(np.int32)
    kept = np.arange(lps_TK.shape[1])[None, :] < counts[:, None]
    if precision == "prob14":
        return _prob14(ids, lp, kept)
    rounded = lp.astype(np.float16).astype(np.float32) if precision == "float16" else lp
    decoded = np.where(kept, rounded, np.float32(-np.inf)).astype(np.float32)
    stored = decoded.astype(np.float16).view(np.uint16) if precision == "float16" else decoded
    return {"ids": np.where(kept, ids, PAD_ID).astype(np.int32), "logprobs": decoded, "stored": stored, "tail": tail,
            "counts": counts, "exact": lp}


def _prob14(ids: np.ndarray, lp: np.ndarray, kept: np.ndarray) -> dict:
    """The prob14 form of a residual-mass support in rank order (``kept`` a prefix of each row)."""
    p = np.exp(lp.astype(np.float64))
    code = np.rint(p / PROB14_STEP)
    code[:, :1] = np.maximum(code[:, :1], 1)  # the most likely entry always stays
    kept = kept & (code > 0)  # codes fall along the rank order: still a prefix
    tail = np.clip(1.0 - np.where(kept, p, 0.0).sum(1), 0.0, 1.0).astype(np.float32)
    asc = np.argsort(np.where(kept, ids.astype(np.int64), np.iinfo(np.int64).max), axis=1, kind="stable")
    kept = np.take_along_axis(kept, asc, 1)
    ids = np.take_along_axis(ids, asc, 1)
    code = np.take_along_axis(code, asc, 1)
    exact = np.take_along_axis(lp, asc, 1)
    stored = np.where(kept, np.minimum(code, 65535), 0).astype(np.uint16)
    with np.errstate(divide="ignore"):
        decoded = np.where(kept, np.log(stored.astype(np.float64) * PROB14_STEP), -np.inf).astype(np.float32)
    return {"ids": np.where(kept, ids, PAD_ID).astype(np.int32), "logprobs": decoded, "stored": stored, "tail": tail,
            "counts": kept.sum(1).astype(np.int32), "exact": exact}


def distortion_sums(enc: dict) -> dict:
    """Sums for one row's compact top-k against its exact top-k (``enc`` from :func:`compact_topk`), to be merged over
    rows and shards: |log-prob error| of kept entries (sum, max, count), and KL(exact || compact) per position over the
    k entries plus one tail bin, where a dropped entry's mass moves into the tail (sum, max, positions)."""
    kept = enc["ids"] != PAD_ID
    exact = enc["exact"].astype(np.float64)
    ok = kept & np.isfinite(exact)
    err = np.abs(enc["logprobs"].astype(np.float64)[ok] - exact[ok])
    p = np.exp(exact)
    p_tail = np.clip(1.0 - p.sum(1), 0.0, 1.0)
    p_total = p.sum(1) + p_tail  # float32 log-probs can sum to 1 + 1e-7: compare normalised distributions
    p, p_tail = p / p_total[:, None], p_tail / p_total
    q = np.where(kept, np.exp(enc["logprobs"].astype(np.float64)), 0.0)
    q_tail = enc["tail"].astype(np.float64)
    total = q.sum(1) + q_tail  # rounding moves a little mass: compare normalised distributions
    q, q_tail = q / total[:, None], q_tail / total
    with np.errstate(divide="ignore", invalid="ignore"):
        # an entry dropped from the support has q = 0 here: its exact mass is compared inside the tail bin instead
        p_in = np.where(kept, p, 0.0)
        p_tail_all = p_tail + np.where(kept, 0.0, p).sum(1)
        kl = np.where(p_in > 0, p_in * (np.log(p_in) - np.log(np.where(kept, q, 1.0))), 0.0).sum(1)
        kl += np.where(p_tail_all > 0, p_tail_all * (np.log(p_tail_all) - np.log(np.maximum(q_tail, 1e-300))), 0.0)
    moved = np.where(kept, 0.0, p).sum(1)
    return {"positions": int(len(kl)), "entries": int(kept.sum()), "kl_sum": float(kl.sum()), "kl_max": float(kl.max(initial=0.0)),
            "err_sum": float(err.sum()), "err_max": float(err.max(initial=0.0)), "err_count": int(err.size),
            "moved_sum": float(moved.sum()), "moved_max": float(moved.max(initial=0.0))}


def merge_sums(parts) -> dict:
    """Merge :func:`distortion_sums` of rows or shards."""
    out = {"positions": 0, "entries": 0, "kl_sum": 0.0, "kl_max": 0.0, "err_sum": 0.0, "err_max": 0.0, "err_count": 0,
           "moved_sum": 0.0, "moved_max": 0.0}
    for part in parts:
        for key in out:
            out[key] = max(out[key], part[key]) if key.endswith("_max") else out[key] + part[key]
    return out


def distortion_summary(sums: dict) -> dict:
    """The manifest's record of a compact top-k table's measured distortion against its exact top-k: the |log-prob
    error| of kept entries (precision), KL(exact || compact) per position over the entries plus the tail bin (what
    rounding costs a forward-KL estimator with a tail bin), and the exact-top-k mass moved into the tail bin by the
    support (at most topk_mass). How much the moved mass changes a forward-KL estimate depends on the student (the
    split of the tail between tokens is lost): bench_storage.py measures |FKL_topk - FKL_full| for that."""
    n = max(sums["positions"], 1)
    return {"positions": sums["positions"], "mean_entries": sums["entries"] / n,
            "max_abs_logprob_error": sums["err_max"], "mean_abs_logprob_error": sums["err_sum"] / max(sums["err_count"], 1),
            "max_kl_exact_to_compact": max(sums["kl_max"], 0.0), "mean_kl_exact_to_compact": max(sums["kl_sum"], 0.0) / n,
            "max_moved_mass": sums["moved_max"], "mean_moved_mass": sums["moved_sum"] / n}


def kl_maxent(entropy_T: np.ndarray, exact_lp_TK: np.ndarray, kept_TK: np.ndarray, stored_lp_TK: np.ndarray,
              stored_tail_T: np.ndarray | None, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per position (r, KL(p || q*)) for a top-k store: r = 1 - the kept entries' exact mass, and KL from the teacher's
    distribution to q*, its maximum-entropy completion (the stored values renormalised with the tail bin, the tail
    spread evenly over the rest; opdcache/format/fidelity.py): KL = -H - sum_S p_i log q_i - r log r_q + r log(V - |S|)
    (r_q the stored tail; float error ~1e-6 nats from float32 log-probs and H in float64). ``exact_lp_TK``: the exact
    temperature-1 log-probs of the support's candidates (float32, any order, -inf allowed); ``kept_TK``: which of them the store
    keeps; ``stored_lp_TK``: their stored (decoded) log-probs; ``stored_tail_T``: the stored tail column (None: the
    exact v1 store, whose tail is 1 - the kept mass)."""
    lp = exact_lp_TK.astype(np.float64)
    p = np.where(kept_TK, np.exp(lp), 0.0)
    r = np.clip(1.0 - p.sum(1), 0.0, 1.0)
    q_raw = np.where(kept_TK, np.exp(stored_lp_TK.astype(np.float64)), 0.0)
    r_q = r.copy() if stored_tail_T is None else stored_tail_T.astype(np.float64)
    z = q_raw.sum(1) + r_q
    with np.errstate(divide="ignore", invalid="ignore"):
        log_q = np.log(q_raw) - np.log(z)[:, None]
        on_support = np.where(kept_TK & (p > 0), p * log_q, 0.0).sum(1)
        log_rq = np.log(np.maximum(r_q / z, 1e-300))
        outside = np.maximum(vocab_size - kept_TK.sum(1), 1)
        tail = np.where(r > 0, r * (np.log(outside) - log_rq), 0.0)
    kl = -entropy_T.astype(np.float64) - on_support + tail
    return r, np.maximum(kl, 0.0)


def decode_logprobs(values: np.ndarray, field) -> np.ndarray:
    """A top-k log-prob column's values (as :func:`opdcache.format.shards.token_values` returns them) -> float32: float16 bits
    (field metadata opdcache.dtype = float16) are decoded, float32 is returned as is."""
    dtype = field.metadata.get(FIELD_DTYPE) if field.metadata else None
    if dtype == b"float16":
        return np.ascontiguousarray(values).view(np.float16).astype(np.float32)
    if dtype == b"prob14":  # uint16 probability codes; 0 (padding) decodes to -inf
        with np.errstate(divide="ignore"):
            return np.log(np.asarray(values, np.float64) * PROB14_STEP).astype(np.float32)
    return values
