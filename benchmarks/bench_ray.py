"""--executor ray against a local run: the demo's build-rollouts + score-teacher with 1 and 2 Ray workers.

Work: the demo's OPD stage at its settings (pi_ref = the shipped student with the demo teacher's lineage, 512 prompts
x 4 samples, 48 new tokens, ref top-k 8, MC 4; score-teacher with logprob, topk k=8, hidden, svd rank 32), 8 shards.
Each variant writes a fresh cache; Ray's cluster start is timed apart. Every variant runs with one torch thread per
process (a Ray task with one CPU gets OMP_NUM_THREADS=1), so the caches are byte-identical and the ratio is about
scheduling, not arithmetic. Overhead per shard = (Ray 1 worker - local) / shards. Run:

    python benchmarks/bench_ray.py [--prompts 512]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from opdcache.backends.base import SamplingConfig
from opdcache.prompts import PromptConfig
from opdcache.rollouts import GenerateJob, run_generate
from opdcache.scoring import ScoreJob, run_score

WEIGHTS = Path(__file__).parent.parent / "opdcache" / "demo" / "weights"


def jobs(out: Path, prompts: Path, n: int):
    gen = GenerateJob(model=WEIGHTS / "student", prompts=PromptConfig(prompts, limit=n), out=out, num_shards=8, sft_teacher=WEIGHTS / "teacher",
                      sampling=SamplingConfig(max_new_tokens=48, samples=4, temperature=1.0, ref_top_k=8, mc_samples=4))
    score = ScoreJob(cache=out, teacher=WEIGHTS / "teacher", stores=("logprob", "topk", "hidden", "svd"), top_k=8, svd_rank=32)
    return gen, score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=512)
    args = ap.parse_args()
    import ray
    import torch

    from opdcache.demo.task import write_prompts
    from opdcache.executors import RayConfig, run_on_ray

    root = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    prompts = write_prompts(root / "opd.jsonl", "opd", args.prompts)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    gen, score = jobs(root / "local", prompts, args.prompts)
    run_generate(gen)
    run_score(score)
    local = time.perf_counter() - t0
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    start = time.perf_counter() - t0
    times = {}
    for workers in (1, 2):
        t0 = time.perf_counter()
        gen, score = jobs(root / f"ray{workers}", prompts, args.prompts)
        run_on_ray(run_generate, gen, RayConfig(workers=workers), "rollouts")
        run_on_ray(run_score, score, RayConfig(workers=workers), "teachers/teacher")
        times[workers] = time.perf_counter() - t0
    ray.shutdown()
    shards = 8 * 2  # rollout shards + teacher shards
    print(f"local (1 thread): {local:.1f} s; Ray cluster start {start:.1f} s (not counted)")
    for w, t in times.items():
        print(f"ray, {w} worker{'s' if w > 1 else ''}: {t:.1f} s = {local / t:.2f}x local")
    print(f"2 workers vs 1: {times[1] / times[2]:.2f}x; overhead per shard (1 worker - local) / {shards} shards: "
          f"{(times[1] - local) / shards * 1000:.0f} ms")


if __name__ == "__main__":
    main()
