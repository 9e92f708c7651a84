"""A minimal Lightning-OPD trainer over a cache (and the standard-OPD ``online`` baseline).

Each step: forward the student on prompt + response of a cached batch, take its log-probs at the
response tokens (and at the mc / top-k ids) from one fused pass over vocabulary slices (opdcache/student.py,
opdcache/logprobs.py), apply the chosen estimator (opdcache/losses.py) and corrections, and update with AdamW
(papers/000 Table 6 defaults: lr 2e-6 constant, weight decay 0.1, betas 0.9/0.98). No teacher runs: its
signals come from the cache. ``online=True`` instead samples fresh rollouts from the current student and
scores them with a live teacher every step, with the same estimator and settings.

Logged every step (metrics.jsonl): loss; mean and std of the per-token importance weight
pi_theta/pi_ref = exp(s - r) (papers/000 Fig. 3a); advantage (T - s) mean and std; ``clip_fraction`` (lightning: tokens with |T - s| > tau);
K1 = mean(r - s) and K3 = mean(exp(s - r) - 1 - (s - r)), estimates of KL(pi_ref || pi_theta) from pi_ref's samples.
Online, r is pi_ref's log-prob scored live when ``kl_coef > 0`` (the weight is then pi_theta/pi_ref on the student's own
samples), and the sampler's own log-prob otherwise (weight 1, K1 0 by construction);
``tokens``, response tokens in the step; ``grad_norm``, the total gradient norm before clipping; ``lr``; ``seconds``,
wall-clock since this invocation started. With corrections (l = r_train - r_rollout, r_train the trainer's float32
pi_ref, r_rollout the cached ``ref_logprobs``): ``tis_clip_fraction``, response tokens whose exp(l) exceeded the TIS cap;
``rejected_fraction``, sequences dropped by K1/K3 rejection; ``band_rejected_fraction``, sequences outside the trust band.
With ``kl_coef > 0``: ``kl_penalty``, the chosen estimator's mean (opdcache/losses.py; the cached or the online form), added
to the loss times ``kl_coef``. Token statistics are means over response tokens, averaged over micro-batches; sequence fractions are over the batch.

Memory: the model, its gradients and AdamW's two moments in float32 (16 bytes per parameter; divided by the
number of processes with ``--fsdp``), activations of one micro-batch [batch, length, hidden] per layer (one layer's
with ``--gradient-checkpointing``), and [response tokens, chunk] float32 logit slices: it grows with tokens x hidden and
tokens x chunk, never with tokens x vocabulary. Launch several processes with ``torchrun --nproc-per-node N -m
opdcache.cli.main train ...``: DDP by default, FSDP2 with ``--fsdp``.

Checkpoints hold model weights (safetensors), optimizer state (safetensors + JSON), loader position and
RNG state -- no pickle -- and a resumed run reproduces an uninterrupted one exactly (deterministic CPU).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from opdcache import losses as L
from opdcache.errors import ConfigError, OpdcacheError, SchemaError
from opdcache.logprobs import check_chunk
from opdcache.models import resolve_model
from opdcache.progress import bar
from opdcache.student import (DTYPES, StudentForward, autocast_dtype, enable_activation_checkpointing, full_tensor, init_distributed,
                              shard_fsdp)

LR_SCHEDULES = ("constant", "cosine")


class TrainingDiverged(OpdcacheError, FloatingPointError):
    """The optimisation produced non-finite numbers from finite inputs."""


@dataclass(frozen=True)
class TrainConfig:
    """Settings of `opdcache train` (also readable from a YAML file; flags override it)."""

    model: Path
    """pi_ref: the SFT student the run starts from (a local directory or a Hub id, org/name[@rev])."""
    cache: Path | str
    """The rollouts cache: a directory or an object-store URL (s3://, gs://, hf://datasets/...)."""
    out: Path
    """Output directory: final model, checkpoints, metrics.jsonl."""
    teacher: str | None = None
    """Teacher table in the cache (default: the only one)."""
    loss: str = "lightning"
    """lightning, is, mc, topk-fkl, topk-rkl, full-fkl, full-rkl or jsd."""
    steps: int = 150
    """Optimizer steps (papers/000 Table 6: 150)."""
    batch_size: int = 16
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    lr: float = 2e-6
    """AdamW peak learning rate (papers/000 Table 6: 2e-6, constant)."""
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
    tau: float = 5.0
    """Lightning advantage clip (Alg. 1); Table 6 gives no value, 5 only bounds outliers."""
    max_grad_norm: float = 1.0
    """Gradient clipping."""
    topk_support: str = "teacher"
    """topk-* losses: the teacher's own top-k ids or pi_ref's ('ref')."""
    tail: bool = False
    """topk-* losses: keep the mass outside the support as one extra bin."""
    chunk: int = 8192
    """Vocabulary slice width of the fused student head pass (and of the full-* losses): memory O(tokens x chunk)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to pi_ref computed from the cached ref_logprobs (0: off)."""
    kl_estimator: str = "k3"
    """Per-token KL(pi_ref || pi_theta) estimator on pi_ref's samples, l = s - r: k1 = -l, k2 = l^2 / 2, k3 = exp(l) - 1 - l."""
    dtype: str = "auto"
    """Compute precision: float32, bfloat16 (autocast over float32 master weights) or auto (bfloat16 on a CUDA GPU that has it)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward (activation memory of one layer, ~1.3x compute)."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state over the processes of a torchrun launch (FSDP2)."""
    corrections: L.Corrections = field(default_factory=L.Corrections)
    """Training-inference mismatch corrections."""
    seed: int = 0
    """Seed of the data order and initialisation."""
    deterministic: bool = False
    """Deterministic kernels (CPU runs become bit-reproducible, including across a resume)."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (0: only at the end)."""
    stop_after: int | None = None
    """Stop after this many steps of this invocation, leaving the checkpoint (for tests of resume)."""
    tensorboard: bool = False
    """Also write TensorBoard events."""
    num_loader_workers: int = 0
    """DataLoader worker processes."""
    online: bool = False
    """Standard-OPD baseline: fresh student rollouts scored by a live teacher every step."""
    teacher_model: Path | None = None
    """online: the live teacher model."""
    max_new_tokens: int = 64
    """online: response length limit."""
    temperature: float = 0.8
    """online: sampling temperature."""
    progress: bool | None = None
    """Progress bar (default: only on a terminal)."""

    def __post_init__(self) -> None:
        if self.loss not in L.ESTIMATORS:
            raise ConfigError(f"--loss must be one of {', '.join(L.ESTIMATORS)}, got {self.loss!r}")
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
        check_chunk(self.chunk)
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.fsdp and self.online:
            raise ConfigError("--fsdp trains from a cache; the --online baseline runs without it")
        if self.topk_support not in ("teacher", "ref"):
            raise ConfigError(f"--topk-support must be teacher or ref, got {self.topk_support!r}")
        if self.online and self.teacher_model is None:
            raise ConfigError("--online needs --teacher-model (the live teacher)")
        online_losses = ("lightning", "is") + L.FULL_VOCABULARY
        if self.online and self.loss not in online_losses:
            raise ConfigError(f"--online supports --loss {', '.join(online_losses[:-1])} or {online_losses[-1]}, got {self.loss!r}")


def stores_for(loss: str, topk_support: str = "teacher") -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(teacher stores, rollout stores) an estimator reads: what score-teacher and build-rollouts must have stored."""
    if loss in L.FULL_VOCABULARY:
        return ("logprob", "hidden"), ("base",)
    if loss.startswith("topk"):
        return (("logprob", "topk"), ("base",)) if topk_support == "teacher" else (("logprob",), ("base", "ref_topk"))
    if loss == "mc":
        return ("logprob",), ("base", "mc")
    return ("logprob",), ("base",)


def _masked_mean_std(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    n = mask.sum().clamp_min(1)
    mean = (x * mask).sum() / n
    var = (((x - mean) ** 2) * mask).sum() / n
    return float(mean), float(var.sqrt())


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


class Trainer:
    def __init__(self, cfg: TrainConfig):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
        self.ddp, self.rank, self.world, self.device, self.owns_process_group = init_distributed()
        self.autocast = autocast_dtype(cfg.dtype, self.device)
        # float32 master weights whatever --dtype says: autocast computes in bfloat16, AdamW updates in float32
        self.model_path = resolve_model(cfg.model).path  # a local directory or a Hub id
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).to(self.device)
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(self.model)
        self.model.train()
        self.ref_forward = None
        if cfg.corrections.active:  # r_train: the trainer-side pi_ref, frozen
            ref = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).to(self.device).eval()
            self.ref_forward = StudentForward(ref, cfg.chunk)
        self.forward = StudentForward(self.model, cfg.chunk)
        if cfg.fsdp:
            self.forward = shard_fsdp(self.forward, self.device, self.world)
        elif self.ddp:
            self.forward = torch.nn.parallel.DistributedDataParallel(self.forward)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2))
        self.step = 0
        head = None  # the teacher's unembedding, for the full-vocabulary losses
        if cfg.online:
            from opdcache.online import OnlineSource

            self.source = OnlineSource(cfg, self.model, self.device)
            if self.source.want_hidden:
                from opdcache.heads import head_of

                head = head_of(self.source.teacher.model)
        else:
            from opdcache.cache import Cache
            from opdcache.data import CacheLoader, CacheLoaderConfig

            cache = Cache(cfg.cache)
            table = cache.teacher_table(cfg.teacher)  # the only teacher when not named
            stores, rstores = stores_for(cfg.loss, cfg.topk_support)
            self.source = CacheLoader(CacheLoaderConfig(cache=cfg.cache, teacher=table.split("/", 1)[1], stores=stores, rollout_stores=rstores,
                                                        batch_size=cfg.batch_size, seed=cfg.seed, num_workers=cfg.num_loader_workers))
            if "hidden" in stores:
                from opdcache.heads import load_head

                head = load_head(cache.root / table / "head.safetensors")
        # moved to the device in float32 once, not at every step
        self.teacher_w = None if head is None else head.weight.to(self.device, torch.float32)
        self.teacher_b = None if head is None or head.bias is None else head.bias.to(self.device, torch.float32)
        self._iter = None

    # ------------------------------------------------------------ one step

    def _next_batch(self) -> dict:
        if self.cfg.online:
            return self.source.next_batch()
        if self._iter is None:
            self._iter = iter(self.source)
        try:
            return next(self._iter)
        except StopIteration:
            self._iter = iter(self.source)
            return next(self._iter)

    def _support(self, batch: dict, sel: torch.Tensor) -> torch.Tensor | None:
        """[N, K] ids besides the sampled token at which the estimator needs the student's log-probs (mc, topk-*)."""
        cfg = self.cfg
        if cfg.loss == "mc":
            return batch["mc_ids"][sel]
        if cfg.loss.startswith("topk"):
            return (batch["teacher_topk_ids"] if cfg.topk_support == "teacher" else batch["ref_topk_ids"])[sel]
        return None

    def _check_finite(self, batch: dict) -> None:
        """Refuse a batch whose cached values are NaN or infinite at response positions (a damaged cache), before
        they reach the loss: no estimator may train through them."""
        mask = batch["response_mask"].bool()
        names = [n for n, v in batch.items() if v.is_floating_point() and n != "response_mask"]
        counts = torch.stack([(~torch.isfinite(batch[n][mask] if batch[n].shape[:2] == mask.shape else batch[n])).sum() for n in names])
        for name, bad in zip(names, counts.tolist()):  # one device sync per batch, not one per column
            if bad:
                raise SchemaError(f"the cache holds {bad} non-finite values in {name} at response positions of this batch; "
                                  f"run `opdcache validate {self.cfg.cache}` to find the rows, then rebuild those shards")

    def loss_and_stats(self, batch: dict) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        batch = {k: v.to(self.device) for k, v in batch.items()}
        self._check_finite(batch)
        mask = batch["response_mask"]
        sel = mask.bool()
        B, T = mask.shape
        support = self._support(batch, sel)
        ids_NK = batch["response_ids"][sel][:, None]  # column 0: the sampled token
        if support is not None:
            ids_NK = torch.cat([ids_NK, support.long()], 1)
        full = cfg.loss.replace("full-", "") if cfg.loss in L.FULL_VOCABULARY else None
        inputs = (batch["input_ids"], batch["attention_mask"], batch["logit_positions"], sel)
        with torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            lp_NK, _, div_N = self.forward(*inputs, ids_NK, full, batch["teacher_hidden"][sel] if full else None, self.teacher_w, self.teacher_b)
        lp_NK = lp_NK.float()
        s = lp_NK.new_zeros(B, T)
        s[sel] = lp_NK[:, 0]  # the student's log-prob of each sampled token, [B, T]
        teacher = batch.get("teacher_logprobs")
        stats: dict = {}
        if cfg.loss == "lightning":
            terms, st = L.lightning_terms(s, teacher, cfg.tau)
            stats["clip_fraction"] = float((st["clipped"] * mask).sum() / mask.sum())
        elif cfg.loss == "is":
            terms, st = L.is_terms(s, batch["sampling_logprobs"], teacher)
        elif support is not None:
            s_K = lp_NK.new_zeros(B, T, support.shape[1])
            s_K[sel] = lp_NK[:, 1:]  # [B, T, K] at the support ids
            if cfg.loss == "mc":
                terms, st = L.mc_terms(s_K, batch["mc_sampling_logprobs"], batch["teacher_mc_logprobs"])
            else:
                t_lp = batch["teacher_topk_logprobs"] if cfg.topk_support == "teacher" else batch["teacher_ref_topk_logprobs"]
                terms, st = L.topk_terms(s_K, t_lp, cfg.loss.split("-")[1], cfg.tail)
        else:
            terms = s.new_zeros(B, T)
            terms[sel] = div_N.float()
            st = {"kl": div_N.detach()}
        advantage = (teacher - s).detach() if teacher is not None else torch.zeros_like(s)
        weights = None
        if cfg.corrections.active:
            with torch.no_grad():
                r_train = s.new_zeros(B, T)
                r_train[sel] = self.ref_forward(*inputs, ids_NK[:, :1])[0][:, 0].float()
            weights, cstats = L.correction_weights(cfg.corrections, s, r_train, batch["ref_logprobs"], advantage, mask)
            stats.update({k: float(v) for k, v in cstats.items()})
        loss = L.reduce(terms, mask, weights)
        if cfg.kl_coef > 0:  # cached: on pi_ref's samples, from the cached ref_logprobs; online: on the student's, pi_ref scored live
            penalty = L.reduce(L.kl_penalty_terms(s, batch["ref_logprobs"], cfg.kl_estimator, "student" if cfg.online else "ref"), mask)
            stats["kl_penalty"] = float(penalty.detach())
            loss = loss + cfg.kl_coef * penalty
        if "ref_logprobs" in batch:
            log_ratio = (s - batch["ref_logprobs"]).detach()
            stats["is_weight_mean"], stats["is_weight_std"] = _masked_mean_std(log_ratio.exp(), mask)
            stats["k1"] = float(((-log_ratio) * mask).sum() / mask.sum())
            stats["k3"] = float(((log_ratio.exp() - 1 - log_ratio) * mask).sum() / mask.sum())
        if teacher is not None:
            stats["advantage_mean"], stats["advantage_std"] = _masked_mean_std(advantage, mask)
        stats["tokens"] = int(mask.sum())
        if self.ddp:  # normalise by every rank's tokens: the gradient average over ranks is then the whole batch's gradient
            tokens = mask.sum().float()
            total = tokens.clone()
            torch.distributed.all_reduce(total)
            loss = loss * (tokens * self.world / total.clamp_min(1))
        return loss, stats

    def _global_mean(self, value: float) -> float:
        """The mean over ranks of a per-rank number (the logged loss: each rank's share, times the world, averaged)."""
        if not self.ddp:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)  # NCCL reduces device tensors only
        torch.distributed.all_reduce(t)
        return float(t) / self.world

    # ------------------------------------------------------------ checkpoints

    def _full_state(self) -> tuple[dict | None, dict[str, torch.Tensor], list[dict]]:
        """(model state dict, or None to save the live model; optimizer tensors keyed '<parameter index>.<name>';
        param groups). Under FSDP every rank must call it: the full tensors are gathered to rank 0's CPU."""
        names = {n: i for i, (n, _) in enumerate(self.model.named_parameters())}
        model_sd = None
        if self.cfg.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_sd = {k.removeprefix("model."): v for k, v in get_model_state_dict(self.forward, options=options).items()}
            optim = get_optimizer_state_dict(self.forward, self.opt, options=options)
            per_param = {names[fqn.removeprefix("model.")]: st for fqn, st in optim.get("state", {}).items()}
        else:
            index = {id(p): i for i, p in enumerate(self.model.parameters())}
            per_param = {index[id(p)]: st for p, st in self.opt.state.items()}
        tensors = {f"{i}.{k}": v.detach().cpu().contiguous() if torch.is_tensor(v) else torch.tensor(v)
                   for i, st in per_param.items() for k, v in st.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        return model_sd, tensors, groups

    def save_checkpoint(self) -> dict | None:
        """Write ``checkpoint/`` atomically (rank 0); every rank calls it. Returns the full model state (FSDP) for reuse."""
        from safetensors.torch import save_file

        if not self.cfg.fsdp and self.rank != 0:
            return None
        model_sd, tensors, groups = self._full_state()
        if self.rank != 0:
            return None
        final = self.cfg.out / "checkpoint"
        tmp = self.cfg.out / f".checkpoint.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp / "model", state_dict=model_sd)
        tensors["rng.torch"] = torch.get_rng_state()
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        state = {"step": self.step, "param_groups": groups, "config": json.loads(json.dumps(asdict(self.cfg), default=str)),
                 "loader": None if self.cfg.online else self.source.state_dict()}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
        old = self.cfg.out / f".checkpoint.old-{os.getpid()}"
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        return model_sd

    def maybe_resume(self) -> bool:
        from safetensors.torch import load_file

        ckpt = self.cfg.out / "checkpoint"
        if not (ckpt / "trainer_state.json").is_file():
            return False
        state = json.loads((ckpt / "trainer_state.json").read_text())
        mine = json.loads(json.dumps(asdict(self.cfg), default=str))
        ignore = {"stop_after", "steps", "progress", "checkpoint_every", "tensorboard", "num_loader_workers"}
        diff = sorted(k for k in set(mine) | set(state["config"]) if k not in ignore and mine.get(k) != state["config"].get(k))
        if diff:
            changes = ", ".join(f"{k}: {state['config'].get(k)!r} -> {mine.get(k)!r}" for k in diff)
            raise ConfigError(f"{ckpt} was written with different settings ({changes}); use the original settings to resume, or a new --out")
        from transformers import AutoModelForCausalLM

        weights = AutoModelForCausalLM.from_pretrained(ckpt / "model", dtype=torch.float32).state_dict()
        tensors = load_file(str(ckpt / "optimizer.safetensors"))
        per_param: dict[int, dict] = {}
        for key, value in tensors.items():
            if not key.startswith("rng."):
                i, name = key.split(".", 1)
                per_param.setdefault(int(i), {})[name] = value
        if self.cfg.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

            options = StateDictOptions(full_state_dict=True)
            names = [f"model.{n}" for n, _ in self.model.named_parameters()]
            set_model_state_dict(self.forward, {f"model.{k}": v for k, v in weights.items()}, options=options)
            optim = {"state": {names[i]: st for i, st in per_param.items()},
                     "param_groups": [{**{k: (tuple(v) if isinstance(v, list) else v) for k, v in g.items()}, "params": names}
                                      for g in state["param_groups"]]}
            set_optimizer_state_dict(self.forward, self.opt, optim, options=options)
        else:
            self.model.load_state_dict(weights)
            params = list(self.model.parameters())
            for i, st in per_param.items():
                self.opt.state[params[i]].update({k: v.to(self.device) if k != "step" else v for k, v in st.items()})
            for g, saved in zip(self.opt.param_groups, state["param_groups"]):
                g.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items()})
        torch.set_rng_state(tensors["rng.torch"])
        self.step = state["step"]
        if state["loader"] is not None:
            self.source.load_state_dict(state["loader"])
        return True

    # ------------------------------------------------------------ the loop

    def fit(self) -> dict:
        cfg = self.cfg
        cfg.out.mkdir(parents=True, exist_ok=True)
        resumed = self.maybe_resume()
        metrics_path = cfg.out / "metrics.jsonl"
        if self.rank == 0:  # rank 0 alone owns the metrics file: another rank rewriting it could truncate what rank 0 appends
            kept = [l for l in metrics_path.read_text().splitlines() if json.loads(l)["step"] <= self.step] if metrics_path.exists() and resumed else []
            metrics_path.write_text("".join(l + "\n" for l in kept))
        writer = None
        if cfg.tensorboard and self.rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(cfg.out / "tensorboard"))
        start, done_now, last = time.perf_counter(), 0, {}
        with bar(total=cfg.steps, desc=f"train {cfg.loss}", unit="step", enabled=cfg.progress) as pbar, \
                (open(metrics_path, "a") if self.rank == 0 else contextlib.nullcontext()) as mf:
            pbar.update(self.step)
            while self.step < cfg.steps:
                self.opt.zero_grad(set_to_none=True)
                agg: dict = {}
                for _ in range(cfg.grad_accum):
                    loss, stats = self.loss_and_stats(self._next_batch())
                    (loss / cfg.grad_accum).backward()
                    for k, v in {"loss": self._global_mean(loss.item()), **stats}.items():
                        agg[k] = agg.get(k, 0.0) + v / cfg.grad_accum
                grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm))
                if not math.isfinite(float(grad_norm)):
                    raise TrainingDiverged(f"non-finite gradient norm at step {self.step + 1} (the inputs were finite); lower --lr, "
                                           "or try --dtype float32")
                lr = learning_rate(cfg, self.step)
                for group in self.opt.param_groups:
                    group["lr"] = lr
                self.opt.step()
                self.step += 1
                done_now += 1
                last = {"step": self.step, **agg, "grad_norm": float(grad_norm), "lr": lr, "seconds": time.perf_counter() - start}
                if self.rank == 0:
                    mf.write(json.dumps(last) + "\n")
                    mf.flush()
                    if writer:
                        for k, v in last.items():
                            writer.add_scalar(k, v, self.step)
                pbar.update(1)
                pbar.set_postfix(loss=f"{agg['loss']:.4f}")
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
                if cfg.stop_after is not None and done_now >= cfg.stop_after:
                    return {"stopped_at": self.step, "last": last, "resumed": resumed}
        model_sd = self.save_checkpoint()
        if self.rank == 0:
            self._save_final(model_sd)
        if writer:
            writer.close()
        result = {"steps": self.step, "last": last, "resumed": resumed, "seconds": time.perf_counter() - start}
        if cfg.online:  # wall-clock seconds of this invocation sampling the student, in the live teacher's forward, in pi_ref's (KL)
            result["online_seconds"] = dict(self.source.seconds)
        return result

    def _save_final(self, model_sd: dict | None) -> None:
        from transformers import AutoTokenizer

        self.model.save_pretrained(self.cfg.out / "model", state_dict=model_sd)
        AutoTokenizer.from_pretrained(self.model_path).save_pretrained(self.cfg.out / "model")
        from opdcache.lineage import read_sft_lineage
        from opdcache.storage import write_text_atomic

        lineage = read_sft_lineage(self.model_path)
        if lineage:  # the OPD student keeps its SFT lineage
            write_text_atomic(self.cfg.out / "model" / "opdcache_lineage.json", json.dumps(lineage, indent=2, sort_keys=True))


def run_train(cfg: TrainConfig) -> dict:
    trainer = Trainer(cfg)
    try:
        return trainer.fit()
    finally:
        # an undestroyed gloo group can abort the process at exit ("terminate called without an active exception")
        if trainer.owns_process_group and torch.distributed.is_initialized():
            torch.distributed.barrier()  # rank 0 may still be writing the final model
            torch.distributed.destroy_process_group()
