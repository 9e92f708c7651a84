"""Held-out evaluation of a model on the embedded task: greedy accuracy, from real generation (demo only: it knows the task)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    n: int
    samples: tuple[tuple[str, str, bool], ...]  # (prompt, response, correct) for the first few

    def __str__(self) -> str:
        return f"accuracy {self.accuracy:.1%} on {self.n} held-out prompts"


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a user prompt with the chat template and generation prompt applied, once."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate_greedy(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 48, batch_size: int = 128) -> list[str]:
    import torch

    texts = []
    pad = tokenizer.pad_token_id
    for start in range(0, len(prompts), batch_size):
        ids = [chat_prompt_ids(tokenizer, p) for p in prompts[start: start + batch_size]]
        length = max(map(len, ids))
        input_ids = torch.full((len(ids), length), pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, row in enumerate(ids):  # left padding, so every row ends where generation starts
            input_ids[i, length - len(row):] = torch.tensor(row)
            mask[i, length - len(row):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
        texts += tokenizer.batch_decode(out[:, length:], skip_special_tokens=True)
    return texts


def evaluate_accuracy(model, tokenizer, n: int = 200, seed: int = 0, split: str = "heldout") -> EvalResult:
    from opdcache.demo import task

    problems = task.problems(split, n, seed=seed)
    texts = generate_greedy(model, tokenizer, [p.prompt for p in problems])
    correct = [task.is_correct(t, p.answer) for t, p in zip(texts, problems)]
    return EvalResult(sum(correct) / len(correct), len(correct),
                      tuple((p.prompt, t, c) for p, t, c in list(zip(problems, texts, correct))[:4]))


def reverse_kl_to_teacher(student, teacher, tokenizer, n: int = 200, seed: int = 0, split: str = "heldout", max_new_tokens: int = 48) -> float:
    """Mean per-token KL(pi_student || pi_teacher), exact over the vocabulary at temperature 1, at every
    position of the student's own greedy responses to ``n`` prompts of ``split``."""
    import torch

    from opdcache.demo import task

    problems = task.problems(split, n, seed=seed)
    texts = generate_greedy(student, tokenizer, [p.prompt for p in problems], max_new_tokens)
    total, count = 0.0, 0
    for p, text in zip(problems, texts):
        prompt = chat_prompt_ids(tokenizer, p.prompt)
        response = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            sl = slice(len(prompt) - 1, len(prompt) - 1 + len(response))
            lq = torch.log_softmax(student(ids).logits[0, sl].double(), -1)
            lp = torch.log_softmax(teacher(ids).logits[0, sl].double(), -1)
        total += float((lq.exp() * (lq - lp)).sum())
        count += len(response)
    return total / max(count, 1)
