"""The training estimators by name: what each reads from the cache and how a batch becomes its per-token terms.

One :class:`Estimator` per loss, in :data:`ESTIMATORS`. The trainer (opdcache/training/objective.py, opdcache/training/train.py), the
settings (opdcache/training/trainconfig.py: which stores a run needs, which losses run --online), the async learner
(opdcache/asyncopd/config.py) and ``train --help`` all read this registry instead of naming losses. The mathematics
of each term lives in opdcache/training/losses.py (each with its reference and parity tests); a new loss is its term function
plus one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# the registry is read by the CLI's help without torch: the term functions import the mathematics when they run


@dataclass(frozen=True)
class Estimator:
    """One loss: its name, what it reads, and its per-token terms."""

    name: str
    summary: str
    """One line for ``train --help`` and the README's table."""
    terms: Callable
    """(cfg, batch, s [B, T], s_K [B, T, K] or None, div_N or None, support or None) -> (terms [B, T], tensors, stats)."""
    teacher_reads: tuple[str, ...] = ("sampled_logprob",)
    """What it reads of a teacher table, by meaning (opdcache.stores.base.SIGNALS); the stores giving them are those a
    run needs (score-teacher --store)."""
    rollout_stores: tuple[str, ...] = ("base",)
    """Rollout stores it reads (build-rollouts --ref-top-k / --mc-samples)."""
    support: Callable | None = None
    """(cfg, batch, sel) -> [N, K] ids besides the sampled token at which it needs the student's log-probs."""
    full_vocabulary: str | None = None
    """The exact divergence it computes from the teacher's hidden states (fkl, rkl, jsd), or None."""
    online: bool = False
    """Runs as standard OPD with a live teacher (train --online)."""
    asynchronous: bool = False
    """Runs as the learner of ``opdcache async`` (the teacher scores each batch's stores as it lands)."""
    aligned: bool = False
    """Runs on a teacher with its own tokenizer (the aligned store): its terms read the teacher's log-prob per group."""
    span_topk: bool = False
    """Reads the teacher's top-k where each group starts: only a table with its own tokenizer scored with --top-k."""
    ref_support: bool = False
    """With ``--topk-support ref``, reads pi_ref's top-k (a rollout store) for its support and the teacher's log-probs there."""

    def stores(self, cfg=None, teacher_stores: tuple[str, ...] = ()) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(teacher stores, rollout stores) a run of this loss needs: the stores of ``teacher_stores`` (a table's) giving
        what it reads, else the registry's first giver of each. The full-vocabulary losses rebuild the teacher's logits from
        whichever store of the table gives vectors (its hidden states, else rank-r vectors and their decoder); the top-k
        losses read pi_ref's top-k instead of the teacher's with ``--topk-support ref``."""
        from opdcache.stores import gives, giving

        if gives(teacher_stores, "groups"):
            if not self.aligned:
                from opdcache.errors import ConfigError

                names = [n for n, e in ESTIMATORS.items() if e.aligned]
                raise ConfigError(f"--loss {self.name} needs a teacher that shares the student's tokenizer; this teacher "
                                  f"table has its own (the {giving('groups')} store): use --loss {', '.join(names[:-1])} or {names[-1]}")
            return (giving("sampled_logprob", teacher_stores), giving("groups", teacher_stores)), self.rollout_stores
        if self.span_topk:
            from opdcache.errors import ConfigError

            raise ConfigError(f"--loss {self.name} compares a teacher of another tokenizer with the student: it needs a table "
                              f"scored with `score-teacher --prompts ... --top-k K` (the {giving('groups')} store)")
        if self.ref_support and getattr(cfg, "topk_support", "teacher") == "ref":
            return (giving("sampled_logprob", teacher_stores),), ("base", "ref_topk")
        return tuple(giving(signal, teacher_stores) for signal in self.teacher_reads), self.rollout_stores


def clip_stats(st: dict, mask) -> dict:
    """``clip_fraction``: the share of the tokens in ``mask`` whose term was clipped (a weighted share where ``clipped``
    holds the weights of several teachers' clipped terms); 0 over no tokens."""
    return {"clip_fraction": float((st["clipped"] * mask).sum() / mask.sum().clamp_min(1))}


def group_ends(batch):
    """Each group's last token: where the aligned store's span_tokens is positive (None for one tokenizer)."""
    spans = batch.get("teacher_span_tokens")
    return None if spans is None else spans > 0


def _lightning(cfg, batch, s, s_K, div_N, support):
    from opdcache.training import losses as L

    terms, st = L.lightning_terms(s, batch["teacher_logprobs"], cfg.tau, group_ends(batch))
    return terms, st, clip_stats(st, batch["response_mask"])


def _uld(cfg, batch, s, s_K, div_N, support):
    from opdcache.training import losses as L
    from opdcache.format.schema import PAD_ID

    starts = batch["teacher_span_topk_ids"][..., 0] != PAD_ID
    terms, st = L.uld_terms(s_K, batch["teacher_span_topk_logprobs"], starts,
                            teacher_valid_BTK=batch["teacher_span_topk_ids"] != PAD_ID)
    return terms, st, {}


def _gold(cfg, batch, s, s_K, div_N, support):
    import torch

    from opdcache.training import losses as L
    from opdcache.format.schema import PAD_ID

    starts = batch["teacher_span_topk_ids"][..., 0] != PAD_ID
    shared = (batch["teacher_span_topk_student_ids"] != PAD_ID) & starts[..., None]
    t_lp = batch["teacher_span_topk_logprobs"]
    tail = (1 - torch.where(shared, t_lp.exp(), torch.zeros((), dtype=t_lp.dtype)).sum(-1)).clamp(min=1e-30)
    kl, st = L.topk_terms(s_K, t_lp, "fkl", True, shared, tail)
    kl = torch.where(starts & shared.any(-1), kl, torch.zeros((), dtype=kl.dtype))
    span, _ = L.span_terms(s, batch["teacher_logprobs"], group_ends(batch))
    return kl + span, {"kl": kl.detach()}, {}


def _span(cfg, batch, s, s_K, div_N, support):
    from opdcache.training import losses as L

    ends = group_ends(batch)
    terms, st = L.span_terms(s, batch["teacher_logprobs"], batch["response_mask"].bool() if ends is None else ends)
    return terms, st, {}


def _is(cfg, batch, s, s_K, div_N, support):
    from opdcache.training import losses as L

    terms, st = L.is_terms(s, batch["sampling_logprobs"], batch["teacher_logprobs"], cfg.importance_weights)
    return terms, st, {}


def _ppo(cfg, batch, s, s_K, div_N, support):
    from opdcache.training import losses as L

    terms, st = L.ppo_terms(s, batch["sampling_logprobs"], batch["teacher_logprobs"], batch["ref_logprobs"], cfg.ppo_clip)
    return terms, st, clip_stats(st, batch["response_mask"])


def _mc(cfg, batch, s, s_K, div_N, support):
    from opdcache.training import losses as L

    terms, st = L.mc_terms(s_K, batch["mc_sampling_logprobs"], batch["teacher_mc_logprobs"], cfg.importance_weights)
    return terms, st, {}


def _sampled_fkl(cfg, batch, s, s_K, div_N, support):
    from opdcache.training import losses as L

    terms, st = L.sampled_fkl_terms(s_K, batch["teacher_sampled_logprobs"], batch["teacher_sampled_counts"])
    return terms, st, {}


def _topk(direction: str):
    def terms_of(cfg, batch, s, s_K, div_N, support):
        from opdcache.training import losses as L
        from opdcache.format.schema import PAD_ID

        sel = batch["response_mask"].bool()
        t_lp = batch["teacher_topk_logprobs"] if cfg.topk_support == "teacher" else batch["teacher_ref_topk_logprobs"]
        valid_K = s_K.new_ones(s_K.shape).bool()
        valid_K[sel] = support != PAD_ID  # False at v3 padding slots
        tail = batch.get("teacher_topk_tail") if cfg.topk_support == "teacher" else None
        terms, st = L.topk_terms(s_K, t_lp, direction, cfg.tail, valid_K, tail)
        return terms, st, {}
    return terms_of


def _full(cfg, batch, s, s_K, div_N, support):
    terms = s.new_zeros(s.shape)
    terms[batch["response_mask"].bool()] = div_N.float()
    return terms, {"kl": div_N.detach()}, {}


def _topk_support(cfg, batch, sel):
    return (batch["teacher_topk_ids"] if cfg.topk_support == "teacher" else batch["ref_topk_ids"])[sel]


ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    Estimator("lightning", "papers/000 Alg. 1: the clipped advantage T - s on the sampled tokens (per aligned group "
              "with a teacher of its own tokenizer)", _lightning, online=True, asynchronous=True, aligned=True),
    Estimator("is", "papers/001 eq. 5/7: the advantage recomputed at learner time, importance-weighted", _is,
              online=True, asynchronous=True),
    Estimator("mc", "papers/001 6.1: the is term over the rollouts' m Monte-Carlo samples per position", _mc,
              rollout_stores=("base", "mc"), support=lambda cfg, batch, sel: batch["mc_ids"][sel], asynchronous=True),
    Estimator("ppo", "papers/001 eq. 6: the rollout-time advantage with a clipped ratio", _ppo, asynchronous=True),
    Estimator("topk-fkl", "forward KL on the cached top-k support (--topk-tail: the rest as one bin)", _topk("fkl"),
              teacher_reads=("sampled_logprob", "top_k"), support=_topk_support, ref_support=True, asynchronous=True),
    Estimator("topk-rkl", "reverse KL on the cached top-k support", _topk("rkl"), teacher_reads=("sampled_logprob", "top_k"),
              support=_topk_support, ref_support=True),
    Estimator("sampled-fkl", "RS-KD: an unbiased forward KL from m teacher draws per position", _sampled_fkl,
              teacher_reads=("sampled_logprob", "draws"), support=lambda cfg, batch, sel: batch["teacher_sampled_ids"][sel]),
    Estimator("full-fkl", "papers/002: the exact forward KL over the vocabulary, from the teacher's hidden states", _full,
              teacher_reads=("sampled_logprob", "vectors"), full_vocabulary="fkl", online=True),
    Estimator("full-rkl", "papers/002: the exact reverse KL over the vocabulary", _full, teacher_reads=("sampled_logprob", "vectors"),
              full_vocabulary="rkl", online=True),
    Estimator("jsd", "papers/002: the exact Jensen-Shannon divergence over the vocabulary", _full,
              teacher_reads=("sampled_logprob", "vectors"), full_vocabulary="jsd", online=True),
    Estimator("uld", "ULD: W1 between sorted top-k probabilities where groups start (a teacher with its own tokenizer, "
              "scored with --top-k; pi_ref's cached top-k on the student's side)", _uld, rollout_stores=("base", "ref_topk"),
              support=lambda cfg, batch, sel: batch["ref_topk_ids"][sel], aligned=True, span_topk=True),
    Estimator("gold", "forward KL on the teacher's top-k entries pi_ref shares byte for byte where groups start, plus "
              "span (a teacher with its own tokenizer, scored with --top-k)", _gold,
              support=lambda cfg, batch, sel: batch["teacher_span_topk_student_ids"][sel], aligned=True, span_topk=True),
    Estimator("span", "span log-likelihood matching, (S - T)^2 / 2 per group of tokens both tokenizers cut at the same "
              "byte: for a teacher with its own tokenizer (each token its own group otherwise)", _span, aligned=True),
)}

NAMES = tuple(ESTIMATORS)
ONLINE = tuple(n for n, e in ESTIMATORS.items() if e.online)
ASYNC = tuple(n for n, e in ESTIMATORS.items() if e.asynchronous)
FULL_VOCABULARY = tuple(n for n, e in ESTIMATORS.items() if e.full_vocabulary)
