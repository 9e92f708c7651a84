"""Estimators and training modes on the embedded demo, side by side, over several seeds.

For each seed the demo's shared stages run (or are reused): teacher trajectories, SFT of the base student
(pi_ref), pi_ref rollouts scored by the teacher in every store. Then each variant trains pi_ref with the same
settings (steps, batch, learning rate, seed) and is evaluated: held-out accuracy, per-token reverse KL to the
teacher, the drift from pi_ref (K1 of the last step) and the importance weight pi_theta/pi_ref over training
(papers/000 Fig. 3a). Printed as mean +- standard deviation over seeds, with every seed's figure; the per-run
figures and weight curves go to <root>/variants.json (the notebook's plot reads the same metrics).

A variant is an estimator name (opdcache/training/estimators.py ESTIMATORS), optionally with suffixes:
``+kl`` adds the KL penalty to pi_ref (``--kl-coef``, k3 estimator), ``@online`` trains standard OPD instead
(fresh rollouts from the current student and a live teacher at every step, same estimator and settings).

    python benchmarks/demo_estimators.py --root runs/estimators --seeds 0 1 2 \\
        --variants lightning lightning+kl lightning@online full-rkl [--lr 1e-4] [--steps 80] [--kl-coef 0.1]
    python benchmarks/demo_estimators.py --root runs/estimators --variants lightning lightning:lora8 lightning:lora32 \
        lightning:lora64 --lora-lr 3e-4      # LoRA students (the demo's layers are 64 wide: rank 64 at most)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from opdcache.demo.pipeline import DemoConfig, DemoReport, evaluate, prepare, run_name, train_run
from opdcache.training.estimators import ESTIMATORS


def variant_settings(variant: str, kl_coef: float, teacher_model: Path) -> tuple[str, float, dict]:
    """(estimator, KL penalty weight, TrainConfig fields) of a variant name such as ``lightning+kl@online`` or
    ``lightning:lora8`` (a LoRA student of rank 8, at ``--lora-lr``)."""
    variant, _, lora = variant.partition(":lora")
    fields = {"lora_rank": int(lora)} if lora else {}
    name, online = (variant[: -len("@online")], True) if variant.endswith("@online") else (variant, False)
    loss, kl = (name[: -len("+kl")], True) if name.endswith("+kl") else (name, False)
    if loss not in ESTIMATORS:
        raise SystemExit(f"unknown estimator {loss!r} in variant {variant!r}; choose from {', '.join(ESTIMATORS)}")
    # online: standard OPD, with the demo's rollout settings, sampled live from the current student
    online_fields = {"online": True, "teacher_model": teacher_model, "max_new_tokens": 48, "temperature": 1.0} if online else {}
    return loss, kl_coef if kl else 0.0, online_fields | fields  # the demo pipeline's penalty uses the k3 estimator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("runs/estimators"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lr", type=float, default=DemoConfig.opd_lr)
    ap.add_argument("--steps", type=int, default=DemoConfig.opd_steps)
    ap.add_argument("--sft-steps", type=int, default=DemoConfig.sft_steps, help="SFT steps of the base student into pi_ref")
    ap.add_argument("--kl-coef", type=float, default=DemoConfig.kl_coef, help="the KL penalty's weight in +kl variants (others: none)")
    ap.add_argument("--tau", type=float, default=DemoConfig.tau, help="lightning's advantage clip (TrainConfig.tau)")
    ap.add_argument("--lora-lr", type=float, default=None, help="the learning rate of :lora<R> variants (default: --lr)")
    ap.add_argument("--variants", nargs="+", default=list(ESTIMATORS))
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {"pi_ref": []} | {v: [] for v in args.variants}
    for seed in args.seeds:
        report = DemoReport()
        cfg = DemoConfig(workdir=args.root / f"seed{seed}", seed=seed, opd_lr=args.lr, opd_steps=args.steps, sft_steps=args.sft_steps)
        p = prepare(cfg, report)
        rows["pi_ref"].append(report.figures["pi_ref"] | {"k1": 0.0, "is_weight": []})
        for variant in args.variants:
            loss, kl_coef, online_fields = variant_settings(variant, args.kl_coef, p["teacher"])
            lr = args.lora_lr if "lora_rank" in online_fields and args.lora_lr is not None else args.lr
            run_cfg = dataclasses.replace(cfg, loss=loss, kl_coef=kl_coef, tau=args.tau, opd_lr=lr)
            run = cfg.workdir / "runs" / f"{variant}-{run_name(run_cfg)}"
            model = train_run(run_cfg, report, p["pi_ref"], p["rollouts"], run, teacher="teacher", **online_fields)
            fig = evaluate(variant, model, p["teacher_model"], cfg, report)
            metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            rows[variant].append(fig | {"k1": metrics[-1].get("k1", float("nan")),
                                        "is_weight": [(m["is_weight_mean"], m["is_weight_std"]) for m in metrics]})

    def ms(values: list[float], fmt: str) -> str:
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{format(statistics.mean(values), fmt)} +- {format(sd, fmt)}"

    print(f"\nlr {args.lr:g}, {args.steps} steps, SFT {args.sft_steps} steps, seeds {args.seeds}, tau {args.tau:g}, "
          f"kl_coef {args.kl_coef:g} (+kl variants)")
    print("| variant | held-out accuracy | reverse KL to teacher | final K1(pi_ref, pi_theta) | importance weight, last step | per seed accuracy |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, figs in rows.items():
        acc = [100 * f["accuracy"] for f in figs]
        weight = ("" if not figs[0]["is_weight"] else
                  f"{ms([f['is_weight'][-1][0] for f in figs], '.3f')} (std {ms([f['is_weight'][-1][1] for f in figs], '.3f')})")
        print(f"| {name} | {ms(acc, '.1f')} % | {ms([f['reverse_kl'] for f in figs], '.3f')} | {ms([f['k1'] for f in figs], '.3f')} | "
              f"{weight} | " + " / ".join(f"{a:.1f}" for a in acc) + " |")
    out = args.root / "variants.json"
    out.write_text(json.dumps({"settings": vars(args) | {"root": str(args.root)}, "runs": rows}, indent=1))
    print(f"\nper-run figures and importance-weight curves: {out}")


if __name__ == "__main__":
    main()
