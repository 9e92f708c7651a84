"""AsyncOPD throughput (papers/001 App. G): async at staleness K against strict synchronous OPD run two ways, on the harness.

Every side is ``opdcache async`` with one process per stage (rollout, teacher, learner) sharing one cache. At K = 0 the
stages take turns (the rollout of batch b waits for update b): strict synchronous OPD. The sides, interleaved over
rounds by benchmarks/harness.py (each run a fresh process; wall and CPU seconds of the whole run, load before and
after):

* **sync, colocated** (the baseline: what a competent user runs on one machine): K = 0, every stage with all the
  machine's cores (``--threads`` = cores), since only one stage works at a time;
* **sync, partitioned**: K = 0, each stage on its own share of the cores (``--threads`` = cores / 3, at least 1);
* **async K**: staleness K, partitioned (the stages run at once, so each keeps to its share).

Per side it also prints papers/001's throughput (response tokens per second of learner time after 5 warm-up updates)
and overlap (stage-busy seconds per wall second), medians over the rounds, and where each stage's time goes (busy
seconds per batch). The GPU-shaped figure (each stage on its own device, as papers/001 App. G runs them) is the
device-time bound from the partitioned sync run's stage times: sum of the per-batch stage times / the largest.

Models: ``--proportions paper`` (default) uses bench_e2e.py's random-weight pair (the teacher's forward ~4x the
student's, no end-of-sequence token, so every response runs to --max-new-tokens), so that a batch's work dwarfs the
stages' handoff latency; ``--proportions demo`` uses the demo's tiny trained models.

    python benchmarks/bench_async.py [--proportions paper --steps 10 --batch-size 8 --max-new-tokens 96 --staleness 2 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from opdcache.asyncopd import AsyncConfig, learner, run_async
from opdcache.backends.base import SamplingConfig
from opdcache.demo.task import write_prompts
from opdcache.inputs.prompts import PromptConfig

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


def setup(workdir: str, student: str, teacher: str, k: int, threads: int, steps: int, batch_size: int, max_new_tokens: int,
          seed: int, name: str) -> dict:
    return dict(locals())


def run(st: dict) -> dict:
    """One whole ``opdcache async`` run in a fresh run directory; its figures (throughput, overlap, busy seconds)."""
    root = Path(st["workdir"])
    out = root / f"run-{st['name']}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = AsyncConfig(learner=learner(st["student"], steps=st["steps"], batch_size=st["batch_size"], lr=3e-5, seed=st["seed"]),
                      teacher=Path(st["teacher"]), prompts=PromptConfig(root / "opd.jsonl"), out=out, staleness=st["k"], device="cpu",
                      threads=st["threads"], sampling=SamplingConfig(temperature=1.0, max_new_tokens=st["max_new_tokens"]))
    fig = run_async(cfg)["figures"]
    fig["per_batch_s"] = {s: v / st["steps"] for s, v in fig["busy_s"].items()}
    shutil.rmtree(out, ignore_errors=True)
    return fig


def main() -> None:
    import statistics
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import Side, compare, report

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench-async"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--proportions", choices=("paper", "demo"), default="paper")
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "async.json")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    write_prompts(args.workdir / "opd.jsonl", "opd", 256)
    student, teacher = models(args)
    cores = len(os.sched_getaffinity(0))
    share = max(1, cores // 3)
    common = {"workdir": str(args.workdir), "student": str(student), "teacher": str(teacher), "steps": args.steps,
              "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "seed": args.seed}
    sides = [Side("sync K=0, colocated", "run", "setup", common | {"k": 0, "threads": cores, "name": "sync-colocated"}, baseline=True,
                  note=f"strict sync, stages take turns, each with all {cores} cores"),
             Side("sync K=0, partitioned", "run", "setup", common | {"k": 0, "threads": share, "name": "sync-partitioned"},
                  note=f"strict sync, each stage on {share} thread(s)"),
             Side(f"async K={args.staleness}", "run", "setup", common | {"k": args.staleness, "threads": share, "name": "async"},
                  note=f"the stages at once, each on {share} thread(s)")]
    result = compare(f"opdcache async, {args.steps} steps x {args.batch_size} prompts x {args.max_new_tokens} tokens, {args.proportions} models",
                     sides, __file__, rounds=args.rounds,
                     meta={"command": "python benchmarks/bench_async.py", "proportions": args.proportions})
    report(result)
    print(f"\n{'side':<24} {'tokens/s':>9} {'vs base':>8} {'overlap':>8} {'rollout s/b':>12} {'teacher s/b':>12} {'learner s/b':>12}  (medians)")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    base = med([r["figures"]["throughput_tokens_per_s"] for r in result["sides"]["sync K=0, colocated"]["runs"]])
    for name, e in result["sides"].items():
        figs = [r["figures"] for r in e["runs"]]
        tps = med([f["throughput_tokens_per_s"] for f in figs])
        pb = {s: med([f["per_batch_s"][s] for f in figs]) for s in ("rollout", "teacher", "learner")}
        e["throughput_median"], e["per_batch_median"] = tps, pb
        print(f"{name:<24} {tps:>9.1f} {tps / base:>7.2f}x {med([f['overlap'] for f in figs]):>8.2f} {pb['rollout']:>12.3f} "
              f"{pb['teacher']:>12.3f} {pb['learner']:>12.3f}")
    pb = result["sides"]["sync K=0, partitioned"]["per_batch_median"]
    result["device_time_speedup"] = sum(pb.values()) / max(pb.values())
    print(f"device-time bound (each stage on its own device, from the partitioned sync run's stage times): "
          f"{result['device_time_speedup']:.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
