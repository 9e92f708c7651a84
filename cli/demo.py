"""``opdcache demo``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from opdcache.cli import options as O

from opdcache.demo.pipeline import DemoConfig


def demo(
    workdir: Annotated[Path, typer.Option("--workdir", help="Where the demo writes models/, prompts/ and caches/.")] = Path("opdcache-demo"),
    seed: Annotated[int, typer.Option(help="Seed of prompts, sampling and training.")] = 0,
    loss: Annotated[str, typer.Option("--loss", help="Estimator of the OPD stage.")] = DemoConfig.loss,
    opd_steps: Annotated[int, typer.Option("--opd-steps", help="OPD optimizer steps.")] = DemoConfig.opd_steps,
    opd_lr: Annotated[float, typer.Option("--opd-lr", help="OPD learning rate.")] = DemoConfig.opd_lr,
    tau: Annotated[float, typer.Option("--tau", help="lightning: advantage clip.")] = DemoConfig.tau,
    kl_coef: Annotated[float, typer.Option("--kl-coef", help="Weight of the KL penalty to pi_ref (0: none).")] = DemoConfig.kl_coef,
    ablation: Annotated[Optional[str], typer.Option("--ablation", help="consistency (teacher 1 vs teacher 2, papers/000 Table 4), quantized (int8, w4a16 and fp8 rollouts: corrections, --rollout-aligned, trust band; papers/003-004) staleness (opdcache async at K in 0, 1, 4, 16, no refresh; papers/001 Findings 1-3: 30 runs, about 25 minutes on 2 cores) storage (exact vs compact top-k, the sampled store and full-vocabulary fKL: bytes/token beside accuracy), mismatch (papers/003: an online learner on exact rollouts vs injected logit noise, bypass vs recompute, TIS and K1/K3 rejection; 12 runs a seed) or cross-tokenizer (the demo teacher against one with its own digit-pair tokenizer, scored through the alignment: lightning and span). Default: none (the demo alone).", show_default=False)] = None,
) -> None:
    """Run the whole pipeline on the embedded task, on CPU, with tiny local models (no network).

    Memory: under 1 GiB (the tiny models and caches of a few thousand sequences)."""
    O.announce_threads()
    from opdcache.demo.ablations import ABLATIONS
    from opdcache.demo.pipeline import run_demo
    from opdcache.errors import ConfigError

    if ablation is not None and ablation not in ABLATIONS:
        raise ConfigError(f"--ablation must be one of {', '.join(ABLATIONS)}, got {ablation!r}")
    cfg = DemoConfig(workdir=workdir, seed=seed, loss=loss, opd_steps=opd_steps, opd_lr=opd_lr, tau=tau, kl_coef=kl_coef)
    (ABLATIONS[ablation] if ablation else run_demo)(cfg)


def register(app: typer.Typer) -> None:
    app.command(short_help="The whole pipeline on the embedded task (CPU).")(demo)
