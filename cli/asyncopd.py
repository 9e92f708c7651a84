"""``opdcache async``: AsyncOPD over one cache (papers/001)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from opdcache.cli import options as O
from opdcache.training.estimators import ASYNC

T = O.Fields("opdcache.training.trainconfig", "TrainConfig")
A = O.Fields("opdcache.asyncopd.config", "AsyncConfig")
DEFAULTS = O.literal("opdcache.asyncopd.config", "LEARNER_DEFAULTS")  # where the async learner's defaults differ from train's
LEARNER = O.literal("opdcache.asyncopd.config", "LEARNER_SETTINGS")
ONE_BATCH_EACH = "Here also the number of rollout batches, one per update."
EXACT_STAGES = "Here every stage: the rollout engine's, the teacher's and the learner's numbers are the same bits for the same weights."


def async_(
    model: Annotated[Path, T.option("model", note="It also samples the first batches.")],
    teacher: Annotated[Path, A.option("teacher")],
    prompts: O.Prompts,
    out: Annotated[Path, A.option("out", note="Rerun the same command to resume.")],
    cache: Annotated[Optional[str], A.option("cache")] = None,
    staleness: Annotated[Optional[int], A.option("staleness", "--staleness", "-k")] = None,
    no_refresh: Annotated[bool, typer.Option("--no-refresh", help="Never refresh the sampler: every batch from the initial student (Lightning OPD).")] = False,
    steps: Annotated[Optional[int], T.option("steps", note=ONE_BATCH_EACH, defaults=DEFAULTS)] = None,
    batch_size: Annotated[Optional[int], T.option("batch_size", note="Here: prompts per batch, one response each.", defaults=DEFAULTS)] = None,
    loss: Annotated[Optional[str], T.option("loss", note=f"One of {', '.join(ASYNC)}.", defaults=DEFAULTS)] = None,
    importance_weights: Annotated[Optional[bool], T.option("importance_weights", defaults=DEFAULTS)] = None,
    mc_samples: Annotated[Optional[int], typer.Option("--mc-samples", help="m next-token samples per position (--loss mc). Default: none (required with --loss mc).", show_default=False)] = None,
    top_k: Annotated[Optional[int], A.option("top_k", note="Required with --loss topk-fkl.")] = None,
    temperature: O.Temperature = 1.0,
    top_p: O.TopP = 1.0,
    max_new_tokens: O.MaxNewTokens = 64,
    lr: Annotated[Optional[float], T.option("lr", defaults=DEFAULTS)] = None,
    tau: Annotated[Optional[float], T.option("tau", defaults=DEFAULTS)] = None,
    ppo_clip: Annotated[Optional[float], T.option("ppo_clip", defaults=DEFAULTS)] = None,
    max_grad_norm: Annotated[Optional[float], T.option("max_grad_norm", defaults=DEFAULTS)] = None,
    weight_decay: Annotated[Optional[float], T.option("weight_decay", defaults=DEFAULTS)] = None,
    chunk: Annotated[Optional[int], T.option("chunk", defaults=DEFAULTS)] = None,
    checkpoint_every: Annotated[Optional[int], T.option("checkpoint_every", note="Here at least 1: a killed learner redoes at most N - 1 updates.", defaults=DEFAULTS)] = None,
    keep_snapshots: Annotated[Optional[bool], A.option("keep_snapshots", "--keep-snapshots")] = None,
    executor: Annotated[Optional[str], A.option("executor")] = None,
    gpus: Annotated[Optional[str], A.option("gpus_per_stage", note="Three comma-separated numbers: 0,1,1.")] = None,
    ray_address: Annotated[Optional[str], A.option("ray_address")] = None,
    device: Annotated[Optional[str], A.option("device")] = None,
    threads: Annotated[Optional[int], A.option("threads")] = None,
    seed: Annotated[Optional[int], T.option("seed", note="Here also of the prompt order and the sampling streams.", defaults=DEFAULTS)] = None,
    deterministic: Annotated[Optional[bool], T.option("deterministic", "--deterministic", defaults=DEFAULTS)] = None,
    exact: Annotated[Optional[bool], T.option("exact", "--exact", note=EXACT_STAGES, defaults=DEFAULTS)] = None,
    prompt_field: O.PromptField = "prompt",
    messages_field: O.MessagesField = None,
    system_prompt: O.SystemPrompt = None,
    chat_template: O.ChatTemplate = True,
    limit: O.Limit = None,
    as_json: O.JsonOut = False,
    report_to: Annotated[Optional[str], T.option("report_to", note="The learner's metrics.", defaults=DEFAULTS)] = None,
    lora_rank: Annotated[Optional[int], T.option("lora_rank", note="The learner publishes its adapters alone; the rollout worker loads them onto the frozen base.")] = None,
    lora_alpha: Annotated[Optional[float], T.option("lora_alpha")] = None,
    lora_dropout: Annotated[Optional[float], T.option("lora_dropout")] = None,
    lora_targets: Annotated[Optional[str], T.option("lora_targets")] = None,
    progress: Annotated[Optional[bool], T.option("progress", "--progress/--no-progress")] = None,
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
    given = {k: v for k, v in locals().items() if v is not None}
    from opdcache.asyncopd import AsyncConfig, learner, run_async
    from opdcache.backends.base import SamplingConfig
    from opdcache.errors import ConfigError
    from opdcache.inputs.prompts import PromptConfig

    if gpus is not None:
        try:
            given["gpus_per_stage"] = tuple(float(x) for x in gpus.split(","))
        except ValueError:
            given["gpus_per_stage"] = ()
        if len(given["gpus_per_stage"]) != 3:
            raise ConfigError(f"--gpus-per-stage takes three numbers (rollout,teacher,learner), got {gpus!r}")
    if no_refresh:
        given["staleness"] = None
    run = {k: given[k] for k in LEARNER if k in given and k != "model"}
    own = {f.name: given[f.name] for f in dataclasses.fields(AsyncConfig)  # the run's own settings the flags gave
           if f.name in given and f.name not in ("learner", "teacher", "prompts", "out", "sampling")}
    settings = learner(model, **run)
    cfg = AsyncConfig(
        learner=settings, teacher=Path(teacher), out=out,
        prompts=PromptConfig(prompts, prompt_field=prompt_field, messages_field=messages_field, system_prompt=system_prompt, limit=limit,
                             chat_template=chat_template),
        sampling=SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, mc_samples=mc_samples, seed=settings.seed),
        **own)
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
    typer.echo(f"{out}: {fig['updates']} updates of {cfg.learner.loss} at {k}{timed}; cache {result['cache']} "
               f"(`opdcache info` shows each shard's sampling snapshot and staleness); model in {out / 'learner' / 'model'}")


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def register(app: typer.Typer) -> None:
    app.command("async", short_help="AsyncOPD: rollout, teacher and learner at once.")(async_)
