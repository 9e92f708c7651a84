"""Trains the demo's shipped models from scratch: ``python -m opdcache.demo.build [--out DIR]``.

The weights under ``opdcache/demo/weights/`` were produced by this script (seed 0, 2 CPU cores):

* ``teacher``: Qwen3-architecture, trained on ground-truth traces of the ``train`` split (``columns`` style), each
  column's digits in a random order, so the teacher spreads its mass over the valid traces (task.solution);
* ``teacher_carry``: the same architecture and data in the ``carry`` trace style (teacher-consistency ablation);
* ``student``: the base student, Llama-architecture and smaller, given only a short warm-up on the same traces
  so it knows the format but not the procedure (clearly weaker: it starts the OPD pipeline);
* ``teacher_pairs``: ``teacher``'s recipe with its own tokenizer, which reads each pair of digits as one token
  (cross-tokenizer ablation).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

WEIGHTS = Path(__file__).parent / "weights"
RECIPES = {
    "teacher": dict(role="teacher", style="columns", steps=600, lr=3e-3, label_smoothing=0.01),
    "teacher_carry": dict(role="teacher", style="carry", steps=1000, lr=3e-3, label_smoothing=0.01),
    "student": dict(role="student", style="columns", steps=150, lr=3e-3, label_smoothing=0.0),
    "teacher_pairs": dict(role="teacher", style="columns", steps=1500, lr=3e-3, label_smoothing=0.01, digit_pairs=True),
}


def training_pairs(tokenizer, style: str, n: int = 20000, seed: int = 0):
    from opdcache.demo import task
    from opdcache.demo.evaluate import chat_prompt_ids

    import random

    rng = random.Random(f"orders-{seed}-{style}")  # each trace's column orders: several valid traces per problem
    pairs = []
    for p in task.problems("train", n, seed=seed):
        response = tokenizer(task.solution(p, style, rng), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        pairs.append((chat_prompt_ids(tokenizer, p.prompt), response))
    return pairs


def build(name: str, out: Path, seed: int = 0, progress: bool = True, steps: int | None = None) -> dict:
    import torch

    from opdcache.demo import models
    from opdcache.demo.evaluate import evaluate_accuracy
    from opdcache.training.sft import SFTConfig, train_sft

    recipe = dict(RECIPES[name], **({"steps": steps} if steps else {}))
    torch.manual_seed(seed)
    pairs = recipe.get("digit_pairs", False)
    tokenizer = models.build_tokenizer(digit_pairs=pairs)
    model = models.new_model(recipe["role"], seed=seed, vocab_size=models.PAIR_VOCAB_SIZE if pairs else models.VOCAB_SIZE)
    start = time.perf_counter()
    train_sft(model, training_pairs(tokenizer, recipe["style"], seed=seed),
              SFTConfig(steps=recipe["steps"], batch_size=64, lr=recipe["lr"], warmup=30, seed=seed, label_smoothing=recipe["label_smoothing"]),
              pad_id=tokenizer.pad_token_id,
              progress=progress)
    seconds = time.perf_counter() - start
    result = evaluate_accuracy(model, tokenizer, n=500)
    models.save(model, tokenizer, out / name)
    report = {"model": name, **recipe, "train_seconds": round(seconds, 1), "heldout_accuracy": result.accuracy,
              "heldout_n": result.n, "params": sum(p.numel() for p in model.parameters())}
    (out / name / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=WEIGHTS)
    parser.add_argument("--only", choices=sorted(RECIPES), action="append")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's steps (for quick checks)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    for name in args.only or RECIPES:
        print(json.dumps(build(name, args.out, args.seed, steps=args.steps)))


if __name__ == "__main__":
    main()
