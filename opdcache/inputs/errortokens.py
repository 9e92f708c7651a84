"""Error tokens (papers/004 section 3.2): tokens a low-bit rollout engine produced that the learner would almost never
produce, and the responses they derail.

The paper describes them as repetitive, garbled tokens in long quantized responses, assigned very low probability
under the policy, occurring in clusters, and sending the rest of the response off-trajectory. The rule here, per
response token t with learner log-prob s_t (the trainer's temperature-1 forward) and rollout log-prob r_t (the
rollout engine's own temperature-1 log-prob of the token, the stored ``ref_logprobs``, so the ratio measures the
engine's arithmetic and not the sampling temperature; an sft table, which has none, uses its ``sampling_logprobs``):

* **error token**: p_learner(a_t) < ``PROB`` (1e-3) **and** p_rollout(a_t) / p_learner(a_t) > ``RATIO`` (10), with
  p_learner = exp(s_t) and p_rollout = exp(r_t).
  Both parts are needed: a low learner probability alone is also what ordinary exploration looks like (a
  temperature-1 sample of a rare token, which the rollout engine found just as rare: ratio ~1); the ratio says the
  engine's arithmetic, not the policy, made the token likely.
* **error sequence**: a response with at least ``CLUSTER`` (2) error tokens (they come in clusters), or with one
  whose tail repeats itself: at least ``TAIL_REPEAT`` (half) of the 4-grams after the first error token already
  occurred earlier in the response (the repetition the paper shows in its Table 6).

Works on numpy arrays and torch tensors alike (comparisons only).
"""

from __future__ import annotations

import math

PROB = 1e-3
RATIO = 10.0
CLUSTER = 2
TAIL_REPEAT = 0.5
NGRAM = 4
RULE = (f"error token: p_learner < {PROB:g} and p_rollout / p_learner > {RATIO:g}; error sequence: >= {CLUSTER} error tokens, "
        f"or one followed by a tail whose {NGRAM}-grams repeat earlier ones at least {TAIL_REPEAT:.0%} of the time")


def error_token_mask(learner_logprobs, rollout_logprobs):
    """True where a token is an error token (same shape as the inputs)."""
    return (learner_logprobs < math.log(PROB)) & (rollout_logprobs - learner_logprobs > math.log(RATIO))


def tail_repetition(response_ids, start: int) -> float:
    """The share of the 4-grams beginning at or after ``start`` that already occurred earlier in the response."""
    ids = [int(x) for x in response_ids]
    seen, repeated, total = set(), 0, 0
    for i in range(len(ids) - NGRAM + 1):
        gram = tuple(ids[i: i + NGRAM])
        if i >= start:
            total += 1
            repeated += gram in seen
        seen.add(gram)
    return repeated / total if total else 0.0


def is_error_sequence(response_ids, errors) -> bool:
    """Whether a response (its ids and its error-token mask, numpy) is an error sequence."""
    count = int(errors.sum())
    if count >= CLUSTER:
        return True
    return count == 1 and tail_repetition(response_ids, int(errors.argmax())) >= TAIL_REPEAT
