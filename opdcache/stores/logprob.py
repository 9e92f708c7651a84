"""The logprob store, in every teacher table: the teacher's log-prob of each sampled token and its log-partition, and
its log-probs at pi_ref's top-k and Monte-Carlo ids when the rollouts hold them."""

from __future__ import annotations

from opdcache.stores.base import Column, Store


def _encode(sc, params) -> dict:
    out = {"logprobs": sc.logprobs}
    if params.has_logsumexp:
        out["logsumexp"] = sc.logsumexp
    if params.ref_top_k:
        out["ref_topk_logprobs"] = sc.ref_topk_logprobs
    if params.mc_samples:
        out["mc_logprobs"] = sc.mc_logprobs
    return out


STORE = Store(
    name="logprob",
    always=True,
    gives=("sampled_logprob",),
    summary="logprob (always): the teacher's log-prob of each sampled token",
    columns=(
        Column("logprobs", "token", "float32", "logprob",
               "T_t: teacher log-prob of each sampled response token at temperature 1 (log_softmax of the raw logits)."),
        Column("logsumexp", "token", "float32", "logprob",
               "Teacher log-partition log(sum_v exp(logit_v)) at each position, temperature 1; logprob_v = logit_v - logsumexp.",
               requires=("same_tokenizer", "has_logsumexp")),
        Column("ref_topk_logprobs", "token_vector", "float32", "logprob",
               "Teacher temperature-1 log-probs at the rollout's ref_topk_ids (same order).", width="ref_top_k", requires=("ref_top_k",)),
        Column("mc_logprobs", "token_vector", "float32", "logprob",
               "Teacher temperature-1 log-probs at the rollout's mc_ids (same order).", width="mc_samples", requires=("mc_samples",)),
    ),
    needs=("logprobs",),  # and the log-partition and the candidates' log-probs where the table has them
    encode=_encode,
    flat=("logprobs", "logsumexp"),
)
