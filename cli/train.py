"""``opdcache sft`` and ``opdcache train``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Optional

import typer

from opdcache.cli import options as O
from opdcache.estimators import ESTIMATORS


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
    seed: O.Seed = 0, progress: O.Progress = None,
) -> None:
    """Supervised fine-tuning on teacher trajectories; the output records its SFT teacher (lineage).

    Memory: the model with AdamW (16 bytes per parameter), batch x length x hidden activations, and
    [tokens, 8,192] float32 logit slices of the fused head pass; never tokens x vocabulary."""
    O.announce_threads()
    from opdcache.sft import SFTConfig, run_sft

    result = run_sft(model, data, out, SFTConfig(steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, seed=seed), only_correct,
                     progress, overwrite)
    if result.get("already_done"):
        typer.echo(f"{result['out']}: already fine-tuned from this model on this data with these settings (its lineage says so); nothing to do")
        return
    typer.echo(f"{result['out']}: fine-tuned on {result['pairs']} trajectories of {result['sft_teacher']} (final loss {result['final_loss']:.4f})")


def train(
    model: Annotated[Optional[Path], typer.Option("--model", help="pi_ref (the SFT student). Required (here or in --config).", show_default=False)] = None,
    cache: Annotated[Optional[str], typer.Option("--cache", help="Rollouts cache: a directory or a URL (s3://bucket/prefix, gs://..., hf://datasets/org/name). Required (here or in --config).", show_default=False)] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Output directory (resumed if it holds a checkpoint). Required (here or in --config).", show_default=False)] = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="YAML file of TrainConfig fields; flags override it (default: none).", show_default=False)] = None,
    teacher: Annotated[Optional[str], typer.Option("--teacher", help="Teacher table name in the cache (default: the only one). Several, comma-separated (a,b): the loss is the weighted sum of each teacher's (--teacher-weights), or each row takes one (--teacher-route); for the losses that read only the teachers' log-probs, all sharing the student's tokenizer. Memory: each teacher's columns per token.", show_default=False)] = None,
    teacher_weights: Annotated[Optional[str], typer.Option("--teacher-weights", help="Several teachers: comma-separated weights in --teacher's order (normalised to sum 1; default equal).", show_default=False)] = None,
    teacher_route: Annotated[Optional[str], typer.Option("--teacher-route", help="Several teachers: a prompt field whose value names each row's teacher (a row naming none is refused). Default: none.", show_default=False)] = None,
    max_batch_tokens: Annotated[Optional[int], typer.Option("--max-batch-tokens", help="Cut each batch into groups of rows of at most this many prompt + response tokens, one forward and backward a group, with the whole batch's loss and gradient: the activation memory follows this budget, not the batch size times the longest row (with --pack, the batch's tokens). Default: none (the batch at once). One process only.", show_default=False)] = None,
    loss: Annotated[Optional[str], typer.Option("--loss", help=f"{', '.join(ESTIMATORS)} (default lightning; opdcache/estimators.py says what each reads).", show_default=False)] = None,
    tail: Annotated[Optional[bool], typer.Option("--topk-tail/--no-topk-tail", help="topk-*: the teacher mass outside the support as one more bin (a compact store's stored tail; default off).", show_default=False)] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Optimizer steps (default 150, papers/000 Table 6).", show_default=False)] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Sequences per micro-batch (default 16).", show_default=False)] = None,
    grad_accum: Annotated[Optional[int], typer.Option("--grad-accum", help="Micro-batches per optimizer step (default 1).", show_default=False)] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="AdamW peak learning rate (default 2e-06, papers/000 Table 6, for 1-8B students; the demo's toy models take 3e-5).", show_default=False)] = None,
    tau: Annotated[Optional[float], typer.Option("--tau", help="Lightning advantage clip, nats (default 1: with --kl-coef 1 it improved pi_ref on every demo seed; README, choosing tau).", show_default=False)] = None,
    ppo_clip: Annotated[Optional[float], typer.Option("--ppo-clip", help="ppo: clip range of the old-to-current ratio (default 0.2).", show_default=False)] = None,
    importance_weights: Annotated[Optional[bool], typer.Option("--importance-weights/--no-importance-weights", help="is/mc: weight by pi_theta/pi_old (default on).", show_default=False)] = None,
    tis_cap: Annotated[Optional[float], typer.Option("--tis-cap", help="Token-level truncated IS cap C (default: off).", show_default=False)] = None,
    reject_k: Annotated[Optional[str], typer.Option("--reject-k", help="Sequence rejection estimator: k1 or k3 (default: off).", show_default=False)] = None,
    reject_threshold: Annotated[Optional[float], typer.Option("--reject-threshold", help="--reject-k: drop a sequence whose summed K exceeds this (default 1.0).", show_default=False)] = None,
    trust_band: Annotated[Optional[bool], typer.Option("--trust-band/--no-trust-band", help="Sequence-level trust band with dual clipping (default off).", show_default=False)] = None,
    checkpoint_every: Annotated[Optional[int], typer.Option("--checkpoint-every", help="Checkpoint every N steps (default 0: at the end only).", show_default=False)] = None,
    checkpoint: Annotated[Optional[str], typer.Option("--checkpoint", help="What to write: full (model and a resumable checkpoint with AdamW's state, 16 bytes a parameter), model (the final model only) or none (default full).", show_default=False)] = None,
    save_dtype: Annotated[Optional[str], typer.Option("--save-dtype", help="The final model's dtype: auto (the training compute dtype), float32 or bfloat16 (default auto).", show_default=False)] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seed of the data order and initialisation (default 0).", show_default=False)] = None,
    deterministic: Annotated[Optional[bool], typer.Option("--deterministic/--no-deterministic", help="Deterministic kernels: bit-reproducible CPU runs (default off).", show_default=False)] = None,
    tensorboard: Annotated[Optional[bool], typer.Option("--tensorboard/--no-tensorboard", help="Also write TensorBoard events (default off).", show_default=False)] = None,
    online: Annotated[Optional[bool], typer.Option("--online/--offline", help="Standard-OPD baseline with a live teacher (default --offline).", show_default=False)] = None,
    teacher_model: Annotated[Optional[Path], typer.Option("--teacher-model", help="--online: the live teacher (default: none; required with --online).", show_default=False)] = None,
    allow_other_model: Annotated[Optional[bool], typer.Option("--allow-other-model", help="Train a --model other than the one that sampled the rollouts (default off).", show_default=False)] = None,
    lr_schedule: Annotated[Optional[str], typer.Option("--lr-schedule", help="constant or cosine (after --warmup-steps; default constant).", show_default=False)] = None,
    warmup_steps: Annotated[Optional[int], typer.Option("--warmup-steps", help="Linear warm-up steps (default 0).", show_default=False)] = None,
    min_lr_ratio: Annotated[Optional[float], typer.Option("--min-lr-ratio", help="cosine: final lr as a fraction of --lr (default 0.0).", show_default=False)] = None,
    kl_coef: Annotated[Optional[float], typer.Option("--kl-coef", help="KL penalty to pi_ref (default 1, measured on the demo; 0: off): from the cached ref_logprobs; --online: a frozen pi_ref scores the fresh samples.", show_default=False)] = None,
    kl_estimator: Annotated[Optional[str], typer.Option("--kl-estimator", help="k1, k2 or k3 (low-variance; the default) penalty (opdcache/losses.py: the forms for pi_ref's cached samples, or --online the student's).", show_default=False)] = None,
    kl_cap: Annotated[Optional[float], typer.Option("--kl-cap", help="Largest per-token KL penalty term, nats (default 10, verl's clamp: k3 grows as exp; 0: no cap).", show_default=False)] = None,
    exact: Annotated[Optional[bool], typer.Option("--exact/--no-exact", help="The exact arithmetic (papers/003): the student's log-probs are bit-identical to an --exact engine's (importance weight exactly 1 at step 0) whatever the batch, padding or threads, in the arithmetic the rollouts record: the CPU's (the same bits on any device; memory: float64 copies of each layer's inputs and outputs, about 2x the activations) or the GPU's batch-invariant kernels (a CUDA GPU); float32 or bfloat16, the rollouts' dtype by default. Default off.", show_default=False)] = None,
    rollout_aligned: Annotated[Optional[bool], typer.Option("--rollout-aligned/--no-rollout-aligned", help="QaRL: the student computes in the rollouts' recorded low-bit scheme (from float32 masters, straight-through gradients), as does the corrections' pi_ref (default off).", show_default=False)] = None,
    chunk: Annotated[Optional[int], typer.Option("--chunk", help="Vocabulary slice width of the fused head pass on a CPU (default 8192; a GPU takes whole vocabulary rows in blocks of up to 1 GiB).", show_default=False)] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="auto, float32 or bfloat16 (autocast over float32 master weights; default auto: bfloat16 on a GPU that has it).", show_default=False)] = None,
    gradient_checkpointing: Annotated[Optional[bool], typer.Option("--gradient-checkpointing/--no-gradient-checkpointing", help="Recompute layer activations in the backward (default off).", show_default=False)] = None,
    pack: Annotated[Optional[bool], typer.Option("--pack/--no-pack", help="Packed batches: the student's forward on the batch's sequences end to end, no compute on padding; the same losses (default off; not with --exact or --online).", show_default=False)] = None,
    fsdp: Annotated[Optional[bool], typer.Option("--fsdp/--no-fsdp", help="Shard the student over torchrun's processes (FSDP2; default off).", show_default=False)] = None,
    stop_after: Annotated[Optional[int], typer.Option("--stop-after", hidden=True)] = None,
    progress: O.Progress = None,
) -> None:
    """Lightning OPD (or another estimator) from a cache: no teacher runs during training.

    Memory grows with the model (16 bytes per parameter in float32 with AdamW, split over processes with --fsdp),
    batch x length x hidden activations (with --pack the batch's tokens x hidden; one layer's with --gradient-checkpointing) and [rows, --chunk] logit blocks (64 MiB; 1 GiB of [rows, vocabulary] on a GPU);
    never with tokens x vocabulary (measured at hidden 1,024, 8 layers, float32: ~85 KiB a token per layer; with
    --gradient-checkpointing 70 KiB a token in all, on a CPU with glibc's mmap threshold fixed so that freed recompute
    buffers leave the RSS, for ~5% more time; the full-vocabulary losses add 256 MiB of blocks at vocabulary 151,936). A --cache on an object store holds one verified shard's bytes in memory while it
    is decoded. Several processes: torchrun --nproc-per-node N -m opdcache.cli.main train ...
    """
    import yaml

    from opdcache.errors import ConfigError

    values = yaml.safe_load(config.read_text()) if config else {}
    if not isinstance(values, dict):
        raise ConfigError(f"--config {config} must hold a mapping of TrainConfig fields")
    if teacher_weights is not None:
        try:
            weights = tuple(float(w) for w in teacher_weights.split(","))
        except ValueError:
            raise ConfigError(f"--teacher-weights takes comma-separated numbers, got {teacher_weights!r}") from None
    flags = dict(model=model, cache=cache, out=out, teacher=teacher, teacher_weights=weights if teacher_weights is not None else None,
                 teacher_route=teacher_route, max_batch_tokens=max_batch_tokens, loss=loss, steps=steps, batch_size=batch_size, grad_accum=grad_accum,
                 lr=lr, tau=tau, ppo_clip=ppo_clip, importance_weights=importance_weights, checkpoint_every=checkpoint_every, checkpoint=checkpoint, save_dtype=save_dtype, seed=seed, deterministic=deterministic, tensorboard=tensorboard,
                 online=online, teacher_model=teacher_model, allow_other_model=allow_other_model, stop_after=stop_after, progress=progress, lr_schedule=lr_schedule,
                 warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio, kl_coef=kl_coef, kl_estimator=kl_estimator, kl_cap=kl_cap, rollout_aligned=rollout_aligned, chunk=chunk, dtype=dtype, exact=exact,
                 gradient_checkpointing=gradient_checkpointing, pack=pack, fsdp=fsdp, tail=tail)
    values.update({k: v for k, v in flags.items() if v is not None})
    corr = dict(values.pop("corrections", {}) or {})
    corr.update({k: v for k, v in dict(tis_cap=tis_cap, reject_k=reject_k, reject_threshold=reject_threshold, trust_band=trust_band).items() if v is not None})
    for required in ("model", "cache", "out"):  # before torch is imported: a missing flag is said at once
        if values.get(required) is None:
            raise ConfigError(f"--{required} is required (as a flag or in --config)")
    O.announce_threads()
    from opdcache.losses import Corrections
    from opdcache.train import TrainConfig, run_train

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"unknown training settings {sorted(unknown)}; see `opdcache train --help`")
    for key in ("model", "out", "teacher_model"):  # the cache stays a string: it may be a URL (s3://...)
        if values.get(key) is not None:
            values[key] = Path(values[key])
    cfg = TrainConfig(**values, corrections=Corrections(**corr))
    if not cfg.online:
        from opdcache.consistency import lineage_line

        for name in cfg.teachers or (None,):
            typer.echo(lineage_line(cfg.cache, name))
    result = run_train(cfg)
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
