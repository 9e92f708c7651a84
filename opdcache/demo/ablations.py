"""The demo's ablations, one registry: each is a function of a DemoConfig that reuses the shared stages of
opdcache/demo/pipeline.py (which imports none of them) and writes its figures into the work directory."""

from __future__ import annotations

import json
import time
from dataclasses import replace

from opdcache.demo.mismatch import run_mismatch_ablation
from opdcache.demo.pipeline import DemoConfig, DemoReport, evaluate, finish, prepare, run_name, score_stage, stage, train_run
from opdcache.demo.quantized import run_quantized_ablation
from opdcache.demo.staleness import run_staleness_ablation
from opdcache.demo.storage import run_storage_ablation


def run_consistency_ablation(cfg: DemoConfig) -> DemoReport:
    """papers/000 Table 4 on the embedded task: pi_ref is fine-tuned on teacher 1's ("columns") trajectories; Lightning
    OPD from its rollouts with teacher 1 (consistent) and with teacher 2 ("carry" style: same task, other traces)."""
    from opdcache.teacher.consistency import check
    from opdcache.training.train import stores_for

    report = DemoReport()
    start = time.perf_counter()
    p = prepare(cfg, report)
    score_stage(report, p["rollouts"], p["teacher_carry"], stores=stores_for(cfg.loss)[0], allow_inconsistent=True)
    c = check(p["rollouts"], ["teacher", "teacher_carry"])  # the two it compares, whatever else the cache was scored by
    report.figures["consistency"] = {"lineage": {n: t["lineage"] for n, t in c["teachers"].items()},
                                     "gap": {n: t["gap"]["mean"] for n, t in c["teachers"].items()},
                                     "empirical": c["consistent_empirically"], "consistent_with": c["consistent_with"]}
    report.say(f"[check-consistency] lineage: {report.figures['consistency']['lineage']}; gap r - T per token: "
               + ", ".join(f"{n} {g:.4f}" for n, g in report.figures["consistency"]["gap"].items())
               + f"; empirically consistent with: {c['consistent_empirically']}")
    for slug in ("teacher", "teacher_carry"):
        model = train_run(cfg, report, p["pi_ref"], p["rollouts"], cfg.workdir / "runs" / f"consistency-{slug}-{run_name(cfg)}", teacher=slug)
        evaluate(f"opd_{slug}", model, p["teacher_model"], cfg, report)
    f = report.figures
    report.say(f"[result] held-out accuracy: pi_ref {f['pi_ref']['accuracy']:.1%} -> Lightning OPD with teacher 1 (consistent) "
               f"{f['opd_teacher']['accuracy']:.1%}, with teacher 2 (inconsistent) {f['opd_teacher_carry']['accuracy']:.1%}")
    return finish(report, cfg, start, f"ablation_consistency_{cfg.loss}.json")


CROSS_LOSSES = ("lightning", "span", "uld", "gold")
"""The losses the cross-tokenizer ablation trains from the digit-pair teacher's table (opdcache/training/estimators.py)."""


def run_cross_tokenizer_ablation(cfg: DemoConfig) -> DemoReport:
    """A teacher with its own tokenizer: Lightning OPD from pi_ref's rollouts scored by the demo teacher (pi_ref's
    tokenizer) against the same recipe trained on a tokenizer that reads each digit pair as one token, scored offline
    through the alignment (--prompts --top-k 8, the aligned store) and trained with each loss such a table feeds."""
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.scoring import ScoreJob, run_score

    report = DemoReport()
    start = time.perf_counter()
    p = prepare(cfg, report)
    tables = json.loads((p["rollouts"] / "opdcache.json").read_text())["tables"]

    def score() -> str:
        a = run_score(ScoreJob(cache=p["rollouts"], teacher=p["teacher_pairs"], prompts=PromptConfig(p["prompts_opd"]),
                               top_k=8, allow_inconsistent_teacher=True))["aligned"]
        report.figures["alignment"] = a
        return (f"teachers/teacher_pairs: {a['aligned']} of {a['rows']} rows aligned, {a['groups']} groups, "
                f"{a['one_to_one'] / max(a['groups'], 1):.1%} one token to one")

    stage(report, f"score-teacher {p['rollouts'].name}/teacher_pairs (its own tokenizer)", "teachers/teacher_pairs" in tables, score)
    runs = (("same", "teacher", cfg.loss),) + tuple((f"cross_{loss}", "teacher_pairs", loss) for loss in CROSS_LOSSES)
    for name, teacher, loss in runs:
        model = train_run(replace(cfg, loss=loss), report, p["pi_ref"], p["rollouts"],
                          cfg.workdir / "runs" / f"cross-{name}-{run_name(replace(cfg, loss=loss))}", teacher=teacher)
        evaluate(f"opd_{name}", model, p["teacher_model"], cfg, report)
    f = report.figures
    report.say(f"[result] held-out accuracy: pi_ref {f['pi_ref']['accuracy']:.1%} -> Lightning OPD with pi_ref's tokenizer "
               f"{f['opd_same']['accuracy']:.1%}; with the digit-pair teacher: "
               + ", ".join(f"{loss} {f[f'opd_cross_{loss}']['accuracy']:.1%}" for loss in CROSS_LOSSES))
    return finish(report, cfg, start, "ablation_cross_tokenizer.json")


ABLATIONS = {"consistency": run_consistency_ablation, "quantized": run_quantized_ablation, "staleness": run_staleness_ablation,
             "storage": run_storage_ablation, "mismatch": run_mismatch_ablation, "cross-tokenizer": run_cross_tokenizer_ablation}
