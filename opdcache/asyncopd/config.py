"""The settings of an async OPD run (``opdcache async``), recorded in ``<out>/run.json`` and checked on resume."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from opdcache.backends.base import SamplingConfig
from opdcache.errors import ConfigError
from opdcache.inputs.prompts import PromptConfig
from opdcache.training.estimators import ASYNC, ESTIMATORS
from opdcache.training.losses import Corrections
from opdcache.training.trainconfig import TrainConfig

EXECUTORS = ("local", "ray")

LEARNER_DEFAULTS = {"loss": "is", "steps": 50, "lr": 1e-5, "checkpoint_every": 1, "kl_coef": 0.0, "pack": False}
"""Where the async learner's defaults differ from `opdcache train`'s: papers/001's unclipped IS estimator, a learner
checkpoint every step (a killed learner redoes no update), no KL penalty (a batch's ref_logprobs are its sampling
snapshot's, not pi_ref's) and padded batches (the learner reads each batch as the rollout worker lands it, padded)."""

LEARNER_SETTINGS = ("model", "loss", "steps", "batch_size", "lr", "tau", "ppo_clip", "importance_weights", "max_grad_norm",
                    "weight_decay", "chunk", "seed", "deterministic", "exact", "checkpoint_every", "progress", "report_to",
                    "lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
"""The learner's settings an async run takes; its others (packing, several teachers, corrections, FSDP, ...) are
offline training's and stay at train's defaults. With ``lora_rank`` the learner trains adapters and publishes them
alone; the rollout worker loads them onto its copy of the frozen base."""


DEFAULT = TrainConfig(model=Path(), cache="", out=Path(), pack=False)  # train's defaults, for what the learner leaves alone


def learner(model: Path | str, **settings) -> TrainConfig:
    """The async learner's settings: ``opdcache train``'s (:class:`TrainConfig`), with the async defaults
    (LEARNER_DEFAULTS) under ``settings``; its cache and out are the run's (AsyncConfig sets them)."""
    return TrainConfig(model=Path(model), cache="", out=Path(), **{**LEARNER_DEFAULTS, **settings})


@dataclass(frozen=True)
class AsyncConfig:
    """One async run: three stages over one cache."""

    learner: TrainConfig
    """The learner's settings, `opdcache train`'s: pi_ref (``model``, which also samples the first batches), the loss,
    steps (also the number of rollout batches), batch size (prompts per batch, one response each), learning rate,
    seed (also of the prompt order and sampling streams), ``exact`` (every stage in the exact arithmetic) and the rest
    of LEARNER_SETTINGS; build it with :func:`learner`. Its cache and out are the run's, and its dtype follows the
    stages' device (float32 on a CPU or exact, else auto)."""
    teacher: Path
    """The teacher the teacher worker scores with: a local Hugging Face directory."""
    prompts: PromptConfig
    """The OPD prompts (read as build-rollouts reads them)."""
    out: Path
    """Run directory (local): run.json, the learner's checkpoint, metrics.jsonl, ledger.jsonl, stage logs, the final model."""
    cache: str | None = None
    """The cache the stages share: a directory or an object-store URL (default: <out>/cache)."""
    staleness: int | None = 1
    """K: the batch the learner consumes at step b + 1 was sampled by snapshot max(0, b - K); 0 is strict synchronous,
    None (--no-refresh) never refreshes (every batch from the initial student: Lightning OPD)."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=1.0, max_new_tokens=64))
    """How the rollout worker samples (temperature, top_p, max_new_tokens, mc_samples; samples must be 1)."""
    top_k: int | None = None
    """topk-fkl: width of the teacher's top-k store."""
    keep_snapshots: bool = False
    """Keep every published snapshot (replay, audits); by default one is deleted once no batch still needs it."""
    executor: str = "local"
    """local (one process per stage) or ray (one Ray task per stage)."""
    gpus_per_stage: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """--executor ray: GPUs reserved by the rollout, teacher and learner stages."""
    ray_address: str | None = None
    """--executor ray: cluster address (default: RAY_ADDRESS, else a local cluster)."""
    device: str = "auto"
    """Device of every stage's models (auto: cuda if present; with --executor ray each task sees its own GPUs)."""
    threads: int | None = None
    """Torch threads per stage (default: the CPUs this process may use, divided among the three stages)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "teacher", Path(self.teacher))
        object.__setattr__(self, "out", Path(self.out))
        run = self.learner
        if not isinstance(run, TrainConfig):
            raise ConfigError(f"AsyncConfig.learner takes a TrainConfig (opdcache.asyncopd.learner(model, ...)), got {type(run).__name__}")
        if run.loss not in ESTIMATORS or not ESTIMATORS[run.loss].asynchronous:
            raise ConfigError(f"--loss must be one of {', '.join(ASYNC)} for an async run, got {run.loss!r} "
                              "(full-vocabulary losses need the teacher's hidden states per batch; train offline for them)")
        if run.kl_coef != 0:
            raise ConfigError(f"the async learner has no KL penalty to pi_ref (a batch's ref_logprobs are its sampling snapshot's), "
                              f"got kl_coef {run.kl_coef}: build the learner with opdcache.asyncopd.learner(), which sets 0")
        others = [f.name for f in fields(TrainConfig) if f.name not in LEARNER_SETTINGS + ("cache", "out", "dtype", "kl_coef")
                  and getattr(run, f.name) != getattr(DEFAULT, f.name)]
        if others:
            raise ConfigError(f"the async learner takes {', '.join(LEARNER_SETTINGS)}; {', '.join(others)} "
                              f"{'is' if len(others) == 1 else 'are'} offline training's (opdcache train): leave at the default")
        if self.staleness is not None and self.staleness < 0:
            raise ConfigError(f"--staleness must be >= 0 (or --no-refresh), got {self.staleness}")
        if run.checkpoint_every < 1:
            raise ConfigError(f"--checkpoint-every must be at least 1, got {run.checkpoint_every}")
        if self.sampling.samples != 1:
            raise ConfigError(f"an async batch holds one response per prompt; got --samples {self.sampling.samples}")
        if "mc" in self.rollout_stores() and not self.sampling.mc_samples:
            raise ConfigError(f"--loss {run.loss} needs --mc-samples M (the m samples per position of papers/001 section 6.1)")
        if self.reads_top_k() and not self.top_k:
            raise ConfigError(f"--loss {run.loss} needs --top-k (the teacher's top-k store)")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"--executor must be local or ray, got {self.executor!r}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {self.threads}")
        object.__setattr__(self, "learner", replace(run, cache=self.cache_root, out=self.out / "learner",
                                                    dtype="float32" if self.device == "cpu" or run.exact else "auto"))

    # ---- derived

    @property
    def cache_root(self) -> str:
        return self.cache if self.cache is not None else str(self.out / "cache")

    def version_for(self, batch: int) -> int:
        """The snapshot that samples batch ``batch``: max(0, b - K); 0 for every batch without refresh."""
        return 0 if self.staleness is None else max(0, batch - self.staleness)

    def needed_snapshot(self, version: int) -> bool:
        """Whether some batch is sampled by snapshot ``version`` (the learner publishes only those)."""
        return self.staleness is not None and 1 <= version <= self.learner.steps - 1 - self.staleness

    def teacher_stores(self) -> tuple[str, ...]:
        """The teacher stores the learner's loss reads (opdcache/training/estimators.py)."""
        return ESTIMATORS[self.learner.loss].stores()[0]

    def reads_top_k(self) -> bool:
        """Whether the learner's loss reads the teacher's top-k (the teacher stage scores it with --top-k)."""
        from opdcache.stores import gives

        return gives(self.teacher_stores(), "top_k")

    def rollout_stores(self) -> tuple[str, ...]:
        """The rollout stores the learner's loss reads: its ``mc`` samples, where it has them."""
        return ESTIMATORS[self.learner.loss].rollout_stores

    # ---- run.json

    def to_json(self) -> dict:
        return json.loads(json.dumps(asdict(self), default=str))

    @classmethod
    def from_json(cls, data: dict) -> "AsyncConfig":
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        prompts = dict(data.pop("prompts"))
        prompts["path"] = Path(prompts["path"])
        run = dict(data.pop("learner"))
        corrections = Corrections(**run.pop("corrections", {}))
        if run.get("teacher_weights") is not None:
            run["teacher_weights"] = tuple(run["teacher_weights"])
        paths = {k: Path(run[k]) for k in ("model", "out", "teacher_model") if run.get(k) is not None}
        return cls(**{**data, "learner": TrainConfig(**{**run, **paths, "corrections": corrections}), "teacher": Path(data["teacher"]),
                      "out": Path(data["out"]), "prompts": PromptConfig(**prompts), "sampling": SamplingConfig(**data["sampling"]),
                      "gpus_per_stage": tuple(data["gpus_per_stage"])})

    def identity(self) -> dict:
        """The settings that decide what the run computes (a resume must keep them); not where or how fast. One flat
        mapping: the run's own settings and the learner's (LEARNER_SETTINGS; its others are train's defaults)."""
        skip = {"progress", "executor", "gpus_per_stage", "ray_address", "threads", "keep_snapshots", "device", "learner"}
        own = {k: v for k, v in self.to_json().items() if k not in skip}
        learner = self.to_json()["learner"]
        learned = {k: learner[k] for k in LEARNER_SETTINGS if k not in ("progress", "report_to") and (k != "exact" or self.learner.exact)
                   and (not k.startswith("lora_") or self.learner.lora_rank)}
        return {**own, **learned}  # exact and LoRA are absent when off: runs from before them keep their identity
