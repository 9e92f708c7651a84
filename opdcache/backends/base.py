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


def row_uniforms(seed: int, row_id: str, tokens: int, draws: int) -> np.ndarray:
    """[tokens, draws] float64 uniforms in [0, 1) for one scored row's draws (``ScoreRequest.uniforms``): a function of
    (seed, row id) only, so the draws are reproducible and batch-invariant."""
    import hashlib

    key = int.from_bytes(hashlib.sha256(f"{seed}:{row_id}".encode()).digest()[:8], "little")
    return np.random.default_rng(key).random((tokens, draws))


@dataclass(frozen=True)
class Statistic:
    """One per-position number (or vector) an engine computes for a scored sequence: at every response position t,
    from the scoring model's next-token distribution p there at temperature 1, aligned with the response ids. Stores ask
    for statistics by name (``Store.needs``); engines say which they compute (``Capabilities.statistics``);
    :class:`Scores` carries them by name."""

    name: str
    shape: str
    """Its shape for a sequence of T response tokens ([T], [T, k], ...)."""
    doc: str
    kind: str
    """How an engine's flat values become a sequence's: "logprob" (float32, clamped at 0: rounding can leave +1e-7),
    "ids" (int32), "float32", "float64", "tensor" (a torch tensor kept as it is: hidden states)."""
    source: str
    """What an engine needs to compute it: "logits" (any scorer), "full_distribution" (the whole next-token
    distribution at every position), "hidden_states" (the final post-norm hidden state), "candidates" (log-probs at
    given ids), "log_partition" (the logsumexp, which a served engine does not return)."""
    on_reference: bool = False
    """A store made from it alone is scored on the reference engine when the chosen one does not compute it (with a
    note), instead of being refused."""


STATISTICS: dict[str, Statistic] = {s.name: s for s in (
    Statistic("logprobs", "[T]", "log p(a_t), the scored token's log-prob", "logprob", "logits"),
    Statistic("logsumexp", "[T]", "the log-partition log sum_v exp(z_v) of the logits", "float32", "log_partition"),
    Statistic("topk_ids", "[T, k]", "the k most likely ids under p, most likely first", "ids", "logits"),
    Statistic("topk_logprobs", "[T, k]", "the log-probs of the k most likely ids", "logprob", "logits"),
    Statistic("ref_topk_logprobs", "[T, k_ref]", "log p at ScoreRequest.ref_topk_ids (pi_ref's top-k)", "logprob", "candidates"),
    Statistic("mc_logprobs", "[T, m]", "log p at ScoreRequest.mc_ids (the rollouts' MC draws)", "logprob", "candidates"),
    Statistic("sampled_ids", "[T, D]", "D draws from p for ScoreRequest.uniforms, in their order", "ids", "full_distribution"),
    Statistic("sampled_logprobs", "[T, D]", "log p of those draws", "logprob", "full_distribution"),
    Statistic("entropy", "[T]", "the teacher's full-distribution entropy -E_p[log p]", "float64", "full_distribution"),
    Statistic("variance", "[T]", "Var_p[log p]", "float64", "full_distribution"),
    Statistic("rounding_kl", "[T]", "KL(p || p from the hidden states rounded to the stored dtype)", "float64", "full_distribution"),
    Statistic("hidden", "[T, H]", "the final post-norm hidden states", "tensor", "hidden_states", on_reference=True),
)}
"""Every statistic an engine can be asked for, by name: a store needing a new one adds it here and to the engines that
compute it (one place each: where their per-position values are collected)."""


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
    statistics: frozenset[str] = frozenset()
    """The statistics it computes when scoring (names in :data:`STATISTICS`; built with :func:`statistics`): a store's
    ``needs`` are checked against them before any model loads."""
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
    monte_carlo: bool = True
    """It draws extra next-token samples at every position while generating (--mc-samples)."""
    reference: bool = False
    """It is the reference: it runs any stored table's arithmetic that another engine cannot (hidden states for an
    engine that has none), and its float32 tables are what others are compared with."""

    def missing(self, names) -> list[str]:
        """Those of the statistics ``names`` it does not compute, in order."""
        return [n for n in names if n not in self.statistics]


def statistics(*sources: str, but: tuple[str, ...] = ()) -> frozenset[str]:
    """The statistics whose source is one of ``sources`` ("logits", "log_partition", "candidates",
    "full_distribution", "hidden_states"), less ``but``: an engine's ``Capabilities.statistics``."""
    return frozenset(n for n, s in STATISTICS.items() if s.source in sources and n not in but)


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


class Scores:
    """Scorer values for one sequence, by statistic name (:data:`STATISTICS`): ``scores.logprobs``; a statistic the
    engine did not compute reads None (and ``name in scores`` is False)."""

    __slots__ = ("_values",)

    def __init__(self, **values) -> None:
        unknown = set(values) - set(STATISTICS)
        if unknown:
            raise TypeError(f"unknown statistics {sorted(unknown)}; add them to opdcache.backends.base.STATISTICS")
        object.__setattr__(self, "_values", {k: v for k, v in values.items() if v is not None})

    def __getattr__(self, name: str):
        if name in STATISTICS:
            return self._values.get(name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value) -> None:
        if name not in STATISTICS:
            raise AttributeError(f"unknown statistic {name!r}; add it to opdcache.backends.base.STATISTICS")
        if value is None:
            self._values.pop(name, None)
        else:
            self._values[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def __repr__(self) -> str:
        return "Scores(" + ", ".join(sorted(self._values)) + ")"


def _finished(kind: str, values):
    if kind == "logprob":
        return values.clamp(max=0).numpy()
    if kind == "ids":
        return values.numpy().astype(np.int32)
    if kind == "float64":
        return values.double().numpy()
    if kind == "tensor":
        return values.clone()
    return values.numpy()


def split_scores(cat: dict, lengths: Sequence[int]) -> list[Scores]:
    """Per-sequence Scores from an engine's flat per-position values: torch tensors over the N = sum(lengths) scored
    positions, keyed by statistic name ([N], [N, k], ...), each finished as its :data:`STATISTICS` kind says."""
    kinds = {name: STATISTICS[name].kind for name in cat}  # an unknown name is a KeyError here, in the engine's test
    result, offset = [], 0
    for T in lengths:
        sl = slice(offset, offset + T)
        result.append(Scores(**{name: _finished(kinds[name], values[sl]) for name, values in cat.items()}))
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
