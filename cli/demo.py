"""``opdcache demo``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def demo(
    workdir: Annotated[Path, typer.Option("--workdir", help="Where the demo writes models/, prompts/ and caches/.")] = Path("opdcache-demo"),
    seed: Annotated[int, typer.Option(help="Seed of prompts, sampling and training.")] = 0,
    loss: Annotated[str, typer.Option("--loss", help="Estimator of the OPD stage.")] = "lightning",
    opd_steps: Annotated[int, typer.Option("--opd-steps", help="OPD optimizer steps.")] = 40,
    opd_lr: Annotated[float, typer.Option("--opd-lr", help="OPD learning rate.")] = 3e-6,
) -> None:
    """Run the whole pipeline on the embedded task, on CPU, with tiny local models (no network)."""
    from opdcache.demo.pipeline import DemoConfig, run_demo

    run_demo(DemoConfig(workdir=workdir, seed=seed, loss=loss, opd_steps=opd_steps, opd_lr=opd_lr))


def register(app: typer.Typer) -> None:
    app.command()(demo)
