"""glibc's malloc and the buffers that activation checkpointing recomputes.

With ``--gradient-checkpointing`` the backward recomputes each decoder layer's activations and frees them, once per
layer. On a CPU, torch takes those [batch, length, hidden] buffers from malloc, and glibc serves them from its heap:
its mmap threshold is dynamic and rises to the largest block freed so far (up to 32 MiB), so after the first step
every buffer below that comes from the heap, and the heap keeps the space of what was freed. The process's resident memory then follows the
largest set of buffers ever live at once, not the tensors torch holds: at hidden 1,024 and 8 layers, 235 KiB of RSS a
response token where torch holds 70 (BENCHMARKS.md, "Training memory").

Fixing the threshold at 128 KiB (glibc's starting value) maps every larger buffer with its own mmap and unmaps it when
freed, so RSS follows torch's tensors. The cost is a page fault for every page of every large buffer: measured about
5% more wall time and CPU time on the same step. ``mallopt(M_MMAP_THRESHOLD)`` is what the environment variable
``MALLOC_MMAP_THRESHOLD_`` sets at start-up; a user who sets the variable keeps their value.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD = 128 * 1024  # bytes: glibc's starting value, here kept fixed
ENV = "MALLOC_MMAP_THRESHOLD_"


def _glibc():
    """The C library when it is glibc (``mallopt`` and ``gnu_get_libc_version`` both present), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def map_large_buffers() -> str:
    """Fix glibc's mmap threshold at 128 KiB for this process, so that freed activation buffers leave the resident
    memory (see the module docstring). Returns what was done, in words: set, the user's own
    ``MALLOC_MMAP_THRESHOLD_`` kept, or nothing (not glibc, or mallopt refused)."""
    if os.environ.get(ENV):
        return f"{ENV}={os.environ[ENV]} from the environment kept"
    libc = _glibc()
    if libc is None:
        return "not glibc: the allocator's settings left as they are"
    if libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(THRESHOLD)) != 1:
        return "glibc refused mallopt(M_MMAP_THRESHOLD): the allocator's settings left as they are"
    return f"buffers over {THRESHOLD // 1024} KiB mapped and unmapped one by one (glibc M_MMAP_THRESHOLD)"
