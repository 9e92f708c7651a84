"""The rules a stored row of token ids and log-probs must meet, written once: ``opdcache validate`` reports every
violation, and the loader (opdcache/training/decoded.py) refuses a shard at its first, naming the shard, the row and the column,
before anything trains on it.

Each function takes a shard's flat per-token values ([tokens, width]) and returns (column, bad tokens [tokens] bool,
message) for each rule that some token breaks.
"""

from __future__ import annotations

import numpy as np

from opdcache.stores.base import PAD_ID, PROB14_STEP, Violation


BLOCK_ROWS = 8192
"""Rows checked at once. Every temporary is [BLOCK_ROWS, k]: memory is bounded by the block, not the shard, and a
block's arrays stay in cache. Whole-shard temporaries were fresh arrays of several MiB for each rule, which numpy asks
huge pages for and the kernel zeroes on first touch: a loader's cold epoch spent 0.50 s of system time where it now
spends 0.09 s, in one scratch measurement (BENCHMARKS.md, "DataLoader")."""


def _blocked(check, arrays: tuple, block_rows: int) -> list[Violation]:
    """``check`` over row blocks of ``arrays`` (each [tokens, ...], or None), its violations merged in ``check``'s order.

    ``check`` returns one (column, bad rows of the block or None, message) per rule, the same rules in the same order
    for every block; the merged [tokens] array is allocated only for a rule some row breaks."""
    n = len(arrays[0])
    merged: list[list] = []
    for a in range(0, max(n, 1), block_rows):  # an empty shard still runs once
        part = check(*(None if x is None else x[a: a + block_rows] for x in arrays))
        merged = merged or [[column, None, message] for column, _, message in part]
        for slot, (_, bad, _) in zip(merged, part, strict=True):
            if bad is not None:
                if slot[1] is None:
                    slot[1] = np.zeros(n, bool)
                slot[1][a: a + len(bad)] = bad
    return [(column, bad, message) for column, bad, message in merged if bad is not None]


def _rows(bad: np.ndarray) -> np.ndarray | None:
    """[tokens] True where a row of ``bad`` [tokens, k] holds a True; None when none does. The whole-array test runs
    first: it is several times faster than the per-row reduction, which only a broken shard then pays."""
    return (bad if bad.ndim == 1 else bad.any(axis=1)) if bad.any() else None


def _neighbours(x: np.ndarray, op) -> np.ndarray | None:
    """[tokens] True where ``op(x[:, j + 1], x[:, j])`` holds for some j; None when it holds nowhere. Taken on the
    flat array with the pairs that straddle two rows masked out: 5x faster than on the strided [tokens, k - 1] views."""
    k = x.shape[1]
    if k < 2:  # no pairs (a hostile width-0 store included)
        return None
    flat = np.ascontiguousarray(x).ravel()
    hit = op(flat[1:], flat[:-1])
    hit[k - 1:: k] = False  # the last of row r against the first of row r + 1
    return np.append(hit, False).reshape(-1, k).any(axis=1) if hit.any() else None


def _duplicates(ids: np.ndarray, pad: np.ndarray) -> np.ndarray | None:
    """Rows of ids [tokens, k] holding one id twice; padding slots (``pad``) never count."""
    dtype = np.int32 if ids.dtype == np.int32 else np.int64  # the stored int32 sorts 5x faster than a widened copy
    distinct_pads = np.iinfo(dtype).min + np.arange(ids.shape[1], dtype=dtype)  # below every id, and different from each other
    x = np.where(pad, distinct_pads, ids.astype(dtype, copy=False)) if pad.any() else ids.astype(dtype, copy=True)
    x.sort(axis=1)
    return _neighbours(x, np.equal)


def _outside(ids: np.ndarray, vocab: int | None, pad: np.ndarray | None = None) -> np.ndarray | None:
    """Rows holding an id outside [0, vocab) that is not padding (``pad``: the id -1 in a compact store)."""
    hi = vocab if vocab is not None else np.iinfo(np.int64).max
    if not ids.size or (ids.min() >= (-1 if pad is not None else 0) and ids.max() < hi):
        return None  # the common case, from two reductions
    bad = (ids < 0) | (ids >= hi)
    return _rows(bad if pad is None else bad & ~pad)


EMPTY_PROMPT = ("prompt_ids is empty: the first response token has no position to be predicted from (a row needs at "
                "least one prompt token, such as the chat template's first)")


def empty_prompts(prompt_offsets: np.ndarray) -> np.ndarray:
    """The rows whose prompt holds no token, from the prompt column's offsets [rows + 1]: a model predicts a row's first
    response token from its prompt's last, so such a row has no value for it in any layout (padded, the row's logit
    position would be -1, the end of its padding; packed, the last token of the sequence before it)."""
    return np.flatnonzero(np.diff(prompt_offsets) == 0)


def ids_in_vocabulary(column: str, ids: np.ndarray, vocab: int | None) -> list[Violation]:
    """Plain id columns (ref_topk_ids, mc_ids, v1 top-k): every id in [0, vocab)."""
    bad = _outside(ids.reshape(ids.shape[0], int(np.prod(ids.shape[1:]))), vocab)
    return [] if bad is None else [(column, bad, f"token id outside the vocabulary [0, {vocab})")]


def topk_layout(precision: str | None, width: int) -> tuple[float, str]:
    """(tolerance on kept mass + tail, order) of a top-k log-prob column stored at ``precision`` (its field's
    ``opdcache.dtype``; None: float32): float32 1e-3 and float16 1e-2, both most likely first ("logprobs"); prob14
    1e-3 + width x 2^-15 (each code rounds by at most 2^-15), ids ascending ("ids")."""
    if precision == "prob14":
        return 1e-3 + width * PROB14_STEP / 2, "ids"
    return (1e-2 if precision == "float16" else 1e-3), "logprobs"


LOGPROB_TOL = 1e-4
"""Agreement between two stores of the same float32 log-prob."""


def against_topk(column: str, sampled: np.ndarray, sampled_lp: np.ndarray, ids: np.ndarray, lps: np.ndarray,
                 rel_tol: float = 0.0, prob_tol: float | None = None, block_rows: int = BLOCK_ROWS) -> list[Violation]:
    """The sampled token's log-prob (``column``, [tokens]) must equal its top-k entry (within LOGPROB_TOL + rel_tol x
    |log-prob|: float16 storage; with ``prob_tol``, prob14 codes: the probabilities within prob_tol), or lie below the
    last kept entry when outside the top-k ([tokens, k] ``ids``, ``lps``). Only the rules some token breaks; checked
    ``block_rows`` rows at a time (memory: a few [block_rows, k] arrays)."""
    return _blocked(lambda s, slp, i, lp: _against_topk_block(column, s, slp, i, lp, rel_tol, prob_tol),
                    (sampled, sampled_lp, ids, lps), block_rows)


def _against_topk_block(column: str, sampled, sampled_lp, ids, lps, rel_tol: float, prob_tol: float | None) -> list:
    """:func:`against_topk` on one block of rows: both rules, None where no row breaks it."""
    hit = ids == sampled[:, None]
    inside = hit.any(axis=1)
    at = np.where(inside, lps[np.arange(len(ids)), hit.argmax(axis=1)], np.nan)
    tol = LOGPROB_TOL + (rel_tol * np.abs(np.nan_to_num(sampled_lp)) if rel_tol else 0.0)
    if prob_tol is not None:  # an entry's probability is stored to within prob_tol, its log-prob to no fixed bound
        with np.errstate(invalid="ignore"):
            mismatch = inside & (np.abs(np.exp(at.astype(np.float64)) - np.exp(sampled_lp.astype(np.float64))) > prob_tol)
        tol = np.maximum(tol, np.log1p(prob_tol / np.maximum(np.exp(sampled_lp.astype(np.float64)), 1e-300)))
    else:
        mismatch = inside & (np.abs(at - sampled_lp) > tol)
    last = np.where(np.isfinite(lps), lps, np.inf).min(axis=1) if lps.shape[1] else np.full(len(ids), np.inf)
    above_kth = ~inside & (sampled_lp > last + tol)
    return [(column, _rows(mismatch), "log-prob of the sampled token disagrees with its top-k entry"),
            (column, _rows(above_kth), "sampled token is outside the top-k but more likely than the k-th")]


def topk_rules(prefix: str, ids: np.ndarray, lps: np.ndarray, vocab: int | None, tail: np.ndarray | None = None,
               tol: float = 1e-3, order: str = "logprobs", block_rows: int = BLOCK_ROWS) -> list[Violation]:
    """A top-k store: ids in the vocabulary and distinct, log-probs finite, not above 0 and descending (``order`` "ids":
    the kept ids ascending instead, the prob14 layout), probabilities summing to at most 1; with ``tail`` (compact),
    padding (id -1, log-prob -inf) only in trailing slots after at least one entry, tail in [0, 1] and kept mass + tail
    = 1 within ``tol``. Checked ``block_rows`` rows at a time (memory: a few [block_rows, k] arrays)."""
    return _blocked(lambda i, lp, t: _topk_block(prefix, i, lp, vocab, t, tol, order), (ids, lps, tail), block_rows)


def _topk_block(prefix: str, ids: np.ndarray, lps: np.ndarray, vocab: int | None, tail: np.ndarray | None, tol: float,
                order: str) -> list[tuple[str, np.ndarray | None, str]]:
    """:func:`topk_rules` on one block of rows: every rule, None where no row breaks it."""
    col_ids, col_lps = f"{prefix}_ids", f"{prefix}_logprobs"
    compact = tail is not None
    pad = ids == PAD_ID if compact else np.zeros(ids.shape, bool)
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
        out += [(col_lps, None, "non-finite log-prob"), (col_lps, None if hi <= 0 else _rows(kept > 0), "log-prob above 0")]
    else:
        finite = np.isfinite(kept).all(axis=1)
        out += [(col_lps, None if finite.all() else ~finite, "non-finite log-prob"),
                (col_lps, _rows((kept > 0) & finite[:, None]), "log-prob above 0")]
    if order == "ids":
        out.append((col_ids, ascending, "top-k ids of a prob14 row not ascending"))
    else:
        out.append((col_lps, _neighbours(lps, np.greater), "top-k log-probs not sorted descending"))
    with np.errstate(over="ignore"):  # float32 exp and sum: within k x 2^-24 of float64 (1.5e-5 at k = 256), far inside tol
        mass = np.einsum("ij->i", np.exp(lps, dtype=np.float32))  # einsum: 5x faster than .sum(axis=1) over rows of k
    out.append((col_lps, _rows(mass > 1 + tol), "top-k probabilities sum to more than 1"))
    if compact:
        with np.errstate(invalid="ignore"):
            out.append((f"{prefix}_tail", _rows(~((tail >= 0) & (tail <= 1)) | (np.abs(mass + tail - 1) > tol)),
                        f"tail outside [0, 1], or kept probabilities plus tail differ from 1 by more than {tol:g}"))
    return out


def sampled_rules(ids: np.ndarray, counts: np.ndarray, lps: np.ndarray, samples: int, vocab: int | None,
                  block_rows: int = BLOCK_ROWS) -> list[Violation]:
    """The sampled store: ids in the vocabulary or padding, distinct, padding only in trailing slots after at least one
    entry, counts positive at entries, 0 at padding and summing to ``samples`` (m), log-probs finite and not above 0 at
    entries and -inf at padding. Checked ``block_rows`` rows at a time (memory: a few [block_rows, k] arrays)."""
    return _blocked(lambda i, c, lp: _sampled_block(i, c, lp, samples, vocab), (ids, counts, lps), block_rows)


def _sampled_block(ids: np.ndarray, counts: np.ndarray, lps: np.ndarray, samples: int,
                   vocab: int | None) -> list[tuple[str, np.ndarray | None, str]]:
    """:func:`sampled_rules` on one block of rows: every rule, None where no row breaks it."""
    pad = ids == PAD_ID
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
    return out
