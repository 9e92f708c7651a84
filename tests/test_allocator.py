"""glibc's mmap threshold under --gradient-checkpointing (opdcache/training/allocator.py): freed large buffers leave the RSS."""

import os
import subprocess
import sys

import pytest

from opdcache.training import allocator

pytestmark = pytest.mark.skipif(allocator._glibc() is None, reason="glibc only")

# What a checkpointed backward does to the heap: a large buffer freed (glibc's dynamic threshold rises to its size), then
# many recomputed buffers below that size allocated and freed while the small tensors allocated between them live on.
CHILD = """
import sys, torch
if sys.argv[1] == "fixed":
    from opdcache.training.allocator import map_large_buffers
    print(map_large_buffers(), file=sys.stderr)
def anon_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1])
big = torch.ones(16 << 18); del big                                   # 16 MiB
before = anon_kib()
bufs, kept = [], []
for _ in range(24):
    bufs.append(torch.ones(1 << 20))                                   # 4 MiB: a recomputed activation
    kept.append(torch.ones(1 << 12))                                   # 16 KiB that outlives it
del bufs
print(anon_kib() - before)
"""


def _retained_kib(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env, check=True)
    return int(out.stdout.split()[-1])


def test_freed_recompute_buffers_leave_the_resident_memory_once_the_threshold_is_fixed():
    default, fixed = _retained_kib("default"), _retained_kib("fixed")
    assert default > 64 * 1024, default  # glibc's defaults keep the 96 MiB in the heap: the test can fail
    assert fixed < 8 * 1024, fixed


def test_a_threshold_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert allocator.map_large_buffers() == "MALLOC_MMAP_THRESHOLD_=1048576 from the environment kept"
