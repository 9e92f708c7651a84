"""Tolerances that follow from float32's arithmetic, not from one CPU's kernels.

Two float32 evaluations of one model (a batched engine and a lone forward, or two kernel sets: AVX2, AVX-512, the
scalar `default`) sum in different orders, so their logits differ by rounding that the network amplifies. That
rounding is measured per position against a float64 forward of the same weights: e_t = max_v |z32_tv - z64_tv|, the
float32 error of this very forward at position t, over the whole vocabulary. Any other float32 evaluation order has an
error of the same kind; allowing it twice this one's (2 e_t), two float32 logits differ by at most 3 e_t. A
log-softmax moves by at most twice its inputs' largest change (d log p_i = dz_i - sum_j p_j dz_j), so two float32
log-probs differ by at most 6 e_t, plus each one's own rounding in the log-softmax: the log of a sum of V exponentials
(pairwise summation, relative error log2(V) u) and the subtraction (u |z| and u |lse|), u = 2^-24, for both sides.
"""

from __future__ import annotations

import math

import torch

U32 = 2.0 ** -24  # float32's unit roundoff


def position_error(logits32_TV: torch.Tensor, logits64_TV: torch.Tensor) -> torch.Tensor:
    """e_t: the float32 forward's largest logit error at each position, against float64. [T]"""
    return (logits32_TV.double() - logits64_TV.double()).abs().amax(-1)


def logprob_tolerance(logits32_TV: torch.Tensor, logits64_TV: torch.Tensor, width: int = 1,
                      other_implementation: bool = False) -> torch.Tensor:
    """How far two float32 evaluations of log_softmax(z) may be apart at each position: 6 e_t plus both sides' own
    rounding of the log-softmax; [T, width] (broadcast over a position's k values). ``other_implementation``: the other
    side is another program's kernels (a vLLM server), whose rounding lands at other positions than this forward's
    (attention carries an earlier position's error forward): e_t is then the row's largest, max_t e_t."""
    e_T = position_error(logits32_TV, logits64_TV)
    if other_implementation:
        e_T = e_T.amax().expand_as(e_T)
    lse_T = torch.logsumexp(logits64_TV.double(), -1)
    zmax_T = logits64_TV.double().abs().amax(-1)
    own_T = 2 * U32 * (math.log2(logits64_TV.shape[-1]) + zmax_T + lse_T.abs() + (zmax_T + lse_T.abs()))
    return (6 * e_T + own_T)[:, None].expand(-1, width)


def assert_close_within(actual, expected, tolerance, what: str) -> None:
    """Every |actual - expected| within its own tolerance (broadcast); the message names the worst entry and its bound."""
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    tolerance = torch.broadcast_to(torch.as_tensor(tolerance).double(), actual.shape)
    excess = ((actual - expected).abs() - tolerance).flatten()
    worst = int(excess.argmax())
    assert float(excess[worst]) <= 0, (
        f"{what}: |{float(actual.flatten()[worst])} - {float(expected.flatten()[worst])}| exceeds its bound "
        f"{float(tolerance.flatten()[worst]):.3g} (entry {worst})")
