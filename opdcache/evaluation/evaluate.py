"""``opdcache eval``: a model's held-out accuracy and pass@k on prompts with answers, judged by a verifier.

The model samples ``samples`` responses a prompt through the same engine, prompt reading and sampling streams as
``build-rollouts`` (so a served or vLLM engine evaluates too, and a rerun with the same seed draws the same responses);
temperature 0 is greedy (one response a prompt is enough). Each response is judged by the ``--reward`` verifier
(opdcache/inputs/verifiers.py: exact, math, a plugin or module:function). Reported: accuracy (the mean score of every
response), pass@1 .. pass@k by the unbiased estimator 1 - C(n - c, j) / C(n, j) over each prompt's n samples, c of
them correct (Chen et al. 2021), the mean response length and the share of responses cut at ``max_new_tokens``.
With a ``teacher`` (one sharing the model's vocabulary): the mean per-token reverse KL(model || teacher), exact over
the vocabulary at temperature 1, at every position of the model's own responses (:func:`reverse_kl_to_teacher`):
``reverse_kl_to_teacher`` in nats a token, averaged over the ``kl_tokens`` response tokens of every sample.
Memory: the engine's (build-rollouts'), and the responses' ids; with a teacher, after the engine is closed, both models
and one sequence's final hidden states a side, through the heads in [rows, chunk] blocks (never [tokens, vocabulary]).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from opdcache.backends import EngineConfig
from opdcache.backends.base import SamplingConfig
from opdcache.errors import ConfigError
from opdcache.inputs.prompts import PromptConfig


@dataclass(frozen=True)
class EvalJob:
    model: Path | str
    """The model to evaluate (a folder or a Hub id)."""
    prompts: PromptConfig
    reward: str
    """The verifier that judges each response against its prompt's answer."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0, samples=1))
    engine: EngineConfig = field(default_factory=EngineConfig)
    examples: int = 3
    """How many (prompt, response, score) triples to keep in the report."""
    teacher: Path | str | None = None
    """Also the mean per-token reverse KL to this model (a folder or a Hub id with the model's vocabulary), exact over
    the vocabulary, at every position of the responses. Default: none."""

    def __post_init__(self) -> None:
        from opdcache.inputs import verifiers

        verifiers.resolve(self.reward)  # an unknown verifier: one line, before any model loads
        if self.sampling.temperature == 0 and self.sampling.samples > 1:
            raise ConfigError("--samples above 1 with --temperature 0 draws the same greedy response again; sample with "
                              "--temperature above 0 for pass@k")
        self.engine.check_sampling(self.sampling.temperature)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator from n samples, c of them correct: 1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def run_eval(job: EvalJob) -> dict:
    """Sample, judge and summarise (see the module docstring); the report as a dict."""
    from opdcache.backends import make_backend
    from opdcache.inputs.models import load_tokenizer, resolve_model
    from opdcache.inputs.prompts import check_local_prompts

    check_local_prompts(Path(job.prompts.path), must_exist=True)
    ref = resolve_model(job.model, None, "--model")
    tokenizer = load_tokenizer(ref.path)
    teacher = None if job.teacher is None else resolve_model(job.teacher, None, "--teacher")
    if teacher is not None:
        check_shared_vocabulary(ref.path, tokenizer, teacher.path)
    backend = make_backend(ref.path, job.engine)
    try:
        backend.load()
        sequences: list = []
        report = evaluate(backend, tokenizer, job, sequences=sequences if teacher is not None else None)
    finally:
        if hasattr(backend, "close"):
            backend.close()
    report = report | {"model": str(ref.name)}
    if teacher is not None:  # the engine is closed: its memory is free for the two models the KL reads
        from opdcache.backends.loading import resolve_device, resolve_dtype
        from opdcache.inputs.models import load_causal_lm

        device = resolve_device(job.engine.device)
        dtype = resolve_dtype(job.engine.dtype, device)
        student, teacher_model = (load_causal_lm(path, dtype).to(device).eval() for path in (ref.path, teacher.path))
        kl, tokens = reverse_kl_to_teacher(student, teacher_model, sequences)
        report |= {"teacher": str(teacher.name), "reverse_kl_to_teacher": kl, "kl_tokens": tokens}
    return report


def check_shared_vocabulary(model_path, tokenizer, teacher_path) -> None:
    """Refuse, in one line before any weights load, a teacher whose tokens or head rows are not the model's: the KL
    compares the two distributions id by id."""
    from opdcache.inputs.lineage import tokenizer_difference
    from opdcache.inputs.models import load_tokenizer, model_facts

    theirs = load_tokenizer(teacher_path)
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"eval --teacher {teacher_path}: its tokenizer is not the model's ({tokenizer_difference(tokenizer, theirs)}); "
                          "the KL compares the distributions id by id, so the teacher must share the model's vocabulary")
    rows = model_facts(model_path).vocab_size, model_facts(teacher_path).vocab_size
    if rows[0] != rows[1]:
        raise ConfigError(f"eval --teacher {teacher_path}: its head has {rows[1]} rows, the model's {rows[0]}; the KL needs "
                          "one vocabulary of one size")


def reverse_kl_to_teacher(student, teacher, sequences, chunk: int | None = None) -> tuple[float, int]:
    """(mean per-token KL(student || teacher), tokens) over every response position of ``sequences``, (prompt ids,
    response ids) pairs: exact over the vocabulary at temperature 1, each position's distributions those of the
    sequence before it. The final hidden states of each sequence go through both heads in vocabulary slices
    (opdcache.logits.divergence, float32 sums), so no [tokens, vocabulary] tensor exists; the sum stays on the device
    until the end. Memory: both models, one sequence's hidden states [length, hidden] a side, [rows, chunk] blocks."""
    import torch

    from opdcache.logits.divergence import DEFAULT_CHUNK, chunked_divergence
    from opdcache.logits.logprobs import head_transform_of

    for model, what in ((student, "model"), (teacher, "teacher")):
        if head_transform_of(model) != (None, None):
            raise ConfigError(f"eval --teacher: the {what} scales or soft-caps its logits, which the exact KL does not support yet; "
                              "evaluate without --teacher")
    heads = [m.get_output_embeddings() for m in (student, teacher)]
    device = heads[0].weight.device
    total, tokens = torch.zeros((), dtype=torch.float64, device=device), 0
    with torch.no_grad():
        for prompt, response in sequences:
            prompt, response = [int(i) for i in prompt], [int(i) for i in response]
            if not response:
                continue
            ids = torch.tensor([prompt + response], device=device)
            at = slice(len(prompt) - 1, len(prompt) - 1 + len(response))  # the positions that predict the response
            hs, ht = (getattr(m, m.base_model_prefix)(input_ids=ids, use_cache=False).last_hidden_state[0, at] for m in (student, teacher))
            div = chunked_divergence("rkl", hs, heads[0].weight, ht, heads[1].weight, getattr(heads[0], "bias", None),
                                     getattr(heads[1], "bias", None), chunk=chunk or DEFAULT_CHUNK)
            total += div.double().sum()
            tokens += len(response)
    return float(total) / max(tokens, 1), tokens


def evaluate(backend, tokenizer, job: EvalJob, prompts=None, sequences: list | None = None) -> dict:
    """The report of ``job`` with an engine already running (``backend``: a model in memory, as a learner's):
    ``prompts``, the job's prompts already read (else read here); ``sequences``: a list that gets every response's
    (prompt ids, response ids), for :func:`reverse_kl_to_teacher`."""
    from opdcache.backends.base import GenerateRequest
    from opdcache.inputs import verifiers
    from opdcache.inputs.prompts import read_prompts
    from opdcache.teacher.rollouts import sample_seed

    verify = verifiers.resolve(job.reward)
    prompts = prompts or read_prompts(job.prompts, tokenizer, backend.max_length - job.sampling.max_new_tokens)
    judged = [p for p in prompts.prompts if p.answer is not None]
    if not judged:
        raise ConfigError(f"{job.prompts.path}: no prompt carries an answer (--answer-field {job.prompts.answer_field}); "
                          "eval needs answers to judge the responses against")
    n = job.sampling.samples
    requests = [GenerateRequest(p.prompt_ids, sample_seed(job.sampling.seed, p.prompt_ids, k)) for p in judged for k in range(n)]
    gens = backend.generate(requests, job.sampling)
    scores, lengths, cut, examples = [], [], 0, []
    if sequences is not None:
        sequences += [(judged[i // n].prompt_ids, g.response_ids) for i, g in enumerate(gens)]
    for i, p in enumerate(judged):
        row = []
        for k in range(n):
            g = gens[i * n + k]
            text = tokenizer.decode(g.response_ids, skip_special_tokens=True)
            task = {"answer": p.answer, "metadata": json.loads(p.metadata) if p.metadata else {}, "prompt_index": p.index,
                    "finish_reason": g.finish_reason}
            score = verifiers.score(verify, text, task, False).score
            row.append(0.0 if score is None else float(score))
            lengths.append(len(g.response_ids))
            cut += g.finish_reason == "length"
            if len(examples) < job.examples and k == 0:
                examples.append({"prompt_index": p.index, "response": text[:500], "score": row[-1]})
        scores.append(row)
    correct = [sum(s >= 1.0 for s in row) for row in scores]
    return {
        "prompts": len(judged), "samples": n, "reward": job.reward,
        "temperature": job.sampling.temperature, "seed": job.sampling.seed,
        "accuracy": sum(map(sum, scores)) / (len(scores) * n),
        "pass_at": {j: sum(pass_at_k(n, c, j) for c in correct) / len(correct) for j in range(1, n + 1)},
        "mean_response_tokens": sum(lengths) / len(lengths), "truncated_share": cut / len(lengths),
        "skipped": {"malformed": prompts.malformed, "too_long": prompts.too_long,
                    "no_answer": len(prompts.prompts) - len(judged)},
        "examples": examples,
    }
