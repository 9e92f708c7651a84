"""AsyncOPD throughput (papers/001 App. G): async at staleness K against strict synchronous (K = 0), same settings, one run.

Both runs are ``opdcache async`` with one process per stage (rollout, teacher, learner) sharing one cache; only K
differs. At K = 0 the stages take turns (the rollout of batch b waits for update b), which is strict synchronous OPD;
at K > 0 the rollout worker runs up to K batches ahead. Printed, per run: papers/001's throughput (response tokens per
second of learner time after 5 warm-up updates), its overlap figure (sum over stages of busy time / wall time, at most
3), each stage's busy seconds, and the ratio async / sync. The machine's CPU count bounds the overlap: with 2 cores and
3 busy stages, at most 2 run at full speed, so the script also prints the bound (sum of busy times / max(the largest,
the sum / cores)) and the device-time figure as bench_e2e.py does (each stage on its own device: the speedup if every
stage ran at its measured busy rate in parallel, = sum / max of the per-batch stage times).

Models: ``--proportions paper`` (default) uses bench_e2e.py's random-weight pair (the teacher's forward ~4x the
student's, no end-of-sequence token, so every response runs to --max-new-tokens), so that a batch's work dwarfs the
stages' handoff latency (a file appearing in the cache, polled every <= 20 ms); ``--proportions demo`` uses the demo's
tiny trained models, whose batches take tens of milliseconds, where the handoff latency itself is what is measured.

    python benchmarks/bench_async.py [--proportions paper --steps 16 --batch-size 16 --max-new-tokens 96 --staleness 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from opdcache.asyncopd import AsyncConfig, run_async
from opdcache.backends.base import SamplingConfig
from opdcache.demo.task import write_prompts
from opdcache.prompts import PromptConfig

WEIGHTS = Path(__file__).resolve().parent.parent / "opdcache" / "demo" / "weights"


def models(args) -> tuple[Path, Path]:
    if args.proportions == "demo":
        return WEIGHTS / "student", WEIGHTS / "teacher"
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_e2e import _random_model

    root = args.workdir / "models"
    return tuple(_random_model(role, root, 512) if not (root / role / "config.json").is_file() else root / role
                 for role in ("student", "teacher"))


def one(args, k: int, root: Path) -> dict:
    out = root / f"k{k}"
    shutil.rmtree(out, ignore_errors=True)
    student, teacher = models(args)
    cfg = AsyncConfig(model=student, teacher=teacher, prompts=PromptConfig(root / "opd.jsonl"), out=out,
                      staleness=k, steps=args.steps, batch_size=args.batch_size, lr=3e-5, device="cpu", threads=args.threads,
                      sampling=SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens), seed=args.seed)
    start = time.perf_counter()
    result = run_async(cfg)
    fig = result["figures"] | {"command_s": time.perf_counter() - start}
    per_batch = {s: v / args.steps for s, v in fig["busy_s"].items()}
    total = sum(per_batch.values())
    cores = len(os.sched_getaffinity(0))
    fig["per_batch_s"] = per_batch
    fig["cpu_bound_speedup"] = total / max(max(per_batch.values()), total / cores)  # the most 'cores' CPUs allow
    fig["device_time_speedup"] = total / max(per_batch.values())  # each stage on its own device
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench-async"))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--proportions", choices=("paper", "demo"), default="paper")
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    write_prompts(args.workdir / "opd.jsonl", "opd", 256)
    sync, async_ = one(args, 0, args.workdir), one(args, args.staleness, args.workdir)
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {len(os.sched_getaffinity(0))} CPUs; {args.steps} steps x "
          f"{args.batch_size} prompts x <= {args.max_new_tokens} tokens; {args.threads} thread(s) per stage; {args.proportions} models")
    print(f"{'run':<10} {'tokens/s':>9} {'overlap':>8} {'rollout s/b':>12} {'teacher s/b':>12} {'learner s/b':>12} {'wall s':>8}")
    for name, f in (("sync K=0", sync), (f"async K={args.staleness}", async_)):
        pb = f["per_batch_s"]
        print(f"{name:<10} {f['throughput_tokens_per_s']:>9.1f} {f['overlap']:>8.2f} {pb['rollout']:>12.3f} {pb['teacher']:>12.3f} "
              f"{pb['learner']:>12.3f} {f['wall_s']:>8.1f}")
    ratio = async_["throughput_tokens_per_s"] / sync["throughput_tokens_per_s"]
    print(f"throughput async / sync: {ratio:.2f}x  (bound on these CPUs from the sync run's stage times: "
          f"{sync['cpu_bound_speedup']:.2f}x; device-time, each stage on its own device: {sync['device_time_speedup']:.2f}x)")
    (args.workdir / "bench_async.json").write_text(json.dumps({"sync": sync, "async": async_, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
