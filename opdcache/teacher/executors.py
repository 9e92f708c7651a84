"""Running a sharded stage on Ray: the same stage functions as a local run, one Ray task per worker partition.

``build-sft``, ``build-rollouts`` and ``score-teacher`` already split their work into disjoint, deterministic shard
sets (``--num-workers N --worker-index i``; generation groups are dealt whole). ``--executor ray`` runs worker
``i`` of ``N`` as a Ray task that loads its own engine (vLLM or transformers, ``--gpus-per-worker`` GPUs) and writes
its whole shards with the local, atomic writer, then the driver writes the manifest. So the cache is byte-identical
to a local run with any worker count. A task that dies (a killed process, a lost node) is retried by Ray and
resumes like a local job: shards already written are kept, none is half-written. Ray Data's batch-inference path
(``map_batches`` over an actor pool) was not used: it streams rows, while a shard here is the unit of atomic
writing and resume, and its bytes must not depend on how rows were batched across shards.

Memory of the driver: the manifest only; each task's is the stage's own (its command's ``--help``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from opdcache.errors import ConfigError

EXECUTORS = ("local", "ray")


@dataclasses.dataclass(frozen=True)
class RayConfig:
    """Where and how the stage's workers run on Ray."""

    workers: int = 2
    """Ray tasks (worker partitions of the shards)."""
    address: str | None = None
    """Ray cluster address (None: the RAY_ADDRESS variable, else a local cluster)."""
    gpus_per_worker: float = 0
    """GPUs each task reserves (its engine's)."""
    cpus_per_worker: float = 1
    """CPUs each task reserves."""
    max_retries: int = 3
    """Times Ray reruns a task whose process died; the rerun resumes from the shards already written."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {self.workers}")
        if self.gpus_per_worker < 0 or self.cpus_per_worker <= 0:
            raise ConfigError(f"--gpus-per-worker must be >= 0 and CPUs per worker > 0, got {self.gpus_per_worker}, {self.cpus_per_worker}")


def _worker(stage: Callable, job, workers: int, index: int, cpus: float = 1):
    """One Ray task: the stage on worker partition ``index`` of ``workers``, without writing the manifest, with as many
    torch threads as CPUs the task reserved (Ray schedules by that reservation: more threads would oversubscribe
    the node)."""
    import torch

    torch.set_num_threads(max(1, int(cpus)))
    return stage(dataclasses.replace(job, num_workers=workers, worker_index=index, progress=False, finalize=False))


def run_on_ray(stage: Callable, job, ray_config: RayConfig, table: str) -> list:
    """Run ``stage(job)`` as ``ray_config.workers`` Ray tasks, then finalize ``table`` on the driver; return each task's result."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--executor ray needs the ray package: pip install 'opdcache[ray]'") from None
    from opdcache.format.cache import TableJob, finalize_table

    if not ray.is_initialized():
        ray.init(address=ray_config.address, ignore_reinit_error=True, log_to_driver=False)
    task = ray.remote(num_cpus=ray_config.cpus_per_worker, num_gpus=ray_config.gpus_per_worker, max_retries=ray_config.max_retries)(_worker)
    if hasattr(job, "prepare_only"):  # score-teacher: the head and the svd projection are written once, before the workers
        ray.get(task.remote(stage, dataclasses.replace(job, prepare_only=True), 1, 0, ray_config.cpus_per_worker))
    refs = [task.remote(stage, job, ray_config.workers, i, ray_config.cpus_per_worker) for i in range(ray_config.workers)]
    try:
        results = ray.get(refs)
    except ray.exceptions.RayError as exc:
        raise ConfigError(f"a Ray worker failed after {ray_config.max_retries} retries: {str(exc).strip().splitlines()[-1][:300]}; "
                          "rerun the same command to resume (written shards are kept)") from exc
    root = job.cache if hasattr(job, "cache") else job.out
    done = TableJob.from_job_file(root, table)
    if not done.all_done():
        missing = [i for i in range(done.num_shards) if not done.is_done(i)]
        raise ConfigError(f"{table}: shards {missing} are still missing after every Ray worker returned; rerun to resume")
    finalize_table(done)
    return results


def run_stage(stage: Callable, job, executor: str, ray_config: RayConfig | None, table: str) -> list:
    """``stage(job)`` on ``executor``: in this process (one result), or as Ray tasks with ``ray_config``, the
    driver finalizing ``table`` (each task's result). One line for an executor that is neither."""
    if executor == "local":
        return [stage(job)]
    if executor == "ray":
        return run_on_ray(stage, job, ray_config or RayConfig(), table)
    raise ConfigError(f"--executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
