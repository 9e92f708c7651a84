"""The sampled teacher store (RS-KD, "Sparse Logit Sampling", arXiv 2503.16870): m draws per position from the
teacher's temperature-1 distribution, kept as the distinct ids with their counts and teacher log-probs.

Why: a top-k store is a biased estimate of the forward KL (the tail is cut), a sampled one is unbiased. With counts
c_v of m draws, (1/m) sum_v c_v (log p_v - log q_v) has expectation sum_v p_v (log p_v - log q_v) = KL(p || q), and
its gradient -(1/m) sum_v c_v grad log q_v is the full forward-KL gradient in expectation (losses.sampled_fkl_terms).

Draws are reproducible and batch-invariant: the uniforms of a row come from (seed, row id) alone (:func:`uniforms`),
and the scorer maps each to a token by inverse CDF over the vocabulary order (backends/streamed.py ``_draw_from_slices``).
"""

from __future__ import annotations

import hashlib

import numpy as np

from opdcache.stores.base import PAD_ID


def uniforms(seed: int, row_id: str, tokens: int, draws: int) -> np.ndarray:
    """[tokens, draws] float64 uniforms in [0, 1) for one row: a function of (seed, row id) only."""
    key = int.from_bytes(hashlib.sha256(f"{seed}:{row_id}".encode()).digest()[:8], "little")
    return np.random.default_rng(key).random((tokens, draws))


def store_columns(draw_ids: np.ndarray, draw_lps: np.ndarray) -> dict:
    """[T, m] draws -> the sampled store's three columns as written (log-probs as float16 bits)."""
    ids, counts, lps = collapse(draw_ids, draw_lps)
    return {"sampled_ids": ids, "sampled_counts": counts, "sampled_logprobs": lps.astype(np.float16).view(np.uint16)}


def collapse(draw_ids: np.ndarray, draw_lps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[T, m] draws (ids and their teacher log-probs) -> the store's fixed-width columns, [T, m] each: the distinct ids
    most drawn first (ties: smaller id first) padded with -1, their counts (0 for padding), their log-probs (-inf for
    padding). Vectorised: memory O(T x m)."""
    T, m = draw_ids.shape
    order = np.lexsort((draw_lps, draw_ids), axis=-1) if T else np.zeros((0, m), np.int64)
    ids_sorted = np.take_along_axis(draw_ids, order, 1)
    lps_sorted = np.take_along_axis(draw_lps, order, 1)
    first = np.ones((T, m), bool)
    first[:, 1:] = ids_sorted[:, 1:] != ids_sorted[:, :-1]
    run = np.cumsum(first, 1) - 1  # index of each draw's distinct id
    counts = np.zeros((T, m), np.int32)
    np.add.at(counts, (np.repeat(np.arange(T), m), run.ravel()), 1)
    uniq_ids = np.full((T, m), PAD_ID, np.int64)
    uniq_lps = np.full((T, m), -np.inf, np.float32)
    rows, cols = np.nonzero(first)
    uniq_ids[rows, run[rows, cols]] = ids_sorted[rows, cols]
    uniq_lps[rows, run[rows, cols]] = lps_sorted[rows, cols]
    # most drawn first, ties by smaller id (padding, count 0, last)
    rank = np.lexsort((np.where(counts > 0, uniq_ids, np.iinfo(np.int64).max), -counts), axis=-1) if T else order
    return (np.take_along_axis(uniq_ids, rank, 1).astype(np.int32), np.take_along_axis(counts, rank, 1),
            np.take_along_axis(uniq_lps, rank, 1))
