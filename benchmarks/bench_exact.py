"""What --exact costs: tokens/s of generation (build-rollouts), scoring (score-teacher) and a train step, the exact
engine against the default transformers engine on the same work, interleaved over rounds.

Baseline (what a user runs without --exact): opdcache's transformers engine, batched (generation batch 64, scoring's
default token budget), and the trainer's default forward. The work: the demo's pi_ref samples --prompts x 4 responses
of at most 48 tokens at temperature 1 with pi_ref's top-8 and 4 MC samples per position (the README's build-rollouts),
the demo teacher scores sequences with its top-8, and one lightning train step runs over 64 of them (forward and
backward). Scoring and the train step get the same sequences on both sides (the default engine's generation, made once
before the timer), so their ratio is of equal work. Generation samples each side's own responses, whose lengths differ
a little (the two engines' arithmetic draws differently from the same seeds), so its ratio is of seconds per
generated token.

Measured with benchmarks/harness.py, one stage at a time: each run a fresh process that loads the one model the stage
needs and runs it once on a single request before the timer (so first-call costs are not timed), a warm-up round,
then --rounds rounds with the order reversed every other round; per side min and median of wall seconds and of
CPU-seconds, peak anonymous RSS above the level before the work (so the exact engine's float64 copy of the weights,
made when it loads, is not in it: 8 bytes a parameter), the load average before and after, and per round the time
and CPU-seconds per token against the baseline's. The models are the demo's (hidden 64 and 128): at this size both
sides are bound by per-operation overhead, not by matmul throughput, which is where --exact's float64 matmuls (half
the float32 rate) would show.

    python benchmarks/bench_exact.py [--prompts 64 --rounds 3]
    python benchmarks/bench_exact.py --model ~/.cache/opdcache/real/smollm2-135m-instruct --prompts 8 --max-new-tokens 32

``--model``: a real model as both student and teacher (SmolLM2-135M-Instruct as the real test group converts it: hidden
576, 30 layers, vocabulary 49,152), prompts from its chat template; there the matmuls dominate and the ratio is what
float64 arithmetic with its interval check costs against float32 BLAS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from opdcache.backends.base import GenerateRequest, SamplingConfig, ScoreRequest
from opdcache.backends.exact import ExactBackend
from opdcache.backends.hf import TransformersBackend

sys.path.insert(0, str(Path(__file__).parent))
from harness import Side, compare, report  # noqa: E402

WEIGHTS = Path(__file__).resolve().parent.parent / "opdcache" / "demo" / "weights"


def _train_step(model, exact: bool, reqs, gens) -> int:
    """One lightning-style forward + backward over the sequences; returns their response tokens."""
    from opdcache.training.student import StudentForward

    rows = [list(r.prompt_ids) + list(g.response_ids) for r, g in zip(reqs, gens)]
    L = max(map(len, rows))
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, : len(r)], mask[b, : len(r)] = torch.tensor(r), 1
    T = max(len(g.response_ids) for g in gens)
    pos = torch.zeros(len(rows), T, dtype=torch.long)
    sel = torch.zeros(len(rows), T, dtype=torch.bool)
    resp = torch.zeros(len(rows), T, dtype=torch.long)
    for b, (r, g) in enumerate(zip(reqs, gens)):
        n = len(g.response_ids)
        pos[b, :n] = torch.arange(len(r.prompt_ids) - 1, len(r.prompt_ids) - 1 + n)
        sel[b, :n] = True
        resp[b, :n] = torch.as_tensor(g.response_ids.astype(np.int64))
    fwd = StudentForward(model, 8192, torch.float32 if exact else None)
    lp, _, _ = fwd(ids, mask, pos, sel, resp[sel][:, None])
    (-lp.sum() / lp.numel()).backward()
    model.zero_grad(set_to_none=True)
    return int(sel.sum())


def _requests(model: Path, prompts: int, chat: bool) -> list[GenerateRequest]:
    """4 seeded samples of each prompt: a real model's chat-template questions, or the demo task's "a+b=" prompts."""
    from opdcache.inputs.models import load_tokenizer

    tok = load_tokenizer(model)
    rng = np.random.default_rng(0)
    if chat:
        questions = [f"What is {a} plus {b}? Answer briefly." for a, b in rng.integers(10, 100, size=(prompts, 2))]
        prompt_ids = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True) for q in questions]
        prompt_ids = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompt_ids]
    else:
        prompt_ids = [tok(f"{a}+{b}=")["input_ids"] for a, b in rng.integers(100, 1000, size=(prompts, 2))]
    return [GenerateRequest(p, seed=i * 4 + k) for i, p in enumerate(prompt_ids) for k in range(4)]


def _sampling(max_new_tokens: int) -> SamplingConfig:
    return SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens, ref_top_k=8, mc_samples=4)


def _engine(side: str, model: str):
    return ExactBackend(Path(model)) if side == "exact" else TransformersBackend(Path(model), dtype="float32", device="cpu")


def setup(stage: str, side: str, student: str, teacher: str, chat: bool, prompts: int, max_new_tokens: int, fixed: str) -> dict:
    """Untimed: the stage's one engine, the requests, the fixed sequences (scoring and training), one warm call."""
    torch.set_num_threads(2)
    reqs, sampling = _requests(Path(student), prompts, chat), _sampling(max_new_tokens)
    engine = _engine(side, teacher if stage == "score" else student)
    seqs = json.loads(Path(fixed).read_text())
    sreqs = [ScoreRequest(r.prompt_ids, np.array(g["response_ids"], np.int32), ref_topk_ids=np.array(g["ref_topk_ids"], np.int32),
                          mc_ids=np.array(g["mc_ids"], np.int32)) for r, g in zip(reqs, seqs)]
    if stage == "generate":
        engine.generate(reqs[:1], sampling)
    elif stage == "score":
        engine.score(sreqs[:1], top_k=8)
    else:
        _train(engine.model, side, reqs[:1], sreqs[:1])
    return {"stage": stage, "side": side, "engine": engine, "reqs": reqs, "sampling": sampling, "sreqs": sreqs}


def _train(model, side: str, reqs, sreqs) -> int:
    model.train()
    with torch.enable_grad():
        n = _train_step(model, side == "exact", reqs, sreqs)
    model.eval()
    return n


def run(st: dict) -> dict:
    """The stage once; its tokens (generation: the side's own responses; scoring and training: the fixed sequences)."""
    if st["stage"] == "generate":
        return {"tokens": sum(len(g.response_ids) for g in st["engine"].generate(st["reqs"], st["sampling"]))}
    if st["stage"] == "score":
        st["engine"].score(st["sreqs"], top_k=8)
        return {"tokens": sum(len(r.response_ids) for r in st["sreqs"])}
    return {"tokens": _train(st["engine"].model, st["side"], st["reqs"][:64], st["sreqs"][:64])}


def per_token(result: dict) -> dict:
    """Per round, the exact side's wall and CPU seconds per token over the baseline's (min, median, max)."""
    exact, base = (next(e for e in result["sides"].values() if e["baseline"] is b) for b in (False, True))
    out = {}
    for what in ("wall", "cpu"):
        ratios = [(a[what] / a["figures"]["tokens"]) / (b[what] / b["figures"]["tokens"]) for a, b in zip(exact["runs"], base["runs"])]
        out[what] = {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}
    toks = [statistics.median(r["figures"]["tokens"] / r["wall"] for r in e["runs"]) for e in (base, exact)]
    out["tokens_per_s_median"] = {"default": toks[0], "exact": toks[1]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", type=Path, default=None, help="a real model as student and teacher (default: the demo's two)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    student, teacher = (args.model, args.model) if args.model else (WEIGHTS / "student", WEIGHTS / "teacher")
    out_path = args.out or Path(__file__).parent / "results" / ("exact_real.json" if args.model else "exact.json")
    command = f"python benchmarks/bench_exact.py --prompts {args.prompts} --rounds {args.rounds} --max-new-tokens {args.max_new_tokens}" + \
        (f" --model {args.model}" if args.model else "")
    torch.set_num_threads(2)
    gens = _engine("default", str(student)).generate(_requests(student, args.prompts, args.model is not None), _sampling(args.max_new_tokens))
    out = {"command": command, "model": str(args.model or WEIGHTS), "stages": {}}
    with tempfile.TemporaryDirectory() as tmp:
        fixed = Path(tmp) / "fixed.json"  # the default engine's generation: what both sides score and train on
        fixed.write_text(json.dumps([{"response_ids": g.response_ids.tolist(), "ref_topk_ids": g.ref_topk_ids.tolist(),
                                      "mc_ids": g.mc_ids.tolist()} for g in gens]))
        for stage in ("generate", "score", "train"):
            common = {"stage": stage, "student": str(student), "teacher": str(teacher), "chat": args.model is not None, "prompts": args.prompts,
                      "max_new_tokens": args.max_new_tokens, "fixed": str(fixed)}
            sides = [Side("exact engine (--exact)", "run", "setup", common | {"side": "exact"},
                          note="float64 arithmetic with its interval check; every stored number equals the learner's recompute"),
                     Side("default transformers engine", "run", "setup", common | {"side": "default"}, baseline=True,
                          note="what a user runs without --exact: batched float32, the trainer's default forward")]
            what = {"generate": f"{len(gens)} sequences, each side's own responses", "score": f"the same {len(gens)} sequences on both sides",
                    "train": f"one lightning step over the same {min(64, len(gens))} sequences on both sides"}[stage]
            result = compare(f"{stage}: {what}", sides, __file__, rounds=args.rounds, meta={"command": command})
            report(result)
            result["per_token"] = per_token(result)
            pt = result["per_token"]
            print(f"  per token, exact / default: wall {pt['wall']['median']:.2f}x ({pt['wall']['min']:.2f}-{pt['wall']['max']:.2f}), "
                  f"CPU {pt['cpu']['median']:.2f}x; tokens/s default {pt['tokens_per_s_median']['default']:,.0f}, "
                  f"exact {pt['tokens_per_s_median']['exact']:,.0f}\n")
            out["stages"][stage] = result
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
