"""``opdcache check-consistency CACHE``."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from opdcache.cli.options import CachePath, JsonOut


def check_consistency(
    cache: CachePath,
    teacher: Annotated[Optional[list[str]], typer.Option("--teacher", help="Teacher tables to compare (default: all).", show_default=False)] = None,
    train_teacher: Annotated[Optional[str], typer.Option("--train-teacher", help="The teacher you will train with; exit 1 if pi_ref is not consistent with it. Default: none (report only).", show_default=False)] = None,
    max_gap_vs_uniform: Annotated[float, typer.Option("--max-gap-vs-uniform", help="One teacher, no lineage: exit 1 when its gap exceeds this fraction of a uniform teacher's.")] = 0.25,
    as_json: JsonOut = False,
) -> None:
    """Which teacher pi_ref is consistent with: lineage, and an empirical probe from the stored scores.

    Memory: the per-token log-prob columns of the cache (a few bytes per token); no model is loaded."""
    from opdcache.teacher.consistency import check, render

    report = check(cache, teacher, train_teacher, max_gap_vs_uniform)
    typer.echo(json.dumps(report, indent=2) if as_json else render(report))
    if (train_teacher is not None and not report["train_teacher_ok"]) or report["likely_inconsistent"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("check-consistency", short_help="Which teacher pi_ref is consistent with.")(check_consistency)
