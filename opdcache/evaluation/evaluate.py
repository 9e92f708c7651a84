"""``opdcache eval``: a model's held-out accuracy and pass@k on prompts with answers, judged by a verifier.

The model samples ``samples`` responses a prompt through the same engine, prompt reading and sampling streams as
``build-rollouts`` (so a served or vLLM engine evaluates too, and a rerun with the same seed draws the same responses);
temperature 0 is greedy (one response a prompt is enough). Each response is judged by the ``--reward`` verifier
(opdcache/inputs/verifiers.py: exact, math, a plugin or module:function). Reported: accuracy (the mean score of every
response), pass@1 .. pass@k by the unbiased estimator 1 - C(n - c, j) / C(n, j) over each prompt's n samples, c of
them correct (Chen et al. 2021), the mean response length and the share of responses cut at ``max_new_tokens``.
Memory: the engine's (build-rollouts'), and the responses' ids.
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
    backend = make_backend(ref.path, job.engine)
    try:
        backend.load()
        return evaluate(backend, tokenizer, job) | {"model": str(ref.name)}
    finally:
        if hasattr(backend, "close"):
            backend.close()


def evaluate(backend, tokenizer, job: EvalJob, prompts=None) -> dict:
    """The report of ``job`` with an engine already running (``backend``: a model in memory, as a learner's):
    ``prompts``, the job's prompts already read (else read here)."""
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
