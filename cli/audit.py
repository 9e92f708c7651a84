"""``opdcache audit CACHE``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from opdcache.cli import options as O


def audit(
    cache: O.CachePath,
    table: Annotated[Optional[str], typer.Option("--table", help="One table: rollouts, sft, or a teacher table's name (default: every table).", show_default=False)] = None,
    rows: Annotated[str, typer.Option("--rows", help="Rows re-computed per table, drawn at random (seeded) over all its shards, or all.")] = "16",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the row sample.")] = 0,
    model: Annotated[Optional[Path], typer.Option("--model", help="pi_ref (the rollout table's model) when it is not at the path the manifest records. Default: the recorded path.", show_default=False)] = None,
    teacher: Annotated[Optional[Path], typer.Option("--teacher", help="The teacher of the teacher tables when it is not at the recorded path. Default: the recorded path.", show_default=False)] = None,
    tolerance: Annotated[float, typer.Option("--tolerance", help="Tables not computed with --exact: the floor of each float column's tolerance; the tolerance grows with the table's dtype and its measured batch-to-batch spread (see the report's reasoning line).")] = 1e-4,
    device: Annotated[str, typer.Option("--device", help="Where tables not computed with --exact are re-computed: auto (a CUDA GPU when there is one), cpu, cuda, cuda:N. An exact table re-computes where its recorded arithmetic runs.")] = "auto",
    replay: Annotated[bool, typer.Option("--replay/--no-replay", help="Teacher tables a batch-dependent engine wrote (bfloat16 "
                                                                  "and float32 tables of the transformers engine): re-score each shard holding a sampled row whole, in the "
                                                                  "batching its footer records, so the values come back bit for bit and a change of any one value is "
                                                                  "seen; --no-replay: the sampled rows alone, within the tolerance.")] = True,
    server_url: O.ServerUrl = None,
    server_kind: O.ServerKind = "auto",
    api_key: O.ApiKey = None,
    as_json: O.JsonOut = False,
) -> None:
    """Re-compute a seeded sample of rows in each table's recorded arithmetic and dtype; per column, bit-exact
    matches, max |delta| and its tolerance. Exit 1 when an --exact table does not reproduce bit for bit, or another's
    float column exceeds the tolerance its dtype allows.

    With --server-url, teacher tables are re-scored through those running servers (serving the recorded teacher;
    checked as score-teacher checks it) instead of in-process.

    Memory: one engine (the model, plus a float64 copy of its weights for exact tables; with --server-url none, the
    requests in flight) and the sampled rows' values three times; the rows are read from one shard at a time. With
    --replay (the default), time and the scores held grow with the shards that hold a sampled row (each is scored
    whole, once), not with --rows."""
    O.announce_threads()
    from opdcache.teacher.audit import AuditConfig, audit as run, render

    from opdcache.backends import EngineConfig

    server = None if server_url is None else EngineConfig(backend="server", server_url=server_url, server_kind=server_kind, api_key=api_key)
    report = run(AuditConfig(cache=cache, table=table, rows=rows, seed=seed, model=model, teacher=teacher, tolerance=tolerance,
                             device=device, server=server, replay=replay))
    typer.echo(json.dumps(report, indent=2) if as_json else render(report))
    if not report["passed"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("audit", short_help="Re-compute sampled rows; compare per column.")(audit)
