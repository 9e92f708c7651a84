"""``opdcache push CACHE REPO_ID`` and ``opdcache pull REPO_ID DIR``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from opdcache.cli.options import CachePath, Revision, Token

RepoId = Annotated[str, typer.Argument(help="Hub dataset repo, e.g. my-org/my-opd-cache.", show_default=False)]


def push(cache: CachePath, repo_id: RepoId, private: Annotated[bool, typer.Option(help="Create the repo as private.")] = False,
         token: Token = None, revision: Revision = None) -> None:
    """Upload a validated cache to the Hub (resumable; the manifest goes last). Memory: as validate. A cache on an object
    store is first downloaded to a temporary folder (disk: the cache's size), since the Hub client uploads folders."""
    from opdcache.format.hub import push as run

    typer.echo(f"pushed {cache} to {run(cache, repo_id, private=private, token=token, revision=revision)}")


def pull(repo_id: RepoId, out: Annotated[Path, typer.Argument(help="Local directory to download into.", show_default=False)],
         token: Token = None, revision: Revision = None) -> None:
    """Download a cache from the Hub and validate it. Memory: as validate (files stream to disk)."""
    from opdcache.format.hub import pull as run

    typer.echo(f"pulled {repo_id} into {run(repo_id, out, token=token, revision=revision)}: ok")


def register(app: typer.Typer) -> None:
    app.command(short_help="Upload a validated cache to the Hub.")(push)
    app.command(short_help="Download a cache from the Hub and validate it.")(pull)
