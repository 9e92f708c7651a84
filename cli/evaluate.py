"""``opdcache eval``."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from opdcache.cli import options as O


def eval_(
    model: O.ModelPath, prompts: O.Prompts,
    reward: Annotated[str, typer.Option("--reward", help="The verifier that judges each response against its prompt's answer: "
                                                         "exact, math, a registered plugin (the demo's addition) or module:function. Required.",
                                        show_default=False)],
    prompt_field: O.PromptField = "prompt", messages_field: O.MessagesField = None, answer_field: O.AnswerField = "answer",
    chat_template: O.ChatTemplate = True, strict: O.Strict = False, limit: O.Limit = None,
    system_prompt: O.SystemPrompt = None, prompt_split: O.PromptSplit = "train",
    samples: Annotated[int, typer.Option("--samples", help="Responses a prompt (k of pass@k); above 1 needs --temperature above 0.")] = 1,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature; 0 is greedy.")] = 0.0,
    top_p: O.TopP = 1.0, max_new_tokens: O.MaxNewTokens = 256, seed: O.Seed = 0,
    backend: O.Backend = "transformers", dtype: O.Dtype = "auto", device: O.Device = "auto",
    tensor_parallel_size: O.TensorParallel = 1, gpu_memory_utilization: O.GpuMemory = 0.85, batch_size: O.GenerateBatch = 64,
    server_url: O.ServerUrl = None, server_kind: O.ServerKind = "auto", server_concurrency: O.ServerConcurrency = None, api_key: O.ApiKey = None,
    teacher: Annotated[Optional[str], typer.Option("--teacher", help="Also the mean per-token reverse KL(model || teacher), exact over "
                                                  "the vocabulary at temperature 1, at every position of the responses: a "
                                                  "folder or Hub id with the model's vocabulary. Memory: after the engine "
                                                  "closes, both models and one sequence's hidden states a side. Default: none.", show_default=False)] = None,
    as_json: O.JsonOut = False,
) -> None:
    """A model's held-out accuracy and pass@k on prompts with answers, judged by a verifier, through the engines
    build-rollouts uses (a served or vLLM engine evaluates too); the same seed draws the same responses.

    Memory: the engine's, as build-rollouts (the model, its KV cache --batch-size x (prompt + --max-new-tokens) per
    layer), and the responses' ids."""
    O.announce_threads()
    from opdcache.backends import EngineConfig
    from opdcache.backends.base import SamplingConfig
    from opdcache.evaluation.evaluate import EvalJob, run_eval
    from opdcache.inputs.prompts import PromptConfig

    job = EvalJob(
        model=model, reward=reward, teacher=teacher,
        prompts=PromptConfig(prompts, prompt_field=prompt_field, messages_field=messages_field, answer_field=answer_field,
                             system_prompt=system_prompt, split=prompt_split, chat_template=chat_template, strict=strict, limit=limit),
        sampling=SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, samples=samples, seed=seed),
        engine=EngineConfig(backend=backend, dtype=dtype, device=device, tensor_parallel_size=tensor_parallel_size,
                            gpu_memory_utilization=gpu_memory_utilization, generate_batch_size=batch_size, server_url=server_url,
                            server_kind=server_kind, server_concurrency=server_concurrency, api_key=api_key))
    report = run_eval(job)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    how = "greedy" if temperature == 0 else f"{samples} samples a prompt at temperature {temperature}, seed {seed}"
    passes = ", ".join(f"pass@{k} {v:.1%}" for k, v in report["pass_at"].items())
    typer.echo(f"{report['model']}: accuracy {report['accuracy']:.1%} on {report['prompts']} prompts ({how}; {passes}); "
               f"mean response {report['mean_response_tokens']:.1f} tokens, {report['truncated_share']:.1%} cut at --max-new-tokens"
               + (f"; reverse KL to {report['teacher']} {report['reverse_kl_to_teacher']:.4f} nats a token over "
                  f"{report['kl_tokens']} tokens" if teacher is not None else ""))


def register(app: typer.Typer) -> None:
    app.command("eval", short_help="A model's accuracy and pass@k on prompts with answers.")(eval_)
