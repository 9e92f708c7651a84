"""Every estimator on the embedded demo, side by side, over several seeds.

For each seed the demo's shared stages run (or are reused): teacher trajectories, SFT of the base student
(pi_ref), pi_ref rollouts scored by the teacher in every store. Then each estimator trains pi_ref from the same
cache with the same settings, and the held-out accuracy, the per-token reverse KL to the teacher, and the final
drift from pi_ref (K1 of the last step) are printed as mean +- standard deviation over seeds.

    python benchmarks/demo_estimators.py --root runs/estimators --seeds 0 1 2 [--lr 1e-4] [--steps 80]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from opdcache.demo.pipeline import DemoConfig, DemoReport, _prepare, _train, evaluate, run_name
from opdcache.losses import ESTIMATORS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("runs/estimators"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lr", type=float, default=DemoConfig.opd_lr)
    ap.add_argument("--steps", type=int, default=DemoConfig.opd_steps)
    ap.add_argument("--losses", nargs="+", default=list(ESTIMATORS))
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {"pi_ref": []} | {loss: [] for loss in args.losses}
    for seed in args.seeds:
        report = DemoReport()
        cfg = DemoConfig(workdir=args.root / f"seed{seed}", seed=seed, opd_lr=args.lr, opd_steps=args.steps)
        p = _prepare(cfg, report)
        rows["pi_ref"].append(report.figures["pi_ref"] | {"k1": 0.0})
        for loss in args.losses:
            run_cfg = dataclasses.replace(cfg, loss=loss)
            run = cfg.workdir / "runs" / run_name(run_cfg)
            model = _train(run_cfg, report, p["pi_ref"], p["rollouts"], run, teacher="teacher")
            fig = evaluate(f"{loss}", model, p["teacher_model"], cfg, report)
            last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
            rows[loss].append(fig | {"k1": last.get("k1", float("nan"))})

    def ms(values: list[float], fmt: str) -> str:
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{format(statistics.mean(values), fmt)} +- {format(sd, fmt)}"

    print(f"\nlr {args.lr:g}, {args.steps} steps, seeds {args.seeds}")
    print("| estimator | held-out accuracy | reverse KL to teacher | final K1(pi_ref, pi_theta) | per seed accuracy |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name, figs in rows.items():
        acc = [100 * f["accuracy"] for f in figs]
        print(f"| {name} | {ms(acc, '.1f')} % | {ms([f['reverse_kl'] for f in figs], '.3f')} | {ms([f['k1'] for f in figs], '.3f')} | "
              + " / ".join(f"{a:.1f}" for a in acc) + " |")


if __name__ == "__main__":
    main()
