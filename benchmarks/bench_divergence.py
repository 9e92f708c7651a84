"""Chunked full-vocabulary KL against a naive implementation that materialises the logits, in one run.

Shape (the issue's): vocabulary 151,936, hidden 1,024 (student and teacher), 2,048 tokens, float32, CPU.
Work: forward + backward of the mean per-token forward KL(p_teacher || q_student) with respect to the
student's hidden states and head, and again with respect to the hidden states only (the head's [V, H] gradient
reported apart). Variants: naive (both sides' full log_softmax with autograd), kl_div (the fair plain baseline: the
teacher under no_grad, torch's kl_div), chunked (opdcache.divergence). Each variant runs in its own process; peak memory is the largest
resident-set size sampled every 2 ms during the work minus the size just before it (inputs allocated).
On a CUDA machine the same script also reports bf16 figures there and the fraction of matmul peak.

    python benchmarks/bench_divergence.py [--tokens 2048 --vocab 151936 --hidden 1024 --kind fkl]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import PeakAnon as PeakRSS  # noqa: E402  (anonymous RSS: not the model file's page cache)


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


def run(variant: str, N: int, V: int, H: int, kind: str, device: str, dtype: str, repeats: int, head_grad: bool = True) -> dict:
    from opdcache.divergence import chunked_divergence

    dt = getattr(torch, dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    hs = torch.randn(N, H, generator=g).to(device, dt).requires_grad_()
    Ws = (torch.randn(V, H, generator=g) * 0.02).to(device, dt).requires_grad_(head_grad)
    ht = torch.randn(N, H, generator=g).to(device, dt)
    Wt = (torch.randn(V, H, generator=g) * 0.02).to(device, dt)

    def step():
        d = {"naive": naive, "kl_div": kl_div_baseline}[variant](kind, hs, Ws, ht, Wt) if variant != "chunked" else chunked_divergence(kind, hs, Ws, ht, Wt)
        d.float().mean().backward()
        hs.grad = Ws.grad = None
        if device == "cuda":
            torch.cuda.synchronize()

    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with PeakRSS() as mem:
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) if device == "cuda" else mem.delta
    seconds = sorted(times)[len(times) // 2]
    flops = 6 * 2 * N * V * H  # naive's matmuls: 2 forward, 4 backward-equivalent (grad h, grad W, per side that needs it)
    return {"variant": variant, "seconds": seconds, "runs": times, "peak_bytes": peak, "tflops_naive_equiv": flops / seconds / 1e12}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--kind", default="fkl")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-head-grad", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--devices", nargs="+", default=["cpu", "cuda"], help="where to run (cuda only where available): cpu float32, cuda bfloat16")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run(args.variant, args.tokens, args.vocab, args.hidden, args.kind, args.device, args.dtype, args.repeats,
                             not args.no_head_grad)))
        return
    configs = [("cpu", "float32")] if "cpu" in args.devices else []
    if torch.cuda.is_available() and "cuda" in args.devices:
        configs.append(("cuda", "bfloat16"))
    print(f"{args.kind}: {args.tokens} tokens, vocabulary {args.vocab:,}, hidden {args.hidden}; forward + backward\n")
    header = f"{'device':<6} {'dtype':<9} {'gradients':<12} {'variant':<8} {'seconds':>8} {'vs naive':>9} {'vs kl_div':>10} {'peak MiB':>9} {'mem vs naive':>13} {'mem vs kl_div':>14}"
    print(header)
    print("-" * len(header))
    for device, dtype in configs:
        for head_grad in (True, False):  # the head's gradient ([V, H]) is most of the work and memory: reported apart
            res = {}
            for v in ("naive", "kl_div", "chunked"):
                out = subprocess.run([sys.executable, __file__, "--variant", v, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
                                      "--hidden", str(args.hidden), "--kind", args.kind, "--device", device, "--dtype", dtype,
                                      "--repeats", str(args.repeats)] + ([] if head_grad else ["--no-head-grad"]), capture_output=True, text=True)
                if out.returncode != 0:
                    print(f"{v} failed: {out.stderr[-1500:]}")
                    continue
                res[v] = json.loads(out.stdout.strip().splitlines()[-1])
            for v, r in res.items():
                print(f"{device:<6} {dtype:<9} {'hidden+head' if head_grad else 'hidden only':<12} {v:<8} {r['seconds']:>8.2f} "
                      f"{r['seconds'] / res['naive']['seconds']:>8.2f}x {r['seconds'] / res['kl_div']['seconds']:>9.2f}x "
                      f"{r['peak_bytes'] / 2**20:>9.0f} {r['peak_bytes'] / res['naive']['peak_bytes']:>12.3f}x "
                      f"{r['peak_bytes'] / res['kl_div']['peak_bytes']:>13.3f}x"
                      + (f"  ({r['tflops_naive_equiv']:.0f} TFLOP/s naive-equivalent)" if device == "cuda" else ""))


if __name__ == "__main__":
    import torch

    main()
