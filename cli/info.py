"""``opdcache info CACHE``."""

from __future__ import annotations

import json

import typer

from opdcache.cli.options import CachePath, JsonOut


def info(cache: CachePath, as_json: JsonOut = False) -> None:
    """Rows, tokens, stores, bytes per token per store, and lineage of a cache. Memory: the manifest only."""
    from opdcache.format.info import render, summary

    data = summary(cache)
    typer.echo(json.dumps(data, indent=2) if as_json else render(data))


def register(app: typer.Typer) -> None:
    app.command(short_help="Rows, tokens, stores, bytes per token, lineage.")(info)
