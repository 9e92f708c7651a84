"""Lightning OPD against standard (online) OPD, same optimizer steps, on the harness.

Both start from the same pi_ref and use the same estimator, batch size, learning rate and steps. A **Lightning** run
is the cache construction (build-rollouts of the OPD prompts x samples, score-teacher with the stores the estimator
needs) plus training over the cached rollouts; an **online** run (the baseline) samples a fresh batch from the current
student and scores it with the live teacher (and pi_ref, for the KL penalty) at every step. benchmarks/harness.py
runs them interleaved over ``--rounds`` after a warm-up round, each run a fresh process, and reports wall and
CPU seconds (every thread), peak anonymous RSS and the load. Each run also reports where its time went. After the
rounds, the last round's two trained students are evaluated (held-out accuracy, reverse KL to the teacher; untimed).

    python benchmarks/bench_e2e.py [--workdir /tmp/opdcache-e2e --steps 80 --loss lightning --rounds 3]

``--proportions paper`` measures cost at papers/000 Table 2's proportions instead (random weights, no accuracy):

    python benchmarks/bench_e2e.py --proportions paper --n-opd 128 --batch-size 32 --max-new-tokens 384

Papers count the online baseline's teacher as a second device held for the whole run (GPU-hours); this benchmark
reports only what it measures on the same CPUs.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from opdcache.backends import EngineConfig
from opdcache.backends.base import SamplingConfig
from opdcache.demo.evaluate import evaluate_prompts
from opdcache.demo.pipeline import DemoConfig, DemoReport, load, setup as demo_setup, sft_stages
from opdcache.inputs.prompts import PromptConfig
from opdcache.teacher.rollouts import GenerateJob, run_generate
from opdcache.teacher.scoring import run_score, ScoreJob
from opdcache.training.train import run_train, stores_for, TrainConfig


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


def setup(**kw) -> dict:
    torch.set_num_threads(2)
    st = {k: Path(v) if k in ("workdir", "pi_ref", "teacher", "prompts") else v for k, v in kw.items()}
    st["train"] = {**st["train"], "model": Path(st["train"]["model"])}
    return st


def lightning(st: dict) -> dict:
    """Cache construction (build-rollouts, score-teacher) and training over it; its stages' seconds."""
    t0 = time.perf_counter()
    rollouts = st["workdir"] / "caches" / "rollouts-bench"
    shutil.rmtree(rollouts, ignore_errors=True)
    run_generate(GenerateJob(model=st["pi_ref"], prompts=PromptConfig(st["prompts"]), out=rollouts, num_shards=4,
                             sampling=SamplingConfig(temperature=1.0, max_new_tokens=st["max_new_tokens"], samples=st["samples"], seed=st["seed"]),
                             engine=EngineConfig(generate_batch_size=st["generate_batch_size"])))
    t_rollouts = time.perf_counter() - t0
    run_score(ScoreJob(cache=rollouts, teacher=st["teacher"], stores=tuple(st["stores"]), allow_inconsistent_teacher=st["paper"]))
    t_cache = time.perf_counter() - t0
    out = st["workdir"] / "runs" / "lightning"
    shutil.rmtree(out, ignore_errors=True)
    run_train(TrainConfig(cache=rollouts, out=out, **st["train"]))
    return {"build_rollouts_s": t_rollouts, "score_teacher_s": t_cache - t_rollouts, "training_s": time.perf_counter() - t0 - t_cache}


def online(st: dict) -> dict:
    """Standard OPD: live rollouts, live teacher and live pi_ref (the KL penalty) at every step; where the time went."""
    out = st["workdir"] / "runs" / "online"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    res = run_train(TrainConfig(cache=st["workdir"] / "caches" / "rollouts-bench", out=out, online=True, teacher_model=st["teacher"],
                                max_new_tokens=st["max_new_tokens"], temperature=1.0, **st["train"]))
    sec = res["online_seconds"]
    return {"sampling_s": sec["sampling"], "live_teacher_and_pi_ref_s": sec["teacher"] + sec["pi_ref"],
            "training_and_rest_s": time.perf_counter() - t0 - sec["sampling"] - sec["teacher"] - sec["pi_ref"]}


def _compare(args, common: dict, title: str) -> dict:
    import json
    import statistics
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import Side, compare, report

    sides = [Side("Lightning OPD (cache + train)", "lightning", "setup", common,
                  note="build-rollouts + score-teacher + train from the cache"),
             Side("standard OPD (--online)", "online", "setup", common, baseline=True,
                  note="train --online: the student samples and the live teacher scores every step")]
    result = compare(title, sides, __file__, rounds=args.rounds, meta={"command": "python benchmarks/bench_e2e.py " + " ".join(sys.argv[1:])})
    report(result)
    for name, e in result["sides"].items():
        parts = {k: statistics.median(r["figures"][k] for r in e["runs"]) for k in e["runs"][0]["figures"]}
        e["where_the_time_went_median"] = parts
        print(f"  {name}: " + ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.1f} s" for k, v in parts.items()))
    lt = result["sides"]["Lightning OPD (cache + train)"]
    print(f"speed-up if the cache cost nothing (online / Lightning's training alone, medians): "
          f"{result['sides']['standard OPD (--online)']['wall_median'] / lt['where_the_time_went_median']['training_s']:.2f}x")
    path = Path(__file__).parent / "results" / f"e2e_{args.proportions}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


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
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.proportions == "paper":
        from opdcache.demo import task

        w = args.workdir / "paper"
        length = args.max_new_tokens
        student, teacher = (_random_model(r, w / "models", length + 32) if not (w / "models" / r / "config.json").is_file() else w / "models" / r
                            for r in ("student", "teacher"))
        ratio = _forward_seconds(teacher, 8 * (length + 10)) / _forward_seconds(student, 8 * (length + 10))
        prompts = task.write_prompts(w / "prompts.jsonl", "opd", args.n_opd, seed=args.seed)
        steps = max(1, round(2.26 * args.n_opd / args.batch_size))
        train = dict(model=str(student), loss="lightning", tau=DemoConfig.tau, kl_coef=DemoConfig.kl_coef, steps=steps,
                     batch_size=args.batch_size, lr=1e-5, seed=args.seed, teacher="teacher")
        common = dict(workdir=str(w), pi_ref=str(student), teacher=str(teacher), prompts=str(prompts), max_new_tokens=length, samples=1,
                      seed=args.seed, generate_batch_size=args.generate_batch_size, stores=["logprob"], paper=True, train=train)
        _compare(args, common, f"paper proportions: teacher/student forward time per token {ratio:.2f}x; {args.n_opd} prompts x 1 "
                               f"response of {length} tokens; lightning, {steps} steps x {args.batch_size} sequences; 2 CPU threads")
        return
    cfg = DemoConfig(workdir=args.workdir, seed=args.seed, n_opd=args.n_opd)
    paths = demo_setup(cfg)
    pi_ref = sft_stages(cfg, DemoReport(), paths)  # the demo's teacher trajectories and SFT (reused when present)
    train = dict(model=str(pi_ref), loss=args.loss, tau=d.tau, kl_coef=d.kl_coef, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                 seed=cfg.seed)
    common = dict(workdir=str(args.workdir), pi_ref=str(pi_ref), teacher=str(paths["teacher"]), prompts=str(paths["prompts_opd"]),
                  max_new_tokens=48, samples=args.samples, seed=cfg.seed, generate_batch_size=args.generate_batch_size,
                  stores=list(stores_for(args.loss)[0]), paper=False, train=train)
    _compare(args, common, f"{args.loss}, {args.steps} steps x batch {args.batch_size}, cache {args.n_opd} prompts x {args.samples} "
                           f"rollouts, demo models, seed {cfg.seed}, 2 CPU threads")
    teacher, _ = load(paths["teacher"])
    print(f"\n{'model (the last round)':<32} {'held-out accuracy':>18} {'reverse KL':>11}")
    for name, path in (("pi_ref (start)", pi_ref), ("Lightning OPD", args.workdir / "runs" / "lightning" / "model"),
                       ("standard OPD (--online)", args.workdir / "runs" / "online" / "model")):
        model, tok = load(path)
        r = evaluate_prompts(model, tok, paths["prompts_heldout"], teacher, kl_prompts=200)
        print(f"{name:<32} {r.accuracy:>17.1%} {r.reverse_kl:>11.4f}")


if __name__ == "__main__":
    main()
