"""``opdcache build-sft`` and ``opdcache build-rollouts``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from opdcache.cli import options as O


def _run(kind: str, model: Path, prompts: Path, out: Path, prompt_field: str, messages_field, answer_field, chat_template, strict, limit,
         reward, samples, temperature, top_p, max_new_tokens, seed, ref_top_k, mc_samples, backend, dtype, device, quantize,
         tensor_parallel_size, gpu_memory_utilization, num_shards, sft_teacher, num_workers, worker_index, progress) -> None:
    from opdcache.backends.base import SamplingConfig
    from opdcache.prompts import PromptConfig
    from opdcache.rollouts import EngineConfig, GenerateJob, run_generate

    job = GenerateJob(
        model=model, out=out, kind=kind, num_shards=num_shards, sft_teacher=sft_teacher, reward=reward,
        prompts=PromptConfig(prompts, prompt_field=prompt_field, messages_field=messages_field, answer_field=answer_field,
                             chat_template=chat_template, strict=strict, limit=limit),
        sampling=SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, samples=samples, seed=seed,
                                ref_top_k=ref_top_k, mc_samples=mc_samples),
        engine=EngineConfig(backend=backend, dtype=dtype, device=device, quantize=quantize, tensor_parallel_size=tensor_parallel_size,
                            gpu_memory_utilization=gpu_memory_utilization),
        num_workers=num_workers, worker_index=worker_index, progress=progress,
    )
    typer.echo(run_generate(job).summary())


Out = Annotated[Path, typer.Option("--out", help="Cache directory to write (resumed if it holds a partial run).", show_default=False)]


def build_sft(
    teacher: Annotated[Path, typer.Option("--teacher", help="Teacher model directory.", show_default=False)],
    prompts: O.Prompts, out: Out,
    prompt_field: O.PromptField = "prompt", messages_field: O.MessagesField = None, answer_field: O.AnswerField = "answer",
    chat_template: O.ChatTemplate = True, strict: O.Strict = False, limit: O.Limit = None, reward: O.Reward = None,
    samples: O.Samples = 1, temperature: O.Temperature = 0.8, top_p: O.TopP = 1.0, max_new_tokens: O.MaxNewTokens = 256,
    seed: O.Seed = 0, backend: O.Backend = "transformers", dtype: O.Dtype = "auto", device: O.Device = "auto",
    tensor_parallel_size: O.TensorParallel = 1, gpu_memory_utilization: O.GpuMemory = 0.85, num_shards: O.NumShards = 8,
    num_workers: O.NumWorkers = None, worker_index: O.WorkerIndex = None, progress: O.Progress = None,
) -> None:
    """Sample teacher trajectories for SFT (papers/000 eq. 5); the teacher's fingerprint is the lineage."""
    _run("sft", teacher, prompts, out, prompt_field, messages_field, answer_field, chat_template, strict, limit, reward, samples,
         temperature, top_p, max_new_tokens, seed, None, None, backend, dtype, device, None, tensor_parallel_size,
         gpu_memory_utilization, num_shards, None, num_workers, worker_index, progress)


def build_rollouts(
    model: O.ModelPath, prompts: O.Prompts, out: Out,
    prompt_field: O.PromptField = "prompt", messages_field: O.MessagesField = None, answer_field: O.AnswerField = "answer",
    chat_template: O.ChatTemplate = True, strict: O.Strict = False, limit: O.Limit = None, reward: O.Reward = None,
    samples: O.Samples = 1, temperature: O.Temperature = 0.8, top_p: O.TopP = 1.0, max_new_tokens: O.MaxNewTokens = 256,
    seed: O.Seed = 0,
    ref_top_k: Annotated[Optional[int], typer.Option("--ref-top-k", help="Store pi_ref's top-k per position (temperature 1).", show_default=False)] = None,
    mc_samples: Annotated[Optional[int], typer.Option("--mc-samples", help="Extra next-token samples per position, not rolled out (papers/001 6.1).", show_default=False)] = None,
    sft_teacher: Annotated[Optional[Path], typer.Option("--sft-teacher", help="The teacher pi_ref was fine-tuned on, if pi_ref has no opdcache lineage.", show_default=False)] = None,
    backend: O.Backend = "transformers", dtype: O.Dtype = "auto", device: O.Device = "auto", quantize: O.Quantize = None,
    tensor_parallel_size: O.TensorParallel = 1, gpu_memory_utilization: O.GpuMemory = 0.85, num_shards: O.NumShards = 8,
    num_workers: O.NumWorkers = None, worker_index: O.WorkerIndex = None, progress: O.Progress = None,
) -> None:
    """Sample pi_ref rollouts with their log-probs (papers/000 eq. 7)."""
    _run("rollouts", model, prompts, out, prompt_field, messages_field, answer_field, chat_template, strict, limit, reward, samples,
         temperature, top_p, max_new_tokens, seed, ref_top_k, mc_samples, backend, dtype, device, quantize, tensor_parallel_size,
         gpu_memory_utilization, num_shards, sft_teacher, num_workers, worker_index, progress)


def register(app: typer.Typer) -> None:
    app.command("build-sft")(build_sft)
    app.command("build-rollouts")(build_rollouts)
