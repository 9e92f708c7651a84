"""Sides of a comparison interleaved in one process, for a GPU: there a process start is a CUDA context and a model
load (10-20 s on an H200) against 0.1-1 s of work, so benchmarks/harness.py's fresh process per run would spend the
device's lease on start-ups. Every side runs once to warm up, then ``rounds`` rounds of every side in turn, the order
reversed every other round; memory is the allocator's peak per run above the level before it (a freed block the
allocator keeps is not counted against the next side). BENCHMARKS.md states this departure from BENCHMARKING.md
beside each figure it gives."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import PeakAnon as PeakRSS, cpu_seconds  # noqa: E402  (anonymous RSS: not the model file's page cache)


class PeakMemory:
    """Peak memory of the work inside the block above what was allocated at its start: the CUDA allocator's own
    count on a GPU, the sampled resident set on a CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def __enter__(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.rss = PeakRSS().__enter__()
        return self

    def __exit__(self, *exc):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.delta = torch.cuda.max_memory_allocated() - self.base
        else:
            self.rss.__exit__(*exc)
            self.delta = self.rss.delta


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def interleaved(fns: dict, device: str, rounds: int) -> dict:
    """Each side once to warm up, then ``rounds`` rounds of every side in turn (the order reversed every other round),
    in this one process: the model loads once and a CUDA machine's timing noise falls on every side alike. Per side:
    each run's seconds (synchronised), its CPU-seconds (this process's threads: launches, the host side's work) and
    the peak memory of its runs above the level before each."""
    for fn in fns.values():
        fn()
        sync(device)
    runs: dict = {name: [] for name in fns}
    cpus: dict = {name: [] for name in fns}
    peaks: dict = {name: 0 for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            with PeakMemory(device) as mem:
                t0, c0 = time.perf_counter(), cpu_seconds()
                fns[name]()
                sync(device)
                runs[name].append(time.perf_counter() - t0)
                cpus[name].append(cpu_seconds() - c0)
            peaks[name] = max(peaks[name], mem.delta)
    return {name: {"seconds": statistics.median(runs[name]), "min_seconds": min(runs[name]), "runs": runs[name],
                   "cpu_seconds": statistics.median(cpus[name]), "min_cpu_seconds": min(cpus[name]), "peak_bytes": peaks[name]}
            for name in fns}


def kernels_off(fn):
    """``fn`` with opdcache's fused Triton kernels off (OPDCACHE_KERNELS=0, opdcache/logits/kernels.py): the torch ops they
    replace, as a side beside the same work with them on."""
    def run():
        os.environ["OPDCACHE_KERNELS"] = "0"
        try:
            return fn()
        finally:
            os.environ.pop("OPDCACHE_KERNELS")
    return run
