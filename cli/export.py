"""``opdcache export CACHE --to jsonl|parquet-flat --out DIR``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from opdcache.cli.options import CachePath


def export(
    cache: CachePath,
    to: Annotated[str, typer.Option("--to", help="jsonl or parquet-flat.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Output directory.", show_default=False)],
    teacher: Annotated[Optional[str], typer.Option("--teacher", help="Teacher table to include (default: the only one).", show_default=False)] = None,
) -> None:
    """One row per rollout, prompt and response decoded beside the ids, with one teacher's per-token columns.

    Memory: one shard's rows at a time."""
    from opdcache.export import export as run

    result = run(cache, to, out, teacher)
    typer.echo(f"exported {result['rows']} rows{' with ' + result['teacher'] if result['teacher'] else ''} to {out} "
               f"({len(result['files'])} file{'s' if len(result['files']) != 1 else ''})")


def register(app: typer.Typer) -> None:
    app.command()(export)
