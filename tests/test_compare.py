"""opdcache/teacher/compare.py: column-by-column disagreement between two teacher tables (the engine conformance check; the
vllm group compares vLLM-cpu against transformers with it)."""

import numpy as np
import pytest

from opdcache.teacher.compare import abs_diff_stats, compare_teachers


def test_abs_diff_stats_against_a_plain_computation():
    a = np.array([0.0, 1.0, -2.0, 4.0], dtype=np.float32)
    b = np.array([0.5, 1.0, -1.0, 0.0], dtype=np.float32)
    stats = abs_diff_stats(a, b)
    assert stats["max"] == 4.0 and stats["mean"] == pytest.approx((0.5 + 0 + 1 + 4) / 4) and stats["n"] == 4
    assert stats["p50"] == pytest.approx(np.quantile([0.5, 0.0, 1.0, 4.0], 0.5))


def test_a_table_against_itself_disagrees_nowhere(hf_cache):
    stats = compare_teachers(hf_cache, "teacher", "teacher")
    assert {"logprobs", "logsumexp"} <= set(stats)
    for name in ("logprobs", "logsumexp", "ref_topk_logprobs", "mc_logprobs"):
        assert stats[name]["max"] == 0.0 and stats[name]["n"] > 0, (name, stats[name])
    assert stats.get("topk_ids_equal_fraction", 1.0) == 1.0
