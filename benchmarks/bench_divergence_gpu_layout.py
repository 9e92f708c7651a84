"""The uniform divergence path's layout on a GPU: positions per whole-vocabulary block and columns per piece, against
kl_div, bf16 at the real shape (4,096 tokens, vocabulary 151,936, hidden 4,096), forward + backward with the head's
gradient. Each layout in its own process (its allocator's peak alone), a warm-up and ``--repeats`` timed runs each,
the layouts interleaved over ``--rounds``. Chose opdcache.logits.divergence.GPU_UNIFORM_BLOCK_BYTES and the GPU's piece for
the torch ops (the fused Triton kernel, opdcache/logits/kernels.py, is off here: OPDCACHE_KERNELS=0).

    python benchmarks/bench_divergence_gpu_layout.py --rounds 2      # on a CUDA machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def child(layout: str, tokens: int, vocab: int, hidden: int, repeats: int) -> dict:
    import opdcache.logits.divergence as dv
    from bench_divergence import run

    variant = "kl_div"
    os.environ["OPDCACHE_KERNELS"] = "0"  # the torch ops' layout: the fused kernel (opdcache/logits/kernels.py) sizes its own blocks
    if layout != "kl_div":
        block_mib, piece = layout.split(":")
        rows = max(1, (int(block_mib) << 20) // (4 * vocab))
        dv._uniform_layout = lambda V, device: (rows, V if piece == "V" else int(piece))
        variant = "uniform"
    return run(variant, tokens, vocab, hidden, "fkl", "cuda", "bfloat16", repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=["kl_div", "1024:V", "256:V", "256:16384", "64:V"],
                    help="kl_div, or BLOCK_MIB:PIECE (PIECE: columns, or V for the whole vocabulary)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.vocab, args.hidden, args.repeats)))
        return
    res: dict = {layout: [] for layout in args.layouts}
    for r in range(args.rounds):
        for layout in (args.layouts if r % 2 == 0 else args.layouts[::-1]):
            out = subprocess.run([sys.executable, __file__, "--child", layout, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
                                  "--hidden", str(args.hidden), "--repeats", str(args.repeats)], capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{layout} failed: {out.stderr[-800:]}", flush=True)
                continue
            res[layout].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(layout, json.dumps(res[layout][-1]), flush=True)
    base = res.get("kl_div") or []
    base_s = statistics.median(x["seconds"] for x in base) if base else None
    base_m = max(x["peak_bytes"] for x in base) if base else None
    print(f"\nfkl, {args.tokens} tokens, vocabulary {args.vocab:,}, hidden {args.hidden}, bf16, forward + backward with the head's gradient; "
          f"{args.rounds} rounds x {args.repeats} runs")
    print(f"{'layout':<12} {'seconds':>8} {'vs kl_div':>9} {'peak MiB':>9} {'vs kl_div':>9}")
    for layout, runs in res.items():
        if not runs:
            continue
        s = statistics.median(x["seconds"] for x in runs)
        m = max(x["peak_bytes"] for x in runs)
        print(f"{layout:<12} {s:>8.4f} {s / base_s if base_s else float('nan'):>8.2f}x {m / 2**20:>9.0f} "
              f"{m / base_m if base_m else float('nan'):>8.3f}x")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
