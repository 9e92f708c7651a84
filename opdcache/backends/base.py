"""The contract every engine meets: generate with log-probs, and score given token ids.

Column meanings are fixed here, whatever the engine (opdcache/format/schema.py documents them):

* ``sampling_logprobs``: log q(a_t), q = softmax(logits / temperature) restricted to the top-p nucleus and
  renormalised -- the distribution the token was actually drawn from (0 for greedy decoding);
* ``ref_logprobs``, teacher ``logprobs``: log softmax(logits)[a_t] at temperature 1, no top-p;
* top-k values are temperature-1 log-probs, most likely first; MC samples are drawn from q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from opdcache.errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled."""

    temperature: float = 0.8
    """Softmax temperature of the sampling distribution (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold: sample from the smallest set of tokens whose probability reaches it."""
    max_new_tokens: int = 256
    """Maximum response length in tokens; a longer response is cut here, with finish_reason 'length'."""
    samples: int = 1
    """Samples per prompt."""
    seed: int = 0
    """Seed; each sample has its own random stream derived from (seed, prompt, sample index)."""
    ref_top_k: int | None = None
    """Store pi_ref's top-k at each position (temperature 1). Default: none (not stored)."""
    mc_samples: int | None = None
    """Extra next-token samples per position from the sampling distribution, not rolled out (papers/001 section
    6.1). Default: none (not stored)."""

    def __post_init__(self) -> None:
        if not 0 <= self.temperature <= 10:
            raise ConfigError(f"--temperature must be between 0 and 10, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.samples < 1:
            raise ConfigError(f"--samples must be at least 1, got {self.samples}")
        if self.ref_top_k is not None and not 1 <= self.ref_top_k <= 1024:
            raise ConfigError(f"--ref-top-k must be between 1 and 1024, got {self.ref_top_k}")
        if self.mc_samples is not None and not 1 <= self.mc_samples <= 256:
            raise ConfigError(f"--mc-samples must be between 1 and 256, got {self.mc_samples}")


@dataclass(frozen=True)
class Capabilities:
    """What an engine computes, declared once by its module (``CAPABILITIES``) and read by every check, before any
    model loads or any file is written: nothing outside ``opdcache/backends/`` asks which engine it has."""

    summary: str
    """What it is, in a few words (``--backend``'s help)."""
    generates: bool = True
    """It samples rollouts (build-rollouts, build-sft)."""
    scores: bool = True
    """It scores given token ids (score-teacher)."""
    full_distribution: bool = False
    """It streams the whole next-token distribution at every position: the exact log-partition, the entropy and
    moments of the fidelity record, teacher draws (the stores that declare ``full_distribution``)."""
    hidden_states: bool = False
    """It returns the final post-norm hidden state (the hidden and svd stores, and the svd fit)."""
    candidate_logprobs_vocab: int | None = None
    """The largest vocabulary at which it returns log-probs at given ids (pi_ref's top-k, the MC ids); None: any."""
    max_top_k: int | None = None
    """The largest top-k it returns (None: any)."""
    batch_size_changes_bits: bool = True
    """Its generation batch size (``--batch-size``) changes the last bits of what it stores: recorded in the config
    fingerprint, so a resume must keep it. False for batch-invariant arithmetic, and for engines whose batching is
    their scheduler's, not a setting."""
    quantization: str = "none"
    """Which --quantize it takes: "emulated" (opdcache's schemes on a transformers model, opdcache/backends/quant.py,
    checked against the model's config before it loads), "engine" (the engine's own methods, checked by it), "none"."""
    exact_arithmetic: bool = False
    """It computes in one exact arithmetic (papers/003): the same bits whatever the batch, padding or KV cache."""
    max_temperature: float | None = None
    """The hottest sampling temperature it accepts (None: any the settings allow)."""
    log_partition: bool = True
    """It returns the teacher's log-partition at each position (the logsumexp column; a table without it says so)."""
    monte_carlo: bool = True
    """It draws extra next-token samples at every position while generating (--mc-samples)."""
    reference: bool = False
    """It is the reference: it runs any stored table's arithmetic that another engine cannot (hidden states for an
    engine that has none), and its float32 tables are what others are compared with."""


@dataclass
class Generation:
    """One sampled response with its per-token values (arrays of length T, or [T, k] / [T, m])."""

    response_ids: np.ndarray
    finish_reason: str
    sampling_logprobs: np.ndarray
    ref_logprobs: np.ndarray
    ref_topk_ids: np.ndarray | None = None
    ref_topk_logprobs: np.ndarray | None = None
    mc_ids: np.ndarray | None = None
    mc_sampling_logprobs: np.ndarray | None = None


@dataclass(frozen=True)
class GenerateRequest:
    prompt_ids: Sequence[int]
    seed: int  # the sample's own random stream


@dataclass(frozen=True)
class ScoreRequest:
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    ref_topk_ids: np.ndarray | None = None  # [T, k]: also return the scorer's log-probs at these ids
    mc_ids: np.ndarray | None = None  # [T, m]
    uniforms: np.ndarray | None = None  # [T, D] float64 in [0, 1): draw D tokens per position from the scorer (sampled store)


@dataclass
class Scores:
    """Scorer values for one sequence, all at temperature 1, aligned with response_ids."""

    logprobs: np.ndarray  # [T]
    logsumexp: np.ndarray  # [T]
    topk_ids: np.ndarray | None = None  # [T, k]
    topk_logprobs: np.ndarray | None = None
    ref_topk_logprobs: np.ndarray | None = None  # [T, k_ref]
    mc_logprobs: np.ndarray | None = None  # [T, m]
    sampled_ids: np.ndarray | None = None  # [T, D]: the draws for ScoreRequest.uniforms, in their order
    sampled_logprobs: np.ndarray | None = None  # [T, D]
    hidden: object | None = None  # torch.Tensor [T, H] in the model's dtype (or the dtype score() was asked to round to)
    entropy: np.ndarray | None = None  # [T] float64: the full distribution's entropy (engines that stream the vocabulary)
    variance: np.ndarray | None = None  # [T] float64: Var_p[log p]
    rounding_kl: np.ndarray | None = None  # [T]: KL(p || p from the hidden states rounded to the stored dtype)


def split_scores(cat: dict, lengths: Sequence[int], top_k: int | None, hidden_NH=None) -> list[Scores]:
    """Per-sequence Scores from an engine's flat per-position values (torch tensors over the N = sum(lengths) scored
    positions): "lp" [N], "lse" [N], and where present "kid"/"klp" [N, k], "rk" [N, k_ref], "mc" [N, m], "sid"/"slp"
    [N, D], "ent"/"var"/"rkl" [N] (opdcache/format/fidelity.py); ``hidden_NH`` [N, H] when the hidden store is wanted. Log-probs
    are clamped at 0 (rounding can leave +1e-7)."""
    result, offset = [], 0
    for T in lengths:
        sl = slice(offset, offset + T)
        sc = Scores(logprobs=cat["lp"][sl].clamp(max=0).numpy(), logsumexp=cat["lse"][sl].numpy())
        if top_k:
            sc.topk_ids = cat["kid"][sl].numpy().astype(np.int32)
            sc.topk_logprobs = cat["klp"][sl].clamp(max=0).numpy()
        if "rk" in cat:
            sc.ref_topk_logprobs = cat["rk"][sl].clamp(max=0).numpy()
        if "mc" in cat:
            sc.mc_logprobs = cat["mc"][sl].clamp(max=0).numpy()
        if "sid" in cat:
            sc.sampled_ids, sc.sampled_logprobs = cat["sid"][sl].numpy(), cat["slp"][sl].clamp(max=0).numpy()
        if "ent" in cat:
            sc.entropy, sc.variance = cat["ent"][sl].double().numpy(), cat["var"][sl].double().numpy()
        if "rkl" in cat:
            sc.rounding_kl = cat["rkl"][sl].double().numpy()
        if hidden_NH is not None:
            sc.hidden = hidden_NH[sl].clone()
        result.append(sc)
        offset += T
    return result


def split_generations(stacked: dict, n_tokens, done, s: SamplingConfig) -> list[Generation]:
    """Per-sequence Generations from an engine's per-step values stacked [B, steps, ...] ("tok", "slp", "rlp", and with
    --ref-top-k "kid"/"klp", with --mc-samples "mid"/"mlp"), each row cut at its own length ``n_tokens[b]``."""
    out = []
    for b in range(len(n_tokens)):
        T = int(n_tokens[b])
        g = Generation(response_ids=stacked["tok"][b, :T].astype(np.int32), finish_reason="stop" if done[b] else "length",
                       sampling_logprobs=stacked["slp"][b, :T].astype(np.float32),
                       ref_logprobs=np.minimum(stacked["rlp"][b, :T], 0).astype(np.float32))
        if s.ref_top_k:
            g.ref_topk_ids = stacked["kid"][b, :T].astype(np.int32)
            g.ref_topk_logprobs = np.minimum(stacked["klp"][b, :T], 0).astype(np.float32)
        if s.mc_samples:
            g.mc_ids = stacked["mid"][b, :T].astype(np.int32)
            g.mc_sampling_logprobs = stacked["mlp"][b, :T].astype(np.float32)
        out.append(g)
    return out


class Backend(Protocol):
    """An engine. Its facts (``version``, ``vocab_size``, ``max_length``, ``hidden_size``, :meth:`model_info`) are known
    when it is built; its weights may load only on first use or :meth:`load`, so a job that finds its work done by
    those facts never loads them."""

    name: str
    version: str
    vocab_size: int
    max_length: int
    hidden_size: int

    def load(self) -> None: ...

    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingConfig) -> list[Generation]: ...

    def score(self, requests: Sequence[ScoreRequest], top_k: int | None = None, hidden: bool = False,
              hidden_dtype: str | None = None) -> list[Scores]: ...

    def model_info(self) -> dict: ...

    def close(self) -> None: ...
