"""``opdcache mismatch-report CACHE``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from opdcache.cli import options as O


def mismatch_report(
    cache: O.CachePath,
    model: Annotated[Optional[Path], typer.Option("--model", help="pi_ref's weights for the float32 recomputation (default: the path the cache recorded).", show_default=False)] = None,
    teacher: Annotated[Optional[list[str]], typer.Option("--teacher", help="Two teacher tables to compare (default: every pair of one teacher's weights scored by different engines).", show_default=False)] = None,
    rollouts: Annotated[bool, typer.Option("--rollouts/--no-rollouts", help="Recompute pi_ref in float32 and compare with the rollout engine's ref_logprobs.")] = True,
    out: Annotated[Optional[Path], typer.Option("--out", help="Directory for mismatch_report.json and mismatch_hist.png (default: CACHE/mismatch-report).", show_default=False)] = None,
    png: Annotated[bool, typer.Option("--png/--no-png", help="Write the |delta| histogram (needs matplotlib).")] = True,
    worst: Annotated[int, typer.Option("--worst", help="Worst sequences listed per comparison.")] = 5,
    max_abs_delta: Annotated[Optional[float], typer.Option("--max-abs-delta", help="Exit 1 if any max |delta| exceeds this (nats). Default: none (no gate).", show_default=False)] = None,
    max_mean_abs_delta: Annotated[Optional[float], typer.Option("--max-mean-abs-delta", help="Exit 1 if any mean |delta| exceeds this (nats). Default: none (no gate).", show_default=False)] = None,
    max_flip_fraction: Annotated[Optional[float], typer.Option("--max-flip-fraction", help="Exit 1 if the fraction of argmax flips exceeds this. Default: none (no gate).", show_default=False)] = None,
    max_k3: Annotated[Optional[float], typer.Option("--max-k3", help="Exit 1 if K3 per token exceeds this. Default: none (no gate).", show_default=False)] = None,
    rollout_aligned: Annotated[bool, typer.Option("--rollout-aligned", help="Also recompute pi_ref in the rollouts' recorded low-bit scheme (train --rollout-aligned's learner) and compare.")] = False,
    exact: Annotated[bool, typer.Option("--exact", help="Recompute every table (pi_ref's rollouts, each teacher table) in the exact arithmetic (train --exact's) instead: on caches built with --exact every max |delta| is 0.")] = False,
    device: O.Device = "auto",
    progress: O.Progress = None,
) -> None:
    """Training-inference mismatch: delta = log pi_train - log pi_rollout per token (papers/003 eq. 1), and between teacher engines;
    for rollouts also papers/004's error tokens (the rule is printed with them).

    Memory: as score-teacher for the float32 recompute (streamed head, no tokens x vocabulary), plus the per-token deltas."""
    from opdcache.teacher import mismatch as M

    out = M.report_folder(cache, out)  # a folder that would write outside the cache is refused before any recompute
    rep, sections = M.report(cache, model, teacher, rollouts, worst, device, progress, rollout_aligned, exact)
    limits = M.Thresholds(max_abs_delta, max_mean_abs_delta, max_flip_fraction, max_k3)
    problems = M.crossed(rep, limits)
    rep["thresholds"] = dict(vars(limits))
    rep["crossed"] = problems
    written = M.write_report(rep, sections, out, png)
    typer.echo(M.render(rep))
    typer.echo("\nwrote " + " and ".join(map(str, written)))
    for line in problems:
        typer.echo(f"threshold crossed: {line}", err=True)
    if problems:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("mismatch-report", short_help="Training-inference mismatch per token.")(mismatch_report)
