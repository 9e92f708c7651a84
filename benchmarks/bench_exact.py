"""What --exact costs: tokens/s of generation (build-rollouts), scoring (score-teacher) and a train step, the exact
engine against the default transformers engine on the same work, interleaved over rounds in one process (issue 27).

Baseline (what a user runs without --exact): opdcache's transformers engine, batched (generation batch 64, scoring's
default token budget), and the trainer's default forward. Both sides do the same work: the demo's pi_ref samples
--prompts x 4 responses of at most 48 tokens at temperature 1 with pi_ref's top-8 and 4 MC samples per position (the
README's build-rollouts), the demo teacher scores them with its top-8, and one lightning train step runs over 64 of
them (forward and backward). Rounds alternate the sides (A B, then B A); we report per side the min and median of
wall seconds and of CPU-seconds (getrusage of this process), tokens per wall second, and the load average before
and after. Against shared/BENCHMARKING.md: the same work on the same 2 threads, interleaved rounds, CPU-seconds beside wall
time; the sides share one process (both engines loaded once: the figure is the engines' per-token cost, not start-up),
and memory is not measured here (exact mode's extra memory is stated, not measured: a float64 copy of each weight, 8
bytes per parameter, and float64 copies of each matmul's inputs and output). The models are the demo's (hidden 64 and 128): at this size both sides are bound by per-operation
overhead, not by matmul throughput, which is where --exact's float64 matmuls (half the float32 rate) would show.

    python benchmarks/bench_exact.py [--prompts 64 --rounds 3]
    python benchmarks/bench_exact.py --model ~/.cache/opdcache/real/smollm2-135m-instruct --prompts 8 --max-new-tokens 32

``--model``: a real model as both student and teacher (SmolLM2-135M-Instruct as the real test group converts it: hidden
576, 30 layers, vocabulary 49,152), prompts from its chat template; there the matmuls dominate and the ratio is what
float64 arithmetic with its interval check costs against float32 BLAS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from opdcache.backends.base import GenerateRequest, SamplingConfig, ScoreRequest
from opdcache.backends.exact import ExactBackend
from opdcache.backends.hf import TransformersBackend

WEIGHTS = Path(__file__).resolve().parent.parent / "opdcache" / "demo" / "weights"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(fn):
    w, c = time.perf_counter(), _cpu()
    out = fn()
    return out, time.perf_counter() - w, _cpu() - c


def _train_step(model, exact: bool, reqs, gens) -> float:
    from opdcache.student import StudentForward

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", type=Path, default=None, help="a real model as student and teacher (default: the demo's two)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from opdcache.models import load_tokenizer

    student, teacher = (args.model, args.model) if args.model else (WEIGHTS / "student", WEIGHTS / "teacher")
    tok = load_tokenizer(student)
    rng = np.random.default_rng(0)
    if args.model:
        questions = [f"What is {a} plus {b}? Answer briefly." for a, b in rng.integers(10, 100, size=(args.prompts, 2))]
        prompt_ids = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True) for q in questions]
        prompt_ids = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompt_ids]
    else:
        prompt_ids = [tok(f"{a}+{b}=")["input_ids"] for a, b in rng.integers(100, 1000, size=(args.prompts, 2))]
    reqs = [GenerateRequest(p, seed=i * 4 + k) for i, p in enumerate(prompt_ids) for k in range(4)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens, ref_top_k=8, mc_samples=4)
    engines = {
        "default": (lambda: TransformersBackend(student, dtype="float32", device="cpu"),
                    lambda: TransformersBackend(teacher, dtype="float32", device="cpu")),
        "exact": (lambda: ExactBackend(student), lambda: ExactBackend(teacher)),
    }
    out_path = args.out or Path(__file__).parent / "results" / ("exact_real.json" if args.model else "exact.json")
    loaded = {k: (a(), b()) for k, (a, b) in engines.items()}
    results: dict = {k: {"generate": [], "score": [], "train": []} for k in engines}
    load_before = os.getloadavg()
    for rnd in range(args.rounds + 1):  # round 0 is the warm-up, not counted
        for side in (["default", "exact"] if rnd % 2 == 0 else ["exact", "default"]):
            student, teacher = loaded[side]
            gens, w, c = _timed(lambda: student.generate(reqs, sampling))
            ntok = sum(len(g.response_ids) for g in gens)
            sreqs = [ScoreRequest(r.prompt_ids, g.response_ids, ref_topk_ids=g.ref_topk_ids, mc_ids=g.mc_ids) for r, g in zip(reqs, gens)]
            _, sw, sc = _timed(lambda: teacher.score(sreqs, top_k=8))
            student.model.train()
            with torch.enable_grad():
                n, tw, tc = _timed(lambda: _train_step(student.model, side == "exact", reqs[:64], gens[:64]))
            student.model.eval()
            if rnd:
                results[side]["generate"].append((w, c, ntok))
                results[side]["score"].append((sw, sc, ntok))
                results[side]["train"].append((tw, tc, n))
    load_after = os.getloadavg()
    table = {}
    for side, stages in results.items():
        table[side] = {}
        for stage, runs in stages.items():
            walls, cpus = [r[0] for r in runs], [r[1] for r in runs]
            table[side][stage] = {"wall_min": min(walls), "wall_median": statistics.median(walls), "cpu_min": min(cpus),
                                  "cpu_median": statistics.median(cpus), "tokens": runs[0][2],
                                  "tokens_per_s_median": runs[0][2] / statistics.median(walls)}
    print(f"rounds {args.rounds} (+1 warm-up), {len(reqs)} sequences, threads {torch.get_num_threads()}, load {load_before[0]:.2f} -> {load_after[0]:.2f}")
    print(f"{'stage':<10} {'default tok/s':>14} {'exact tok/s':>12} {'wall ratio':>11} {'cpu ratio':>10}")
    for stage in ("generate", "score", "train"):
        d, e = table["default"][stage], table["exact"][stage]
        print(f"{stage:<10} {d['tokens_per_s_median']:>14,.0f} {e['tokens_per_s_median']:>12,.0f} "
              f"{e['wall_median'] / d['wall_median']:>10.2f}x {e['cpu_median'] / d['cpu_median']:>9.2f}x")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    command = f"python benchmarks/bench_exact.py --prompts {args.prompts} --rounds {args.rounds} --max-new-tokens {args.max_new_tokens}" + \
        (f" --model {args.model}" if args.model else "")
    out_path.write_text(json.dumps({"command": command, "model": str(student),
                                    "date": time.strftime("%Y-%m-%d"), "load_before": load_before, "load_after": load_after,
                                    "threads": torch.get_num_threads(), "results": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
