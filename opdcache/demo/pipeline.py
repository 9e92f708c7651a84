"""``opdcache demo``: the whole pipeline on the embedded task, on a CPU, with tiny local models.

The work directory has a documented layout, so every CLI command can be rerun by hand on it::

    <workdir>/models/teacher        Qwen3-architecture teacher (HF format; solves the task)
    <workdir>/models/teacher_carry  a second teacher in another trace style (consistency ablation)
    <workdir>/models/student        Llama-architecture base student (smaller, clearly weaker)
    <workdir>/models/pi_ref         the base student after SFT on the teacher's trajectories
    <workdir>/prompts/{train,opd,heldout}.jsonl
    <workdir>/demo_config.json      the settings the shared stages were built with (a rerun with others is refused)
    <workdir>/caches/sft            teacher trajectories (build-sft)
    <workdir>/caches/rollouts       pi_ref rollouts (build-rollouts) scored by the teacher in every store
    <workdir>/caches/rollouts_<scheme>  --ablation quantized: rollouts in int8, w4a16:g32 and fp8:per-channel
    <workdir>/runs/<run>            OPD runs (metrics.jsonl, checkpoint, model); <run> = <loss>-lr<lr>-<steps>x<batch>,
                                    prefixed consistency-<teacher>- or int8-<correction>- in the ablations
    <workdir>/demo_report.json, ablation_<name>_<loss>.json   figures, with their definitions

Stages are the library calls behind the CLI commands; each is skipped when its output exists, so a
rerun resumes. The README shows the equivalent commands.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from opdcache.demo import task
from opdcache.demo.build import WEIGHTS

SHIPPED = ("teacher", "teacher_carry", "student", "teacher_pairs")


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
    sft_steps: int = 700
    """SFT steps of the base student on the teacher's trajectories (pi_ref's accuracy per seed: BENCHMARKS.md)."""
    opd_steps: int = 80
    """OPD optimizer steps (80 x 64 sequences: 2.5 passes over the 2,048 cached rollouts)."""
    opd_lr: float = 3e-5
    """OPD learning rate. papers/000 Table 6 uses 2e-6 for 4-8B students; this 115k-parameter student needs more to
    move within 80 steps (measured: benchmarks/demo_estimators.py, BENCHMARKS.md)."""
    opd_batch_size: int = 64
    """Sequences per OPD step."""
    samples: int = 4
    """Rollouts per OPD prompt."""
    loss: str = "lightning"
    """Estimator of the OPD stage: papers/000 Alg. 1, the teacher-minus-student log-prob of each cached token, clipped
    to [-tau, tau], with the KL penalty to pi_ref below (README, "What the demo shows", compares it with --online and
    with the exact full-vocabulary reverse KL)."""
    tau: float = 1.0
    """lightning: the advantage clip. 1 nat, not 5: the cached tokens the teacher rejects sit near its floor, about
    -9 nats, and a wide clip lets the fixed samples keep pushing them down (measured: BENCHMARKS.md)."""
    kl_coef: float = 1.0
    """Weight of the KL penalty to pi_ref (k3 estimator on pi_ref's cached samples); 0 turns it off."""


STAGE_FIELDS = ("seed", "n_train", "n_opd", "n_heldout", "sft_steps", "samples")
"""Settings the shared stages (prompts, SFT, rollouts) are built from; a work directory holds one set of them."""

FIGURES = {
    "accuracy": "greedy held-out accuracy on n_heldout prompts of the held-out split (answer after the last '=')",
    "reverse_kl": "mean per-token KL(student || teacher) in nats, exact over the vocabulary at temperature 1, at every "
                  "position of the student's own greedy responses to min(n_heldout, 200) held-out prompts",
    "seconds": "wall-clock of this invocation",
    "machine": "what the figures depend on besides the seed: torch's CPU kernels (cpu_capability: AVX2, AVX512, ...), threads, "
               "library versions",
    "models": "teacher, base (student before SFT), pi_ref (after SFT), opd (after OPD); ablations: opd_<teacher> (OPD with that "
              "teacher), int8_<correction> (OPD from int8 rollouts with that correction)",
    "consistency": "check-consistency on pi_ref's rollouts: lineage verdict per teacher; gap = mean per-token "
                   "ref_logprobs - teacher logprobs (nats), over every response token",
    "mismatch": "mismatch-report's rollout figures per rollout cache (definitions in opdcache/teacher/mismatch.py DEFINITIONS)",
}
"""What the numbers in demo_report.json and the ablation files mean (written into them as ``definitions``)."""


SEED_RANGES = {
    "teacher": {"accuracy": (0.997, 1.0), "reverse_kl": (0.0, 0.0)},
    "base": {"accuracy": (0.0, 0.0), "reverse_kl": (2.3828, 2.3959)},
    "pi_ref": {"accuracy": (0.853, 0.907), "reverse_kl": (0.0765, 0.0985)},
    "opd": {"accuracy": (0.887, 0.923), "reverse_kl": (0.0468, 0.0674)},
}
"""(lowest, highest) of each figure over seeds 0, 1 and 2 of ``opdcache demo --seed S`` at the default settings, on 2
cores of two AMD machines with AVX-512 kernels (README, "What the demo shows"). Printed beside the figures for
reference only: another CPU's kernels round differently and move pi_ref's SFT, so a healthy run may fall outside (an
Intel Xeon's OPD read 93.3%); whether a run is healthy is :func:`health`'s, which judges the run against itself."""

HEALTH_ACCURACY_DROP = 0.05
"""The most OPD's held-out accuracy may fall below pi_ref's in a healthy run: on 300 prompts near 90% one accuracy's
standard error is about 1.7 points, so a 5-point drop is about two standard errors of the difference of two independent
measurements (the two share prompts, so a real drop of that size is rarer still)."""


def health(figures: dict) -> tuple[bool, str]:
    """Whether OPD did what the demo shows, judged within this run (so on any CPU's kernels): the reverse KL to the
    teacher fell from pi_ref's, and held-out accuracy fell by at most HEALTH_ACCURACY_DROP. (ok, the line to print)."""
    ref, opd = figures["pi_ref"], figures["opd"]
    kl_fell = opd["reverse_kl"] < ref["reverse_kl"]
    kept = opd["accuracy"] >= ref["accuracy"] - HEALTH_ACCURACY_DROP
    said = (f"reverse KL to the teacher {ref['reverse_kl']:.4f} -> {opd['reverse_kl']:.4f}, held-out accuracy "
            f"{ref['accuracy']:.1%} -> {opd['accuracy']:.1%}")
    if kl_fell and kept:
        return True, f"[check] ok: OPD moved pi_ref toward the teacher ({said})"
    why = "the reverse KL to the teacher did not fall" if not kl_fell else \
        f"accuracy fell by more than {HEALTH_ACCURACY_DROP:.0%}"
    return False, (f"[check] NOT OK: {why} ({said}); a healthy run moves toward the teacher on any machine: report it "
                   "with demo_report.json (its `machine` record)")


def _seed_range(name: str, cfg: DemoConfig) -> str:
    """' [seeds 0-2: ...]' for a figure measured at the default settings, else ''."""
    defaults = dataclasses.replace(DemoConfig(), workdir=cfg.workdir, seed=cfg.seed)
    if cfg != defaults or name not in SEED_RANGES:
        return ""
    (a_lo, a_hi), (k_lo, k_hi) = SEED_RANGES[name]["accuracy"], SEED_RANGES[name]["reverse_kl"]
    return f"   [seeds 0-2 on AMD AVX-512: {a_lo:.1%}-{a_hi:.1%}, {k_lo:.4f}-{k_hi:.4f}]"


def run_name(cfg: DemoConfig) -> str:
    """The OPD run's directory name: the settings that change it, so a run with other settings never reuses it."""
    tau = f"-tau{cfg.tau:g}" if cfg.loss == "lightning" else ""
    return f"{cfg.loss}{tau}{f'-kl{cfg.kl_coef:g}' if cfg.kl_coef else ''}-lr{cfg.opd_lr:g}-{cfg.opd_steps}x{cfg.opd_batch_size}"


@dataclass
class DemoReport:
    lines: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)


def setup(cfg: DemoConfig) -> dict[str, Path]:
    """Copy the shipped models and write the prompt splits into the work directory; refuse a work directory whose
    stages were built with other settings (finished stages are reused, so their figures would not be this run's)."""
    from opdcache.errors import ConfigError, InstallError
    from opdcache.storage import write_text_atomic

    mine = {k: getattr(cfg, k) for k in STAGE_FIELDS}
    record = cfg.workdir / "demo_config.json"
    if record.is_file():
        old = json.loads(record.read_text())
        diff = [f"{k} {old.get(k)} -> {mine[k]}" for k in STAGE_FIELDS if old.get(k) != mine[k]]
        if diff:
            raise ConfigError(f"{cfg.workdir} holds a demo built with other settings ({', '.join(diff)}); "
                              "use another --workdir for these settings, or delete it")
    else:
        cfg.workdir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(record, json.dumps(mine, indent=2) + "\n")
    paths = {}
    for name in SHIPPED:
        dst = cfg.workdir / "models" / name
        if not (dst / "config.json").is_file():
            src = WEIGHTS / name
            if not (src / "config.json").is_file():
                raise InstallError(f"the demo's shipped model {name!r} is not in this install ({src} has no config.json): "
                                   "reinstall opdcache (pip install --force-reinstall opdcache, or pip install -e . in a "
                                   "checkout); a checkout can rebuild it with `python -m opdcache.demo.build`")
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
    from opdcache.inputs.models import load_causal_lm, load_tokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return (load_causal_lm(path, torch.float32).eval(),
            load_tokenizer(path))


def evaluate(name: str, path: Path, teacher, cfg: DemoConfig, report: DemoReport, served: str | None = None) -> dict:
    """Held-out accuracy and reverse KL to the teacher of the model at ``path``; ``served``: also the accuracy of the
    model run in that low-bit scheme (opdcache/backends/quant.py), as a quantized engine would serve it."""
    from opdcache.demo.evaluate import evaluate_prompts

    heldout = cfg.workdir / "prompts" / "heldout.jsonl"
    model, tok = load(path)
    if served is not None:
        from opdcache.backends.quant import QuantScheme, apply_scheme

        low, _ = load(path)
        apply_scheme(low, QuantScheme.parse(served), "inference")
        served_acc = evaluate_prompts(low, tok, heldout).accuracy
    result = evaluate_prompts(model, tok, heldout, teacher, kl_prompts=min(cfg.n_heldout, 200))
    acc, rkl = result.accuracy, result.reverse_kl
    report.figures[name] = {"accuracy": acc, "reverse_kl": rkl}
    if served is not None:
        report.figures[name]["accuracy_served"] = served_acc
    report.say(f"[eval] {name:<9} held-out accuracy {acc:6.1%}   per-token reverse KL to teacher {rkl:.4f} nats"
               + (f"   served in {served}: {served_acc:.1%}" if served is not None else "") + _seed_range(name, cfg))
    return report.figures[name]


def stage(report: DemoReport, name: str, done: bool, run) -> None:
    start = time.perf_counter()
    if done:
        report.say(f"[{name}] already done, skipped")
        return
    detail = run()
    report.say(f"[{name}] {detail} ({time.perf_counter() - start:.1f}s)")


def prepare(cfg: DemoConfig, report: DemoReport) -> dict:
    """Models, prompts, teacher trajectories, SFT (pi_ref), pi_ref rollouts scored by the teacher; evaluations of
    the teacher, the base student and pi_ref. Shared by the demo and its ablations."""
    import torch

    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    w = cfg.workdir
    paths = setup(cfg)
    report.say(f"[setup] models and prompts in {w}")
    teacher, _ = load(paths["teacher"])
    evaluate("teacher", paths["teacher"], teacher, cfg, report)
    evaluate("base", paths["student"], teacher, cfg, report)
    pi_ref, rollouts = sft_stages(cfg, report, paths), w / "caches" / "rollouts"
    evaluate("pi_ref", pi_ref, teacher, cfg, report)
    rollouts_stage(cfg, report, pi_ref, paths["prompts_opd"], rollouts)
    score_stage(report, rollouts, paths["teacher"])
    return {**paths, "teacher_model": teacher, "pi_ref": pi_ref, "rollouts": rollouts}


def sft_stages(cfg: DemoConfig, report: DemoReport, paths: dict[str, Path]) -> Path:
    """Teacher trajectories (build-sft) and the SFT of the base student on them; returns pi_ref's directory."""
    from opdcache.backends.base import SamplingConfig
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate
    from opdcache.training.sft import SFTConfig, run_sft

    sft_cache, pi_ref = cfg.workdir / "caches" / "sft", cfg.workdir / "models" / "pi_ref"
    stage(report, "build-sft", (sft_cache / "opdcache.json").is_file(), lambda: run_generate(GenerateJob(
        model=paths["teacher"], prompts=PromptConfig(paths["prompts_train"]), out=sft_cache, kind="sft", num_shards=4,
        sampling=SamplingConfig(temperature=0.8, max_new_tokens=48, seed=cfg.seed), reward="addition")).summary())
    stage(report, "sft", (pi_ref / "config.json").is_file(), lambda: "pi_ref: {pairs} teacher trajectories, final loss {final_loss:.3f}".format(
        **run_sft(paths["student"], sft_cache, pi_ref, SFTConfig(steps=cfg.sft_steps, batch_size=64, lr=3e-3, warmup=10, seed=cfg.seed))))
    return pi_ref


def rollouts_stage(cfg: DemoConfig, report: DemoReport, pi_ref: Path, prompts: Path, out: Path, quantize: str | None = None) -> None:
    from opdcache.backends.base import SamplingConfig
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.backends import EngineConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate

    stage(report, "build-rollouts" + (f" --quantize {quantize}" if quantize else ""), (out / "opdcache.json").is_file(),
           lambda: run_generate(GenerateJob(
               model=pi_ref, prompts=PromptConfig(prompts), out=out, num_shards=4, reward="addition", engine=EngineConfig(quantize=quantize),
               sampling=SamplingConfig(temperature=1.0, max_new_tokens=48, samples=cfg.samples, seed=cfg.seed, ref_top_k=8, mc_samples=4))).summary())


def score_stage(report: DemoReport, cache: Path, teacher: Path, stores=("logprob", "topk", "hidden", "svd"), allow_inconsistent: bool = False) -> str:
    from opdcache.teacher.scoring import ScoreJob

    slug = ScoreJob(cache=cache, teacher=teacher).table_slug
    done = f"teachers/{slug}" in json.loads((cache / "opdcache.json").read_text())["tables"]

    def run() -> str:
        from opdcache.teacher.scoring import run_score

        res = run_score(ScoreJob(cache=cache, teacher=teacher, stores=tuple(stores), top_k=8, svd_rank=32 if "svd" in stores else None,
                                 allow_inconsistent_teacher=allow_inconsistent))
        return f"teachers/{slug}: stores {', '.join(stores)}; consistency {res['consistency']['verdict']}"

    stage(report, f"score-teacher {cache.name}/{slug}", done, run)
    return slug


def train_run(cfg: DemoConfig, report: DemoReport, pi_ref: Path, cache: Path, run_dir: Path, teacher: str | None = None, **extra) -> Path:
    from opdcache.training.train import TrainConfig, run_train

    stage(report, f"train {run_dir.name}", (run_dir / "model" / "config.json").is_file(), lambda: "{loss}: {steps} steps, final loss {l:.4f}".format(
        loss=cfg.loss, steps=cfg.opd_steps, l=run_train(TrainConfig(model=pi_ref, cache=cache, out=run_dir, loss=cfg.loss, steps=cfg.opd_steps, teacher=teacher,
                                                                  batch_size=cfg.opd_batch_size, lr=cfg.opd_lr, seed=cfg.seed,
                                                                  kl_coef=cfg.kl_coef, kl_estimator="k3", tau=cfg.tau, **extra))["last"]["loss"]))
    return run_dir / "model"


def machine() -> dict:
    """What the figures depend on besides the seed: the CPU kernels torch picked (AVX2 and AVX-512 round float32 sums
    differently, and the demo's SFT amplifies rounding), its threads and the library versions."""
    import platform

    import torch
    import transformers

    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(), "processor": platform.machine(),
            "torch": torch.__version__, "transformers": transformers.__version__}


def finish(report: DemoReport, cfg: DemoConfig, start: float, name: str) -> DemoReport:
    report.figures["seconds"] = time.perf_counter() - start
    report.figures["machine"] = machine()
    out = cfg.workdir / name
    report.say(f"[done] {report.figures['seconds']:.0f}s; figures in {out}")
    out.write_text(json.dumps({"definitions": FIGURES, **report.figures}, indent=2))
    return report


def run_demo(cfg: DemoConfig) -> DemoReport:
    from opdcache.format.validate import validate

    report = DemoReport()
    start = time.perf_counter()
    p = prepare(cfg, report)
    problems = [x for x in validate(p["rollouts"]) if not x.warning]
    report.say(f"[validate] {p['rollouts']}: {'ok' if not problems else f'{len(problems)} problems, first: {problems[0]}'}")
    model = train_run(cfg, report, p["pi_ref"], p["rollouts"], cfg.workdir / "runs" / run_name(cfg))
    evaluate("opd", model, p["teacher_model"], cfg, report)
    f = report.figures
    report.say(f"[result] held-out accuracy: base {f['base']['accuracy']:.1%} -> SFT (pi_ref) {f['pi_ref']['accuracy']:.1%} -> "
               f"OPD ({cfg.loss}) {f['opd']['accuracy']:.1%} (teacher {f['teacher']['accuracy']:.1%}); reverse KL to teacher "
               f"{f['pi_ref']['reverse_kl']:.4f} -> {f['opd']['reverse_kl']:.4f}")
    f["healthy"], line = health(f)
    report.say(line)
    return finish(report, cfg, start, "demo_report.json")
