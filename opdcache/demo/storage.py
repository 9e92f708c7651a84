"""``opdcache demo --ablation storage``: the teacher's signal at fewer bytes per token on the embedded task.

pi_ref's cached rollouts are scored again into three teacher tables: the exact top-16 (format v1), the compact top-16
(float16 log-probs, residual mass 1e-3, one tail column: format v3) and the sampled store (RS-KD, 12 teacher draws a
position: format v3). pi_ref is then trained from each with the forward KL it supports, beside the exact
full-vocabulary forward KL from the hidden store:

* topk16: ``topk-fkl --topk-tail`` on the exact top-16; topk16-compact: the same estimator on the compact table;
* sampled12: ``sampled-fkl`` (unbiased for the full forward KL); full: ``full-fkl`` (exact, from hidden states).

Each run: held-out accuracy and reverse KL to the teacher, beside its store's bytes per response token on disk. One
seed per invocation; :func:`summarize` puts several seeds' reports into one table (benchmarks/demo_storage.py).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from opdcache.demo.pipeline import DemoConfig, DemoReport, evaluate, finish, prepare, run_name, stage, train_run

TABLES = {  # teacher table -> ScoreJob settings (besides the logprob store)
    "topk16": {"stores": ("logprob", "topk"), "top_k": 16},
    "topk16-compact": {"stores": ("logprob", "topk"), "top_k": 16, "topk_precision": "float16", "topk_mass": 1e-3},
    "sampled12": {"stores": ("logprob", "sampled"), "samples_per_position": 12},
}
RUNS = {  # run -> (teacher table, loss, extra TrainConfig fields, the store whose bytes it reads)
    "topk16": ("topk16", "topk-fkl", {"tail": True}, "topk"),
    "topk16-compact": ("topk16-compact", "topk-fkl", {"tail": True}, "topk"),
    "sampled12": ("sampled12", "sampled-fkl", {}, "sampled"),
    "full": ("teacher", "full-fkl", {}, "hidden"),
}


def run_storage_ablation(cfg: DemoConfig) -> DemoReport:
    """One seed: the extra teacher tables, one run from each, figures to ablation_storage.json."""
    from opdcache.format.cache import Cache
    from opdcache.format.info import store_bytes
    from opdcache.teacher.scoring import ScoreJob, run_score

    report = DemoReport()
    start = time.perf_counter()
    p = prepare(cfg, report)
    cache = p["rollouts"]
    for slug, settings in TABLES.items():
        done = f"teachers/{slug}" in json.loads((cache / "opdcache.json").read_text())["tables"]
        stage(report, f"score-teacher {slug}", done, lambda s=slug, kw=settings: "teachers/{}: {}".format(
            s, run_score(ScoreJob(cache=cache, teacher=p["teacher"], slug=s, **kw))["consistency"]["verdict"]))
    c = Cache(cache)
    tokens = sum(s["tokens"] for s in c.table("rollouts")["shards"])
    report.figures["tables"] = {slug: {"bytes_per_token": {k: v / tokens for k, v in store_bytes(c, f"teachers/{slug}").items()},
                                       "topk": c.table(f"teachers/{slug}").get("topk")} for slug in (*TABLES, "teacher")}
    report.figures["runs"] = {}
    for name, (table, loss, extra, store) in RUNS.items():
        run_cfg = dataclasses.replace(cfg, loss=loss)
        run_dir = cfg.workdir / "runs" / f"storage-{name}-{run_name(run_cfg)}"
        model = train_run(run_cfg, report, p["pi_ref"], cache, run_dir, teacher=table, **extra)
        figures = evaluate(f"storage/{name}", model, p["teacher_model"], cfg, report)
        figures["bytes_per_token"] = report.figures["tables"][table]["bytes_per_token"][store]
        report.figures["runs"][name] = figures
        del report.figures[f"storage/{name}"]
    report.say("[result] held-out accuracy (pi_ref {:.1%}):\n".format(report.figures["pi_ref"]["accuracy"]) + table_of([report.figures]))
    return finish(report, cfg, start, "ablation_storage.json")


def _cell(values: list[float], digits: int = 1, scale: float = 100.0) -> str:
    return f"{scale * sum(values) / len(values):.{digits}f} ({'/'.join(f'{scale * v:.0f}' for v in values)})"


def table_of(reports: list[dict]) -> str:
    """Markdown over the reports (one per seed): per run, accuracy, reverse KL and the store's bytes per token."""
    lines = ["| run | loss | store B/token | accuracy % (per seed) | reverse KL |", "|---|---|---:|---|---:|"]
    for name, (_, loss, extra, store) in RUNS.items():
        runs = [r["runs"][name] for r in reports if name in r.get("runs", {})]
        if runs:
            label = loss + (" --topk-tail" if extra.get("tail") else "")
            lines.append(f"| {name} | {label} | {sum(x['bytes_per_token'] for x in runs) / len(runs):.1f} ({store}) | "
                         f"{_cell([x['accuracy'] for x in runs])} | {sum(x['reverse_kl'] for x in runs) / len(runs):.4f} |")
    return "\n".join(lines)


def summarize(paths: list[Path]) -> str:
    reports = [json.loads(Path(p).read_text()) for p in paths]
    return table_of(reports) + f"\n\npi_ref: {_cell([r['pi_ref']['accuracy'] for r in reports])}"
