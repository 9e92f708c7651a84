"""Which worker of a job runs which shards: the worker count and index from the flags or the launcher's environment
(a SLURM job array, torchrun), and the split of a table's shards (or groups of shards) between workers by index."""

from __future__ import annotations

import os
from typing import Sequence

from opdcache.errors import ConfigError


def worker_from_env(num_workers: int | None = None, worker_index: int | None = None) -> tuple[int, int]:
    """(num_workers, worker_index), defaulting to a SLURM job array, then torchrun's RANK/WORLD_SIZE, then (1, 0)."""
    env = os.environ
    if num_workers is None:
        for key in ("SLURM_ARRAY_TASK_COUNT", "WORLD_SIZE"):
            if env.get(key):
                num_workers = int(env[key])
                break
        else:
            num_workers = 1
    if worker_index is None:
        if env.get("SLURM_ARRAY_TASK_ID") and env.get("SLURM_ARRAY_TASK_COUNT"):
            worker_index = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
        elif env.get("RANK"):
            worker_index = int(env["RANK"])
        else:
            worker_index = 0
    if num_workers < 1:
        raise ConfigError(f"--num-workers must be at least 1, got {num_workers}")
    if not 0 <= worker_index < num_workers:
        raise ConfigError(f"--worker-index must be between 0 and {num_workers - 1}, got {worker_index}")
    return num_workers, worker_index


def shards_for_worker(num_shards: int, num_workers: int, worker_index: int, groups: Sequence[Sequence[int]] | None = None) -> list[int]:
    """This worker's shards: every num_workers-th shard, or every num_workers-th group of shards when the stage
    computes a group together (generation batches that span shards), so no group is split between workers."""
    if groups is None:
        return [i for i in range(num_shards) if i % num_workers == worker_index]
    return [i for g, group in enumerate(groups) if g % num_workers == worker_index for i in group]
