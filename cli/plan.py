"""``opdcache plan CACHE --teacher T``."""

from __future__ import annotations

import json
from typing import Annotated, List, Optional

import typer

from opdcache.cli import options as O


def plan(
    cache: O.CachePath,
    teacher: O.TeacherModel,
    rows: Annotated[int, typer.Option("--rows", help="Rollout rows sampled (seeded, over all shards). With svd settings the first half fits the projection and the rest is measured.")] = 16,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the row sample and of the sampled store's draws.")] = 0,
    student: Annotated[Optional[List[str]], typer.Option("--student", help="A model on the same vocabulary (pi_ref, say; repeatable): adds the forward-KL estimate's and its gradient's error for this student. Default: none (student-independent errors only).", show_default=False)] = None,
    max_error: Annotated[Optional[float], typer.Option("--max-error", help="Recommend the cheapest setting whose max KL(teacher || what the store implies) is at most this (nats). Default: 0.01.", show_default=False)] = None,
    max_bytes: Annotated[Optional[float], typer.Option("--max-bytes", help="Pick the most accurate setting within this many bytes per token. Default: none.", show_default=False)] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Compute dtype of the teacher and students: float32, bfloat16, float16.")] = "float32",
    as_json: O.JsonOut = False,
) -> None:
    """Measure, on a sample of this cache's own rollouts, what each teacher store would cost and how far its signal is
    from the teacher's full vocabulary; print the frontier (top-k widths, the compact top-128 in float16 and prob14,
    sampled m, hidden float32 / bfloat16, svd ranks, and the settings the cache already holds, marked *) and the
    setting it recommends: the cheapest within --max-error (default 0.01 nats, max KL a position) or the most
    accurate within --max-bytes.

    Memory: the teacher (and students), one row's hidden states, [128 positions, vocabulary] blocks (one float32 per
    model, a few float64 while errors are summed: about 1 GiB at a 151,936 vocabulary), and the sampled rows' stored
    values for each setting (rows x tokens x width); never the sample's tokens x vocabulary."""
    O.announce_threads()
    from opdcache.teacher.plan import PlanConfig, render, run_plan

    report = run_plan(PlanConfig(cache=cache, teacher=teacher, rows=rows, seed=seed, students=tuple(student or ()), dtype=dtype,
                                 max_error=max_error, max_bytes=max_bytes))
    typer.echo(json.dumps(report, indent=2) if as_json else render(report))


def register(app: typer.Typer) -> None:
    app.command("plan", short_help="Bytes per token against error, per teacher store.")(plan)
