"""Column-by-column disagreement between two teacher tables of one cache (the engine conformance check).

Every per-token column both tables store (log-probs, log-partition, log-probs at pi_ref's top-k and MC ids,
the teacher's own top-k) is compared as |a - b| over all tokens; ``opdcache mismatch-report`` gives the
per-token delta of the log-probs with quantiles, flips and the worst sequences (opdcache/teacher/mismatch.py).
"""

from __future__ import annotations

import numpy as np

from opdcache.format import schema as S
from opdcache.format.cache import Cache


def column(cache: Cache, table: str, name: str) -> np.ndarray:
    """A per-token column of a whole table, concatenated over shards: [tokens] or [tokens, width]."""
    return np.concatenate(cache.sequences(table, name))


def abs_diff_stats(a: np.ndarray, b: np.ndarray) -> dict:
    """max, p99, p50 and mean of |a - b| (float64), and the number of values compared."""
    d = np.abs(a.astype(np.float64) - b.astype(np.float64)).ravel()
    return {"max": float(d.max()), "p99": float(np.quantile(d, 0.99)), "p50": float(np.quantile(d, 0.5)),
            "mean": float(d.mean()), "n": int(d.size)}


def compare_teachers(root, a: str, b: str) -> dict:
    """Column-by-column |a - b| for two teacher tables of one cache (same rollouts, e.g. two engines)."""
    cache = Cache(root)
    ta, tb = cache.teacher_table(a), cache.teacher_table(b)
    pa, pb = cache.params(ta), cache.params(tb)
    present = {c.name for c in S.columns("teacher", pa)} & {c.name for c in S.columns("teacher", pb)}
    out = {}
    for name in ("logprobs", "logsumexp", "ref_topk_logprobs", "mc_logprobs"):
        if name in present:
            out[name] = abs_diff_stats(column(cache, ta, name), column(cache, tb, name))
    if "topk_ids" in present and pa.top_k == pb.top_k:
        ids_a, ids_b = column(cache, ta, "topk_ids"), column(cache, tb, "topk_ids")
        same = (ids_a == ids_b).all(axis=1)
        out["topk_ids_equal_fraction"] = float(same.mean())
        out["topk_logprobs"] = abs_diff_stats(column(cache, ta, "topk_logprobs")[same], column(cache, tb, "topk_logprobs")[same])
    return out
