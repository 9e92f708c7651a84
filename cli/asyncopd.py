"""``opdcache async``: AsyncOPD over one cache (papers/001)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from opdcache.cli import options as O


def async_(
    model: O.ModelPath,
    teacher: O.TeacherModel,
    prompts: O.Prompts,
    out: Annotated[Path, typer.Option("--out", help="Run directory (local): run.json, ledger.jsonl, learner/, stages/. Rerun the same command to resume.", show_default=False)],
    cache: Annotated[Optional[str], typer.Option("--cache", help="The cache the stages share: a directory or a URL (s3://bucket/prefix). Default: OUT/cache.", show_default=False)] = None,
    staleness: Annotated[int, typer.Option("--staleness", "-k", help="K: batch b is sampled by the student after update b-K (0: strict synchronous).")] = 1,
    no_refresh: Annotated[bool, typer.Option("--no-refresh", help="Never refresh the sampler: every batch from the initial student (Lightning OPD).")] = False,
    steps: Annotated[int, typer.Option("--steps", help="Learner updates, one rollout batch each.")] = 50,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Prompts per batch (one response each).")] = 16,
    loss: Annotated[str, typer.Option("--loss", help="is (A_theta, unclipped IS), mc (m samples), ppo (A_old, clipped), topk-fkl or lightning.")] = "is",
    importance_weights: Annotated[bool, typer.Option("--importance-weights/--no-importance-weights", help="is/mc: weight stale samples by pi_theta/pi_old.")] = True,
    mc_samples: Annotated[Optional[int], typer.Option("--mc-samples", help="m next-token samples per position (--loss mc). Default: none (required with --loss mc).", show_default=False)] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="Teacher top-k width (--loss topk-fkl). Default: none (required with --loss topk-*).", show_default=False)] = None,
    temperature: O.Temperature = 1.0,
    top_p: O.TopP = 1.0,
    max_new_tokens: O.MaxNewTokens = 64,
    lr: Annotated[float, typer.Option("--lr", help="Learner learning rate (AdamW, constant).")] = 1e-5,
    tau: Annotated[float, typer.Option("--tau", help="lightning: advantage clip, nats (train's default).")] = 1.0,
    ppo_clip: Annotated[float, typer.Option("--ppo-clip", help="ppo: clip range of the old-to-current ratio.")] = 0.2,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="Learner checkpoint every N steps.")] = 1,
    keep_snapshots: Annotated[bool, typer.Option("--keep-snapshots", help="Keep every published student snapshot in the cache.")] = False,
    executor: Annotated[str, typer.Option("--executor", help="local (one process per stage on this machine) or ray (one Ray task per stage, with --gpus-per-stage).")] = "local",
    gpus: Annotated[str, typer.Option("--gpus-per-stage", help="--executor ray: GPUs of the rollout,teacher,learner stages.")] = "0,0,0",
    ray_address: O.RayAddress = None,
    device: O.Device = "auto",
    threads: Annotated[Optional[int], typer.Option("--threads", help="Torch threads per stage (default: usable CPUs / 3).", show_default=False)] = None,
    seed: O.Seed = 0,
    deterministic: Annotated[bool, typer.Option("--deterministic", help="Deterministic learner kernels.")] = False,
    exact: O.Exact = False,
    prompt_field: O.PromptField = "prompt",
    messages_field: O.MessagesField = None,
    system_prompt: O.SystemPrompt = None,
    chat_template: O.ChatTemplate = True,
    limit: O.Limit = None,
    as_json: O.JsonOut = False,
    progress: O.Progress = None,
) -> None:
    """Rollout, teacher scoring and learner at once over one cache, K batches stale (AsyncOPD, papers/001).

    Three processes (or Ray tasks) share nothing but the cache: the rollout stage writes batch b sampled by the student
    snapshot of update max(0, b-K), the teacher stage scores it, the learner consumes it with A_theta recomputed at
    learner time and publishes the snapshots. Kill any stage and rerun the command: it resumes, and no batch is lost or
    consumed twice. Memory per stage: rollout, the student and its KV cache [batch, prompt + response] per layer;
    teacher, the teacher and [positions, chunk] logit blocks; learner, as `opdcache train` (16 bytes per parameter,
    batch x length x hidden activations, tokens x chunk logit slices); never tokens x vocabulary. The cache grows by
    one shard per step (plus one snapshot of the student, deleted once no batch needs it).
    """
    from opdcache.asyncopd import AsyncConfig, run_async
    from opdcache.backends.base import SamplingConfig
    from opdcache.errors import ConfigError
    from opdcache.prompts import PromptConfig

    try:
        gpus_per_stage = tuple(float(x) for x in gpus.split(","))
    except ValueError:
        gpus_per_stage = ()
    if len(gpus_per_stage) != 3:
        raise ConfigError(f"--gpus-per-stage takes three numbers (rollout,teacher,learner), got {gpus!r}")
    cfg = AsyncConfig(
        model=Path(model), teacher=Path(teacher), out=out, cache=cache, staleness=None if no_refresh else staleness,
        prompts=PromptConfig(prompts, prompt_field=prompt_field, messages_field=messages_field, system_prompt=system_prompt, limit=limit,
                             chat_template=chat_template),
        steps=steps, batch_size=batch_size, loss=loss, importance_weights=importance_weights, top_k=top_k,
        sampling=SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, mc_samples=mc_samples, seed=seed),
        lr=lr, tau=tau, ppo_clip=ppo_clip, checkpoint_every=checkpoint_every, keep_snapshots=keep_snapshots, executor=executor,
        gpus_per_stage=gpus_per_stage, ray_address=ray_address, device=device, threads=threads, seed=seed,
        deterministic=deterministic, exact=exact, progress=progress)
    result = run_async(cfg)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    fig = result["figures"]
    k = "no refresh" if cfg.staleness is None else f"K={cfg.staleness}"
    attempt = f" (this attempt, the {_ordinal(fig['attempt'])}: {fig['updates_this_attempt']} updates)" if fig.get("attempt", 1) > 1 else ""
    rate = f", {fig['throughput_tokens_per_s']:.0f} response tokens/s after 5 warm-up updates" if "throughput_tokens_per_s" in fig else ""
    overlap = (f", overlap {fig['overlap']:.2f} (stage-busy seconds per wall second: 1 is one stage at a time, 3 all three "
               "always busy)") if "overlap" in fig else ""
    timed = f"{rate}{overlap}{attempt}" if rate or overlap else ""
    typer.echo(f"{out}: {fig['updates']} updates of {cfg.loss} at {k}{timed}; cache {result['cache']} "
               f"(`opdcache info` shows each shard's sampling snapshot and staleness); model in {out / 'learner' / 'model'}")


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def register(app: typer.Typer) -> None:
    app.command("async", short_help="AsyncOPD: rollout, teacher and learner at once.")(async_)
