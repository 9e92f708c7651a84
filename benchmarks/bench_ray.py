"""--executor ray against a local run with the same total threads: the demo's build-rollouts + score-teacher, on the
harness.

Work: the demo's OPD stage at its settings (pi_ref = the shipped student with the demo teacher's lineage, 512 prompts
x 4 samples, 48 new tokens, ref top-k 8, MC 4; score-teacher with logprob, topk k=8, hidden, svd rank 32), 8 shards
per table, each run into a fresh cache. Sides, on a 2-CPU budget:

* **local, 2 threads** (the baseline: one process with the same total threads the Ray sides get);
* local, 1 thread (the arithmetic the Ray tasks below share: its caches are byte-identical to theirs, tests/test_ray.py);
* Ray, 2 workers of 1 CPU each (``--workers 2 --cpus-per-worker 1``: each task runs one torch thread);
* Ray, 1 worker of 2 CPUs (``--cpus-per-worker 2``).

benchmarks/harness.py interleaves them over rounds, each run a fresh process; Ray's cluster start (``ray.init``) is in
the untimed setup. CPU-seconds count the driver only for the Ray sides (Ray's workers are not its children); wall
time is the figure to compare.

    python benchmarks/bench_ray.py [--prompts 512 --rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

WEIGHTS = Path(__file__).parent.parent / "opdcache" / "demo" / "weights"


def setup(root: str, prompts: int, side: str, workers: int = 0, cpus: int = 1, threads: int = 1) -> dict:
    import torch

    torch.set_num_threads(threads)
    if workers:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    return {"root": Path(root), "prompts": prompts, "side": side, "workers": workers, "cpus": cpus}


def run(st: dict) -> None:
    from opdcache.backends.base import SamplingConfig
    from opdcache.teacher.executors import RayConfig, run_on_ray
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate
    from opdcache.teacher.scoring import ScoreJob, run_score

    out = st["root"] / st["side"]
    shutil.rmtree(out, ignore_errors=True)
    gen = GenerateJob(model=WEIGHTS / "student", prompts=PromptConfig(st["root"] / "opd.jsonl", limit=st["prompts"]), out=out, num_shards=8,
                      sft_teacher=WEIGHTS / "teacher", sampling=SamplingConfig(max_new_tokens=48, samples=4, temperature=1.0, ref_top_k=8, mc_samples=4))
    score = ScoreJob(cache=out, teacher=WEIGHTS / "teacher", stores=("logprob", "topk", "hidden", "svd"), top_k=8, svd_rank=32)
    if not st["workers"]:
        run_generate(gen)
        run_score(score)
    else:
        cfg = RayConfig(workers=st["workers"], cpus_per_worker=st["cpus"])
        run_on_ray(run_generate, gen, cfg, "rollouts")
        run_on_ray(run_score, score, cfg, "teachers/teacher")
    shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import Side, compare, report

    from opdcache.demo.task import write_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "ray.json")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    write_prompts(root / "opd.jsonl", "opd", args.prompts)
    common = {"root": str(root), "prompts": args.prompts}
    sides = [Side("local, 2 threads", "run", "setup", common | {"side": "local2", "threads": 2}, baseline=True,
                  note="one process, the same total threads as the Ray sides"),
             Side("local, 1 thread", "run", "setup", common | {"side": "local1"}, note="the Ray tasks' arithmetic (byte-identical caches)"),
             Side("Ray, 2 workers x 1 CPU", "run", "setup", common | {"side": "ray2", "workers": 2, "cpus": 1},
                  note="--executor ray --workers 2 --cpus-per-worker 1"),
             Side("Ray, 1 worker x 2 CPUs", "run", "setup", common | {"side": "ray1", "workers": 1, "cpus": 2},
                  note="--executor ray --workers 1 --cpus-per-worker 2")]
    result = compare(f"build-rollouts + score-teacher, {args.prompts} prompts x 4 samples, 8 + 8 shards, 2 CPUs", sides, __file__,
                     rounds=args.rounds, meta={"command": "python benchmarks/bench_ray.py"})
    report(result, args.json)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
