"""``opdcache demo``: the whole pipeline on the embedded task, on a CPU, with tiny local models.

The work directory has a documented layout, so every CLI command can be rerun by hand on it::

    <workdir>/models/teacher        Qwen3-architecture teacher (HF format; solves the task)
    <workdir>/models/teacher_carry  a second teacher in another trace style (consistency ablation)
    <workdir>/models/student        Llama-architecture base student (smaller, clearly weaker)
    <workdir>/models/pi_ref         the base student after SFT on the teacher's trajectories
    <workdir>/models/opd            pi_ref after Lightning OPD
    <workdir>/prompts/{train,opd,heldout}.jsonl
    <workdir>/caches/sft            teacher trajectories (build-sft)
    <workdir>/caches/rollouts       pi_ref rollouts (build-rollouts) scored by the teacher in every store
    <workdir>/runs/lightning        the training run (metrics.jsonl, checkpoint)

Stages are the library calls behind the CLI commands; each is skipped when its output exists, so a
rerun resumes. The README shows the equivalent commands.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from opdcache.demo import task
from opdcache.demo.build import WEIGHTS

SHIPPED = ("teacher", "teacher_carry", "student")


@dataclass(frozen=True)
class DemoConfig:
    """Settings of the embedded demo (defaults sized for 2 CPU cores, under 5 minutes)."""

    workdir: Path = Path("opdcache-demo")
    """Where models, prompts, caches and runs are written."""
    seed: int = 0
    """Seed of the prompt splits, sampling and training."""
    n_train: int = 1000
    """Prompts for the SFT-teacher trajectories."""
    n_opd: int = 512
    """Prompts for pi_ref rollouts (Lightning OPD)."""
    n_heldout: int = 300
    """Held-out prompts for evaluation."""
    sft_steps: int = 340
    """SFT steps of the base student on the teacher's trajectories (340: pi_ref ~88% accurate, close to its teacher,
    the regime Lightning OPD assumes; far from the teacher the student leaks mass off pi_ref's support, see README)."""
    opd_steps: int = 40
    """OPD optimizer steps."""
    opd_lr: float = 3e-6
    """OPD learning rate (close to papers/000 Table 6's 2e-6; the tiny student is very sensitive, see README)."""
    opd_batch_size: int = 64
    """Sequences per OPD step."""
    samples: int = 4
    """Rollouts per OPD prompt."""
    loss: str = "lightning"
    """Estimator of the OPD stage."""


@dataclass
class DemoReport:
    lines: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)


def setup(cfg: DemoConfig) -> dict[str, Path]:
    """Copy the shipped models and write the prompt splits into the work directory."""
    paths = {}
    for name in SHIPPED:
        dst = cfg.workdir / "models" / name
        if not (dst / "config.json").is_file():
            src = WEIGHTS / name
            if not (src / "config.json").is_file():
                raise FileNotFoundError(f"shipped demo model {src} is missing; rebuild it with `python -m opdcache.demo.build`")
            shutil.copytree(src, dst, dirs_exist_ok=True)
        paths[name] = dst
    for split, n in {"train": cfg.n_train, "opd": cfg.n_opd, "heldout": cfg.n_heldout}.items():
        path = cfg.workdir / "prompts" / f"{split}.jsonl"
        if not path.is_file():
            task.write_prompts(path, split, n, seed=cfg.seed)
        paths[f"prompts_{split}"] = path
    return paths


def load(path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def evaluate(name: str, path: Path, teacher, cfg: DemoConfig, report: DemoReport) -> dict:
    from opdcache.evaluate import evaluate_accuracy, reverse_kl_to_teacher

    model, tok = load(path)
    acc = evaluate_accuracy(model, tok, n=cfg.n_heldout, seed=cfg.seed).accuracy
    rkl = reverse_kl_to_teacher(model, teacher, tok, n=min(cfg.n_heldout, 200), seed=cfg.seed)
    report.figures[name] = {"accuracy": acc, "reverse_kl": rkl}
    report.say(f"[eval] {name:<9} held-out accuracy {acc:6.1%}   per-token reverse KL to teacher {rkl:.4f} nats")
    return report.figures[name]


def _stage(report: DemoReport, name: str, done: bool, run) -> None:
    start = time.perf_counter()
    if done:
        report.say(f"[{name}] already done, skipped")
        return
    detail = run()
    report.say(f"[{name}] {detail} ({time.perf_counter() - start:.1f}s)")


def run_demo(cfg: DemoConfig) -> DemoReport:
    import torch

    from opdcache.backends.base import SamplingConfig
    from opdcache.prompts import PromptConfig
    from opdcache.rollouts import GenerateJob, run_generate
    from opdcache.scoring import ScoreJob, run_score
    from opdcache.sft import SFTConfig, run_sft
    from opdcache.train import TrainConfig, run_train
    from opdcache.validate import validate

    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    report = DemoReport()
    start = time.perf_counter()
    w = cfg.workdir
    paths = setup(cfg)
    report.say(f"[setup] models and prompts in {w}")
    teacher, _ = load(paths["teacher"])
    evaluate("teacher", paths["teacher"], teacher, cfg, report)
    evaluate("base", paths["student"], teacher, cfg, report)
    sft_cache, pi_ref, rollouts = w / "caches" / "sft", w / "models" / "pi_ref", w / "caches" / "rollouts"
    _stage(report, "build-sft", (sft_cache / "opdcache.json").is_file(), lambda: run_generate(GenerateJob(
        model=paths["teacher"], prompts=PromptConfig(paths["prompts_train"]), out=sft_cache, kind="sft", num_shards=4,
        sampling=SamplingConfig(temperature=0.8, max_new_tokens=48, seed=cfg.seed), reward="addition")).summary())
    _stage(report, "sft", (pi_ref / "config.json").is_file(), lambda: "pi_ref: {pairs} teacher trajectories, final loss {final_loss:.3f}".format(
        **run_sft(paths["student"], sft_cache, pi_ref, SFTConfig(steps=cfg.sft_steps, batch_size=64, lr=3e-3, warmup=10, seed=cfg.seed)))
    )
    evaluate("pi_ref", pi_ref, teacher, cfg, report)
    _stage(report, "build-rollouts", (rollouts / "opdcache.json").is_file(), lambda: run_generate(GenerateJob(
        model=pi_ref, prompts=PromptConfig(paths["prompts_opd"]), out=rollouts, num_shards=4, reward="addition",
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=48, samples=cfg.samples, seed=cfg.seed, ref_top_k=8, mc_samples=4))).summary())
    _stage(report, "score-teacher", "teachers/teacher" in json.loads((rollouts / "opdcache.json").read_text())["tables"],
           lambda: "teachers/teacher: stores logprob, topk (k=8), hidden, svd (rank 32); consistency {}".format(run_score(ScoreJob(
               cache=rollouts, teacher=paths["teacher"], stores=("logprob", "topk", "hidden", "svd"), top_k=8, svd_rank=32))["consistency"]["verdict"]))
    problems = [p for p in validate(rollouts) if not p.warning]
    report.say(f"[validate] {rollouts}: {'ok' if not problems else f'{len(problems)} problems, first: {problems[0]}'}")
    run_dir = w / "runs" / cfg.loss
    _stage(report, "train", (run_dir / "model" / "config.json").is_file(), lambda: "{loss}: {steps} steps, final loss {l:.4f}".format(
        loss=cfg.loss, steps=cfg.opd_steps, l=run_train(TrainConfig(model=pi_ref, cache=rollouts, out=run_dir, loss=cfg.loss, steps=cfg.opd_steps,
                                                                  batch_size=cfg.opd_batch_size, lr=cfg.opd_lr, seed=cfg.seed))["last"]["loss"]))
    evaluate("opd", run_dir / "model", teacher, cfg, report)
    f = report.figures
    report.figures["seconds"] = time.perf_counter() - start
    report.say(f"[result] held-out accuracy: base {f['base']['accuracy']:.1%} -> SFT (pi_ref) {f['pi_ref']['accuracy']:.1%} -> "
               f"OPD ({cfg.loss}) {f['opd']['accuracy']:.1%} (teacher {f['teacher']['accuracy']:.1%}); reverse KL to teacher "
               f"{f['pi_ref']['reverse_kl']:.4f} -> {f['opd']['reverse_kl']:.4f}")
    report.say(f"[done] {report.figures['seconds']:.0f}s; figures in {w / 'demo_report.json'}")
    (w / "demo_report.json").write_text(json.dumps(report.figures, indent=2))
    return report
