"""Chunked full-vocabulary KL (opdcache.logits.divergence) against what a competent user writes, on the harness.

Shape (the issue's): vocabulary 151,936, hidden 1,024 (student and teacher), 2,048 tokens, float32, CPU.
Work: one forward + backward of the mean per-token forward KL(p_teacher || q_student) with respect to the
student's hidden states and head, and again with respect to the hidden states only (the head's [V, H] gradient
reported apart). Sides: ``kl_div`` is the baseline (the teacher's log-probs under no_grad, the student's
log_softmax, torch's kl_div: what a competent user writes); ``uniform`` is opdcache as the trainer calls it (a
mean over tokens, so the gradient is computed in the forward: 4 head matmuls); ``chunked`` is opdcache's
per-position path (any reduction; the backward recomputes the logits: 6 head matmuls); ``naive`` (both sides'
log_softmax under autograd) is there for reference with ``--naive``. benchmarks/harness.py runs them interleaved over rounds, each
run a fresh process, and reports wall and CPU seconds and peak anonymous RSS above the inputs. Each run is one cold
step (no warm-up step inside the process: a freed block the allocator keeps would hide the next step's peak).

    python benchmarks/bench_divergence.py [--tokens 2048 --vocab 151936 --hidden 1024 --kind fkl --rounds 3]

On a CUDA machine, ``--devices cuda`` reports bf16 figures there: the sides interleaved in one process
(benchmarks/inprocess.py), with the uniform path twice, with the fused Triton kernel (opdcache/logits/kernels.py) and without.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import PeakAnon as PeakRSS, cpu_seconds  # noqa: E402  (anonymous RSS: not the model file's page cache)


def naive(kind, hs, Ws, ht, Wt):
    zs, zt = hs @ Ws.T, ht @ Wt.T  # [N, V] each
    lq, lp = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    if kind == "fkl":
        return (lp.exp() * (lp - lq)).sum(-1)
    if kind == "rkl":
        return (lq.exp() * (lq - lp)).sum(-1)
    lm = torch.log(0.5 * (lp.exp() + lq.exp()))
    return 0.5 * ((lp.exp() * (lp - lm)).sum(-1) + (lq.exp() * (lq - lm)).sum(-1))


def kl_div_baseline(kind, hs, Ws, ht, Wt):
    """The fair plain baseline: the teacher's log-probs under no_grad (nothing of the teacher is kept for the backward),
    the student's log_softmax, and torch's kl_div."""
    with torch.no_grad():
        lp = torch.log_softmax(ht @ Wt.T, -1)
    lq = torch.log_softmax(hs @ Ws.T, -1)
    if kind == "fkl":  # KL(p || q) = sum p (log p - log q)
        return torch.nn.functional.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
    if kind == "rkl":
        return torch.nn.functional.kl_div(lp, lq, reduction="none", log_target=True).sum(-1)
    return naive(kind, hs, Ws, ht, Wt)


def setup(variant: str, N: int, V: int, H: int, kind: str, head_grad: bool) -> dict:
    """The inputs of one run (untimed): student states and head with gradients, the teacher's without."""
    g = torch.Generator().manual_seed(0)
    return {"variant": variant, "kind": kind, "hs": torch.randn(N, H, generator=g).requires_grad_(),
            "Ws": (torch.randn(V, H, generator=g) * 0.02).requires_grad_(head_grad),
            "ht": torch.randn(N, H, generator=g), "Wt": torch.randn(V, H, generator=g) * 0.02}


def step(st: dict) -> None:
    """One forward + backward of the mean per-token divergence, the side's way."""
    from opdcache.logits.divergence import chunked_divergence

    fn = {"naive": naive, "kl_div": kl_div_baseline, "chunked": chunked_divergence,
          "uniform": lambda *a: chunked_divergence(*a, uniform=True)}[st["variant"]]
    fn(st["kind"], st["hs"], st["Ws"], st["ht"], st["Wt"]).float().mean().backward()
    torch.cuda.synchronize() if st["hs"].is_cuda else None


def run(variant: str, N: int, V: int, H: int, kind: str, device: str, dtype: str, repeats: int, head_grad: bool = True) -> dict:
    """One variant, ``repeats`` steps after a warm-up in this process (bench_divergence_gpu_layout.py's sweep)."""
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    hs = torch.randn(N, H, generator=g).to(device, dt).requires_grad_()
    Ws = (torch.randn(V, H, generator=g) * 0.02).to(device, dt).requires_grad_(head_grad)
    ht = torch.randn(N, H, generator=g).to(device, dt)
    Wt = (torch.randn(V, H, generator=g) * 0.02).to(device, dt)

    def one():
        step({"variant": variant, "kind": kind, "hs": hs, "Ws": Ws, "ht": ht, "Wt": Wt})
        hs.grad = Ws.grad = None

    one()  # warm-up: cuBLAS handles, the allocator's first blocks
    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    cpus = []
    with PeakRSS() as mem:
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), cpu_seconds()
            one()
            times.append(time.perf_counter() - t0)
            cpus.append(cpu_seconds() - c0)
    peak = (torch.cuda.max_memory_allocated() - base) if device == "cuda" else mem.delta
    seconds = sorted(times)[len(times) // 2]
    flops = 6 * 2 * N * V * H  # naive's matmuls: 2 forward, 4 backward-equivalent (grad h, grad W, per side that needs it)
    return {"variant": variant, "seconds": seconds, "runs": times, "cpu_seconds": sorted(cpus)[len(cpus) // 2], "peak_bytes": peak,
            "tflops_naive_equiv": flops / seconds / 1e12}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--kind", default="fkl")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (CPU: on the harness, a process per run; cuda: in one process)")
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results", help="folder for the CPU results' JSON")
    parser.add_argument("--naive", action="store_true", help="also run the naive reference side (slow, and far from the others)")
    parser.add_argument("--devices", nargs="+", default=["cpu"], help="where to run: cpu (float32, on the harness), cuda (bfloat16, where available)")
    args = parser.parse_args()
    if "cpu" in args.devices:
        from harness import Side, compare, report

        for head_grad in (True, False):  # the head's gradient ([V, H]) is most of the work and memory: reported apart
            common = {"N": args.tokens, "V": args.vocab, "H": args.hidden, "kind": args.kind, "head_grad": head_grad}
            sides = [Side("opdcache, uniform (trainer)", "step", "setup", common | {"variant": "uniform"},
                          note="chunked_divergence(uniform=True): the trainer's mean over tokens, gradient computed in the forward"),
                     Side("kl_div, teacher no_grad", "step", "setup", common | {"variant": "kl_div"}, baseline=True,
                          note="the competent baseline: teacher log_softmax under no_grad, student log_softmax, torch kl_div"),
                     Side("opdcache, per position", "step", "setup", common | {"variant": "chunked"},
                          note="chunked_divergence: any reduction, the backward recomputes each vocabulary slice")]
            if args.naive:
                sides.append(Side("naive", "step", "setup", common | {"variant": "naive"}, note="both log_softmax under autograd (reference)"))
            grads = "hidden+head" if head_grad else "hidden only"
            result = compare(f"{args.kind} forward+backward ({grads}), {args.tokens} tokens, vocabulary {args.vocab:,}, hidden {args.hidden}, "
                             "float32 CPU", sides, __file__, rounds=args.rounds,
                             meta={"command": "python benchmarks/bench_divergence.py", "gradients": grads})
            report(result, args.results / f"divergence_{args.kind}_{'head' if head_grad else 'hidden'}.json")
            print()
    if torch.cuda.is_available() and "cuda" in args.devices:
        print(f"{args.kind}: {args.tokens} tokens, vocabulary {args.vocab:,}, hidden {args.hidden}; forward + backward, cuda; "
              f"sides interleaved in one process (benchmarks/inprocess.py), {args.rounds} rounds after a warm-up, median; "
              "naive-equivalent TFLOP/s = the FLOPs of 6 [tokens x hidden x vocabulary] matmuls over the side's time\n")
        table, load_before = {}, os.getloadavg()[0]
        # bf16 parameters (a bf16 model), and float32 masters under bf16 autocast (how `opdcache train` runs: the head's
        # products in bf16, its gradient and the hidden states in float32; kl_div's log_softmax in float32 under autocast)
        for setting in ("bf16", "autocast"):
            for head_grad in (True, False):
                grads = "hidden+head" if head_grad else "hidden only"
                res = table[f"{setting} {grads}"] = inprocess_sides("cuda", args.tokens, args.vocab, args.hidden, args.kind, args.rounds,
                                                                    head_grad, args.naive, masters=setting == "autocast")
                base = res["kl_div"]
                flops = 6 * 2 * args.tokens * args.vocab * args.hidden  # naive's matmuls: 2 forward, 4 backward-equivalent
                for v, r in res.items():
                    ratios = [a / b for a, b in zip(r["runs"], base["runs"])]
                    print(f"cuda {setting:<8} {grads:<12} {v:<24} {r['seconds']:>8.4f} s (min {r['min_seconds']:.4f}) "
                          f"{r['seconds'] / base['seconds']:>6.2f}x kl_div ({min(ratios):.2f}-{max(ratios):.2f}), "
                          f"CPU {r['cpu_seconds']:.4f} s (min {r['min_cpu_seconds']:.4f}), peak {r['peak_bytes'] / 2**20:>7.0f} MiB "
                          f"({r['peak_bytes'] / base['peak_bytes']:.3f}x kl_div), {flops / r['seconds'] / 1e12:.0f} TFLOP/s naive-equivalent")
        load = [load_before, os.getloadavg()[0]]
        print(f"host load (1 min) before and after: {load[0]:.1f} -> {load[1]:.1f}")
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / f"divergence_cuda_{args.kind}.json").write_text(json.dumps({"tokens": args.tokens, "vocab": args.vocab,
                                                                                   "hidden": args.hidden, "rounds": args.rounds, "load": load,
                                                                                   "sides": table}, indent=2))


def inprocess_sides(device: str, N: int, V: int, H: int, kind: str, rounds: int, head_grad: bool, naive_too: bool,
                    masters: bool = False) -> dict:
    """The sides on ``device`` (cuda), interleaved in this process (one set of inputs): kl_div (the baseline), opdcache's
    uniform path (the fused kernel, opdcache/logits/kernels.py), the same in 256 MiB blocks, the same with the kernel off (its torch ops:
    OPDCACHE_KERNELS=0) and the per-position path. Inputs in bf16, or with ``masters`` in float32 under bf16 autocast."""
    import contextlib

    from inprocess import interleaved, kernels_off

    dtype = torch.float32 if masters else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    hs = torch.randn(N, H, generator=g).to(device, dtype).requires_grad_()
    Ws = (torch.randn(V, H, generator=g) * 0.02).to(device, dtype).requires_grad_(head_grad)
    ht = torch.randn(N, H, generator=g).to(device, dtype)
    Wt = (torch.randn(V, H, generator=g) * 0.02).to(device, dtype)

    def side(variant: str):
        def run():
            with torch.autocast(device, dtype=torch.bfloat16) if masters else contextlib.nullcontext():
                step({"variant": variant, "kind": kind, "hs": hs, "Ws": Ws, "ht": ht, "Wt": Wt})
            hs.grad = Ws.grad = None
        return run

    def smaller_blocks(run, mib: int):  # the fused path's blocks at ``mib`` instead of GPU_UNIFORM_BLOCK_BYTES
        import opdcache.logits.divergence as dv

        def sized():
            shipped, dv.GPU_UNIFORM_BLOCK_BYTES = dv.GPU_UNIFORM_BLOCK_BYTES, mib << 20
            try:
                run()
            finally:
                dv.GPU_UNIFORM_BLOCK_BYTES = shipped
        return sized

    fns = {"kl_div": side("kl_div"), "uniform": side("uniform"), "uniform, 256 MiB blocks": smaller_blocks(side("uniform"), 256),
           "uniform, torch ops": kernels_off(side("uniform")), "per position": side("chunked")}
    if naive_too:
        fns["naive"] = side("naive")
    return interleaved(fns, device, rounds)

if __name__ == "__main__":
    main()
