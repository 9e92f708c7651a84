"""Training estimators for on-policy distillation from a cache, and mismatch corrections that compose with them.

Notation (per response token t, all [B, T] unless noted): s_t = log pi_theta(a_t) (student, with gradient),
T_t = teacher log-prob, b_t = sampling log-prob (the distribution a_t was drawn from), r_t = pi_ref log-prob;
sg = stop-gradient; mask = response mask. Every estimator returns per-token terms ``[B, T]`` whose
masked sum, divided once by the number of response tokens, is the loss (:func:`reduce`), so token-level
weights and sequence-level masks from the corrections multiply the terms before the one division.

* lightning (papers/000 Alg. 1):  A_t = clip(T_t - sg(s_t), -tau, tau);  term_t = -A_t * s_t. With a teacher of
  another tokenizer (the aligned store: T_g its log-prob of a group of tokens both tokenizations cut at the same byte,
  S_g = sum of s_t over the group's tokens) every token of group g takes A_t = clip(T_g - sg(S_g), -tau, tau); with
  one tokenizer every token is its own group and this is the line above
* span: (S_g - T_g)^2 / 2 at each group's last token: span log-likelihood matching, which needs no map between the
  two vocabularies. Its gradient (S_g - T_g) grad S_g is lightning's unclipped one on the same sample (the on-policy
  reverse-KL gradient of the spans, papers/000 with groups for tokens)
* uld (Universal Logit Distillation, Boizard et al. 2024, arXiv:2402.12030): at each group's first token, where both
  sides predict from the same text, sum_j |p_(j) - q_(j)| + |r_p - r_q| between the teacher's sorted top-k
  probabilities and the student's on pi_ref's cached top-k ids (r: the mass outside); no vocabulary map
* gold (after the idea of TRL's GOLD trainer; docs/teachers.md says how it differs): at each group's first token, the
  forward KL on the teacher's top-k entries that pi_ref's vocabulary holds with the same bytes (each side's remaining
  mass one tail bin), plus span at each group's last token for what the shared tokens do not cover
* is (papers/001 eq. 5/7, "A_theta, no clip"):  rho_t = exp(s_t - b_t);  term_t = -rho_t * sg(T_t - s_t)
* mc (papers/001 section 6.1): the is term averaged over the m cached samples of each position
* is / mc without importance weights (papers/001 App. F's "no IS" ablation): rho_t replaced by exp(s_t - sg(s_t)),
  which is 1 in value with the gradient of s_t: the score-function surrogate applied to stale samples as if on-policy
* ppo (papers/001 eq. 6, "A_old, clip"): A_t = T_t - r_t with r_t the rollout policy's temperature-1 log-prob
  (held fixed: the advantage as it was at rollout time); term_t = -min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t)
* topk_fkl / topk_rkl: KL on a cached top-k support, both distributions renormalised on it, optionally with the
  remaining mass as one extra "tail" bin (a v3 compact store's padded slots hold no mass; its stored tail is the
  teacher's tail bin)
* sampled_fkl (RS-KD, arXiv 2503.16870): with counts c_v of m teacher draws at a position,
  term_t = (1/m) sum_v c_v (log p_v - log q_v): an unbiased estimate of KL(p || q) whose gradient is the full
  forward-KL gradient in expectation (opdcache/stores/sampled.py)
* full_fkl / full_rkl / jsd: exact full-vocabulary divergences, see opdcache/logits/divergence.py

KL penalty to pi_ref (papers/000 section 3.3 keeps the student near pi_ref with "standard KL regularization"):
the cached rollouts are pi_ref's samples, so the penalty estimates KL(pi_ref || pi_theta) = E_ref[r - s] per token
from l_t = s_t - r_t:  k1 = -l (unbiased, high variance), k3 = exp(l) - 1 - l (unbiased, non-negative, low variance:
E_ref[exp(l)] = 1; the form verl calls low_var_kl), k2 = l^2 / 2 (biased, the squared-log-ratio penalty). k1 and k3
have the same expected gradient, -E_ref[grad s]; l is clamped to [-20, 20] inside k3 so one far-off token cannot overflow,
and each term is capped at --kl-cap (default 10 nats, verl's clamp) so one token cannot outweigh a batch.
The online baseline samples the current student instead, and uses the forms for samples from pi_theta (what verl and
TRL compute): k1 = l, k2 = l^2 / 2, k3 = exp(-l) - 1 + l. Its k3 has the same expected gradient as the cached one,
E_theta[(1 - exp(-l)) grad s] = -E_ref[grad s] = grad KL(pi_ref || pi_theta), so online and offline runs with the
same --kl-coef are pulled toward pi_ref by the same force.

Corrections (papers/003 section 4.2, papers/004 section 3.2), with log ratio l_t = r_train_t - r_rollout_t:

* token_tis:  weight_t = min(exp(l_t), C)
* seq_reject: drop a sequence when sum_t K(l_t) > threshold, K1(l) = -l, K3(l) = exp(l) - 1 - l
* trust_band: geometric-mean ratios per sequence: mismatch w = exp(mean_t l_t) capped at C, and proximal
  rho = exp(mean_t (s_t - r_train_t)); a sequence whose mean advantage is >= 0 is kept when rho <= 1 + eps_high,
  one with a negative mean advantage when 1 - eps_low <= rho <= dual_clip (dual clipping of negative samples);
  kept sequences are weighted by w. Defaults are papers/004's (App. B): eps_low 3e-4, eps_high 4e-4, dual clip
  1 + 7e-4, cap 2. These bands are on geometric-mean ratios and are tight: here the proximal ratio is against the
  trainer-side pi_ref (the policy the cache was sampled from), so once the student has moved by more than ~4e-4
  nats per token on a sequence, that sequence is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# the estimators by name, what each reads and how a batch becomes its terms: opdcache/training/estimators.py


KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty_terms(s: torch.Tensor, r: torch.Tensor, estimator: str, samples: str = "ref", cap: float = 0.0) -> torch.Tensor:
    """Per-token KL penalty between pi_theta and pi_ref, differentiable through s. [B, T]

    ``samples="ref"``: the tokens are pi_ref's samples (the cache): estimates of KL(pi_ref || pi_theta).
    ``samples="student"``: the tokens are the current student's (the online baseline): the forms for pi_theta's samples.
    ``cap`` > 0: each term clamped to [-cap, cap] (verl clamps its low-variance KL at 10); a clamped term has no gradient.
    """
    terms = _kl_terms(s, r, estimator, samples)
    return terms.clamp(-cap, cap) if cap > 0 else terms


def _kl_terms(s: torch.Tensor, r: torch.Tensor, estimator: str, samples: str) -> torch.Tensor:
    l = s - r.detach()
    if samples not in ("ref", "student"):
        raise ValueError(f"samples must be 'ref' or 'student', got {samples!r}")
    sign = 1.0 if samples == "ref" else -1.0  # the ratio that has expectation 1 under the sampling policy: exp(sign * l)
    if estimator == "k1":
        return -sign * l
    if estimator == "k2":
        return 0.5 * l * l
    if estimator == "k3":
        l = (sign * l).clamp(-20.0, 20.0)
        return torch.exp(l) - 1 - l
    raise ValueError(f"--kl-estimator must be one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")


def reduce(terms: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """sum(terms * mask * weights) / number of response tokens (the mask's sum, before any rejection). Positions with
    weight 0 contribute exactly 0, whatever their term holds (a NaN or inf there is selected away, not multiplied)."""
    w = mask if weights is None else mask * weights
    return torch.where(w != 0, terms * w, torch.zeros_like(terms)).sum() / mask.sum().clamp_min(1)


def lightning_terms(s: torch.Tensor, teacher: torch.Tensor, tau: float, ends: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """With ``ends`` (a teacher with its own tokenizer): the advantage of each token is its group's, T_g - sg(S_g)."""
    adv = teacher - s.detach() if ends is None else span_sums(teacher, ends) - span_sums(s.detach(), ends)
    clipped = adv.clamp(-tau, tau)
    return -clipped * s, {"advantage": adv, "clipped": (adv.abs() > tau).float()}


def span_sums(x_BT: torch.Tensor, ends_BT: torch.Tensor) -> torch.Tensor:
    """[B, T]: for each token, the sum of ``x`` over its group: the tokens after the previous group end up to and
    including the next one (``ends_BT`` marks each group's last token); 0 after a row's last end. Summed within each
    group (a scatter, not a difference of running sums, so a long row loses no precision)."""
    ends = ends_BT.bool()
    group_BT = (ends.long().cumsum(1) - ends.long())  # the group a token belongs to: the ends before it
    closed = group_BT < ends.long().sum(1, keepdim=True)  # tokens after the last end belong to no group
    T = x_BT.shape[1]
    sums = x_BT.new_zeros(x_BT.shape[0], T + 1).scatter_add(1, torch.where(closed, group_BT, T), x_BT)
    return torch.where(closed, sums.gather(1, group_BT.clamp(max=T)), torch.zeros((), dtype=x_BT.dtype, device=x_BT.device))


def uld_terms(student_BTK: torch.Tensor, teacher_BTK: torch.Tensor, at_BT: torch.Tensor,
              student_valid_BTK: torch.Tensor | None = None, teacher_valid_BTK: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """ULD at the positions ``at_BT``: the Wasserstein-1 distance between the two sorted probability vectors (each
    side's own support, so no map between vocabularies), with each side's remaining mass as one more entry:
    sum_j |p_(j) - q_(j)| + |r_p - r_q|, the shorter vector padded with zeros. ``*_valid_BTK``: False at padding slots."""
    def sorted_probs(lp, valid):
        p = lp.exp() if valid is None else torch.where(valid, lp.exp(), torch.zeros((), dtype=lp.dtype, device=lp.device))
        return p.sort(-1, descending=True).values

    p, q = sorted_probs(teacher_BTK.detach(), teacher_valid_BTK), sorted_probs(student_BTK, student_valid_BTK)
    K = max(p.shape[-1], q.shape[-1])
    p, q = torch.nn.functional.pad(p, (0, K - p.shape[-1])), torch.nn.functional.pad(q, (0, K - q.shape[-1]))
    rest_p, rest_q = (1 - p.sum(-1)).clamp(min=0), (1 - q.sum(-1)).clamp(min=0)
    w1 = (p - q).abs().sum(-1) + (rest_p - rest_q).abs()
    terms = torch.where(at_BT.bool(), w1, torch.zeros((), dtype=w1.dtype, device=w1.device))
    return terms, {"kl": terms.detach()}


def span_terms(s: torch.Tensor, teacher: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Span log-likelihood matching: at each group's last token, (S_g - T_g)^2 / 2 with S_g the student's log-prob of
    the group (the sum of s over its tokens) and T_g the teacher's; 0 inside a group."""
    gap = span_sums(s, ends) - span_sums(teacher, ends)
    terms = torch.where(ends.bool(), 0.5 * gap ** 2, torch.zeros((), dtype=s.dtype, device=s.device))
    return terms, {"advantage": -gap.detach()}


def _ratio(s: torch.Tensor, sampling: torch.Tensor, weighted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the factor multiplying the advantage, the old-to-current ratio pi_theta / pi_old it stands for)."""
    rho = torch.exp(s - sampling)
    return (rho if weighted else torch.exp(s - s.detach())), rho.detach()


def is_terms(s: torch.Tensor, sampling: torch.Tensor, teacher: torch.Tensor, weighted: bool = True) -> tuple[torch.Tensor, dict]:
    """papers/001 eq. 7, L_theta^noclip: A_theta recomputed at learner time, unclipped old-to-current weight."""
    factor, rho = _ratio(s, sampling, weighted)
    adv = (teacher - s).detach()
    return -factor * adv, {"advantage": adv, "rho": rho}


def mc_terms(s_BTM: torch.Tensor, sampling_BTM: torch.Tensor, teacher_BTM: torch.Tensor, weighted: bool = True) -> tuple[torch.Tensor, dict]:
    """papers/001 eq. 15: the is term over the m cached samples of each position, averaged."""
    factor, rho = _ratio(s_BTM, sampling_BTM, weighted)
    adv = (teacher_BTM - s_BTM).detach()
    return (-factor * adv).mean(-1), {"advantage": adv.mean(-1), "rho": rho.mean(-1)}


def ppo_terms(s: torch.Tensor, sampling: torch.Tensor, teacher: torch.Tensor, rollout: torch.Tensor, eps: float) -> tuple[torch.Tensor, dict]:
    """papers/001 eq. 6, L_old^clip: the rollout-time advantage A_old = T - r_old, PPO's clipped ratio."""
    rho = torch.exp(s - sampling)
    adv = (teacher - rollout).detach()
    clipped = rho.clamp(1 - eps, 1 + eps)
    terms = -torch.minimum(rho * adv, clipped * adv)
    return terms, {"advantage": adv, "rho": rho.detach(), "clipped": (rho.detach() - clipped.detach()).abs().gt(0).float()}


PAD_LOGPROB = -1e4
"""What a padded support slot's log-prob becomes before an estimator sees it: finite (no inf - inf), and exp() of it
is exactly 0 in float32, so the slot holds no mass and passes no gradient."""


def _support_logprobs(lp_BTK: torch.Tensor, tail: bool, stored_tail: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probs on the support, renormalised; with ``tail`` the leftover mass is appended as one more bin (the
    ``stored_tail`` mass when the cache has it: a compact top-k's, computed before rounding)."""
    if not tail:
        return lp_BTK - torch.logsumexp(lp_BTK, -1, keepdim=True)
    if stored_tail is not None:
        bins = torch.cat([lp_BTK, torch.log(stored_tail.clamp(min=1e-30))[..., None]], -1)
        return bins - torch.logsumexp(bins, -1, keepdim=True)  # float16 rounding of the kept entries moves a little mass
    # the leftover mass log(1 - exp(mass)) as log(-expm1(mass)): exact where the support holds nearly all the mass (1 -
    # exp(mass) would round there, and a floor at 1e-6 understated the KL where a side's tail is below it); bounded
    # only at the smallest normal float, where the tail underflows the dtype itself
    mass = torch.logsumexp(lp_BTK, -1, keepdim=True).clamp(max=0)
    tiny = torch.finfo(lp_BTK.dtype).tiny
    rest = torch.log(torch.clamp(-torch.expm1(mass), min=tiny))
    return torch.cat([lp_BTK, rest], -1)


def topk_terms(student_BTK: torch.Tensor, teacher_BTK: torch.Tensor, direction: str, tail: bool = False,
               valid_BTK: torch.Tensor | None = None, teacher_tail_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """KL on the cached top-k support. student/teacher: log-probs at the support ids (full-vocabulary log-probs).
    ``valid_BTK``: False at a compact store's padding slots, which then hold no mass on either side.
    ``teacher_tail_BT``: the stored teacher tail mass (compact store), used as the teacher's tail bin."""
    if valid_BTK is not None:
        student_BTK = student_BTK.masked_fill(~valid_BTK, PAD_LOGPROB)
        teacher_BTK = teacher_BTK.masked_fill(~valid_BTK, PAD_LOGPROB)
    lq = _support_logprobs(student_BTK, tail)
    lp = _support_logprobs(teacher_BTK.detach(), tail, teacher_tail_BT)
    if direction == "fkl":
        kl = (lp.exp() * (lp - lq)).sum(-1)
    elif direction == "rkl":
        kl = (lq.exp() * (lq - lp)).sum(-1)
    else:
        raise ValueError(f"direction must be fkl or rkl, got {direction!r}")
    return kl, {"kl": kl.detach()}


def sampled_fkl_terms(student_BTM: torch.Tensor, teacher_BTM: torch.Tensor, counts_BTM: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """RS-KD's forward KL from m teacher draws: (1/m) sum_v c_v (log p_v - log q_v) per position. student/teacher:
    log-probs at the distinct drawn ids; counts 0 at padding (those slots contribute nothing).

    Also its standard error per position, "stderr" = sqrt(s^2 / m) with s^2 the unbiased variance of the m draws'
    log p - log q (0 where m = 1): the spread of the estimate this store buys for its bytes, logged by train."""
    c = counts_BTM.to(student_BTM.dtype)
    m = c.sum(-1, keepdim=True).clamp(min=1)
    diff = torch.where(c > 0, teacher_BTM.detach() - student_BTM, torch.zeros_like(student_BTM))
    kl = (c / m * diff).sum(-1)
    with torch.no_grad():
        dev = torch.where(c > 0, diff.detach() - kl.detach()[..., None], torch.zeros_like(diff))
        var = (c * dev * dev).sum(-1) / (m[..., 0] - 1).clamp(min=1)
        stderr = torch.sqrt(var / m[..., 0])
    return kl, {"kl": kl.detach(), "stderr": stderr}


@dataclass(frozen=True)
class Corrections:
    """Training-inference mismatch corrections; all off by default."""

    tis_cap: float | None = None
    """Token-level truncated importance weight min(exp(r_train - r_rollout), C) (papers/003 TIS)."""
    reject_k: str | None = None
    """Sequence-level rejection on K1 or K3 of the mismatch ratio: 'k1' or 'k3' (papers/003 section 4.2)."""
    reject_threshold: float = 1.0
    """Drop a sequence when its summed K exceeds this."""
    trust_band: bool = False
    """Sequence-level geometric-mean trust band with dual clipping for negative advantages (papers/004 TBPO)."""
    band_low: float = 3e-4
    """Trust band: eps_low, negative samples need rho >= 1 - eps_low (papers/004 App. B: seq/neg_seq_clip_ratio_low 3e-4)."""
    band_high: float = 4e-4
    """Trust band: eps_high, positive samples need rho <= 1 + eps_high (papers/004 App. B: seq_clip_ratio_high 4e-4)."""
    dual_clip: float = 1.0007
    """Trust band: upper bound on rho for negative samples (papers/004 App. B: 1 + neg_seq_clip_ratio_high 7e-4)."""
    band_cap: float = 2.0
    """Trust band: cap C of the sequence-level mismatch weight (papers/004 App. B: seq_tis_imp_ratio_cap 2)."""

    def __post_init__(self) -> None:
        from opdcache.errors import ConfigError

        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ConfigError(f"--tis-cap must be positive, got {self.tis_cap}")
        if self.reject_k not in (None, "k1", "k3"):
            raise ConfigError(f"--reject-k must be k1 or k3, got {self.reject_k!r}")
        if self.dual_clip <= 1 + self.band_high:
            raise ConfigError(f"--dual-clip must exceed 1 + band_high = {1 + self.band_high}, got {self.dual_clip}")

    @property
    def active(self) -> bool:
        return self.tis_cap is not None or self.reject_k is not None or self.trust_band


def k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return -log_ratio


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio) - 1 - log_ratio


def token_tis_weight(r_train: torch.Tensor, r_rollout: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.exp(r_train - r_rollout).clamp(max=cap).detach()


def sequence_reject_mask(r_train: torch.Tensor, r_rollout: torch.Tensor, mask: torch.Tensor, which: str, threshold: float) -> torch.Tensor:
    """[B] 1.0 for kept sequences, 0.0 for sequences whose summed K1/K3 of the mismatch exceeds ``threshold``."""
    k = (k1 if which == "k1" else k3)(r_train - r_rollout)
    return ((k * mask).sum(-1) <= threshold).float()


def trust_band_weights(s: torch.Tensor, r_train: torch.Tensor, r_rollout: torch.Tensor, advantage: torch.Tensor, mask: torch.Tensor,
                       c: Corrections) -> tuple[torch.Tensor, dict]:
    """[B] sequence weights: 0 outside the band, else the capped geometric-mean mismatch weight."""
    n = mask.sum(-1).clamp_min(1)
    w = torch.exp(((r_train - r_rollout) * mask).sum(-1) / n).clamp(max=c.band_cap)
    rho = torch.exp(((s.detach() - r_train) * mask).sum(-1) / n)
    adv = (advantage * mask).sum(-1) / n
    keep_pos = (adv >= 0) & (rho <= 1 + c.band_high)
    keep_neg = (adv < 0) & (rho >= 1 - c.band_low) & (rho <= c.dual_clip)
    keep = (keep_pos | keep_neg).float()
    return (keep * w).detach(), {"band_kept": keep, "seq_mismatch_weight": w, "seq_ratio": rho}


def correction_weights(c: Corrections, s: torch.Tensor, r_train: torch.Tensor, r_rollout: torch.Tensor, advantage: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """[B, T] weights multiplying the estimator's terms, and what they did."""
    weights = torch.ones_like(mask)
    stats: dict = {}
    if c.tis_cap is not None:
        w = token_tis_weight(r_train, r_rollout, c.tis_cap)
        weights = weights * w
        stats["tis_clip_fraction"] = ((torch.exp(r_train - r_rollout) > c.tis_cap).float() * mask).sum() / mask.sum().clamp_min(1)
    if c.reject_k is not None:
        keep = sequence_reject_mask(r_train, r_rollout, mask, c.reject_k, c.reject_threshold)
        weights = weights * keep[:, None]
        stats["rejected_fraction"] = 1 - keep.mean()
    if c.trust_band:
        w, band = trust_band_weights(s, r_train, r_rollout, advantage, mask, c)
        weights = weights * w[:, None]
        stats["band_rejected_fraction"] = 1 - band["band_kept"].mean()
    return weights, stats
