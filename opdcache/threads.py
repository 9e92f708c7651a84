"""How many CPU threads torch uses, chosen so that a busy machine slows opdcache down instead of collapsing it.

torch's default is one OpenMP thread per core, and GNU OpenMP threads *spin* while they wait for work (about 300,000
iterations before sleeping). On a shared node whose cores other processes keep busy, spinning threads steal the
cores from each other and from those processes: 10 demo train steps took 12-26 s instead of 1.7-2.8 s.
Two settings fix it without giving up parallelism on a quiet machine:

* ``OMP_WAIT_POLICY=PASSIVE`` (unless the user set it): waiting threads sleep instead of spinning. It must be in the
  environment before the OpenMP runtime loads, i.e. before ``import torch``: the CLI sets it first thing.
* the thread count comes from ``--threads``, else ``OPDCACHE_THREADS``, else ``OMP_NUM_THREADS`` (set by Slurm, torchrun
  and Ray workers from their allocation), else the CPUs this process may run on
  (``os.sched_getaffinity``, which respects taskset, cgroups' cpusets and Slurm's binding), not the machine's cores.

The count changes the last bits of CPU float reductions, so caches record it (unhashed: a resume on a machine with
another core count is allowed and documented, as GPU kernels' nondeterminism is).
"""

from __future__ import annotations

import os

ENV = "OPDCACHE_THREADS"


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pick(threads: int | None = None) -> tuple[int, str]:
    """(thread count, where it came from)."""
    from opdcache.errors import ConfigError

    if threads is not None:
        source = "--threads"
    elif os.environ.get(ENV):
        try:
            threads, source = int(os.environ[ENV]), ENV
        except ValueError:
            raise ConfigError(f"{ENV} must be a whole number of threads, got {os.environ[ENV]!r}") from None
    elif os.environ.get("OMP_NUM_THREADS", "").strip().isdigit() and int(os.environ["OMP_NUM_THREADS"]) >= 1:
        # Slurm, torchrun and Ray workers set it from their CPU allocation (e.g. num_cpus=1): honour it
        threads, source = int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    else:
        threads, source = usable_cpus(), "the CPUs this process may use"
    if threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {threads}")
    return threads, source


def prepare_environment() -> None:
    """Before torch is imported: waiting OpenMP threads sleep instead of spinning (unless the user chose otherwise)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def configure(threads: int | None = None) -> str:
    """Set torch's thread count; return a line saying what was picked and why."""
    import torch

    n, source = pick(threads)
    torch.set_num_threads(n)
    return f"threads: {n} (from {source}; {usable_cpus()} usable CPUs; OpenMP wait policy {os.environ.get('OMP_WAIT_POLICY', 'default')})"


def record() -> dict:
    """What a cache records of the CPU arithmetic that produced it (not part of its fingerprint)."""
    import torch

    return {"torch_threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
