"""``opdcache demo --ablation quantized``: papers/003 and papers/004 on the embedded task.

pi_ref samples the OPD prompts three more times, each in a low-bit scheme of the transformers engine: int8 (torch's
dynamic int8), w4a16:g32 (int4 weight groups of 32; the demo's 64-wide layers take no 128-groups) and fp8:per-channel
(e4m3 weights and activations). The mismatch each causes against the float32 trainer is measured (mismatch-report,
unaligned and, for the emulated schemes, aligned), then Lightning OPD trains pi_ref from each cache:

* int8: without correction, with token TIS, with K3 sequence rejection, with the trust band (papers/003, papers/004);
* w4a16 and fp8: without correction, with ``--rollout-aligned`` (QaRL), and with ``--rollout-aligned`` + the trust
  band (QaRL + TBPO, papers/004's full method).

Each trained student is evaluated in float32 and, for the emulated schemes, also served in its scheme (as the
quantized rollout engine would run it). One seed per invocation (``--seed``); :func:`summarize` puts several seeds'
reports into one table (benchmarks/demo_quantized.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from opdcache.demo.pipeline import DemoConfig, DemoReport, evaluate, finish, prepare, rollouts_stage, run_name, score_stage, train_run

QUANTIZED_RUNS = {
    "none": {},
    "tis": {"tis_cap": 2.0},
    "reject-k3": {"reject_k": "k3", "reject_threshold": 0.5},
    "trust-band": {"trust_band": True},
}
"""The corrections compared on int8 rollouts (papers/003 TIS and K3 rejection, papers/004 trust band)."""

SCHEMES = {"int8": "int8", "w4a16": "w4a16:g32", "fp8": "fp8:per-channel"}
"""Label -> the --quantize spec of each rollout cache."""

ALIGNED_RUNS = {
    "none": {},
    "aligned": {"rollout_aligned": True},
    "aligned+trust-band": {"rollout_aligned": True, "trust_band": True},
}
"""The runs on the emulated schemes: no correction, QaRL, QaRL + TBPO."""


def runs_of(label: str) -> dict:
    return QUANTIZED_RUNS if label == "int8" else ALIGNED_RUNS


def run_quantized_ablation(cfg: DemoConfig) -> DemoReport:
    """One seed: the three low-bit caches, their mismatch, and every run; figures to ablation_quantized_<loss>.json."""
    from opdcache.teacher import mismatch
    from opdcache.training.losses import Corrections
    from opdcache.training.train import stores_for

    report = DemoReport()
    start = time.perf_counter()
    p = prepare(cfg, report)
    fig = mismatch.report(p["rollouts"])[0]["sections"]["rollouts"]
    report.figures["mismatch"] = {"float32": _mismatch_figures(fig)}
    report.figures["runs"] = {}
    for label, spec in SCHEMES.items():
        cache = cfg.workdir / "caches" / f"rollouts_{label}"
        rollouts_stage(cfg, report, p["pi_ref"], p["prompts_opd"], cache, quantize=spec)
        score_stage(report, cache, p["teacher"], stores=stores_for(cfg.loss)[0])
        rep = mismatch.report(cache, aligned=label != "int8")[0]["sections"]
        report.figures["mismatch"][label] = {name: _mismatch_figures(f) for name, f in rep.items()}
        plain = rep["rollouts"]
        report.say(f"[mismatch-report] {label} rollouts: mean |delta| {plain['mean_abs_delta']:.2e}, max {plain['max_abs_delta']:.2e}, "
                   f"K3 {plain['k3']:.2e}, error tokens {plain['error_tokens']['token_share']:.3%}"
                   + (f"; aligned: mean |delta| {rep['rollouts, aligned']['mean_abs_delta']:.2e}" if "rollouts, aligned" in rep else ""))
        for name, settings in runs_of(label).items():
            settings = dict(settings)
            aligned = settings.pop("rollout_aligned", False)
            run_dir = cfg.workdir / "runs" / f"{label}-{name}-{run_name(cfg)}"
            model = train_run(cfg, report, p["pi_ref"], cache, run_dir, corrections=Corrections(**settings), rollout_aligned=aligned)
            key = f"{label}/{name}"
            figures = evaluate(key, model, p["teacher_model"], cfg, report, served=None if label == "int8" else spec)
            logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            figures["error_token_share"] = sum(r.get("error_token_share", 0.0) for r in logged) / max(len(logged), 1)
            report.figures["runs"][key] = figures
            del report.figures[key]
    report.say("[result] held-out accuracy (pi_ref {:.1%}):\n".format(report.figures["pi_ref"]["accuracy"]) + table([report.figures]))
    return finish(report, cfg, start, f"ablation_quantized_{cfg.loss}.json")


def _mismatch_figures(f: dict) -> dict:
    out = {k: f[k] for k in ("mean_abs_delta", "max_abs_delta", "argmax_flip_fraction", "k1", "k3")}
    if "error_tokens" in f:
        out["error_token_share"] = f["error_tokens"]["token_share"]
        out["error_sequence_share"] = f["error_tokens"]["sequence_share"]
    return out


def _cell(values: list[float], digits: int = 1, scale: float = 100.0) -> str:
    mean = scale * sum(values) / len(values)
    return f"{mean:.{digits}f} ({'/'.join(f'{scale * v:.0f}' for v in values)})"


def table(reports: list[dict]) -> str:
    """Markdown over the reports (one per seed): per scheme and run, float32 accuracy, served accuracy, reverse KL,
    the error-token share the learner logged; then the mismatch of each cache."""
    lines = ["| rollouts | run | accuracy % (per seed) | served in the scheme % | reverse KL | error tokens logged |", "|---|---|---|---|---|---|"]
    for label in SCHEMES:
        for name in runs_of(label):
            runs = [r["runs"][f"{label}/{name}"] for r in reports if f"{label}/{name}" in r.get("runs", {})]
            if not runs:
                continue
            served = [x["accuracy_served"] for x in runs if "accuracy_served" in x]
            lines.append(f"| {SCHEMES[label]} | {name} | {_cell([x['accuracy'] for x in runs])} | {_cell(served) if served else ''} | "
                         f"{sum(x['reverse_kl'] for x in runs) / len(runs):.3f} | {100 * sum(x['error_token_share'] for x in runs) / len(runs):.3f}% |")
    lines += ["", "| rollouts | mean abs delta (unaligned) | max | K3 | error tokens | error sequences | mean abs delta (aligned) | max (aligned) |",
              "|---|---|---|---|---|---|---|---|"]
    for label in ("float32", *SCHEMES):
        ms = [r["mismatch"][label] for r in reports if label in r.get("mismatch", {})]
        if not ms:
            continue
        plain = [m.get("rollouts", m) for m in ms]
        aligned = [m["rollouts, aligned"] for m in ms if "rollouts, aligned" in m]

        def mean(xs, key):
            vals = [x[key] for x in xs if x.get(key) is not None]
            return sum(vals) / len(vals) if vals else None

        def fmt(v, pct=False):
            return "" if v is None else (f"{100 * v:.2f}%" if pct else f"{v:.2e}")

        lines.append(f"| {SCHEMES.get(label, label)} | {fmt(mean(plain, 'mean_abs_delta'))} | {fmt(mean(plain, 'max_abs_delta'))} | "
                     f"{fmt(mean(plain, 'k3'))} | {fmt(mean(plain, 'error_token_share'), True)} | {fmt(mean(plain, 'error_sequence_share'), True)} | "
                     f"{fmt(mean(aligned, 'mean_abs_delta'))} | {fmt(mean(aligned, 'max_abs_delta'))} |")
    return "\n".join(lines)


def summarize(paths: list[Path]) -> str:
    reports = [json.loads(Path(p).read_text()) for p in paths]
    pi_ref = [r["pi_ref"]["accuracy"] for r in reports]
    return table(reports) + f"\n\npi_ref: {_cell(pi_ref)}"
