"""``opdcache export CACHE --to jsonl|parquet-flat --out DIR``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from opdcache.cli.options import CachePath


def export(
    cache: CachePath,
    to: Annotated[str, typer.Option("--to", help="jsonl, parquet-flat, or lightning-opd (the Lightning OPD release's slime layout).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Output directory.", show_default=False)],
    teacher: Annotated[Optional[str], typer.Option("--teacher", help="Teacher table to include (default: the only one).", show_default=False)] = None,
    ref_logprobs: Annotated[bool, typer.Option("--ref-logprobs", help="lightning-opd: also export the cached ref_logprobs (pi_ref) as student_log_probs.")] = False,
) -> None:
    """One row per rollout, prompt and response decoded beside the ids, with one teacher's per-token columns; or the Lightning OPD release's layout.

    Memory: one shard's rows at a time."""
    from opdcache.format.export import export as run

    result = run(cache, to, out, teacher, ref_logprobs)
    refused = f"; {result['refused']} rows refused (their prompt text does not re-encode to the cached ids)" if result["refused"] else ""
    typer.echo(f"exported {result['rows']} rows{' with ' + result['teacher'] if result['teacher'] else ''} to {out} "
               f"({len(result['files'])} file{'s' if len(result['files']) != 1 else ''}){refused}")
    if result["left_out"]:
        typer.echo(f"not exported (the cache keeps them): {', '.join(result['left_out'])}")


def register(app: typer.Typer) -> None:
    app.command(short_help="Write a cache in another trainer's format.")(export)
