"""The student's head pass (log-probs at the sampled ids, forward and backward): the backward from the forward's kept
probabilities against the recomputing backward, beside the full-logits baseline.

The baseline is what a user writes: ``log_softmax(h @ W.T)`` gathered at the ids (opdcache.logits.logprobs
``logprobs_reference``), backward through autograd. opdcache's head pass streams the vocabulary and, by default on a
GPU within ``KEEP_BYTES``, keeps the forward's softmax probabilities so the backward needs no second logit matmul
("kept"); the other side recomputes them ("recomputed": what a CPU and an over-budget GPU run). Each side is the
forward and backward of one Lightning-shaped step's head (one id a position), on the same inputs.

On a CPU the kept path is forced (with one vocabulary slice a block, the layout a GPU uses), as a measurement of the
matmul it saves; a CPU run of opdcache never takes it (its passes stay in BLOCK_BYTES blocks). In one process,
interleaved (benchmarks/inprocess.py: the departure from a fresh process a run is stated there):

    python benchmarks/bench_head_backward.py [--device cpu] [--positions 512] [--hidden 1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from inprocess import interleaved  # noqa: E402

from opdcache.logits import logprobs as LP  # noqa: E402

VOCAB = 151_936


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(args.positions, args.hidden, generator=g) * 0.5).to(device).requires_grad_()
    W = (torch.randn(args.vocab, args.hidden, generator=g) * 0.05).to(device).requires_grad_()
    ids = torch.randint(0, args.vocab, (args.positions, 1), generator=g).to(device)
    default_keeps = LP.keeps_probabilities

    def side(keep: bool | None):
        def run():
            if device.type == "cpu" and keep:  # the GPU's one slice a block, its probabilities kept
                LP.keeps_probabilities = lambda n, v, chunk, dev, softcap: softcap is None
            elif keep is False:
                LP.keeps_probabilities = lambda *a: False
            try:
                if keep is None:
                    lp, lse = LP.logprobs_reference(h, W, ids)
                else:
                    lp, lse = LP.chunked_logprobs(h, W, ids, chunk=args.vocab)
                lp.sum().backward()
            finally:
                LP.keeps_probabilities = default_keeps
            h.grad = W.grad = None
        return run

    res = interleaved({"full logits (log_softmax, autograd)": side(None), "opdcache, recomputed": side(False),
                       "opdcache, kept": side(True)}, str(device), args.rounds)
    base = res["full logits (log_softmax, autograd)"]["seconds"]
    print(f"head pass forward + backward, {args.positions} positions x hidden {args.hidden} x vocabulary {args.vocab}, "
          f"{device}, {torch.get_num_threads()} threads, {args.rounds} interleaved rounds")
    for name, r in res.items():
        print(f"  {name:38s} {r['seconds']:7.3f} s (min {r['min_seconds']:.3f})  CPU {r['cpu_seconds']:7.3f} s  "
              f"peak {r['peak_bytes'] / 2**20:8.0f} MiB  time / full logits {r['seconds'] / base:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "sides": res}, indent=2) + "\n")


if __name__ == "__main__":
    main()
