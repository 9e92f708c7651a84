"""A toy store as a newcomer writes one: the variance of the teacher's log-prob under its own distribution,
Var_p[log p], a statistic the engines already compute (STATISTICS["variance"]) but no store kept. One file; its registry
line is put in by tests/test_stores.py before the format is imported."""

import numpy as np

from opdcache.stores.base import Column, Store


def _encode(sc, params) -> dict:
    return {"logprob_variance": np.asarray(sc.variance, np.float32)}


def _rules(values, vocab, params) -> list:
    v = values["logprob_variance"]
    bad = ~np.isfinite(v) | (v < 0)
    return [("logprob_variance", bad if bad.any() else None, "logprob_variance must be finite and at least 0")]


STORE = Store(
    name="variance",
    summary="variance: Var_p[log p] of the teacher at each position",
    columns=(Column("logprob_variance", "token", "float32", "variance", "Var_p[log p] of the teacher's distribution."),),
    since=7,
    needs=("variance",),
    encode=_encode,
    rules=_rules,
)
