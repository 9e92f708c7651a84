"""The entropy store: the teacher's entropy H_t = -sum_v p_v log p_v of its full temperature-1 distribution at each
position, in nats. 4 bytes a token (before compression), it says where the teacher is sure and where it hesitates:
a weight for the loss or a filter on positions, read by the loader as ``teacher_entropy`` like any per-token column.

Computed in float64 over the whole vocabulary by the engines that stream it (transformers, exact), stored as float32;
0 <= H_t <= log(vocabulary size)."""

from __future__ import annotations

import numpy as np

from opdcache.stores.base import Column, Store

ROUNDING = 1e-6
"""Slack on the rules' bounds: float32 rounding of a float64 entropy (relative 2^-24) at log(151,936) ~ 11.9 nats."""


def _encode(sc, params) -> dict:
    return {"entropy": np.asarray(sc.entropy, dtype=np.float32)}


def _rules(values, vocab: int | None, params) -> list:
    h = values["entropy"]
    vocab = params.get("teacher_vocab_size") or vocab  # the teacher's distribution: its own vocabulary
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(h) | (h < -ROUNDING)
        if vocab:
            bad |= h > np.log(vocab) * (1 + ROUNDING)
    bound = f"log({vocab}) = {np.log(vocab):.4f}" if vocab else "log(vocabulary size)"
    return [("entropy", bad if bad.any() else None, f"entropy must be finite, at least 0 and at most {bound} nats")]


def _info(params) -> str | None:
    return "entropy store: the teacher's full-distribution entropy at each position, nats (the loader's teacher_entropy)"


STORE = Store(
    name="entropy",
    summary="entropy: the teacher's entropy at each position",
    columns=(
        Column("entropy", "token", "float32", "entropy",
               "H_t: entropy of the teacher's full temperature-1 distribution at the position, -sum_v p_v log p_v in nats, "
               "computed in float64 over the whole vocabulary and stored as float32 (0 <= H_t <= log vocabulary size)."),
    ),
    since=5,
    needs=("entropy",),
    encode=_encode,
    rules=_rules,
    info=_info,
)
