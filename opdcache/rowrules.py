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


def duplicate_ids(ids: np.ndarray, pad: np.ndarray) -> np.ndarray:
    """[tokens] True where a row of ids [tokens, k] holds one id twice; padding slots (``pad``) never count."""
    dtype = np.int32 if ids.dtype == np.int32 else np.int64  # the stored int32 sorts 5x faster than a widened copy
    distinct_pads = np.iinfo(dtype).min + np.arange(ids.shape[1], dtype=dtype)  # below every id, and different from each other
    x = np.where(pad, distinct_pads, ids.astype(dtype, copy=False))
    x.sort(axis=1)
    return (x[:, 1:] == x[:, :-1]).any(axis=1)


def _outside(ids: np.ndarray, vocab: int | None, pad: np.ndarray) -> np.ndarray:
    hi = vocab if vocab is not None else np.iinfo(np.int64).max
    return (((ids < 0) | (ids >= hi)) & ~pad).any(axis=1)


def ids_in_vocabulary(column: str, ids: np.ndarray, vocab: int | None) -> list[Violation]:
    """Plain id columns (ref_topk_ids, mc_ids, v1 top-k): every id in [0, vocab)."""
    ids = ids.reshape(len(ids), -1)
    bad = _outside(ids, vocab, np.zeros(ids.shape, bool))
    return [(column, bad, f"token id outside the vocabulary [0, {vocab})")] if bad.any() else []


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
    pad = ids == S.PAD_ID if tail is not None else np.zeros(ids.shape, bool)
    out: list[Violation] = [(col_ids, _outside(ids, vocab, pad), f"token id outside the vocabulary [0, {vocab})")]
    if tail is not None:
        out.append((col_ids, (pad[:, :-1] & ~pad[:, 1:]).any(axis=1) | pad[:, 0] | (pad != (lps == -np.inf)).any(axis=1),
                    "padding (id -1, log-prob -inf) must fill the trailing slots only, after at least one entry"))
    out.append((col_ids, duplicate_ids(ids, pad), "duplicate token ids in a top-k row"))
    kept = np.where(pad, 0.0, lps)
    finite = np.isfinite(kept).all(axis=1)
    out.append((col_lps, ~finite, "non-finite log-prob"))
    out.append((col_lps, (kept > 0).any(axis=1) & finite, "log-prob above 0"))
    if order == "ids":
        ascending = (np.diff(ids.astype(np.int64), axis=1) > 0) | pad[:, 1:]
        out.append((col_ids, ~ascending.all(axis=1), "top-k ids of a prob14 row not ascending"))
    else:
        with np.errstate(invalid="ignore"):
            out.append((col_lps, (np.diff(lps, axis=1) > 0).any(axis=1), "top-k log-probs not sorted descending"))
    with np.errstate(over="ignore"):  # float32 exp, float64 sum: within 1e-6 of an all-float64 sum, 14x faster
        mass = np.exp(lps).sum(axis=1, dtype=np.float64)
    out.append((col_lps, mass > 1 + tol, "top-k probabilities sum to more than 1"))
    if tail is not None:
        with np.errstate(invalid="ignore"):
            out.append((f"{prefix}_tail", ~((tail >= 0) & (tail <= 1)) | (np.abs(mass + tail - 1) > tol),
                        f"tail outside [0, 1], or kept probabilities plus tail differ from 1 by more than {tol:g}"))
    return [v for v in out if v[1].any()]


def sampled_rules(ids: np.ndarray, counts: np.ndarray, lps: np.ndarray, samples: int, vocab: int | None) -> list[Violation]:
    """The sampled store: ids in the vocabulary or padding, distinct, padding only in trailing slots after at least one
    entry, counts positive at entries, 0 at padding and summing to ``samples`` (m), log-probs finite and not above 0 at
    entries and -inf at padding."""
    pad = ids == S.PAD_ID
    c = counts.astype(np.int64)
    with np.errstate(invalid="ignore"):
        out = [
            ("sampled_ids", _outside(ids, vocab, pad), f"token id outside the vocabulary [0, {vocab})"),
            ("sampled_ids", (pad[:, :-1] & ~pad[:, 1:]).any(axis=1) | pad[:, 0],
             "padding (id -1) must fill the trailing slots only, after at least one entry"),
            ("sampled_counts", (c.sum(axis=1) != samples) | ((c == 0) != pad).any(axis=1) | (c < 0).any(axis=1),
             f"counts must be positive, sum to {samples} (samples_per_position), and be 0 exactly at padding"),
            ("sampled_logprobs", ((pad & (lps != -np.inf)) | (~pad & (~np.isfinite(lps) | (lps > 0)))).any(axis=1),
             "log-probs must be finite and not above 0 at entries, -inf at padding"),
            ("sampled_ids", duplicate_ids(ids, pad), "duplicate token ids in a sampled row"),
        ]
    return [v for v in out if v[1].any()]
