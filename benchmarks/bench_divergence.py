"""Chunked full-vocabulary KL (opdcache.divergence) against what a competent user writes, on the harness.

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

On a CUDA machine, ``--devices cuda`` reports bf16 figures there, each variant in its own process.
"""

from __future__ import annotations

import argparse
import json
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
    from opdcache.divergence import chunked_divergence

    fn = {"naive": naive, "kl_div": kl_div_baseline, "chunked": chunked_divergence,
          "uniform": lambda *a: chunked_divergence(*a, uniform=True)}[st["variant"]]
    fn(st["kind"], st["hs"], st["Ws"], st["ht"], st["Wt"]).float().mean().backward()
    torch.cuda.synchronize() if st["hs"].is_cuda else None


def run(variant: str, N: int, V: int, H: int, kind: str, device: str, dtype: str, repeats: int, head_grad: bool = True) -> dict:
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
    parser.add_argument("--repeats", type=int, default=3, help="--devices cuda: steps per process (median)")
    parser.add_argument("--rounds", type=int, default=3, help="CPU: interleaved rounds on the harness")
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results", help="folder for the CPU results' JSON")
    parser.add_argument("--variant")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-head-grad", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--naive", action="store_true", help="also run the naive reference side (slow, and far from the others)")
    parser.add_argument("--devices", nargs="+", default=["cpu"], help="where to run: cpu (float32, on the harness), cuda (bfloat16, where available)")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run(args.variant, args.tokens, args.vocab, args.hidden, args.kind, args.device, args.dtype, args.repeats,
                             not args.no_head_grad)))
        return
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
        print(f"{args.kind}: {args.tokens} tokens, vocabulary {args.vocab:,}, hidden {args.hidden}; forward + backward, cuda bfloat16\n")
        for head_grad in (True, False):
            res = {}
            for v in ("naive", "kl_div", "chunked", "uniform"):
                out = subprocess.run([sys.executable, __file__, "--variant", v, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
                                      "--hidden", str(args.hidden), "--kind", args.kind, "--device", "cuda", "--dtype", "bfloat16",
                                      "--repeats", str(args.repeats)] + ([] if head_grad else ["--no-head-grad"]), capture_output=True, text=True)
                if out.returncode != 0:
                    print(f"{v} failed: {out.stderr[-1500:]}")
                    continue
                res[v] = json.loads(out.stdout.strip().splitlines()[-1])
            for v, r in res.items():
                print(f"cuda bf16 {'hidden+head' if head_grad else 'hidden only':<12} {v:<8} {r['seconds']:>8.3f} s "
                      f"{r['seconds'] / res['kl_div']['seconds']:>6.2f}x kl_div, peak {r['peak_bytes'] / 2**20:>7.0f} MiB "
                      f"({r['peak_bytes'] / res['kl_div']['peak_bytes']:.3f}x kl_div), {r['tflops_naive_equiv']:.0f} TFLOP/s naive-equivalent")


if __name__ == "__main__":
    main()
