"""Lightning OPD against standard (online) OPD on the embedded task, same optimizer steps, in one run.

Both start from the same pi_ref (the demo student after SFT on the teacher's trajectories) and use the same
estimator, batch size, learning rate and steps (the demo's defaults). Lightning OPD's wall-clock counts the cache
construction (build-rollouts of the OPD prompts x samples, score-teacher with the stores the estimator needs)
plus training, which passes over the cached rollouts as many times as the steps need; the online baseline samples
a fresh batch from the current student and scores it with the live teacher at every step. Prints the wall-clock
ratio and both final held-out accuracies and reverse KLs.

    python benchmarks/bench_e2e.py [--workdir /tmp/opdcache-e2e --steps 80 --loss full-rkl]

``--proportions paper`` measures cost at papers/000 Table 2's proportions instead (random weights, no accuracy):

    python benchmarks/bench_e2e.py --proportions paper --n-opd 128 --batch-size 32 --max-new-tokens 384
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

import torch

from opdcache.backends.base import SamplingConfig
from opdcache.demo.pipeline import DemoConfig, DemoReport, load, setup, sft_stages
from opdcache.demo.evaluate import evaluate_accuracy, reverse_kl_to_teacher
from opdcache.prompts import PromptConfig
from opdcache.rollouts import EngineConfig, GenerateJob, run_generate
from opdcache.scoring import ScoreJob, run_score
from opdcache.train import TrainConfig, run_train, stores_for


PAPER_SIZES = {  # random-weight Llama models; the teacher's forward costs ~4x the student's per token (measured and printed each run)
    "student": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=64),
    "teacher": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=8, head_dim=64),
}


def _random_model(role: str, out: Path, max_positions: int) -> Path:
    """A random-weight model in the Hugging Face format, with the demo tokenizer and no end-of-sequence token (so every
    response runs to the length limit: the cost of long responses is what is measured, not what random weights say)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from opdcache.demo import models

    torch.manual_seed({"student": 1, "teacher": 2}[role])
    config = LlamaConfig(vocab_size=models.VOCAB_SIZE, max_position_embeddings=max_positions, tie_word_embeddings=False,
                         pad_token_id=0, eos_token_id=None, bos_token_id=None, **PAPER_SIZES[role])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return models.save(model, models.build_tokenizer(), out / role)


def _forward_seconds(path: Path, tokens: int) -> float:
    """Seconds of one forward pass over a [8, tokens/8] batch (median of 3), to check the teacher/student cost ratio."""
    from opdcache.demo.pipeline import load

    model, _ = load(path)
    ids = torch.randint(5, 20, (8, tokens // 8))
    times = []
    with torch.no_grad():
        for _ in range(4):
            t = time.perf_counter()
            model(input_ids=ids)
            times.append(time.perf_counter() - t)
    return sorted(times[1:])[1]


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads (the engines run in it)."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def paper_proportions(args) -> None:
    """papers/000 Table 2's proportions: a teacher costing ~4x the student per token, one response per prompt, long
    responses, and 150 x 256 = 38,400 training sequences over 17k cached prompts (2.26 passes)."""
    from opdcache.demo import task

    w = args.workdir / "paper"
    length = args.max_new_tokens
    student, teacher = (_random_model(r, w / "models", length + 32) for r in ("student", "teacher"))
    ratio = _forward_seconds(teacher, 8 * (length + 10)) / _forward_seconds(student, 8 * (length + 10))
    prompts = task.write_prompts(w / "prompts.jsonl", "opd", args.n_opd, seed=args.seed)
    steps = max(1, round(2.26 * args.n_opd / args.batch_size))
    train = dict(model=student, loss="lightning", tau=DemoConfig.tau, kl_coef=DemoConfig.kl_coef, steps=steps, batch_size=args.batch_size,
                 lr=1e-5, seed=args.seed, teacher="teacher")

    t0, c0 = time.perf_counter(), cpu_seconds()  # Lightning OPD: cache construction + training
    rollouts = w / "caches" / f"rollouts-{time.time_ns()}"
    run_generate(GenerateJob(model=student, prompts=PromptConfig(prompts), out=rollouts, num_shards=4,
                             sampling=SamplingConfig(temperature=1.0, max_new_tokens=length, samples=1, seed=args.seed),
                             engine=EngineConfig(generate_batch_size=args.generate_batch_size)))
    t_rollouts = time.perf_counter() - t0
    run_score(ScoreJob(cache=rollouts, teacher=teacher, stores=("logprob",), allow_inconsistent_teacher=True))
    t_cache = time.perf_counter() - t0
    run_train(TrainConfig(cache=rollouts, out=rollouts.with_name(rollouts.name + "-lightning"), **train))
    t_lightning, c_lightning = time.perf_counter() - t0, cpu_seconds() - c0

    t0, c0 = time.perf_counter(), cpu_seconds()  # standard OPD: live rollouts, live teacher and live pi_ref (the KL penalty) at every step
    online = run_train(TrainConfig(cache=rollouts, out=rollouts.with_name(rollouts.name + "-online"), online=True, teacher_model=teacher,
                                   max_new_tokens=length, temperature=1.0, **train))
    t_online, c_online = time.perf_counter() - t0, cpu_seconds() - c0
    sampling, live_teacher = online["online_seconds"]["sampling"], online["online_seconds"]["teacher"] + online["online_seconds"]["pi_ref"]
    t_train = t_lightning - t_cache
    print(f"\npaper proportions: teacher/student forward time per token {ratio:.2f}x (random weights: student "
          f"{PAPER_SIZES['student']['hidden_size']}x{PAPER_SIZES['student']['num_hidden_layers']}, teacher "
          f"{PAPER_SIZES['teacher']['hidden_size']}x{PAPER_SIZES['teacher']['num_hidden_layers']}); {args.n_opd} prompts x 1 response of "
          f"{length} tokens; lightning estimator, {steps} steps x {args.batch_size} = {steps * args.batch_size} sequences "
          f"({steps * args.batch_size / args.n_opd:.2f} passes); 2 CPU threads\n")
    print(f"{'run':<32} {'wall-clock s':>12}")
    print(f"{'Lightning OPD (cache + train)':<32} {t_lightning:>12.1f}   (build-rollouts {t_rollouts:.1f}, score-teacher "
          f"{t_cache - t_rollouts:.1f}, training {t_train:.1f})")
    print(f"{'standard OPD (--online)':<32} {t_online:>12.1f}   (sampling {sampling:.1f}, live teacher and pi_ref {live_teacher:.1f}, "
          f"training and the rest {t_online - sampling - live_teacher:.1f})")
    print(f"{'speed-up, same devices':<32} {t_online / t_lightning:>11.2f}x")
    print(f"{'speed-up if the cache were free':<32} {t_online / t_train:>11.2f}x   (online / Lightning's training alone)")
    print(f"{'compute, measured':<32} {c_online / c_lightning:>11.2f}x   (CPU-seconds of all threads, getrusage: standard OPD "
          f"{c_online:.1f}, Lightning {c_lightning:.1f}; the work each did, wherever it ran)")
    print(f"{'device-time, teacher served apart':<32} {2 * t_online / t_lightning:>11.2f}x   (accounting, not a measurement: standard "
          "OPD holding a second device for its teacher server for the whole run, as papers/000 Table 2 counts GPU-hours; "
          "Lightning holds one)")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


def main() -> None:
    d = DemoConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/opdcache-e2e"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=d.opd_steps)
    parser.add_argument("--batch-size", type=int, default=d.opd_batch_size)
    parser.add_argument("--lr", type=float, default=d.opd_lr)
    parser.add_argument("--loss", default=d.loss)
    parser.add_argument("--n-opd", type=int, default=d.n_opd, help="OPD prompts in the cache")
    parser.add_argument("--samples", type=int, default=d.samples, help="cached rollouts per prompt")
    parser.add_argument("--generate-batch-size", type=int, default=512,
                        help="build-rollouts --batch-size: the cache decodes many sequences at once; the online baseline decodes its batch")
    parser.add_argument("--proportions", choices=("demo", "paper"), default="demo",
                        help="paper: random-weight models with a teacher ~4x the student's cost per token, 1 response per prompt, "
                             "--max-new-tokens long, 2.26 passes over the cache (papers/000 Table 2's proportions)")
    parser.add_argument("--max-new-tokens", type=int, default=384, help="--proportions paper: response length")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.proportions == "paper":
        return paper_proportions(args)
    cfg = DemoConfig(workdir=args.workdir, seed=args.seed, n_opd=args.n_opd)
    paths = setup(cfg)
    w = cfg.workdir
    pi_ref = sft_stages(cfg, DemoReport(), paths)  # the demo's teacher trajectories and SFT (reused when present)
    stores = stores_for(args.loss)[0]
    train = dict(model=pi_ref, loss=args.loss, tau=d.tau, kl_coef=d.kl_coef, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=cfg.seed)

    load(pi_ref), load(paths["teacher"])  # warm-up: transformers' lazy model imports, paid once per process, by whichever side ran first

    t0, c0 = time.perf_counter(), cpu_seconds()  # Lightning OPD: cache construction + training
    rollouts = w / "caches" / f"rollouts-{time.time_ns()}"
    run_generate(GenerateJob(model=pi_ref, prompts=PromptConfig(paths["prompts_opd"]), out=rollouts, num_shards=4,
                             sampling=SamplingConfig(temperature=1.0, max_new_tokens=48, samples=args.samples, seed=cfg.seed),
                             engine=EngineConfig(generate_batch_size=args.generate_batch_size)))
    t_rollouts = time.perf_counter() - t0
    run_score(ScoreJob(cache=rollouts, teacher=paths["teacher"], stores=stores))
    t_cache = time.perf_counter() - t0
    run_train(TrainConfig(cache=rollouts, out=rollouts.with_name(rollouts.name + "-lightning"), **train))
    t_lightning, c_lightning = time.perf_counter() - t0, cpu_seconds() - c0

    t0, c0 = time.perf_counter(), cpu_seconds()  # standard OPD: live rollouts, live teacher and live pi_ref (the KL penalty) at every step
    online = run_train(TrainConfig(cache=rollouts, out=rollouts.with_name(rollouts.name + "-online"), online=True, teacher_model=paths["teacher"],
                                   max_new_tokens=48, temperature=1.0, **train))
    t_online, c_online = time.perf_counter() - t0, cpu_seconds() - c0
    sampling, live_teacher = online["online_seconds"]["sampling"], online["online_seconds"]["teacher"] + online["online_seconds"]["pi_ref"]

    teacher, _ = load(paths["teacher"])
    fig = {}
    for name, path in (("pi_ref", pi_ref), ("lightning", rollouts.with_name(rollouts.name + "-lightning") / "model"),
                       ("online", rollouts.with_name(rollouts.name + "-online") / "model")):
        model, tok = load(path)
        fig[name] = (evaluate_accuracy(model, tok, n=cfg.n_heldout, seed=cfg.seed).accuracy,
                     reverse_kl_to_teacher(model, teacher, tok, n=200, seed=cfg.seed))
    cached = args.n_opd * args.samples
    print(f"\n{args.loss}, {args.steps} steps x batch {args.batch_size} ({args.steps * args.batch_size:,} sequences), lr {args.lr:g}, "
          f"cache {args.n_opd} prompts x {args.samples} = {cached:,} rollouts, demo models, seed {cfg.seed}, 2 CPU threads\n")
    print(f"{'run':<32} {'wall-clock s':>12} {'held-out accuracy':>18} {'reverse KL':>11}")
    print(f"{'pi_ref (start)':<32} {'':>12} {fig['pi_ref'][0]:>17.1%} {fig['pi_ref'][1]:>11.4f}")
    print(f"{'Lightning OPD (cache + train)':<32} {t_lightning:>12.1f} {fig['lightning'][0]:>17.1%} {fig['lightning'][1]:>11.4f}"
          f"   (cache construction {t_cache:.1f}s)")
    print(f"{'standard OPD (--online)':<32} {t_online:>12.1f} {fig['online'][0]:>17.1%} {fig['online'][1]:>11.4f}")
    print(f"{'speed-up':<32} {t_online / t_lightning:>11.2f}x")
    print(f"{'compute, measured':<32} {c_online / c_lightning:>11.2f}x   (CPU-seconds of all threads, getrusage: standard OPD "
          f"{c_online:.1f}, Lightning {c_lightning:.1f}); load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    t_train = t_lightning - t_cache
    print(f"\nwhere the time went (s): Lightning: build-rollouts {t_rollouts:.1f}, score-teacher {t_cache - t_rollouts:.1f}, "
          f"training {t_train:.1f}; online: sampling {sampling:.1f}, live teacher and pi_ref {live_teacher:.1f}, "
          f"training and the rest {t_online - sampling - live_teacher:.1f}")
    print(f"speed-up if the cache cost nothing (online / Lightning's training alone): {t_online / t_train:.2f}x")


if __name__ == "__main__":
    main()
