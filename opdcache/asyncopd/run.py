"""The supervisor of an async run: records the settings, starts the three stages, stops them all when one fails,
and, when the learner is done, finalizes the cache (manifest with each shard's sampling snapshot and the staleness at
which it was consumed) and reports papers/001's throughput and overlap figures.

Memory of the supervisor: the ledger and the stages' busy intervals; each stage's is in its own docstring
(opdcache/asyncopd/stages.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from opdcache import storage
from opdcache.asyncopd import queue as Q
from opdcache.asyncopd.config import AsyncConfig
from opdcache.asyncopd.stages import STAGES, table_paths
from opdcache.errors import ConfigError, OpdcacheError, ResumeError
from opdcache.format.cache import config_diff, finalize_table, JOB_FILE, settings_summary, TableJob
from opdcache.progress import bar, detail

WARMUP_UPDATES = 5  # papers/001 App. G: throughput discards the first five learner updates
ATTEMPTS = "attempts.jsonl"  # one line per invocation that ran stages: {"attempt", "start"}


class StageFailed(OpdcacheError, RuntimeError):
    """A stage of an async run stopped with an error; the others were stopped, and everything written is kept."""


def stage_threads(cfg: AsyncConfig) -> int:
    """Torch threads per stage: --threads, else the CPUs this process may use shared by the three stages (at least 1).
    Three processes each spinning the machine's full thread count collapse on a busy machine."""
    from opdcache.threads import ENV, usable_cpus

    if cfg.threads:
        return cfg.threads
    if os.environ.get(ENV):
        return int(os.environ[ENV])
    return max(1, usable_cpus() // len(STAGES))


def _begin(cfg: AsyncConfig) -> None:
    """Write run.json, or refuse a resume whose settings differ from it."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    path = cfg.out / Q.RUN_FILE
    record = {"config": cfg.to_json(), "identity": cfg.identity()}
    if path.is_file():
        from opdcache.untrusted import read_json

        old = read_json(path, str(path), ResumeError)
        if not isinstance(old, dict) or not isinstance(old.get("identity"), dict):
            raise ResumeError(f"{path} is not an opdcache async run record (no identity); use a new --out or delete {cfg.out}")
        from opdcache.training.checkpoint import setting_defaults

        defaults = {**setting_defaults(cfg.learner), **setting_defaults(cfg)}
        predates = sorted(k for k in record["identity"] if k not in old["identity"] and k in defaults)
        diff = config_diff({**{k: defaults[k] for k in predates}, **old["identity"]}, record["identity"])
        if diff:
            raise ResumeError(f"{cfg.out} holds an async run with other settings ({settings_summary(diff)}); rerun with the original "
                              f"settings to resume, or use a new --out (or delete {cfg.out})")
        if predates:
            print(f"async: {path} predates the settings {', '.join(f'{k} = {defaults[k]!r}' for k in predates)}: the run "
                  "was started with their defaults", file=sys.stderr)
    storage.write_text_atomic(path, json.dumps(record, indent=2, sort_keys=True) + "\n")


def _check_inputs(cfg: AsyncConfig) -> None:
    """What a stage would only find out after starting its engine: refuse it before anything starts."""
    from opdcache.inputs.models import is_hub_id, resolve_model

    if cfg.out.exists() and not cfg.out.is_dir():
        raise ConfigError(f"--out {cfg.out} is a file; the run directory must be a directory (new or a run's to resume)")
    if not Path(cfg.prompts.path).exists() and not is_hub_id(str(cfg.prompts.path)):  # before the models' lookups
        raise ConfigError(f"prompt file {cfg.prompts.path} does not exist; check --prompts")
    resolve_model(cfg.learner.model, what="--model")
    resolve_model(cfg.teacher, what="--teacher")
    storage.as_path(cfg.cache_root)  # a URL whose filesystem package is missing fails here
    if cfg.executor == "local":  # a Ray task sees its own GPUs: there each stage resolves its device
        from opdcache.backends.loading import resolve_device

        resolve_device(cfg.device)


def _last_line(path: Path) -> str:
    lines = [l for l in path.read_text(errors="replace").splitlines() if l.strip()] if path.is_file() else []
    errors = [l for l in lines if l.startswith("error: ")]
    return (errors or lines or ["(no output)"])[-1].removeprefix("error: ")


class _Watch:
    """The supervisor's progress: learner updates from the ledger, the rollout and teacher stages' finished batches from
    their busy intervals (all files in the local run directory, read at most once a second). The first report comes at
    once; the stages' own output goes to their logs."""

    def __init__(self, cfg: AsyncConfig, pbar):
        self.cfg, self.pbar, self.at = cfg, pbar, time.monotonic()
        self.updates = len({e["batch"] for e in Q.read_jsonl(cfg.out / Q.LEDGER)})  # a resume starts where it was
        detail("starting the rollout, teacher and learner stages")
        if self.updates:
            self.pbar.update(self.updates)

    def poll(self) -> None:
        now = time.monotonic()
        if now - self.at < 1.0:
            return
        self.at = now
        done = {s: len({iv["batch"] for iv in Q.read_jsonl(self.cfg.out / "stages" / f"{s}.busy.jsonl")}) for s in ("rollout", "teacher")}
        updates = len({e["batch"] for e in Q.read_jsonl(self.cfg.out / Q.LEDGER)})
        if updates > self.updates:
            self.pbar.update(updates - self.updates)
            self.updates = updates
        detail(f"batches sampled {done['rollout']}, scored {done['teacher']}")


def _run_local(cfg: AsyncConfig, watch: _Watch) -> None:
    logs = cfg.out / "stages"
    logs.mkdir(parents=True, exist_ok=True)
    threads = stage_threads(cfg)
    env = {**os.environ, "OPDCACHE_STAGE_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    procs: dict[str, subprocess.Popen] = {}
    handles = []  # the stages' log files, closed when the run ends
    try:
        for name in STAGES:
            log = open(logs / f"{name}.log", "w")
            handles.append(log)
            procs[name] = subprocess.Popen([sys.executable, "-m", "opdcache.asyncopd.worker", name, str(cfg.out), str(os.getpid())],
                                           stdout=log, stderr=subprocess.STDOUT, env=env)
            storage.write_text_atomic(logs / f"{name}.pid", f"{procs[name].pid}\n")  # whole or absent to a reader
        while True:
            codes = {name: p.poll() for name, p in procs.items()}
            failed = [n for n, c in codes.items() if c not in (None, 0)]
            if failed:
                name = failed[0]
                how = f"signal {-codes[name]}" if codes[name] < 0 else f"exit {codes[name]}"
                raise StageFailed(f"the {name} stage stopped ({how}): {_last_line(logs / f'{name}.log')}; the other stages were "
                                  f"stopped and every finished shard and checkpoint is kept: rerun the same command to resume "
                                  f"(log: {logs / f'{name}.log'})")
            if codes["learner"] == 0 and all(c is not None for c in codes.values()):
                return
            watch.poll()
            time.sleep(0.1)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in handles:
            log.close()


def _run_ray(cfg: AsyncConfig, watch: _Watch) -> None:
    """Each stage as one Ray task with its own engine and GPUs; they share only the cache (and the run directory,
    which must be on a filesystem every node sees: the learner writes it, the stages log their busy intervals there)."""
    try:
        import ray
    except ImportError:
        from opdcache.errors import MissingDependencyError

        raise MissingDependencyError("--executor ray needs the ray package; pip install 'opdcache[ray]'") from None
    from opdcache.asyncopd.stages import run_stage

    if not ray.is_initialized():
        ray.init(address=cfg.ray_address or os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
    # all three must run at once (each waits on the others' files): each reserves the CPUs its torch threads use, or
    # its third of a cluster too small for that (then the threads share CPUs: said, not refused)
    cluster = float(ray.cluster_resources().get("CPU", 3))
    threads = cfg.threads or max(1, int(cluster // len(STAGES)))
    cpus = min(float(threads), cluster / len(STAGES))
    if cpus < threads:
        print(f"warning: the Ray cluster has {cluster:g} CPUs: each stage reserves {cpus:.2g} for its {threads} torch threads "
              "(lower --threads or add CPUs to give each stage its own)", file=sys.stderr)

    def stage(name: str, cfg: AsyncConfig):
        import torch

        torch.set_num_threads(threads)
        try:
            run_stage(name, cfg)
        except OpdcacheError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    task = ray.remote(max_retries=0)(stage)
    refs = {name: task.options(num_gpus=gpus, num_cpus=cpus).remote(name, cfg) for name, gpus in zip(STAGES, cfg.gpus_per_stage)}
    pending = dict(refs)
    try:
        while pending:
            done, _ = ray.wait(list(pending.values()), num_returns=1, timeout=1.0)
            watch.poll()
            if not done:
                continue
            name = next(n for n, r in pending.items() if r == done[0])
            del pending[name]
            try:
                error = ray.get(done[0])
            except Exception as exc:  # the task died (worker killed, out of memory): Ray's own error, first line
                error = str(exc).strip().splitlines()[0][:300]
            if error:
                raise StageFailed(f"the {name} stage stopped: {error}; the other stages were stopped and every finished "
                                  "shard and checkpoint is kept: rerun the same command to resume")
    finally:
        for ref in pending.values():
            ray.cancel(ref, force=True)


def finalize(cfg: AsyncConfig) -> dict:
    """Write the cache's manifest: both tables, and per rollout shard the snapshot that sampled it and the staleness at
    which the learner consumed it (from the ledger). Idempotent."""
    from opdcache.format import manifest as M
    from opdcache.asyncopd.stages import teacher_slug

    root = storage.as_path(cfg.cache_root)
    ledger = {e["batch"]: e for e in Q.read_jsonl(cfg.out / Q.LEDGER)}
    consumption = {"staleness": cfg.staleness, "steps": cfg.learner.steps, "batch_size": cfg.learner.batch_size, "loss": cfg.learner.loss,
                   "shards": [{"shard": b, "student_version": cfg.version_for(b), "consumed_at_step": ledger[b]["consumed_at_step"],
                               "staleness": ledger[b]["staleness"]} for b in sorted(ledger)]}
    for table in ("rollouts", f"teachers/{teacher_slug(cfg)}"):
        if (root / table / JOB_FILE).is_file():
            extra = {"async": consumption} if table == "rollouts" else {}
            finalize_table(TableJob.from_job_file(root, table), **extra)
    if not cfg.keep_snapshots and (root / Q.SNAPSHOTS).is_dir():  # the run is over: the final model is in learner/model
        for path in (root / Q.SNAPSHOTS).iterdir():
            path.unlink()
    return M.load(root)


def figures(cfg: AsyncConfig) -> dict:
    """papers/001's throughput (response tokens per second of learner time after 5 warm-up updates, App. G) and overlap
    (the stages' busy seconds per wall second: sum over stages of merged busy time / wall time, so 1 is one stage at a
    time and 3 all three always busy), with each stage's busy time. ``updates`` counts every consumed batch; the timed
    figures cover the last attempt alone (a resumed run's earlier attempts and the pause between them are not its
    speed), from that attempt's ledger lines and busy intervals; ``attempt`` says which."""
    ledger = Q.read_jsonl(cfg.out / Q.LEDGER)
    attempts = Q.read_jsonl(cfg.out / ATTEMPTS)
    since = attempts[-1]["start"] if attempts else float("-inf")
    out: dict = {"updates": len(ledger), "attempt": len(attempts) or 1}
    timed = [e for e in ledger if e.get("time") is not None and e["time"] >= since]
    out["updates_this_attempt"] = len(timed)
    if len(timed) > WARMUP_UPDATES:  # J >= 6: updates 6..J after t_5
        t5 = timed[WARMUP_UPDATES - 1]["time"]
        tokens = sum(e["tokens"] for e in timed[WARMUP_UPDATES:])
        out["throughput_tokens_per_s"] = tokens / max(1e-9, timed[-1]["time"] - t5)
    busy = {}
    intervals = {s: [iv for iv in Q.read_jsonl(cfg.out / "stages" / f"{s}.busy.jsonl") if iv["start"] >= since] for s in STAGES}
    everything = [iv for ivs in intervals.values() for iv in ivs]
    if everything:
        start, end = min(iv["start"] for iv in everything), max(iv["end"] for iv in everything)
        for s, ivs in intervals.items():
            merged, total = sorted((iv["start"], iv["end"]) for iv in ivs), 0.0
            cur = None
            for a, b in merged:
                if cur is None or a > cur[1]:
                    total += 0 if cur is None else cur[1] - cur[0]
                    cur = [a, b]
                else:
                    cur[1] = max(cur[1], b)
            total += 0 if cur is None else cur[1] - cur[0]
            busy[s] = total
        out["wall_s"] = end - start
        out["busy_s"] = busy
        out["overlap"] = sum(busy.values()) / max(1e-9, end - start)
    return out


LOCK_FILE = "run.lock"


@contextmanager
def _owned(out: Path):
    """Hold the run directory for this run alone: an exclusive lock on run.lock (flock, released by the kernel when the
    process dies, so a killed run never leaves it held), which records the holder's host and pid for the refusal."""
    import fcntl
    import socket

    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise ResumeError(f"{out} is in use by another opdcache async run ({holder}); wait for it to finish or stop it, "
                              "or give this run another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _check_regenerable(cfg: AsyncConfig) -> None:
    """A consumed batch whose rollout shard is gone cannot be sampled again once its snapshot is deleted (the rollout
    stage would wait for it forever; version 0 is --model itself, always there): refuse in one line saying what is
    missing."""
    consumed = sorted({e["batch"] for e in Q.read_jsonl(cfg.out / Q.LEDGER)})
    for b in consumed:
        shard, version = table_paths(cfg, b)[0], cfg.version_for(b)
        if version >= 1 and not shard.is_file() and not Q.snapshot_path(cfg.cache_root, version).is_file():  # v0 is --model itself
            raise ResumeError(f"batch {b} was consumed but its rollout shard {shard} is missing, and the snapshot "
                              f"v{cfg.version_for(b)} that sampled it is gone, so it cannot be sampled again: restore the shard, "
                              f"or start over with a new --out (or delete {cfg.out} and the cache)")


def run_async(cfg: AsyncConfig) -> dict:
    """Run (or resume) an async OPD run to its end; return the manifest's consumption record and the figures.
    The run directory is held by this run alone while it runs (run.lock)."""
    _check_inputs(cfg)
    with _owned(cfg.out):
        return _run_owned(cfg)


def _run_owned(cfg: AsyncConfig) -> dict:
    _begin(cfg)
    _check_regenerable(cfg)
    done = len(Q.read_jsonl(cfg.out / Q.LEDGER)) >= cfg.learner.steps and (cfg.out / "learner" / "model").is_dir()
    if not done:
        attempts = Q.read_jsonl(cfg.out / ATTEMPTS)
        with open(cfg.out / ATTEMPTS, "a") as f:  # this attempt's start: its figures count only what happened after it
            f.write(json.dumps({"attempt": len(attempts) + 1, "start": time.time()}) + "\n")
        with bar(total=cfg.learner.steps, desc="async", unit="update", enabled=cfg.learner.progress, track=True) as pbar:
            (_run_ray if cfg.executor == "ray" else _run_local)(cfg, _Watch(cfg, pbar))
    manifest = finalize(cfg)
    return {"out": str(cfg.out), "cache": cfg.cache_root, "async": manifest["tables"]["rollouts"].get("async"),
            "figures": figures(cfg), "resumed_finished": done}
