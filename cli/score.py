"""``opdcache score-teacher`` and ``opdcache finalize``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from opdcache.cli import options as O
from opdcache.stores import ALWAYS, REGISTRY

J = O.Fields("opdcache.teacher.scoring", "ScoreJob")
STORE_HELP = "Comma-separated teacher stores: " + "; ".join(store.summary for store in REGISTRY.values()) + "."


def score_teacher(
    ctx: typer.Context,
    cache: O.CachePath,
    teacher: O.TeacherModel, revision: O.ModelRevision = None,
    store: Annotated[str, typer.Option("--store", help=STORE_HELP)] = ",".join(ALWAYS),
    top_k: Annotated[Optional[int], J.option("top_k")] = None,
    topk_precision: Annotated[Optional[str], J.option("topk_precision")] = None,
    topk_mass: Annotated[Optional[float], J.option("topk_mass")] = None,
    samples_per_position: Annotated[Optional[int], J.option("samples_per_position")] = None,
    sample_seed: Annotated[int, J.option("sample_seed", state_default=False)] = 0,
    hidden_dtype: Annotated[Optional[str], J.option("hidden_dtype")] = None,
    svd_rank: Annotated[Optional[int], J.option("svd_rank")] = None,
    svd_method: Annotated[str, J.option("svd_method", state_default=False)] = "prob-weighted",
    svd_min_positions: Annotated[Optional[int], J.option("svd_min_positions")] = None,
    svd_dtype: Annotated[str, J.option("svd_dtype", state_default=False)] = "bfloat16",
    prompts: Annotated[Optional[Path], J.option("prompts")] = None,
    prompt_field: O.PromptField = "prompt", messages_field: O.MessagesField = None,
    name: Annotated[Optional[str], J.option("slug", "--name")] = None,
    allow_inconsistent_teacher: Annotated[bool, J.option("allow_inconsistent_teacher", "--allow-inconsistent-teacher", state_default=False)] = False,
    backend: O.Backend = "transformers", dtype: O.Dtype = "auto", device: O.Device = "auto", deterministic: O.Deterministic = False, exact: O.Exact = False,
    tensor_parallel_size: O.TensorParallel = 1, gpu_memory_utilization: O.GpuMemory = 0.85, max_batch_tokens: O.ScoreBatchTokens = None,
    server_url: O.ServerUrl = None, server_kind: O.ServerKind = "auto", server_concurrency: O.ServerConcurrency = None, api_key: O.ApiKey = None,
    num_workers: O.NumWorkers = None, worker_index: O.WorkerIndex = None, progress: O.Progress = None,
    executor: O.Executor = "local", ray_address: O.RayAddress = None, workers: O.RayWorkers = 2, gpus_per_worker: O.GpusPerWorker = 0, cpus_per_worker: O.CpusPerWorker = 1,
) -> None:
    """Score a rollouts cache with a teacher, once, into teachers/<name>/ (row-aligned).

    Memory: the teacher, decoder activations of --max-batch-tokens padded tokens, two float32 logit blocks of ~2,048
    positions x a vocabulary slice (8 MiB each on a CPU, 1 GiB on a GPU; the second for the error record's moments) and
    the running top-k, and two shards' stored values (the one being scored and the one being written behind it); the
    svd fit adds [hidden, hidden] float64
    moments and the calibration states; the sampled store adds [positions, slices] float64 slice masses and one
    [positions drawing into a slice, slice] block at a time. Never tokens x vocabulary (measured per token:
    BENCHMARKS.md, "Real scale"). To an object store, each finished shard is
    spooled to a local temporary file (one shard on disk) and uploaded whole, while the next shard is scored. With
    --prompts (a teacher with its own tokenizer) add both tokenizers' byte tables (linear in each vocabulary) and the
    prompts' ids in both tokenizations. With --backend server: no teacher in this process; at most --server-concurrency
    x replicas requests in flight, each a sequence's ids and --top-k entries a position."""
    O.announce_threads()
    from opdcache.backends import EngineConfig
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.scoring import ScoreJob, run_score

    job = ScoreJob(prompts=PromptConfig(prompts, prompt_field=prompt_field, messages_field=messages_field) if prompts else None,
                   cache=cache, teacher=teacher, revision=revision, stores=tuple(s.strip() for s in store.split(",") if s.strip()), top_k=top_k,
                   topk_precision=topk_precision, topk_mass=topk_mass, samples_per_position=samples_per_position, sample_seed=sample_seed,
                   svd_rank=svd_rank, svd_method=svd_method, svd_dtype=svd_dtype, svd_min_positions=svd_min_positions, hidden_dtype=hidden_dtype, slug=name, allow_inconsistent_teacher=allow_inconsistent_teacher,
                   engine=EngineConfig(backend=backend, dtype=dtype, device=device, deterministic=deterministic, exact=exact,
                                       tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
                                       max_batch_tokens=max_batch_tokens, server_url=server_url, server_kind=server_kind,
                                       server_concurrency=server_concurrency, api_key=api_key),
                   num_workers=num_workers, worker_index=worker_index, progress=progress)
    from opdcache.teacher.executors import RayConfig, run_stage

    ray = RayConfig(workers=workers, address=ray_address, gpus_per_worker=gpus_per_worker, cpus_per_worker=cpus_per_worker) if executor == "ray" else None
    results = run_stage(run_score, job, executor, ray, f"teachers/{job.table_slug}")
    result = results[0] if ray is None else {**results[0], "written": sorted(i for r in results for i in r["written"]), "finished": True}
    O.save_stage_settings(ctx.params, job.cache, "teachers", result["slug"])
    c = result["consistency"]
    typer.echo(f"teacher consistency: {c['verdict']} ({c['note']})")
    for name, store in REGISTRY.items():  # what each store recorded: the svd fit, the compact top-k, the alignment
        for line in store.describe(result[name]) if result.get(name) else ():
            typer.echo(line)
    if result.get("fidelity"):
        from opdcache.format.fidelity import describe

        for line in describe(result["fidelity"]):
            typer.echo(f"against the full vocabulary: {line}")
    state = "cache updated" if result["finished"] else "shards written; other workers still to finish (then run finalize)"
    typer.echo(f"teachers/{result['slug']}: wrote shards {result['written'] or 'none (all present)'}; {state}")


def finalize(cache: O.CachePath,
             table: Annotated[str, typer.Option("--table", help="rollouts, sft, or teachers/<name>.")] = "rollouts") -> None:
    """Write the manifest after all workers of a job are done (any worker that finishes last does it too)."""
    from opdcache.format.cache import TableJob, finalize_table

    finalize_table(TableJob.from_job_file(cache, table))
    typer.echo(f"{cache}: {table} finalized")


def upgrade(
    cache: O.CachePath,
    teacher: Annotated[Optional[str], typer.Option("--teacher", help="The exact top-k teacher table to compact (default: the only one).", show_default=False)] = None,
    topk_precision: Annotated[Optional[str], typer.Option("--topk-precision", help="float32 or float16 log-probs, or prob14 probability codes (format v4). Default: float16.", show_default=False)] = "float16",
    topk_mass: Annotated[Optional[float], typer.Option("--topk-mass", help="Keep entries until the mass left out is at most this (default 1e-4; 1e-3: the fast path).", show_default=False)] = 1e-4,
    name: Annotated[Optional[str], typer.Option("--name", help="The new table's name (default: <teacher>-compact).", show_default=False)] = None,
    progress: O.Progress = None,
) -> None:
    """Re-encode an exact top-k teacher table as a v3 compact one, beside it, without the teacher model.

    v1 and v2 caches need no upgrade: they read, validate and train unchanged. The compact form is lossy, so it is
    written as a new table teachers/<name> (the source is never touched; its distortion is recorded as score-teacher
    records it) rather than in place. Memory: one shard's columns."""
    from opdcache.teacher.upgrade import run_upgrade

    res = run_upgrade(cache, teacher, topk_precision, topk_mass, name, progress)
    typer.echo(f"{res['table']} (from {res['source']}): wrote shards {res['written'] or 'none (all present)'}")
    for line in res["describe"]:
        typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command("score-teacher", short_help="Score a rollouts cache with a teacher, once.")(score_teacher)
    app.command(short_help="Re-encode an exact top-k table as a compact one.")(upgrade)
    app.command(short_help="Write the manifest once every worker is done.")(finalize)
