"""``opdcache demo``: the whole pipeline on the embedded task, on a CPU, with tiny local models.

The work directory has a documented layout, so every CLI command can be rerun by hand on it::

    <workdir>/models/teacher        Qwen3-architecture teacher (HF format; solves the task)
    <workdir>/models/teacher_carry  a second teacher in another trace style (consistency ablation)
    <workdir>/models/student        Llama-architecture base student (smaller, clearly weaker)
    <workdir>/prompts/{train,opd,heldout}.jsonl
    <workdir>/caches/               the caches the pipeline writes

Stages are skipped when their output already exists, so a rerun resumes.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from opdcache.demo import task
from opdcache.demo.build import WEIGHTS

SHIPPED = ("teacher", "teacher_carry", "student")


@dataclass(frozen=True)
class DemoConfig:
    """Settings of the embedded demo."""

    workdir: Path = Path("opdcache-demo")
    """Where models, prompts and caches are written."""
    seed: int = 0
    """Seed of the prompt splits, sampling and training."""
    n_train: int = 2000
    """Prompts for the SFT-teacher trajectories."""
    n_opd: int = 512
    """Prompts for pi_ref rollouts (Lightning OPD)."""
    n_heldout: int = 500
    """Held-out prompts for evaluation."""


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
    sizes = {"train": cfg.n_train, "opd": cfg.n_opd, "heldout": cfg.n_heldout}
    for split, n in sizes.items():
        path = cfg.workdir / "prompts" / f"{split}.jsonl"
        if not path.is_file():
            task.write_prompts(path, split, n, seed=cfg.seed)
        paths[f"prompts_{split}"] = path
    (cfg.workdir / "caches").mkdir(parents=True, exist_ok=True)
    return paths


def load(path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def run_demo(cfg: DemoConfig) -> DemoReport:
    import torch

    from opdcache.evaluate import evaluate_accuracy

    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    report = DemoReport()
    start = time.perf_counter()
    paths = setup(cfg)
    report.say(f"[setup] models and prompts in {cfg.workdir} ({time.perf_counter() - start:.1f}s)")
    for name in ("teacher", "student"):
        model, tok = load(paths[name])
        result = evaluate_accuracy(model, tok, n=cfg.n_heldout, seed=cfg.seed)
        report.figures[f"{name}_accuracy"] = result.accuracy
        report.say(f"[eval] {name:<8} {result} ({sum(p.numel() for p in model.parameters()):,} parameters)")
    report.say("[missing] build-sft, sft, build-rollouts, score-teacher, train: not implemented yet in this version")
    report.figures["seconds"] = time.perf_counter() - start
    report.say(f"[done] {report.figures['seconds']:.1f}s")
    return report
