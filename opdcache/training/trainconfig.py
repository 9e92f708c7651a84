"""The settings of a training run (offline from a cache, online, or the async learner), and what follows from them:
which stores an estimator reads and the learning-rate schedule. One frozen dataclass feeds the CLI, YAML files and
the Python API."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from opdcache.errors import ConfigError
from opdcache.logits.logprobs import check_chunk
from opdcache.training import losses as L
from opdcache.training.estimators import ESTIMATORS, ONLINE
from opdcache.training.student import DTYPES

LR_SCHEDULES = ("constant", "cosine")
CHECKPOINTS = ("full", "model", "none")
SAVE_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class TrainConfig:
    """Settings of `opdcache train` (also readable from a YAML file; flags override it)."""

    model: Path
    """pi_ref: the SFT student the run starts from (a local directory or a Hub id, org/name[@rev])."""
    cache: Path | str
    """The rollouts cache: a directory or an object-store URL (s3://, gs://, hf://datasets/...)."""
    out: Path
    """Output directory: the final model, the checkpoint (a rerun resumes from it), metrics.jsonl."""
    teacher: str | None = None
    """Teacher table in the cache (default: the only one). Several, comma-separated (a,b): the loss is the weighted sum
    of each teacher's (--teacher-weights), or each row takes one (--teacher-route); for the losses that read only the
    teachers' log-probs, all sharing the student's tokenizer. Memory: each teacher's columns per token."""
    teacher_weights: tuple[float, ...] | None = None
    """Several teachers: each one's weight in the loss, in --teacher's order, comma-separated on the command line
    (normalised to sum 1; default equal)."""
    teacher_route: str | None = None
    """Several teachers: a prompt field (the rows' metadata) whose value names each row's teacher, e.g. a "domain"
    field of "math" or "code" with teachers math,code (a row naming none is refused)."""
    loss: str = "lightning"
    """The estimator: what the loss reads from the cache and computes per token (opdcache/training/estimators.py)."""
    steps: int = 150
    """Optimizer steps (papers/000 Table 6: 150)."""
    batch_size: int = 16
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    max_batch_tokens: int | None = None
    """Cut each batch into groups of rows of at most this many prompt + response tokens (a longer row alone), one
    forward and backward a group, the loss and gradient those of the whole batch (each group's mean weighted by its
    response tokens): the activation memory follows this budget, not the batch size times the longest row. Default:
    none (the batch at once). One process only."""
    lr: float = 2e-6
    """AdamW peak learning rate. papers/000 Table 6 uses 2e-6 (constant) for 1-8B students; the demo's 2-layer models
    take 3e-5 (docs/demo.md)."""
    lr_schedule: str = "constant"
    """constant or cosine (decay from lr to lr * min_lr_ratio over the steps after warm-up)."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to lr over this many steps."""
    min_lr_ratio: float = 0.0
    """cosine: the final learning rate as a fraction of lr."""
    weight_decay: float = 0.1
    """AdamW weight decay (Table 6)."""
    beta1: float = 0.9
    """AdamW beta1 (Table 6)."""
    beta2: float = 0.98
    """AdamW beta2 (Table 6)."""
    tau: float = 1.0
    """Lightning advantage clip (papers/000 Alg. 1), nats. 1 is the measured setting: with --kl-coef 1, Lightning
    improved pi_ref on every demo seed, and 5 (which only bounds outliers; the paper gives no value) did not (the
    README's "Choosing tau, the KL penalty and the learning rate"; BENCHMARKS.md)."""
    ppo_clip: float = 0.2
    """ppo: clip range eps of the old-to-current ratio (papers/001 eq. 6)."""
    importance_weights: bool = True
    """is, mc: weight each stale sample by pi_theta / pi_old (papers/001 section 6); off is the paper's no-IS ablation."""
    max_grad_norm: float = 1.0
    """Gradient clipping."""
    topk_support: str = "teacher"
    """topk-* losses: the teacher's own top-k ids or pi_ref's ('ref')."""
    tail: bool = False
    """topk-* losses: keep the mass outside the support as one extra bin."""
    chunk: int = 8192
    """Vocabulary slice width of the fused student head pass on a CPU (and of the full-* losses): memory
    O(tokens x chunk); a GPU takes whole vocabulary rows in blocks of up to 1 GiB."""
    kl_coef: float = 1.0
    """Weight of the KL penalty to pi_ref (0: off), from the cached ref_logprobs; --online: a frozen pi_ref scores the
    fresh samples. 1 (with k3) is the measured setting: without it the sampled-token estimators drift from pi_ref and
    Lightning does not improve on it (docs/demo.md; BENCHMARKS.md)."""
    kl_estimator: str = "k3"
    """Per-token KL(pi_ref || pi_theta) estimator on pi_ref's samples, l = s - r: k1 = -l, k2 = l^2 / 2, or k3 =
    exp(l) - 1 - l (low-variance); --online has the forms for the student's own samples (opdcache/training/losses.py)."""
    kl_cap: float = 10.0
    """Largest per-token KL penalty term, nats (0: no cap). k3 grows as exp(l): one token with l = 20 would add 5e8 to
    the batch's penalty; 10 is verl's clamp of its low-variance KL."""
    rollout_aligned: bool = False
    """QaRL (papers/004): the student's forward computes in the low-bit scheme the rollouts record (quantized on the
    fly from float32 masters, straight-through gradients), and so does the trainer-side pi_ref of the corrections."""
    dtype: str = "auto"
    """Compute precision: float32, bfloat16 (autocast over float32 master weights) or auto (bfloat16 on a CUDA GPU
    that has it, else float32)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward: the activation memory of one layer, for more
    compute (BENCHMARKS.md)."""
    pack: bool | None = None
    """Packed batches (opdcache/training/packing.py): the student's forward runs on the batch's sequences laid end to
    end with their position ids (attention within each sequence), so no compute goes to padding; the losses are the
    padded path's on the same numbers. Memory: activations grow with the batch's tokens, not its longest row times the
    batch size. With --exact, each sequence's values are the bits of its padded row. Default: packed, except with
    --online (whose batches are generated padded); --no-pack pads every row to the batch's longest."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state over the processes of a torchrun launch (FSDP2)."""
    corrections: L.Corrections = field(default_factory=L.Corrections)
    """Training-inference mismatch corrections."""
    seed: int = 0
    """Seed of the data order and initialisation."""
    deterministic: bool = False
    """Deterministic kernels (CPU runs become bit-reproducible, including across a resume)."""
    exact: bool = False
    """The exact arithmetic (opdcache/exact/, papers/003): the student's forward gives the bits an exact rollout engine
    stored (at step 0 every importance weight is exactly 1), whatever the batch, padding, thread count or device (a CPU
    or a CUDA GPU give the same bits: tests/test_gpu.py); Llama, Mistral, Qwen2, Qwen3; float32 or bfloat16 (--dtype
    auto takes the exact rollouts' dtype, another is refused). The arithmetic is the one the rollouts record (the CPU's
    float64 matmuls, on any device; or the GPU's batch-invariant kernels, on a CUDA GPU); gradients as usual. Memory:
    in the CPU's arithmetic, float64 copies of each layer's inputs and outputs (about 2x the activations)."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (0: only at the end)."""
    checkpoint: str = "full"
    """What the run writes besides metrics: full (the final model and a resumable checkpoint: float32 weights and AdamW's
    two moments, 16 bytes a parameter), model (the final model only: the run cannot be resumed or extended) or none."""
    save_dtype: str = "auto"
    """dtype of the final model: auto (the training compute dtype: bfloat16 under --dtype bfloat16 or auto on a bf16 GPU,
    else float32), float32 or bfloat16. The checkpoint keeps float32 masters whatever this says."""
    eval_every: int = 0
    """Evaluate the student every N steps (0: never) on --eval-prompts with the --eval-reward verifier, as `opdcache
    eval` does (opdcache/evaluation/evaluate.py), logging eval/accuracy and eval/pass@k beside the step's metrics, to every
    tracker; rank 0 only. Memory: the student's KV cache for the prompts' generation."""
    eval_prompts: Path | None = None
    """The held-out prompts (a JSONL file with answers) --eval-every evaluates on."""
    eval_reward: str | None = None
    """The verifier --eval-every judges with (as --reward)."""
    eval_samples: int = 1
    """Responses a prompt for --eval-every (pass@k; above 1 needs --eval-temperature above 0)."""
    eval_temperature: float = 0.0
    """--eval-every's sampling temperature (0: greedy)."""
    eval_max_new_tokens: int = 64
    """--eval-every's response length limit."""
    lora_rank: int = 0
    """Train low-rank adapters of this rank through PEFT instead of the whole student (0: full fine-tuning): the base
    weights frozen in their dtype (bfloat16 on a GPU, float32 on a CPU), the adapters and AdamW's moments in float32,
    a checkpoint holding those only (opdcache/training/lora.py). Memory: the base in its dtype plus 16 bytes per adapter
    parameter."""
    lora_alpha: float | None = None
    """LoRA's scaling numerator (the update is scaled by alpha / rank; default: 2 x rank)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input."""
    lora_targets: str | None = None
    """The linear layers that get adapters, a comma list of leaf names (q_proj,v_proj); default: every linear layer of
    the decoder's attention and MLP blocks."""
    lora_ref: bool = False
    """With --lora-rank: recompute pi_ref's log-probs with the adapters disabled (the frozen base is pi_ref) instead of
    reading the cache's ref_logprobs, for the importance weight, the KL penalty and the losses that read them: one
    forward more a step, no gradient, and no sampler-side rounding in the reference."""
    save: str = "auto"
    """What --out/model holds: merged (the whole model, adapters merged, in --save-dtype), adapter (a PEFT adapter folder:
    PeftModel.from_pretrained(base, folder)) or auto (adapter with --lora-rank, else the model)."""
    stop_after: int | None = None
    """Stop after this many steps of this invocation, leaving the checkpoint (for tests of resume)."""
    tensorboard: bool = False
    """Also write TensorBoard events (the same as --report-to tensorboard)."""
    report_to: tuple[str, ...] = ("jsonl",)
    """Where the metrics go, a comma list of jsonl (always), tensorboard, wandb, trackio and mlflow, each through its own
    library in its own offline mode where set (WANDB_MODE=offline, MLFLOW_TRACKING_URI, TRACKIO_DIR;
    opdcache/training/trackers.py); the same numbers to each, from rank 0, with the resolved settings."""
    num_loader_workers: int = 0
    """DataLoader worker processes."""
    allow_other_model: bool = False
    """Train a --model other than the one that sampled the cache's rollouts (off: refused, with both fingerprints)."""
    online: bool = False
    """The standard-OPD baseline: fresh student rollouts scored by a live teacher (--teacher-model) every step
    (--offline: from the cache)."""
    teacher_model: Path | None = None
    """--online: the live teacher model (required there)."""
    max_new_tokens: int = 64
    """--online: response length limit."""
    temperature: float = 0.8
    """--online: sampling temperature."""
    progress: bool | None = None
    """Progress bar (default: only on a terminal)."""

    @property
    def teachers(self) -> tuple[str, ...]:
        """The teacher tables named by --teacher, in order (empty: the cache's only one)."""
        return tuple(t.strip() for t in self.teacher.split(",")) if self.teacher else ()

    def __post_init__(self) -> None:
        from opdcache.training import trackers

        if self.tensorboard:
            import importlib.util

            if importlib.util.find_spec("tensorboard") is None:
                from opdcache.errors import MissingDependencyError

                raise MissingDependencyError("--tensorboard needs the tensorboard package: pip install tensorboard "
                                             "(metrics.jsonl is written either way)")
        from opdcache.training import lora

        if self.eval_every:
            if self.eval_every < 0 or self.eval_prompts is None or self.eval_reward is None:
                raise ConfigError("--eval-every N needs a positive N, --eval-prompts (a JSONL file with answers) and "
                                  "--eval-reward (the verifier)")
            if not Path(self.eval_prompts).is_file():
                raise ConfigError(f"--eval-prompts {self.eval_prompts} is not a file; give the held-out prompts' JSONL file")
            from opdcache.inputs import verifiers

            verifiers.resolve(self.eval_reward)
            if self.eval_samples > 1 and self.eval_temperature == 0:
                raise ConfigError("--eval-samples above 1 with --eval-temperature 0 draws the same greedy response again")

        if self.save not in ("auto", "adapter", "merged"):
            raise ConfigError(f"--save must be auto, adapter or merged, got {self.save!r}")
        lora.check(self)
        names = trackers.parse(self.report_to)
        object.__setattr__(self, "report_to", names + (("tensorboard",) if self.tensorboard and "tensorboard" not in names else ()))
        trackers.check(self.report_to)
        if self.loss not in ESTIMATORS:
            raise ConfigError(f"--loss must be one of {', '.join(ESTIMATORS)}, got {self.loss!r}")
        self._check_teachers()
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ConfigError(f"--max-batch-tokens must be at least 1, got {self.max_batch_tokens}")
        if self.max_batch_tokens is not None and (self.fsdp or self.online):
            raise ConfigError("--max-batch-tokens cuts a cached batch on one process; drop it with --fsdp or --online")
        for name in ("steps", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--warmup-steps must be >= 0 and --min-lr-ratio in [0, 1], got {self.warmup_steps} and {self.min_lr_ratio}")
        if self.kl_coef < 0:
            raise ConfigError(f"--kl-coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in L.KL_ESTIMATORS:
            raise ConfigError(f"--kl-estimator must be one of {', '.join(L.KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        if self.online and self.kl_coef > 0 and self.kl_estimator == "k1":
            raise ConfigError("--online --kl-estimator k1: on the student's own samples the k1 penalty l = s - r has zero expected "
                              "gradient (E_theta[grad log pi_theta] = 0), so it would not pull toward pi_ref; use k3 (the default) or k2")
        if self.kl_cap < 0:
            raise ConfigError(f"--kl-cap must be >= 0 (0: no cap), got {self.kl_cap}")
        if self.pack is None:
            object.__setattr__(self, "pack", not self.online)
        if self.pack and self.online:
            raise ConfigError("--pack lays a cache's rows end to end for the student's forward; --online generates its "
                              "batches: drop --pack")
        if self.exact and (self.fsdp or self.online):
            raise ConfigError("--exact trains one process from a cache; drop --fsdp/--online")
        if self.rollout_aligned and self.online:
            raise ConfigError("--rollout-aligned aligns the learner to cached low-bit rollouts; --online samples the student in full precision")
        check_chunk(self.chunk)
        if self.checkpoint not in CHECKPOINTS:
            raise ConfigError(f"--checkpoint must be one of {', '.join(CHECKPOINTS)}, got {self.checkpoint!r}")
        if self.checkpoint != "full" and (self.checkpoint_every or self.stop_after is not None):
            raise ConfigError(f"--checkpoint-every (and stopping to resume) needs --checkpoint full, got --checkpoint {self.checkpoint}")
        if self.save_dtype not in SAVE_DTYPES:
            raise ConfigError(f"--save-dtype must be one of {', '.join(SAVE_DTYPES)}, got {self.save_dtype!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.fsdp and self.online:
            raise ConfigError("--fsdp trains from a cache; the --online baseline runs without it")
        if self.topk_support not in ("teacher", "ref"):
            raise ConfigError(f"--topk-support must be teacher or ref, got {self.topk_support!r}")
        if self.online and self.teacher_model is None:
            raise ConfigError("--online needs --teacher-model (the live teacher)")
        if not 0 < self.ppo_clip < 1:
            raise ConfigError(f"--ppo-clip must be in (0, 1), got {self.ppo_clip}")
        if self.online and not ESTIMATORS[self.loss].online:
            raise ConfigError(f"--online supports --loss {', '.join(ONLINE[:-1])} or {ONLINE[-1]}, got {self.loss!r}")


    def _check_teachers(self) -> None:
        names = self.teachers
        if any(not n for n in names) or len(set(names)) != len(names):
            raise ConfigError(f"--teacher takes distinct table names separated by commas, got {self.teacher!r}")
        if self.teacher_weights is not None:
            weights = tuple(self.teacher_weights)
            object.__setattr__(self, "teacher_weights", weights)
            if len(names) < 2 or len(weights) != len(names):
                raise ConfigError(f"--teacher-weights takes one weight per teacher of --teacher ({len(names)}), got {len(weights)}")
            if not all(0 <= w < math.inf for w in weights) or not 0 < sum(weights) < math.inf:
                raise ConfigError(f"--teacher-weights must be finite, at least 0, not all 0 and of a finite sum, got "
                                  f"{', '.join(map(str, weights))}")
        if self.teacher_route is not None:
            if len(names) < 2:
                raise ConfigError("--teacher-route routes rows among several teachers: name them in --teacher (a,b)")
            if self.teacher_weights is not None:
                raise ConfigError("--teacher-route gives each row one teacher; --teacher-weights mixes them: use one")
        if len(names) > 1 and self.online:
            raise ConfigError("several teachers are read from a cache; --online has one live teacher (--teacher-model)")


def stores_for(loss: str, topk_support: str = "teacher", teacher_stores: tuple[str, ...] = ()) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(teacher stores, rollout stores) an estimator reads: what score-teacher and build-rollouts must have stored
    (:meth:`opdcache.training.estimators.Estimator.stores`)."""
    from types import SimpleNamespace

    return ESTIMATORS[loss].stores(SimpleNamespace(topk_support=topk_support), teacher_stores)


def learning_rate(cfg: "TrainConfig", step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based): linear warm-up, then constant or cosine decay."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
