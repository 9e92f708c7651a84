"""``opdcache demo --ablation staleness``: papers/001's findings in miniature, on the embedded task.

From the demo's pi_ref, ``opdcache async`` runs with the teacher at staleness K in {0, 1, 4, 16, no refresh} with six
learner variants:

* (a) Finding 1, KL direction: ``topk-fkl`` (forward KL on the teacher's cached top-8) against ``is`` (reverse KL);
* (b) Finding 2, surrogate: ``is`` (A_theta recomputed at learner time, unclipped IS) against ``ppo`` (A_old, clipped);
* (c) Finding 3, samples: one sample (``is``: the rolled-out token) against ``mc4`` (4 cached samples per position),
  each with and without old-to-current importance weights (``-noIS``).

Every run has the demo's OPD budget (80 steps x 64 prompts, lr 3e-5) and no KL penalty. Figures per run: held-out
greedy accuracy, per-token reverse KL to the teacher (as the demo defines them), and papers/001's throughput. One seed
per invocation (``--seed``); ``summarize`` puts several seeds' reports into one table and a plot of accuracy against K.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

STALENESS = (0, 1, 4, 16, None)
"""K values: None is no refresh (every batch from pi_ref: Lightning OPD's sampling)."""

VARIANTS = {
    "is": {"loss": "is"},
    "ppo": {"loss": "ppo"},
    "topk-fkl": {"loss": "topk-fkl", "top_k": 8},
    "is-noIS": {"loss": "is", "importance_weights": False},
    "mc4": {"loss": "mc", "mc_samples": 4},
    "mc4-noIS": {"loss": "mc", "mc_samples": 4, "importance_weights": False},
}


def k_name(k: int | None) -> str:
    return "none" if k is None else str(k)


def run_staleness_ablation(cfg):
    """One seed of the ablation in ``cfg.workdir``: each run resumes or is skipped when done; figures to
    ``ablation_staleness_seed<seed>.json``."""
    from opdcache.asyncopd import AsyncConfig, learner, run_async
    from opdcache.asyncopd.config import LEARNER_SETTINGS
    from opdcache.backends.base import SamplingConfig
    from opdcache.demo.pipeline import DemoReport, evaluate, finish, prepare
    from opdcache.inputs.prompts import PromptConfig

    report = DemoReport()
    start = time.perf_counter()
    p = prepare(cfg, report)
    report.figures["runs"] = {}
    for variant, settings in VARIANTS.items():
        settings = dict(settings)
        mc = settings.pop("mc_samples", None)
        for k in STALENESS:
            name = f"{variant}@K{k_name(k)}"
            out = cfg.workdir / "runs" / f"async-{variant}-K{k_name(k)}"
            t0 = time.perf_counter()
            run = {k: settings.pop(k) for k in list(settings) if k in LEARNER_SETTINGS}
            result = run_async(AsyncConfig(
                learner=learner(p["pi_ref"], steps=cfg.opd_steps, batch_size=cfg.opd_batch_size, lr=cfg.opd_lr, seed=cfg.seed, **run),
                teacher=p["teacher"], prompts=PromptConfig(p["prompts_opd"]), out=out, staleness=k, device="cpu",
                sampling=SamplingConfig(temperature=1.0, max_new_tokens=48, mc_samples=mc, seed=cfg.seed), **settings))
            figures = evaluate(name, out / "learner" / "model", p["teacher_model"], cfg, report)
            figures["throughput_tokens_per_s"] = result["figures"].get("throughput_tokens_per_s")
            figures["seconds"] = time.perf_counter() - t0
            report.figures["runs"][name] = {"variant": variant, "staleness": k_name(k), **figures}
            del report.figures[name]
    report.say("[result] held-out accuracy by variant and K:\n" + table([report.figures]))
    done = finish(report, cfg, start, f"ablation_staleness_seed{cfg.seed}.json")
    png = cfg.workdir / f"ablation_staleness_seed{cfg.seed}.png"
    summarize([cfg.workdir / f"ablation_staleness_seed{cfg.seed}.json"], png)
    report.say(f"[plot] held-out accuracy against K: {png}")
    return done


def table(reports: list[dict]) -> str:
    """Markdown: per variant and K, accuracy (mean over the reports, with each seed's value), reverse KL, throughput."""
    lines = ["| variant | " + " | ".join(f"K={k_name(k)}" for k in STALENESS) + " |", "|---" * (len(STALENESS) + 1) + "|"]
    for variant in VARIANTS:
        cells = []
        for k in STALENESS:
            runs = [r["runs"].get(f"{variant}@K{k_name(k)}") for r in reports]
            runs = [x for x in runs if x]
            if not runs:
                cells.append("")
                continue
            acc = [x["accuracy"] for x in runs]
            rkl = sum(x["reverse_kl"] for x in runs) / len(runs)
            cells.append(f"{100 * sum(acc) / len(acc):.1f} ({'/'.join(f'{100 * a:.0f}' for a in acc)}); rKL {rkl:.3f}")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summarize(paths: list[Path], png: Path | None = None) -> str:
    """The table over several seeds' reports, and (with ``png``) held-out accuracy against K per variant."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    text = table(reports)
    pi_ref = [r["pi_ref"]["accuracy"] for r in reports]
    text += f"\n\npi_ref: {100 * sum(pi_ref) / len(pi_ref):.1f} ({'/'.join(f'{100 * a:.0f}' for a in pi_ref)})"
    if png is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        xs = list(range(len(STALENESS)))
        for variant in VARIANTS:
            ys = []
            for k in STALENESS:
                acc = [r["runs"][f"{variant}@K{k_name(k)}"]["accuracy"] for r in reports if f"{variant}@K{k_name(k)}" in r["runs"]]
                ys.append(100 * sum(acc) / len(acc) if acc else float("nan"))
            ax.plot(xs, ys, marker="o", label=variant)
        ax.axhline(100 * sum(pi_ref) / len(pi_ref), color="grey", linestyle=":", label="pi_ref")
        ax.set_xticks(xs, [k_name(k) if k is not None else "no refresh" for k in STALENESS])
        ax.set_xlabel("staleness K (train-batch steps)")
        ax.set_ylabel(f"held-out accuracy, % (mean of {len(reports)} seeds)")
        ax.set_title("Async OPD on the embedded task (papers/001 findings in miniature)")
        ax.legend(fontsize=8, ncol=2)
        fig.tight_layout()
        fig.savefig(png, dpi=110)
    return text
