"""``opdcache sft`` and ``opdcache train``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from opdcache.cli import options as O
from opdcache.training.estimators import ESTIMATORS

T = O.Fields("opdcache.training.trainconfig", "TrainConfig")
C = O.Fields("opdcache.training.losses", "Corrections")
SFT = O.Fields("opdcache.training.sft", "SFTConfig")
CORRECTIONS = ("tis_cap", "reject_k", "reject_threshold", "trust_band", "band_low", "band_high", "dual_clip", "band_cap")
"""The Corrections fields (every one) that train's flags set."""
REQUIRED = "Required (here or in --config)."


def sft(
    model: O.ModelPath,
    data: Annotated[str, typer.Option("--data", help="SFT cache from `opdcache build-sft` (a directory or a URL such as s3://bucket/prefix).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Output model directory.", show_default=False)],
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps.")] = 500,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per step.")] = 64,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (warm-up, cosine decay).")] = 3e-3,
    warmup: Annotated[int, typer.Option("--warmup", help="Linear warm-up steps (default 0).")] = 20,
    only_correct: Annotated[bool, typer.Option("--only-correct", help="Train only on trajectories with reward 1.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a model already in --out.")] = False,
    weight_decay: Annotated[float, SFT.option("weight_decay")] = 0.0,
    label_smoothing: Annotated[float, SFT.option("label_smoothing")] = 0.0,
    seed: O.Seed = 0, progress: O.Progress = None,
) -> None:
    """Supervised fine-tuning on teacher trajectories; the output records its SFT teacher (lineage).

    Memory: the model with AdamW (16 bytes per parameter), batch x length x hidden activations, and
    [tokens, 8,192] float32 logit slices of the fused head pass; never tokens x vocabulary."""
    O.announce_threads()
    from opdcache.training.sft import SFTConfig, run_sft

    result = run_sft(model, data, out, SFTConfig(steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, seed=seed,
                                                  weight_decay=weight_decay, label_smoothing=label_smoothing), only_correct,
                     progress, overwrite)
    if result.get("already_done"):
        typer.echo(f"{result['out']}: already fine-tuned from this model on this data with these settings (its lineage says so); nothing to do")
        return
    typer.echo(f"{result['out']}: fine-tuned on {result['pairs']} trajectories of {result['sft_teacher']} (final loss {result['final_loss']:.4f})")


def train(
    model: Annotated[Optional[Path], T.option("model", note=REQUIRED)] = None,
    cache: Annotated[Optional[str], T.option("cache", note=REQUIRED)] = None,
    out: Annotated[Optional[Path], T.option("out", note=REQUIRED)] = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="YAML file of TrainConfig fields; flags override it (default: none).", show_default=False)] = None,
    print_config: Annotated[bool, typer.Option("--print-config", help="Print the resolved settings as YAML and exit (nothing loads).")] = False,
    teacher: Annotated[Optional[str], T.option("teacher")] = None,
    teacher_weights: Annotated[Optional[str], T.option("teacher_weights")] = None,
    teacher_route: Annotated[Optional[str], T.option("teacher_route")] = None,
    max_batch_tokens: Annotated[Optional[int], T.option("max_batch_tokens")] = None,
    loss: Annotated[Optional[str], T.option("loss", note=f"One of {', '.join(ESTIMATORS)}.")] = None,
    tail: Annotated[Optional[bool], T.option("tail", "--topk-tail/--no-topk-tail")] = None,
    steps: Annotated[Optional[int], T.option("steps")] = None,
    batch_size: Annotated[Optional[int], T.option("batch_size")] = None,
    grad_accum: Annotated[Optional[int], T.option("grad_accum")] = None,
    lr: Annotated[Optional[float], T.option("lr")] = None,
    tau: Annotated[Optional[float], T.option("tau")] = None,
    ppo_clip: Annotated[Optional[float], T.option("ppo_clip")] = None,
    importance_weights: Annotated[Optional[bool], T.option("importance_weights")] = None,
    tis_cap: Annotated[Optional[float], C.option("tis_cap")] = None,
    reject_k: Annotated[Optional[str], C.option("reject_k")] = None,
    reject_threshold: Annotated[Optional[float], C.option("reject_threshold")] = None,
    trust_band: Annotated[Optional[bool], C.option("trust_band")] = None,
    band_low: Annotated[Optional[float], C.option("band_low")] = None,
    band_high: Annotated[Optional[float], C.option("band_high")] = None,
    dual_clip: Annotated[Optional[float], C.option("dual_clip")] = None,
    band_cap: Annotated[Optional[float], C.option("band_cap")] = None,
    checkpoint_every: Annotated[Optional[int], T.option("checkpoint_every")] = None,
    checkpoint: Annotated[Optional[str], T.option("checkpoint")] = None,
    save_dtype: Annotated[Optional[str], T.option("save_dtype")] = None,
    seed: Annotated[Optional[int], T.option("seed")] = None,
    deterministic: Annotated[Optional[bool], T.option("deterministic")] = None,
    tensorboard: Annotated[Optional[bool], T.option("tensorboard")] = None,
    report_to: Annotated[Optional[str], T.option("report_to")] = None,
    online: Annotated[Optional[bool], T.option("online", "--online/--offline")] = None,
    teacher_model: Annotated[Optional[Path], T.option("teacher_model")] = None,
    allow_other_model: Annotated[Optional[bool], T.option("allow_other_model", "--allow-other-model")] = None,
    lr_schedule: Annotated[Optional[str], T.option("lr_schedule")] = None,
    warmup_steps: Annotated[Optional[int], T.option("warmup_steps")] = None,
    min_lr_ratio: Annotated[Optional[float], T.option("min_lr_ratio")] = None,
    kl_coef: Annotated[Optional[float], T.option("kl_coef")] = None,
    kl_estimator: Annotated[Optional[str], T.option("kl_estimator")] = None,
    kl_cap: Annotated[Optional[float], T.option("kl_cap")] = None,
    exact: Annotated[Optional[bool], T.option("exact")] = None,
    rollout_aligned: Annotated[Optional[bool], T.option("rollout_aligned")] = None,
    chunk: Annotated[Optional[int], T.option("chunk")] = None,
    dtype: Annotated[Optional[str], T.option("dtype")] = None,
    gradient_checkpointing: Annotated[Optional[bool], T.option("gradient_checkpointing")] = None,
    pack: Annotated[Optional[bool], T.option("pack", "--pack/--no-pack")] = None,
    fsdp: Annotated[Optional[bool], T.option("fsdp")] = None,
    weight_decay: Annotated[Optional[float], T.option("weight_decay")] = None,
    beta1: Annotated[Optional[float], T.option("beta1")] = None,
    beta2: Annotated[Optional[float], T.option("beta2")] = None,
    max_grad_norm: Annotated[Optional[float], T.option("max_grad_norm")] = None,
    topk_support: Annotated[Optional[str], T.option("topk_support")] = None,
    num_loader_workers: Annotated[Optional[int], T.option("num_loader_workers")] = None,
    max_new_tokens: Annotated[Optional[int], T.option("max_new_tokens")] = None,
    temperature: Annotated[Optional[float], T.option("temperature")] = None,
    eval_every: Annotated[Optional[int], T.option("eval_every")] = None,
    eval_prompts: Annotated[Optional[Path], T.option("eval_prompts")] = None,
    eval_reward: Annotated[Optional[str], T.option("eval_reward")] = None,
    eval_samples: Annotated[Optional[int], T.option("eval_samples")] = None,
    eval_temperature: Annotated[Optional[float], T.option("eval_temperature")] = None,
    eval_max_new_tokens: Annotated[Optional[int], T.option("eval_max_new_tokens")] = None,
    lora_rank: Annotated[Optional[int], T.option("lora_rank")] = None,
    lora_alpha: Annotated[Optional[float], T.option("lora_alpha")] = None,
    lora_dropout: Annotated[Optional[float], T.option("lora_dropout")] = None,
    lora_targets: Annotated[Optional[str], T.option("lora_targets")] = None,
    lora_ref: Annotated[Optional[bool], T.option("lora_ref", "--lora-ref")] = None,
    save: Annotated[Optional[str], T.option("save")] = None,
    stop_after: Annotated[Optional[int], typer.Option("--stop-after", hidden=True)] = None,
    progress: Annotated[Optional[bool], T.option("progress", "--progress/--no-progress")] = None,
) -> None:
    """Lightning OPD (or another estimator) from a cache: no teacher runs during training.

    Memory grows with the model (16 bytes per parameter in float32 with AdamW, split over processes with --fsdp),
    the batch's tokens x hidden activations (with --no-pack batch x longest row x hidden; with --max-batch-tokens that budget's;
    one layer's with --gradient-checkpointing) and [rows, --chunk] logit blocks (1 GiB blocks of [rows, vocabulary]
    on a GPU, where the head's softmax probabilities are kept for the backward within 8 GiB and a quarter of free
    memory); never with tokens x vocabulary beyond that (measured per token: BENCHMARKS.md). A --cache on an object store holds
    one verified shard's bytes in memory while it
    is decoded. Several processes: torchrun --nproc-per-node N -m opdcache.cli.main train ...
    """
    given = dict(locals())  # every flag by its field's name; None where not given
    from opdcache.errors import ConfigError

    values = O.read_config(config, "TrainConfig fields") if config else {}
    if teacher_weights is not None:
        try:
            weights = tuple(float(w) for w in teacher_weights.split(","))
        except ValueError:
            raise ConfigError(f"--teacher-weights takes comma-separated numbers, got {teacher_weights!r}") from None
    flags = {k: v for k, v in given.items() if k not in CORRECTIONS and k not in ("config", "print_config")}
    if teacher_weights is not None:
        flags["teacher_weights"] = weights
    values.update({k: v for k, v in flags.items() if v is not None})
    corr = dict(values.pop("corrections", {}) or {})
    corr.update({k: v for k, v in given.items() if k in CORRECTIONS and v is not None})
    for required in ("model", "cache", "out"):  # before torch is imported: a missing flag is said at once
        if values.get(required) is None:
            raise ConfigError(f"--{required} is required (as a flag or in --config)")
    O.announce_threads()
    from opdcache.training.losses import Corrections
    from opdcache.training.train import TrainConfig, run_train

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"unknown training settings {sorted(unknown)}; see `opdcache train --help`")
    for key in ("model", "out", "teacher_model", "eval_prompts"):  # the cache stays a string: it may be a URL (s3://...)
        if values.get(key) is not None:
            values[key] = Path(values[key])
    cfg = TrainConfig(**values, corrections=Corrections(**corr))
    if print_config:
        import yaml

        typer.echo(yaml.safe_dump(json.loads(json.dumps(dataclasses.asdict(cfg), default=str)), sort_keys=False).rstrip())
        return

    def announce() -> None:  # once the checks have passed: a refused run prints only its error
        if not cfg.online:
            from opdcache.teacher.consistency import lineage_line

            for name in cfg.teachers or (None,):
                typer.echo(lineage_line(cfg.cache, name))

    result = run_train(cfg, announce)
    if result.get("already_done"):
        typer.echo(f"{cfg.out}: already trained to step {result['steps']} with these settings (its checkpoint says so; the "
                   f"model is in {cfg.out / 'model'}); nothing to do. Pass a larger --steps to go on, or another --out")
        return
    last = result.get("last") or {}
    how = "resumed from its checkpoint" if result["resumed"] else "from the start"
    if "stopped_at" in result:
        typer.echo(f"{cfg.out}: stopped at step {result['stopped_at']} ({how}); checkpoint in {cfg.out / 'checkpoint'}")
        return
    loss = f"final loss {last['loss']:.4f}" if "loss" in last else "no step run"
    wrote = f"model in {cfg.out / 'model'}, " if cfg.checkpoint != "none" else "no model (--checkpoint none), "
    typer.echo(f"{cfg.out}: {result['steps']} steps of {cfg.loss} ({how}) in {result['seconds']:.1f} s, {loss}; "
               f"{wrote}metrics in {cfg.out / 'metrics.jsonl'}")
    if result.get("allocator"):
        typer.echo(f"{cfg.out}: --gradient-checkpointing on a CPU: {result['allocator']}")
    sizes = {name: _bytes(cfg.out / name) for name in ("model", "checkpoint")}
    if cfg.checkpoint == "full":
        typer.echo(f"{cfg.out}: {_human(sum(sizes.values()))} on disk: the model {_human(sizes['model'])} ({result['save_dtype']}), the "
                   f"checkpoint {_human(sizes['checkpoint'])} (float32 weights and AdamW's two moments, to resume or add steps; "
                   f"delete {cfg.out / 'checkpoint'} once the run is final, or train with --checkpoint model)")
    elif cfg.checkpoint == "model":
        typer.echo(f"{cfg.out}: {_human(sizes['model'])} on disk: the model ({result['save_dtype']}); no checkpoint "
                   "(--checkpoint model): the run cannot be resumed or extended")


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def register(app: typer.Typer) -> None:
    app.command(short_help="Fine-tune a base model on teacher trajectories.")(sft)
    app.command(short_help="Train a student from a cache (OPD estimators).")(train)
