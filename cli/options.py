"""Option and argument types shared by several commands, defined once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

CachePath = Annotated[Path, typer.Argument(help="Cache directory (the folder holding opdcache.json).", show_default=False)]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print only problems and the final line.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]
Token = Annotated[Optional[str], typer.Option("--token", help="Hub token; defaults to HF_TOKEN or your `hf auth login`. Never printed.", show_default=False)]
Revision = Annotated[Optional[str], typer.Option("--revision", help="Hub branch or commit.")]
NumWorkers = Annotated[Optional[int], typer.Option("--num-workers", help="Workers sharing the job (default: SLURM array size, torchrun WORLD_SIZE, or 1).", show_default=False)]
WorkerIndex = Annotated[Optional[int], typer.Option("--worker-index", help="This worker's index in [0, num-workers) (default: SLURM array index, torchrun RANK, or 0).", show_default=False)]
