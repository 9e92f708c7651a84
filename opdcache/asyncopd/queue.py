"""Where every batch, snapshot and record of an async run lives, and waiting for them.

In the cache (a directory or an object-store URL; the only thing the stages share):

    rollouts/part-<b>-of-<steps>.parquet          batch b, sampled by snapshot v(b) (its rows' student_version)
    teachers/<slug>/part-<b>-of-<steps>.parquet   the teacher's scores of batch b, row-aligned
    snapshots/student-v<v>.safetensors            the learner's weights after update v (float32, safetensors)

In the run directory (the learner's, local):

    run.json            the settings (a resume with other settings is refused, with the difference)
    ledger.jsonl        one line per consumed batch: batch, student_version, consumed_at (learner step), staleness
    learner/            the learner's checkpoint/, metrics.jsonl and, at the end, model/
    stages/<stage>.log  each stage's output; stages/<stage>.busy.jsonl its busy intervals (for the overlap figure)

Every file appears whole under its final name (opdcache.storage.staged), so a reader that sees a name may read it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from opdcache import storage
from opdcache.errors import OpdcacheError

SNAPSHOTS = "snapshots"
LEDGER = "ledger.jsonl"
RUN_FILE = "run.json"


class StageStopped(OpdcacheError, RuntimeError):
    """A stage stopped waiting because its supervisor is gone (the run was stopped or killed)."""


def snapshot_path(cache_root, version: int):
    return storage.as_path(cache_root) / SNAPSHOTS / f"student-v{version:06d}.safetensors"


def publish_snapshot(model: torch.nn.Module, cache_root, version: int, adapters: bool = False) -> None:
    """Write the model's float32 weights as snapshot ``version``, whole or not at all (tied weights stored once); with
    ``adapters``, a LoRA student's trained adapters alone (the base is --model's, frozen)."""
    from safetensors.torch import save_file, save_model

    path = snapshot_path(cache_root, version)
    meta = {"opdcache.student_version": str(version)}
    with storage.staged(path) as tmp:
        if adapters:
            from opdcache.training.lora import adapter_state

            save_file(adapter_state(model), str(tmp), metadata=meta | {"opdcache.snapshot": "adapters"})
        else:
            save_model(model, str(tmp), metadata=meta)


def load_snapshot(model: torch.nn.Module, cache_root, version: int, adapters: bool = False) -> None:
    """Load snapshot ``version`` into ``model`` in place (every parameter must be present: a snapshot of another
    architecture is refused by safetensors with the missing names); with ``adapters``, exactly the model's trainable
    adapters."""
    import tempfile

    path = snapshot_path(cache_root, version)
    if not storage.is_remote(path):
        _load(model, path, adapters)
        return
    with tempfile.TemporaryDirectory(prefix="opdcache-snapshot-") as tmp:  # one snapshot on local disk at a time, not one per version
        local = Path(tmp) / path.name
        path.fs.get_file(path.path, str(local))
        _load(model, local, adapters)


def _load(model: torch.nn.Module, path, adapters: bool) -> None:
    from safetensors.torch import load_file, load_model

    if not adapters:
        load_model(model, str(path), strict=True)
        return
    from opdcache.errors import SchemaError

    state = load_file(str(path))
    own = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(state) != set(own) or any(state[n].shape != p.shape for n, p in own.items()):
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise SchemaError(f"{path} does not hold this run's adapters (missing {missing[:3]}, unexpected {extra[:3]}, or "
                          "other shapes); it is another run's snapshot: start the run in a new cache")
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(state[name])


class Waiter:
    """Polls for a path with a growing interval; stops when the supervisor that started this stage has gone.

    The interval grows from ``first`` to ``longest``: 20 ms on a local disk (a stat), 500 ms on an object store (a HEAD
    request), so a handoff between stages costs at most that much latency."""

    def __init__(self, parent_pid: int | None = None, first: float = 0.005, longest: float = 0.02, remote_longest: float = 0.5):
        self.parent_pid, self.first, self.longest, self.remote_longest = parent_pid, first, longest, remote_longest
        self.waited = 0.0  # seconds spent waiting, over the stage's life

    def until(self, ready, what: str, longest: float | None = None) -> None:
        interval, start, longest = self.first, time.perf_counter(), longest or self.longest
        while not ready():
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                raise StageStopped(f"the run was stopped while this stage waited for {what}")
            time.sleep(interval)
            interval = min(longest, interval * 1.5)
        self.waited += time.perf_counter() - start

    def for_file(self, path, what: str) -> None:
        self.until(path.is_file, what, self.remote_longest if storage.is_remote(path) else self.longest)


def append_busy(out: Path, stage: str, batch: int, start: float, end: float) -> None:
    """Record one busy interval of a stage (wall-clock seconds since the epoch), for papers/001's overlap figure."""
    path = out / "stages" / f"{stage}.busy.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"batch": batch, "start": start, "end": end}) + "\n")


INTEGER, NUMBER, OPTIONAL_NUMBER = "a non-negative integer", "a number", "a number or null"
JSONL_FIELDS = {
    "ledger.jsonl": {"batch": INTEGER, "consumed_at_step": INTEGER, "student_version": INTEGER, "time": OPTIONAL_NUMBER},
    "attempts.jsonl": {"start": NUMBER},
}
"""The fields every line of the run's jsonl files must hold, and their types."""
BUSY_FIELDS = {"batch": INTEGER, "start": NUMBER, "end": NUMBER}
MAX_JSONL_BYTES = 256 << 20


def _typed(value, kind: str) -> bool:
    if isinstance(value, bool):
        return False
    if kind == INTEGER:
        return isinstance(value, int) and value >= 0
    if kind == OPTIONAL_NUMBER and value is None:
        return True
    return isinstance(value, (int, float)) and value == value and abs(value) != float("inf")


def read_jsonl(path: Path) -> list[dict]:
    """The entries of one of the run's own jsonl files, read by the run folder's rules (opdcache/training/runfolder.py:
    a regular file, no link, within MAX_JSONL_BYTES, a line cut by a crash dropped); a line that is not a JSON object
    with its fields of their types is refused in one line: the run directory was written by something else."""
    from opdcache.training.runfolder import read_jsonl as read

    run_dir = path.parent.parent if path.parent.name == "stages" else path.parent
    wanted = BUSY_FIELDS if path.name.endswith(".busy.jsonl") else JSONL_FIELDS.get(path.name, {})
    fields = ", ".join(f"{k} ({kind})" for k, kind in wanted.items()) or "fields"
    return read(run_dir, path, MAX_JSONL_BYTES, lambda e: all(_typed(e.get(k), kind) for k, kind in wanted.items()),
                f"an entry of the run (a JSON object with {fields})", "start the run again in a new --out")
