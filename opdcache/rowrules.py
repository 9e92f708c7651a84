"""The rules a stored row of token ids and log-probs must meet, written once: ``opdcache validate`` reports every
violation, and the loader (opdcache/data.py) refuses a shard at its first, naming the shard, the row and the column,
before anything trains on it.

Each function takes a shard's flat per-token values ([tokens, width]) and returns (column, bad tokens [tokens] bool,
message) for each rule that some token breaks.
"""

from __future__ import annotations

import numpy as np

from opdcache import schema as S

Violation = tuple[str, np.ndarray, str]


def _rows(bad: np.ndarray) -> np.ndarray | None:
    """[tokens] True where a row of ``bad`` [tokens, k] holds a True; None when none does. The whole-array test runs
    first: it is several times faster than the per-row reduction, which only a broken shard then pays."""
    return (bad if bad.ndim == 1 else bad.any(axis=1)) if bad.any() else None


def _duplicates(ids: np.ndarray, pad: np.ndarray) -> np.ndarray | None:
    """Rows of ids [tokens, k] holding one id twice; padding slots (``pad``) never count."""
    dtype = np.int32 if ids.dtype == np.int32 else np.int64  # the stored int32 sorts 5x faster than a widened copy
    distinct_pads = np.iinfo(dtype).min + np.arange(ids.shape[1], dtype=dtype)  # below every id, and different from each other
    x = np.where(pad, distinct_pads, ids.astype(dtype, copy=False)) if pad.any() else ids.astype(dtype, copy=True)
    x.sort(axis=1)
    return _rows(x[:, 1:] == x[:, :-1])


def _outside(ids: np.ndarray, vocab: int | None, pad: np.ndarray | None = None) -> np.ndarray | None:
    """Rows holding an id outside [0, vocab) that is not padding (``pad``: the id -1 in a compact store)."""
    hi = vocab if vocab is not None else np.iinfo(np.int64).max
    if not ids.size or (ids.min() >= (-1 if pad is not None else 0) and ids.max() < hi):
        return None  # the common case, from two reductions
    bad = (ids < 0) | (ids >= hi)
    return _rows(bad if pad is None else bad & ~pad)


def ids_in_vocabulary(column: str, ids: np.ndarray, vocab: int | None) -> list[Violation]:
    """Plain id columns (ref_topk_ids, mc_ids, v1 top-k): every id in [0, vocab)."""
    bad = _outside(ids.reshape(ids.shape[0], int(np.prod(ids.shape[1:]))), vocab)
    return [] if bad is None else [(column, bad, f"token id outside the vocabulary [0, {vocab})")]


def topk_layout(field, width: int) -> tuple[float, str]:
    """(tolerance on kept mass + tail, order) of a top-k log-prob column from its field metadata: float32 1e-3 and
    float16 1e-2, both most likely first ("logprobs"); prob14 1e-3 + width x 2^-15 (each code rounds by at most
    2^-15), ids ascending ("ids")."""
    dtype = field.metadata.get(S.FIELD_DTYPE) if field.metadata else None
    if dtype == b"prob14":
        return 1e-3 + width * S.PROB14_STEP / 2, "ids"
    return (1e-2 if dtype == b"float16" else 1e-3), "logprobs"


def topk_rules(prefix: str, ids: np.ndarray, lps: np.ndarray, vocab: int | None, tail: np.ndarray | None = None,
               tol: float = 1e-3, order: str = "logprobs") -> list[Violation]:
    """A top-k store: ids in the vocabulary and distinct, log-probs finite, not above 0 and descending (``order`` "ids":
    the kept ids ascending instead, the prob14 layout), probabilities summing to at most 1; with ``tail`` (compact),
    padding (id -1, log-prob -inf) only in trailing slots after at least one entry, tail in [0, 1] and kept mass + tail
    = 1 within ``tol``."""
    col_ids, col_lps = f"{prefix}_ids", f"{prefix}_logprobs"
    compact = tail is not None
    pad = ids == S.PAD_ID if compact else np.zeros(ids.shape, bool)
    out = [(col_ids, _outside(ids, vocab, pad if compact else None), f"token id outside the vocabulary [0, {vocab})")]
    if compact:
        out.append((col_ids, _rows(np.concatenate([pad[:, :-1] & ~pad[:, 1:], pad[:, :1], pad != (lps == -np.inf)], axis=1)),
                    "padding (id -1, log-prob -inf) must fill the trailing slots only, after at least one entry"))
    ascending = _rows(~((ids[:, 1:] > ids[:, :-1]) | pad[:, 1:])) if order == "ids" else None
    # strictly ascending kept ids before trailing padding are distinct: the sort is only needed when they are not
    out.append((col_ids, _duplicates(ids, pad) if order != "ids" or ascending is not None else None, "duplicate token ids in a top-k row"))
    kept = np.where(pad, np.float32(0), lps) if compact else lps
    lo, hi = (kept.min(), kept.max()) if kept.size else (0.0, 0.0)
    if np.isfinite(lo) and np.isfinite(hi):  # min and max carry any NaN or infinity: the common case from two reductions
        out.append((col_lps, None if hi <= 0 else _rows(kept > 0), "log-prob above 0"))
    else:
        finite = np.isfinite(kept).all(axis=1)
        out += [(col_lps, None if finite.all() else ~finite, "non-finite log-prob"),
                (col_lps, _rows((kept > 0) & finite[:, None]), "log-prob above 0")]
    if order == "ids":
        out.append((col_ids, ascending, "top-k ids of a prob14 row not ascending"))
    else:
        out.append((col_lps, _rows(lps[:, 1:] > lps[:, :-1]), "top-k log-probs not sorted descending"))
    with np.errstate(over="ignore"):  # float32 exp, float64 sum: within 1e-6 of an all-float64 sum, 14x faster
        mass = np.exp(lps).sum(axis=1, dtype=np.float64)
    out.append((col_lps, _rows(mass > 1 + tol), "top-k probabilities sum to more than 1"))
    if compact:
        with np.errstate(invalid="ignore"):
            out.append((f"{prefix}_tail", _rows(~((tail >= 0) & (tail <= 1)) | (np.abs(mass + tail - 1) > tol)),
                        f"tail outside [0, 1], or kept probabilities plus tail differ from 1 by more than {tol:g}"))
    return [v for v in out if v[1] is not None]


def sampled_rules(ids: np.ndarray, counts: np.ndarray, lps: np.ndarray, samples: int, vocab: int | None) -> list[Violation]:
    """The sampled store: ids in the vocabulary or padding, distinct, padding only in trailing slots after at least one
    entry, counts positive at entries, 0 at padding and summing to ``samples`` (m), log-probs finite and not above 0 at
    entries and -inf at padding."""
    pad = ids == S.PAD_ID
    c = counts.astype(np.int64)
    with np.errstate(invalid="ignore"):
        out = [
            ("sampled_ids", _outside(ids, vocab, pad), f"token id outside the vocabulary [0, {vocab})"),
            ("sampled_ids", _rows(np.concatenate([pad[:, :-1] & ~pad[:, 1:], pad[:, :1]], axis=1)),
             "padding (id -1) must fill the trailing slots only, after at least one entry"),
            ("sampled_counts", _rows(np.concatenate([(c.sum(axis=1) != samples)[:, None], (c == 0) != pad, c < 0], axis=1)),
             f"counts must be positive, sum to {samples} (samples_per_position), and be 0 exactly at padding"),
            ("sampled_logprobs", _rows((pad & (lps != -np.inf)) | (~pad & (~np.isfinite(lps) | (lps > 0)))),
             "log-probs must be finite and not above 0 at entries, -inf at padding"),
            ("sampled_ids", _duplicates(ids, pad), "duplicate token ids in a sampled row"),
        ]
    return [v for v in out if v[1] is not None]
