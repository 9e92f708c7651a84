"""``opdcache validate CACHE``."""

from __future__ import annotations

from typing import Annotated

import typer

from opdcache.cli.options import CachePath


def validate(
    cache: CachePath,
    quick: Annotated[bool, typer.Option("--quick", help="Check files, sizes, hashes and schemas only; skip the per-row checks.")] = False,
) -> None:
    """Check a cache against its manifest, its schema and the data invariants. Exit 1 on any problem.

    Memory: one shard's columns at a time, hidden states one row group at a time, a [1,024, 8,192] float32
    logit block for rebuilding log-probs from them; never tokens x vocabulary. A cache on an object store (s3://...)
    is read in place: each shard is streamed once for its sha256, then read again by columns."""
    from opdcache.errors import NotACacheError
    from opdcache.format.manifest import not_a_cache
    from opdcache.format.validate import validate as run

    why = not_a_cache(cache)
    if why is not None:  # not a cache at all: a usage error (exit 2), not a cache that fails its checks
        raise NotACacheError(why)
    problems = run(cache, quick=quick)
    for p in problems:
        typer.echo(str(p))
    errors = [p for p in problems if not p.warning]
    if errors:
        typer.echo(f"{cache}: INVALID ({len(errors)} problems)")
        raise typer.Exit(1)
    typer.echo(f"{cache}: ok{' (quick)' if quick else ''}")


def register(app: typer.Typer) -> None:
    app.command(short_help="Check a cache against its manifest and schema.")(validate)
