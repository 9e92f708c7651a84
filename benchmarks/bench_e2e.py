"""Lightning OPD against standard (online) OPD on the embedded task, same optimizer steps, in one run.

Both start from the same pi_ref (the demo student after SFT on the teacher's trajectories) and use the same
estimator (lightning), batch size, learning rate and steps. Lightning OPD's wall-clock counts the cache
construction (build-rollouts + score-teacher) plus training; the online baseline samples fresh rollouts from
the current student and scores them with the live teacher at every step. Prints the wall-clock ratio and
both final held-out accuracies.

    python benchmarks/bench_e2e.py [--workdir /tmp/e2e --steps 40]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from opdcache.backends.base import SamplingConfig
from opdcache.demo.pipeline import DemoConfig, load, setup
from opdcache.evaluate import evaluate_accuracy
from opdcache.prompts import PromptConfig
from opdcache.rollouts import GenerateJob, run_generate
from opdcache.scoring import ScoreJob, run_score
from opdcache.sft import SFTConfig, run_sft
from opdcache.train import TrainConfig, run_train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/opdcache-e2e"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-6)
    args = parser.parse_args()
    torch.set_num_threads(2)
    cfg = DemoConfig(workdir=args.workdir, n_train=1000, n_opd=args.steps * args.batch_size // 2, n_heldout=300)
    paths = setup(cfg)
    w = cfg.workdir
    sft, pi_ref = w / "caches" / "sft", w / "models" / "pi_ref"
    if not (sft / "opdcache.json").is_file():
        run_generate(GenerateJob(model=paths["teacher"], prompts=PromptConfig(paths["prompts_train"]), out=sft, kind="sft", num_shards=4,
                                 sampling=SamplingConfig(temperature=0.8, max_new_tokens=48)))
    if not (pi_ref / "config.json").is_file():
        run_sft(paths["student"], sft, pi_ref, SFTConfig(steps=cfg.sft_steps, batch_size=64, lr=3e-3, warmup=10))

    t0 = time.perf_counter()  # Lightning OPD: cache construction + training
    rollouts = w / "caches" / "rollouts"
    run_generate(GenerateJob(model=pi_ref, prompts=PromptConfig(paths["prompts_opd"]), out=rollouts, num_shards=4,
                             sampling=SamplingConfig(temperature=1.0, max_new_tokens=48, samples=2)))
    run_score(ScoreJob(cache=rollouts, teacher=paths["teacher"]))
    t_cache = time.perf_counter() - t0
    run_train(TrainConfig(model=pi_ref, cache=rollouts, out=w / "runs" / "lightning", steps=args.steps, batch_size=args.batch_size, lr=args.lr))
    t_lightning = time.perf_counter() - t0

    t0 = time.perf_counter()  # standard OPD: live rollouts and live teacher at every step
    run_train(TrainConfig(model=pi_ref, cache=rollouts, out=w / "runs" / "online", steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                          online=True, teacher_model=paths["teacher"], max_new_tokens=48, temperature=1.0))
    t_online = time.perf_counter() - t0

    acc = {}
    for name, path in (("pi_ref", pi_ref), ("lightning", w / "runs" / "lightning" / "model"), ("online", w / "runs" / "online" / "model")):
        model, tok = load(path)
        acc[name] = evaluate_accuracy(model, tok, n=cfg.n_heldout).accuracy
    print(f"\n{args.steps} steps, batch {args.batch_size}, lr {args.lr}, lightning estimator, demo models, 2 CPU threads\n")
    print(f"{'run':<32} {'wall-clock s':>12} {'held-out accuracy':>18}")
    print(f"{'pi_ref (start)':<32} {'':>12} {acc['pi_ref']:>17.1%}")
    print(f"{'Lightning OPD (cache + train)':<32} {t_lightning:>12.1f} {acc['lightning']:>17.1%}   (cache construction {t_cache:.1f}s)")
    print(f"{'standard OPD (--online)':<32} {t_online:>12.1f} {acc['online']:>17.1%}")
    print(f"{'speed-up':<32} {t_online / t_lightning:>11.2f}x")


if __name__ == "__main__":
    main()
