"""The settings of an async OPD run (``opdcache async``), recorded in ``<out>/run.json`` and checked on resume."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from opdcache.estimators import ASYNC, ESTIMATORS
from opdcache.backends.base import SamplingConfig
from opdcache.errors import ConfigError
from opdcache.prompts import PromptConfig
from opdcache.trainconfig import TrainConfig

EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class AsyncConfig:
    """One async run: three stages over one cache."""

    model: Path
    """The initial student (pi_ref): a local Hugging Face directory."""
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
    None never refreshes (every batch from the initial student: Lightning OPD)."""
    steps: int = 50
    """Learner updates; also the number of rollout batches (shards)."""
    batch_size: int = 16
    """Prompts per batch (one response each), as in `train --online`."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=1.0, max_new_tokens=64))
    """How the rollout worker samples (temperature, top_p, max_new_tokens, mc_samples; samples must be 1)."""
    loss: str = "is"
    """is (A_theta, unclipped IS; papers/001 eq. 7), mc (m samples, eq. 15), ppo (A_old, clipped; eq. 6), topk-fkl
    (forward KL on the teacher's top-k; Finding 1) or lightning."""
    importance_weights: bool = True
    """is/mc: weight by pi_theta / pi_old; off is papers/001's no-IS ablation."""
    top_k: int | None = None
    """topk-fkl: width of the teacher's top-k store."""
    lr: float = 1e-5
    """Learner AdamW learning rate (constant)."""
    tau: float = TrainConfig.tau
    """lightning: advantage clip (train's default)."""
    ppo_clip: float = 0.2
    """ppo: clip range of the ratio."""
    max_grad_norm: float = 1.0
    """Learner gradient clipping."""
    weight_decay: float = 0.1
    """Learner AdamW weight decay."""
    chunk: int = 8192
    """Vocabulary slice width of the learner's fused head pass."""
    seed: int = 0
    """Seed of the prompt order, the sampling streams and the learner."""
    deterministic: bool = False
    """Deterministic learner kernels (CPU runs become bit-reproducible)."""
    exact: bool = False
    """Every stage in the exact arithmetic (opdcache/exact/): the rollout engine's, the teacher's and the learner's
    numbers are the same bits for the same weights (at K = 0 the old-to-current weight of a batch is exactly 1)."""
    checkpoint_every: int = 1
    """Learner checkpoint every N steps; a killed learner redoes at most N - 1 updates (same batches, same ledger)."""
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
    progress: bool | None = None
    """Progress bar of the learner (default: only on a terminal)."""

    def __post_init__(self) -> None:
        if self.loss not in ESTIMATORS or not ESTIMATORS[self.loss].asynchronous:
            raise ConfigError(f"--loss must be one of {', '.join(ASYNC)} for an async run, got {self.loss!r} "
                              "(full-vocabulary losses need the teacher's hidden states per batch; train offline for them)")
        if self.staleness is not None and self.staleness < 0:
            raise ConfigError(f"--staleness must be >= 0 (or --no-refresh), got {self.staleness}")
        for name in ("steps", "batch_size", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.sampling.samples != 1:
            raise ConfigError(f"an async batch holds one response per prompt; got --samples {self.sampling.samples}")
        if "mc" in self.rollout_stores() and not self.sampling.mc_samples:
            raise ConfigError(f"--loss {self.loss} needs --mc-samples M (the m samples per position of papers/001 section 6.1)")
        if "topk" in self.teacher_stores() and not self.top_k:
            raise ConfigError(f"--loss {self.loss} needs --top-k (the teacher's top-k store)")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"--executor must be local or ray, got {self.executor!r}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {self.threads}")
        self.train_config()  # the learner's own checks (lr, clip ranges, chunk) fail here, before anything starts

    # ---- derived

    @property
    def cache_root(self) -> str:
        return self.cache if self.cache is not None else str(self.out / "cache")

    def version_for(self, batch: int) -> int:
        """The snapshot that samples batch ``batch``: max(0, b - K); 0 for every batch without refresh."""
        return 0 if self.staleness is None else max(0, batch - self.staleness)

    def needed_snapshot(self, version: int) -> bool:
        """Whether some batch is sampled by snapshot ``version`` (the learner publishes only those)."""
        return self.staleness is not None and 1 <= version <= self.steps - 1 - self.staleness

    def teacher_stores(self) -> tuple[str, ...]:
        """The teacher stores the learner's loss reads (opdcache/estimators.py)."""
        return ESTIMATORS[self.loss].teacher_stores

    def rollout_stores(self) -> tuple[str, ...]:
        """The rollout stores the learner's loss reads: its ``mc`` samples, where it has them."""
        return ESTIMATORS[self.loss].rollout_stores

    def train_config(self) -> TrainConfig:
        """The learner's settings: the offline trainer's, reading batches from the queue instead of a finished cache."""
        return TrainConfig(
            model=self.model, cache=self.cache_root, out=self.out / "learner", loss=self.loss, steps=self.steps,
            batch_size=self.batch_size, lr=self.lr, tau=self.tau, ppo_clip=self.ppo_clip, max_grad_norm=self.max_grad_norm,
            weight_decay=self.weight_decay, chunk=self.chunk, seed=self.seed, deterministic=self.deterministic,
            importance_weights=self.importance_weights, checkpoint_every=self.checkpoint_every, progress=self.progress,
            dtype="float32" if self.device == "cpu" or self.exact else "auto", exact=self.exact,
            kl_coef=0.0)  # papers/001's learner has no penalty to pi_ref (a batch's ref_logprobs are its sampling snapshot's)

    # ---- run.json

    def to_json(self) -> dict:
        return json.loads(json.dumps(asdict(self), default=str))

    @classmethod
    def from_json(cls, data: dict) -> "AsyncConfig":
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        prompts = {k: v for k, v in data.pop("prompts").items()}
        prompts["path"] = Path(prompts["path"])
        return cls(**{**data, "model": Path(data["model"]), "teacher": Path(data["teacher"]), "out": Path(data["out"]),
                      "prompts": PromptConfig(**prompts), "sampling": SamplingConfig(**data["sampling"]),
                      "gpus_per_stage": tuple(data["gpus_per_stage"])})

    def identity(self) -> dict:
        """The settings that decide what the run computes (a resume must keep them); not where or how fast."""
        skip = {"progress", "executor", "gpus_per_stage", "ray_address", "threads", "keep_snapshots", "device"}
        if not self.exact:  # absent when off: runs from before --exact keep their identity
            skip.add("exact")
        return {k: v for k, v in self.to_json().items() if k not in skip}

