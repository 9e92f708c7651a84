"""The demo's held-out evaluation, through the library's (``opdcache eval``'s): greedy accuracy judged by the task's
verifier (``addition``) and the per-token reverse KL to the teacher at the model's own responses."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    n: int
    reverse_kl: float | None = None
    """Mean per-token KL(model || teacher) at every position of the model's greedy responses (when a teacher is given)."""

    def __str__(self) -> str:
        return f"accuracy {self.accuracy:.1%} on {self.n} held-out prompts"


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a user prompt with the chat template and generation prompt applied, once."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def evaluate_prompts(model, tokenizer, prompts: Path, teacher=None, kl_prompts: int | None = None,
                     max_new_tokens: int = 48) -> EvalResult:
    """``opdcache eval``'s greedy report of a model in memory on the prompt file ``prompts`` (the task's format), and
    with ``teacher`` (a model in memory with the same vocabulary) the reverse KL to it on the first ``kl_prompts``
    responses (default: all)."""
    from opdcache.backends import backend_from_model
    from opdcache.backends.base import SamplingConfig
    from opdcache.evaluation.evaluate import EvalJob, evaluate, reverse_kl_to_teacher
    from opdcache.inputs.prompts import PromptConfig

    job = EvalJob(model="(in memory)", prompts=PromptConfig(prompts), reward="addition",
                  sampling=SamplingConfig(temperature=0.0, samples=1, max_new_tokens=max_new_tokens))
    sequences: list = []
    report = evaluate(backend_from_model(model), tokenizer, job, sequences=sequences)
    kl = None if teacher is None else reverse_kl_to_teacher(model, teacher, sequences[:kl_prompts])[0]
    return EvalResult(report["accuracy"], report["prompts"], kl)


def evaluate_accuracy(model, tokenizer, n: int = 200, seed: int = 0, split: str = "heldout") -> EvalResult:
    """Greedy accuracy on ``n`` problems of the task's ``split`` (written to a temporary prompt file)."""
    from opdcache.demo import task

    with tempfile.TemporaryDirectory() as tmp:
        return evaluate_prompts(model, tokenizer, task.write_prompts(Path(tmp) / f"{split}.jsonl", split, n, seed=seed))
