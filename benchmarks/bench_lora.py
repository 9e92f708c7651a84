"""LoRA against full fine-tuning of the same student, same cache and batch: step time, peak memory, bytes a checkpoint.

Work: ``run_train`` for ``--steps`` steps of Lightning OPD (batch ``--batch-size``, packed) from a cache, then its
checkpoint (the run's end: the full student's float32 weights and AdamW's moments, or the adapters and theirs). Sides:
full fine-tuning (the baseline: what ``opdcache train`` did before LoRA) and LoRA at ``--ranks`` (default 8, 32, 64:
the demo student's layers are 64 wide) on every linear layer of the decoder (the default targets). Each run is a fresh process (benchmarks/harness.py: interleaved
rounds, wall and CPU seconds, peak anonymous RSS above the process's level after its imports); the bytes the
checkpoint holds are read from disk afterwards. Run:

    python benchmarks/bench_lora.py --cache CACHE [--model opdcache/demo/weights/student --steps 8 --batch-size 16]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path


def setup(model: str, cache: str, steps: int, batch_size: int, rank: int) -> dict:
    import torch

    from opdcache.training.train import TrainConfig

    torch.set_num_threads(1)
    out = Path(tempfile.mkdtemp(prefix="bench-lora-")) / "run"
    return {"cfg": TrainConfig(model=Path(model), cache=cache, out=out, steps=steps, batch_size=batch_size, lora_rank=rank,
                               lr=1e-4, progress=False, deterministic=True)}


def run(st: dict) -> dict:
    from opdcache.training.train import run_train

    run_train(st["cfg"])
    ckpt = st["cfg"].out / "checkpoint"
    written = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    shutil.rmtree(st["cfg"].out.parent, ignore_errors=True)
    return {"checkpoint_bytes": written}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from harness import Side, compare, report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path(__file__).parent.parent / "opdcache" / "demo" / "weights" / "student"))
    parser.add_argument("--cache", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", default="8,32,64")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "lora.json"))
    args = parser.parse_args()
    common = {"model": args.model, "cache": args.cache, "steps": args.steps, "batch_size": args.batch_size}
    sides = [Side("full fine-tuning", "run", setup="setup", args=common | {"rank": 0}, baseline=True,
                  note="float32 weights and AdamW's moments of every parameter")]
    sides += [Side(f"LoRA rank {r}", "run", setup="setup", args=common | {"rank": r}) for r in map(int, args.ranks.split(","))]
    result = compare(f"LoRA vs full fine-tuning ({Path(args.model).name}, {args.steps} steps, batch {args.batch_size})", sides,
                     module=__file__, rounds=args.rounds, meta={"args": vars(args)})
    print(report(result, args.out))
    data = json.loads(Path(args.out).read_text())
    for name, side in data["sides"].items():
        print(f"{name}: checkpoint {side['runs'][0]['figures']['checkpoint_bytes'] / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
