"""Training memory as torch allocates it: the live tensor bytes of one lightning forward + backward, with and without
activation checkpointing, at two response lengths, from torch's memory profiler.

bench_scale.py --train-memory measures the process's anonymous RSS, as a user sees it. On a CPU that includes what
glibc's malloc keeps after torch frees it: checkpointing's recomputed activations are allocated and freed once per
layer in the backward, and the heap keeps the space. This script measures what the algorithm itself holds: the peak
of live tensor bytes (torch.profiler, profile_memory=True, export_memory_timeline), whatever the allocator keeps.

The model: the same Qwen3 shape as bench_scale (vocabulary 151,936, hidden 1,024, intermediate 2,048, 16 heads, 8
layers by default), random weights, built in the process; 64-token prompts, batch 2; the step is opdcache's own
StudentForward (decoder, gather of the response positions, the streamed head) and the lightning loss's log-probs.
One run per cell: nothing is timed, so there are no sides to interleave, and memory does not vary with load. Two
lengths give the per-token slope; bench_scale.py --train-memory runs three (128, 512, 2,048) through the trainer, which
is where a quadratic term would show. What ``peak_mib`` means differs by measure and is written into the JSON:

    python benchmarks/bench_tensor_memory.py [--layers 8 --lengths 512 2048]
    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/bench_tensor_memory.py --rss   # the RSS, glibc's retained heap gone

Results: benchmarks/results/tensor_memory.json (rss_memory.json with --rss).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

V, HIDDEN, BATCH, PROMPT = 151_936, 1024, 2, 64
DEFINITIONS = {
    "live tensors": "the highest total of live tensor bytes torch's profiler saw during the step (parameters, their zeroed "
                    "gradients and the inputs included), MiB",
    "anonymous RSS": "the step's peak anonymous RSS above the process's level at the step's start (sampled every ms), MiB",
}


def child(R: int, ckpt: bool, layers: int, rss: bool = False) -> None:
    """One forward + backward under the profiler (``rss``: with its anonymous RSS sampled instead); prints {peak_mib, tokens}."""
    import warnings

    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from opdcache.training.student import StudentForward, enable_activation_checkpointing

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    model.config.use_cache = False
    if ckpt:
        enable_activation_checkpointing(model)
    model.train()
    for p in model.parameters():  # the gradients exist before the step, as from the second step of a run on
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, V, (BATCH, PROMPT + R))
    positions = (PROMPT - 1 + torch.arange(R)).expand(BATCH, R)
    select = torch.ones(BATCH, R, dtype=torch.bool)
    forward = StudentForward(model, chunk=8192)
    if rss:  # the process's view: what bench_scale.py measures, here without the trainer around the step
        sys.path.insert(0, str(Path(__file__).parent))
        from harness import PeakAnon

        with PeakAnon() as peak:
            lp, _, _ = forward(ids, torch.ones_like(ids), positions, select, ids[:, PROMPT:].reshape(-1, 1))
            (-lp.mean()).backward()
        print(json.dumps({"peak_mib": peak.delta / 2**20, "tokens": BATCH * R}))
        return
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        lp, _, _ = forward(ids, torch.ones_like(ids), positions, select, ids[:, PROMPT:].reshape(-1, 1))
        (-lp.mean()).backward()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # export_memory_timeline is deprecated in favour of CUDA-only tools
        prof.export_memory_timeline(f"{tmp}/timeline.json", device="cpu")
        _, sizes = json.loads(Path(f"{tmp}/timeline.json").read_text())
    print(json.dumps({"peak_mib": max(sum(c) for c in sizes) / 2**20, "tokens": BATCH * R}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs=2, default=[512, 2048], help="two response lengths: the slope is taken between them")
    ap.add_argument("--rss", action="store_true", help="the step's anonymous RSS above its start instead of live tensors (run it "
                    "with MALLOC_MMAP_THRESHOLD_=131072 to see glibc's retained heap go)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.json = args.json or Path(__file__).parent / "results" / ("rss_memory.json" if args.rss else "tensor_memory.json")
    what = "anonymous RSS" if args.rss else "live tensors"
    rows = {}
    for ckpt in (False, True):
        for R in args.lengths:
            out = subprocess.run([sys.executable, __file__, "_child", str(R), str(int(ckpt)), str(args.layers), str(int(args.rss))],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(out.stderr[-3000:])
            rows.setdefault("checkpointing" if ckpt else "plain", {})[R] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"R={R} {'checkpointing' if ckpt else 'plain'}: peak {what} {rows['checkpointing' if ckpt else 'plain'][R]['peak_mib']:.0f} MiB", flush=True)
    a, b = args.lengths
    slopes = {k: (v[b]["peak_mib"] - v[a]["peak_mib"]) * 1024 / (v[b]["tokens"] - v[a]["tokens"]) for k, v in rows.items()}
    print(f"\nper response token, {a} -> {b}: plain {slopes['plain']:.1f} KiB, checkpointing {slopes['checkpointing']:.1f} KiB: "
          f"a {slopes['plain'] / slopes['checkpointing']:.1f}x cut ({args.layers} layers, hidden {HIDDEN}, vocabulary {V:,}, batch {BATCH})")
    import os

    env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    args.json.write_text(json.dumps({"command": "python benchmarks/bench_tensor_memory.py " + " ".join(sys.argv[1:]), "malloc_env": env, "measure": what,
                                     "definitions": {"peak_mib": DEFINITIONS[what], "slope_kib_per_token": "(peak at the longer length - peak at the "
                                                     "shorter) / (response tokens between them), KiB; tokens = batch x response length"},
                                     "layers": args.layers,
                                     "rows": rows, "slope_kib_per_token": slopes, "cut": slopes["plain"] / slopes["checkpointing"]}, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        child(int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]), len(sys.argv) > 5 and sys.argv[5] == "1")
    else:
        main()
