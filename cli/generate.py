"""``opdcache build-sft`` and ``opdcache build-rollouts``."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from opdcache.cli import options as O


def _json_object(text: str | None) -> dict | None:
    import json

    from opdcache.errors import ConfigError

    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--chat-template-kwargs must be a JSON object, got {text!r} ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--chat-template-kwargs must be a JSON object, got {text!r}")
    return value


def _run(kind: str, model: str, o: dict) -> None:
    """Build and run the job from a command's options (``o``: its parameters by name; build-sft has no
    rollout-only options, which then take their defaults)."""
    O.announce_threads()
    from opdcache.backends.base import SamplingConfig
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.backends import EngineConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate

    job = GenerateJob(
        model=model, revision=o["revision"], out=o["out"], kind=kind, num_shards=o["num_shards"], sft_teacher=o.get("sft_teacher"), reward=o["reward"],
        keep=o.get("keep", "all"), credit_truncated=o["credit_truncated"],
        prompts=PromptConfig(o["prompts"], prompt_field=o["prompt_field"], messages_field=o["messages_field"], answer_field=o["answer_field"],
                             system_prompt=o["system_prompt"], chat_template_kwargs=_json_object(o["chat_template_kwargs"]), split=o["prompt_split"],
                             chat_template=o["chat_template"], strict=o["strict"], limit=o["limit"]),
        sampling=SamplingConfig(temperature=o["temperature"], top_p=o["top_p"], max_new_tokens=o["max_new_tokens"], samples=o["samples"],
                                seed=o["seed"], ref_top_k=o.get("ref_top_k"), mc_samples=o.get("mc_samples")),
        engine=EngineConfig(backend=o["backend"], dtype=o["dtype"], device=o["device"], quantize=o.get("quantize"),
                            tensor_parallel_size=o["tensor_parallel_size"], gpu_memory_utilization=o["gpu_memory_utilization"],
                            generate_batch_size=o["batch_size"], exact=o["exact"], inject=o.get("inject_mismatch"),
                            server_url=o["server_url"], server_kind=o["server_kind"], server_concurrency=o["server_concurrency"],
                            api_key=o["api_key"]),
        num_workers=o["num_workers"], worker_index=o["worker_index"], progress=o["progress"],
    )
    from opdcache.teacher.executors import RayConfig, run_stage

    ray = RayConfig(workers=o["workers"], address=o["ray_address"], gpus_per_worker=o["gpus_per_worker"],
                    cpus_per_worker=o["cpus_per_worker"]) if o["executor"] == "ray" else None
    results = run_stage(run_generate, job, o["executor"], ray, kind)
    O.save_stage_settings(o["ctx"].params, job.out, kind)
    if ray is None:
        typer.echo(results[0].summary())
    else:
        written = sorted(i for r in results for i in r.written)
        typer.echo(f"{job.out}: {len(results)} Ray workers wrote shards {written or 'none (all present)'}; cache complete. {results[0].prompts.summary()}")


Out = Annotated[str, typer.Option("--out", help="Cache to write, a directory or a URL such as s3://bucket/prefix (resumed if it holds a partial run).", show_default=False)]


def build_sft(
    ctx: typer.Context, teacher: O.TeacherModel, prompts: O.Prompts, out: Out, revision: O.ModelRevision = None,
    keep: Annotated[str, O.G.option("keep", state_default=False)] = "all",
    prompt_field: O.PromptField = "prompt", messages_field: O.MessagesField = None, answer_field: O.AnswerField = "answer",
    chat_template: O.ChatTemplate = True, strict: O.Strict = False, limit: O.Limit = None, reward: O.Reward = None, credit_truncated: O.CreditTruncated = False,
    system_prompt: O.SystemPrompt = None, chat_template_kwargs: O.ChatTemplateKwargs = None, prompt_split: O.PromptSplit = "train",
    samples: O.Samples = 1, temperature: O.Temperature = 0.8, top_p: O.TopP = 1.0, max_new_tokens: O.MaxNewTokens = 256,
    seed: O.Seed = 0, backend: O.Backend = "transformers", dtype: O.Dtype = "auto", device: O.Device = "auto", exact: O.Exact = False,
    tensor_parallel_size: O.TensorParallel = 1, gpu_memory_utilization: O.GpuMemory = 0.85, batch_size: O.GenerateBatch = 64, num_shards: O.NumShards = 8,
    server_url: O.ServerUrl = None, server_kind: O.ServerKind = "auto", server_concurrency: O.ServerConcurrency = None, api_key: O.ApiKey = None,
    num_workers: O.NumWorkers = None, worker_index: O.WorkerIndex = None, progress: O.Progress = None,
    executor: O.Executor = "local", ray_address: O.RayAddress = None, workers: O.RayWorkers = 2, gpus_per_worker: O.GpusPerWorker = 0, cpus_per_worker: O.CpusPerWorker = 1,
) -> None:
    """Sample teacher trajectories for SFT (papers/000 eq. 5); the teacher's fingerprint is the lineage.

    Memory: the model, its KV cache (--batch-size x (prompt + --max-new-tokens) per layer), a few reused
    [--batch-size, vocabulary] float32 buffers, one generation group's rows and the shard being written behind them
    (a background thread writes each finished shard while the next is generated); not prompt length x vocabulary.
    To an object store (--out s3://...), each finished shard is spooled to a local temporary file and uploaded whole.
    With --backend server: no model in this process; at most --server-concurrency x replicas requests in flight."""
    _run("sft", teacher, locals())


def build_rollouts(
    ctx: typer.Context, model: O.ModelPath, prompts: O.Prompts, out: Out, revision: O.ModelRevision = None,
    prompt_field: O.PromptField = "prompt", messages_field: O.MessagesField = None, answer_field: O.AnswerField = "answer",
    chat_template: O.ChatTemplate = True, strict: O.Strict = False, limit: O.Limit = None, reward: O.Reward = None, credit_truncated: O.CreditTruncated = False,
    system_prompt: O.SystemPrompt = None, chat_template_kwargs: O.ChatTemplateKwargs = None, prompt_split: O.PromptSplit = "train",
    samples: O.Samples = 1, temperature: O.Temperature = 0.8, top_p: O.TopP = 1.0, max_new_tokens: O.MaxNewTokens = 256,
    seed: O.Seed = 0,
    ref_top_k: Annotated[Optional[int], O.S.option("ref_top_k")] = None,
    mc_samples: Annotated[Optional[int], O.S.option("mc_samples")] = None,
    sft_teacher: Annotated[Optional[str], O.G.option("sft_teacher")] = None,
    backend: O.Backend = "transformers", dtype: O.Dtype = "auto", device: O.Device = "auto", quantize: O.Quantize = None, exact: O.Exact = False, inject_mismatch: O.InjectMismatch = None,
    tensor_parallel_size: O.TensorParallel = 1, gpu_memory_utilization: O.GpuMemory = 0.85, batch_size: O.GenerateBatch = 64, num_shards: O.NumShards = 8,
    server_url: O.ServerUrl = None, server_kind: O.ServerKind = "auto", server_concurrency: O.ServerConcurrency = None, api_key: O.ApiKey = None,
    num_workers: O.NumWorkers = None, worker_index: O.WorkerIndex = None, progress: O.Progress = None,
    executor: O.Executor = "local", ray_address: O.RayAddress = None, workers: O.RayWorkers = 2, gpus_per_worker: O.GpusPerWorker = 0, cpus_per_worker: O.CpusPerWorker = 1,
) -> None:
    """Sample pi_ref rollouts with their log-probs (papers/000 eq. 7).

    Memory: the model, its KV cache (--batch-size x (prompt + --max-new-tokens) per layer), a few reused
    [--batch-size, vocabulary] float32 buffers, one generation group's rows and the shard being written behind them
    (a background thread writes each finished shard while the next is generated); not prompt length x vocabulary
    (measured per token: BENCHMARKS.md, "Real scale"). To an object store (--out s3://...), each finished shard is spooled to a local
    temporary file and uploaded whole. With --backend server: no model in this process; at most --server-concurrency x
    replicas requests in flight, each a sequence's ids and --ref-top-k entries a position."""
    _run("rollouts", model, locals())


def register(app: typer.Typer) -> None:
    app.command("build-sft", short_help="Sample teacher trajectories for SFT.")(build_sft)
    app.command("build-rollouts", short_help="Sample pi_ref rollouts with their log-probs.")(build_rollouts)
