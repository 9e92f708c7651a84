"""Kernels a decode step launches: ``--exact --device cuda`` (the batch-invariant arithmetic) against the default
transformers engine, counted on the CPU.

On a GPU at batch 16 the exact engine's decode step took 2.5x the default engine's (BENCHMARKS.md, "The GPU suite on
an H200"), with many small kernels a step; the launches are what this counts, where no GPU is at hand. A torch
dispatch mode counts every compute operator (views, allocations and host reads left out); each Triton launch counts
one (the batch-invariant kernels, run by Triton's CPU interpreter); each of the exact arithmetic's elementwise
functions counts one (on the CPU it is a correctly rounded Python-level function of several torch calls; on CUDA one
torch kernel). Both engines generate the same requests: a batch of 4 prompts of 3-5 tokens, temperature 0.9, top-p
0.9, ref top-4, 2 MC draws, in bfloat16, end-of-sequence ids unset so every row decodes every step; a step's count is
(N steps - 1 step) / (N - 1), so the prefill cancels. Model: the demo student's shape (hidden 64) at 4 layers and the
real vocabulary 151,936, random weights (the count depends on the layer count and the vocabulary's slices, not on the
widths). A count is not a time: which kernels bound a step on a GPU is what the GPU suite's exact section profiles.

    TRITON_INTERPRET=1 python benchmarks/count_kernels.py [--layers 4] [--json benchmarks/results/kernel_count.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

NOT_KERNELS = {"empty", "empty_like", "empty_strided", "new_empty", "_local_scalar_dense", "view", "_unsafe_view", "as_strided",
               "t", "transpose", "unsqueeze", "squeeze", "expand", "slice", "select", "split_with_sizes", "split", "alias",
               "detach", "permute", "reshape", "lift_fresh", "set_"}


def build_model(root: Path, layers: int) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    demo = Path(__file__).parent.parent / "opdcache" / "demo" / "weights" / "student"
    cfg = AutoConfig.from_pretrained(demo)
    cfg.vocab_size, cfg.num_hidden_layers = 151_936, layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root)
    AutoTokenizer.from_pretrained(demo).save_pretrained(root)
    return root


class Counter:
    """Counts kernels inside ``with counter:``; ``counter.counts``: name -> launches."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.counts: collections.Counter = collections.Counter()
        self.inside = 0
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.__name__.split(".")[0]
                if not counter.inside and name not in NOT_KERNELS and not getattr(func, "is_view", False):
                    counter.counts["aten." + name] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.torch = torch

    def one(self, label: str, fn, *args, **kwargs):
        """fn(*args) counted as one kernel named ``label``, nothing inside it counted."""
        self.counts[label] += 1
        self.inside += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self.inside -= 1

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


ACTIVE: list = []  # the counter now counting (the patches below are installed once and report to it)


def patch() -> None:
    """Each Triton launch and each of the invariant arithmetic's elementwise functions counts one, in the active
    counter (installed once: a second install would count every launch twice)."""
    import triton.runtime.interpreter as interp

    from opdcache.exact import invariant

    if getattr(interp.InterpretedFunction, "_counted", False):
        return
    run, elementwise = interp.InterpretedFunction.run, invariant._elementwise

    def counted_run(self, *a, **k):
        return ACTIVE[-1].one("triton." + self.fn.__name__, run, self, *a, **k) if ACTIVE else run(self, *a, **k)

    def counted_elementwise(name, f, x):
        return ACTIVE[-1].one("elementwise." + name, elementwise, name, f, x) if ACTIVE else elementwise(name, f, x)

    interp.InterpretedFunction.run, interp.InterpretedFunction._counted = counted_run, True
    invariant._elementwise = counted_elementwise


def per_step(engine, steps: int) -> dict[str, float]:
    from opdcache.backends.base import GenerateRequest, SamplingConfig

    requests = [GenerateRequest([1, 5, 7, 9, 3][: 3 + i % 3], seed=i) for i in range(4)]

    def sampling(n):
        return SamplingConfig(temperature=0.9, top_p=0.9, max_new_tokens=n, ref_top_k=4, mc_samples=2)

    engine.generate(requests, sampling(2))  # warm: lazy state (the weights, their stop tokens) built outside the count
    engine.eos_ids = type(engine.eos_ids)([10 ** 9])  # no row ends: every step decodes every row
    counts = []
    patch()
    for n in (1, steps):
        counter = Counter()
        ACTIVE.append(counter)
        try:
            with counter:
                engine.generate(requests, sampling(n))
        finally:
            ACTIVE.pop()
        counts.append(counter.counts)
    names = set(counts[0]) | set(counts[1])
    return {k: (counts[1][k] - counts[0][k]) / (steps - 1) for k in sorted(names)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1: the batch-invariant kernels run in Triton's CPU interpreter here")
    from opdcache.backends.exact import ExactBackend
    from opdcache.backends.hf import TransformersBackend
    from opdcache.exact import GPU_ARITHMETIC

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", args.layers)
        sides = {"--exact --device cuda (counted on the CPU)": ExactBackend(model, dtype="bfloat16", arithmetic=GPU_ARITHMETIC),
                 "default engine": TransformersBackend(model, dtype="bfloat16")}
        out = {}
        for label, engine in sides.items():
            counts = per_step(engine, args.steps)
            total = sum(counts.values())
            out[label] = {"kernels_per_step": round(total, 1), "top": {k: round(v, 1) for k, v in sorted(counts.items(), key=lambda x: -x[1])[:12]}}
            print(f"{label}: {total:.1f} kernels a decode step ({args.layers} layers)")
            for name, n in list(out[label]["top"].items())[:8]:
                print(f"    {n:6.1f}  {name}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": "TRITON_INTERPRET=1 python benchmarks/count_kernels.py"
                                         + (f" --layers {args.layers}" if args.layers != 4 else ""), "layers": args.layers,
                                         "sides": out}, indent=2) + "\n")


if __name__ == "__main__":
    main()
