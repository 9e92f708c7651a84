"""A cache directory: its layout, the resumable shard-by-shard job that fills a table, and read access.

Layout (DESIGN.md section 3)::

    <cache>/opdcache.json                     manifest, written last
    <cache>/README.md                         dataset card with `configs:` for datasets.load_dataset
    <cache>/<sft|rollouts>/part-i-of-n.parquet
    <cache>/teachers/<slug>/part-i-of-n.parquet   row-aligned with the rollout shard of the same index
    <cache>/teachers/<slug>/head.safetensors      (hidden store) / svd.safetensors (svd store)

A :class:`TableJob` owns one table. Its settings are hashed into a config fingerprint that a job file
records at the start; a restarted job compares fingerprints and refuses with the difference shown, or
writes only the shards that are missing. Shards are split across workers by index (opdcache/format/workers.py), so any
launcher can run them in parallel.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from opdcache import storage
from opdcache.errors import ConfigError, ManifestError, NotACacheError, ResumeError
from opdcache.format import manifest as M, schema as S, shards
from opdcache.format.records import TABLE_RECORD, finalize_table  # noqa: F401 (finalize_table: the job's last step, named here too)
from opdcache.format.sidefiles import SIDE_FILE_OF_STORE
from opdcache.format.workers import shards_for_worker
from opdcache.inputs.fingerprint import config_fingerprint, sha256_file
from opdcache.untrusted import loads, read_json

if TYPE_CHECKING:
    import pyarrow as pa

JOB_FILE = "_opdcache_job.json"
STAGE_SETTINGS = "settings.yaml"
"""The command's resolved settings beside a table it wrote, in ``--config`` form (the flags' names): rerun the stage
with ``--config <table>/settings.yaml``. Written by the command line, never read by opdcache unless passed so."""




# ---------------------------------------------------------------- config diffs


def _flatten(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def settings_summary(diff: list[str], shown: int = 4) -> str:
    """The first ``shown`` 'name: old -> new' differences on one line, and how many more there are."""
    more = f"; and {len(diff) - shown} more" if len(diff) > shown else ""
    return "; ".join(diff[:shown]) + more


def config_diff(old: dict, new: dict) -> list[str]:
    """Readable lines naming each setting that differs: 'sampling.temperature: 0.8 -> 1.0'."""
    a, b = _flatten(old), _flatten(new)
    lines = []
    for key in sorted(set(a) | set(b)):
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            lines.append(f"{key}: {json.dumps(a.get(key, '<unset>'))} -> {json.dumps(b.get(key, '<unset>'))}")
    return lines


# ---------------------------------------------------------------- the job


@dataclass
class TableJob:
    """Fills one table of a cache, shard by shard, resumably."""

    root: storage.AnyPath  # a local directory or an object-store URL (opdcache.storage)
    table: str  # "sft", "rollouts" or "teachers/<slug>"
    kind: str
    params: S.StoreParams
    config: dict  # everything that determines the content; hashed into the fingerprint
    num_shards: int
    parent_fingerprint: str | None = None
    meta: dict = field(default_factory=dict)  # what finalize records besides shards (model, lineage, ...); not hashed
    groups: list[list[int]] | None = None  # shards computed together (dealt to workers whole); None: each on its own
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        self.root = storage.as_path(self.root)
        if self.num_shards < 1:
            raise ConfigError(f"--num-shards must be at least 1, got {self.num_shards}")
        full = {"table": self.table, "kind": self.kind, "params": self.params.to_dict(), "num_shards": self.num_shards,
                "format_version": S.version_of(self.params), **self.config}
        self.config = full
        self.fingerprint = config_fingerprint(full, self.parent_fingerprint)

    @property
    def dir(self) -> storage.AnyPath:
        return self.root / self.table

    def shard_path(self, index: int) -> storage.AnyPath:
        return self.dir / shards.shard_name(index, self.num_shards)

    def _job_record(self) -> dict:
        return {"config_fingerprint": self.fingerprint, "parent_fingerprint": self.parent_fingerprint, "config": self.config,
                "meta": self.meta}

    @classmethod
    def from_job_file(cls, root: str | os.PathLike, table: str) -> "TableJob":
        """Rebuild a running job from the record it left, e.g. to finalize after all workers are done."""
        path = storage.as_path(root) / table / JOB_FILE
        if not path.is_file():
            raise ManifestError(f"no job in progress for {table!r} under {root} ({path} is missing)")
        rec = read_json(path, str(path), ManifestError)
        cfg = dict(rec["config"])
        job = cls(storage.as_path(root), cfg.pop("table"), cfg.pop("kind"), S.StoreParams.from_dict(cfg.pop("params")),
                  {k: v for k, v in cfg.items() if k not in ("num_shards", "format_version")}, cfg["num_shards"],
                  rec["parent_fingerprint"], rec.get("meta", {}))
        if job.fingerprint != rec["config_fingerprint"]:
            raise ManifestError(f"{path} is inconsistent (its fingerprint does not match its config); rerun the job")
        return job

    def _check_recorded(self) -> bool:
        """Refuse a change against the settings the finished table or the partial run's job file records; True when a
        job file is there."""
        if M.exists(self.root):
            done = M.load(self.root)["tables"].get(self.table)
            if done is not None:
                self._refuse_if_changed(done["config"], done["config_fingerprint"], "the finished cache")
        job_file = storage.confined_write(self.root, self.dir / JOB_FILE)  # no folder of the table leads outside the cache
        if not job_file.is_file():
            return False
        old = read_json(storage.confined(self.root, job_file), str(job_file), ManifestError)
        if not isinstance(old, dict) or not isinstance(old.get("config"), dict) or not isinstance(old.get("config_fingerprint"), str):
            raise ManifestError(f"{job_file} is not a job record opdcache wrote; delete {self.dir} to start the table over")
        self._refuse_if_changed(old["config"], old["config_fingerprint"], "the partial run")
        return True

    def begin(self) -> None:
        """Record this job's settings, or check them against a partial run's; refuse a change."""
        if not self._check_recorded():
            job_file = self.dir / JOB_FILE
            self._refuse_strays()
            storage.write_text_atomic(job_file, json.dumps(self._job_record(), indent=2, sort_keys=True) + "\n")

    def _refuse_strays(self) -> None:
        """A job that has not started (no job file) starts in an empty folder: shards, records or side files already
        there were put by someone else, and are refused, never adopted; what an earlier run of the same job left (its
        fingerprint in a shard's footer or a record) is its own. (An object store lists keys under the prefix.)"""
        if (self.dir / JOB_FILE).is_file() or not self.dir.is_dir() or (M.exists(self.root) and self.table in M.load(self.root)["tables"]):
            return
        remote = storage.is_remote(self.dir)  # an object store has no links
        # a writer's temporary (another worker's, mid-write) is never read, so never adopted; a file renamed or
        # removed since the listing is another worker's finished write, looked at again when that worker's name shows
        files = sorted((p for p in self.dir.rglob("*") if not shards.is_temporary(p)
                        and (p.is_file() or (not remote and p.is_symlink()))), key=str)
        ours = {p for p in files if self._written_by_this_job(p)}
        files = [p for p in files if p in ours or p.is_file() or (not remote and p.is_symlink())]
        side = set(SIDE_FILE_OF_STORE.values()) | {STAGE_SETTINGS}
        stray = [p.relative_to(self.root).as_posix() for p in files if p not in ours and not (ours and p.name in side)]
        if stray:
            raise ResumeError(f"{self.dir} holds files no job of this table wrote ({', '.join(stray[:3])}"
                              f"{', ...' if len(stray) > 3 else ''}); refusing to adopt them. Delete {self.dir}, or "
                              f"{'score under another --name' if self.kind == 'teacher' else 'write to a new --out'}")

    def _refuse_if_changed(self, old_config: dict, old_fp: str, what: str) -> None:
        if old_fp == self.fingerprint:
            return
        diff = config_diff(old_config, self.config) or [f"parent cache fingerprint changed (now {self.parent_fingerprint})"]
        # a finished table's settings live in the manifest: deleting its folder alone would not start it afresh
        if self.kind == "teacher":
            fix = ("score under another --name" if what == "the finished cache" else f"delete {self.dir}") + " to start over"
        else:
            fix = f"write to a new --out directory (or delete {self.root})"
        raise ResumeError(f"{self.dir} holds {what} with different settings ({settings_summary(diff)}); refusing to mix them. "
                          f"Rerun with the original settings to resume, or {fix}")

    def is_done(self, index: int) -> bool:
        """Shard ``index`` is written: it is there and its footer carries this job's fingerprint. One that carries
        another's was not written by this job (nor an earlier run of it) and is refused, never adopted."""
        path = self.shard_path(index)
        if not path.is_file():
            return False
        fp = (shards.read_schema(storage.confined(self.root, path)).metadata or {}).get(S.META_CONFIG_FP, b"").decode(errors="replace")
        if fp != self.fingerprint:
            self._check_recorded()  # a rerun with other settings: the difference is the clearer message
            raise ResumeError(f"{path} was not written by this job (its config fingerprint {fp[:12]!r} is not the job's "
                              f"{self.fingerprint[:12]}...: a shard of another run); refusing to adopt it. Delete it and rerun")
        return True

    def _written_by_this_job(self, path) -> bool:
        """A shard, table record or job file of this job: an earlier run's (its job file gone: the run finished, then
        its manifest was lost) or another worker's that started meanwhile; it carries this job's config fingerprint. A
        side file beside such files is taken with them."""
        if not storage.is_remote(path) and path.is_symlink():
            return False
        try:
            if path.name == JOB_FILE:  # another worker of this job began it meanwhile (a concurrent start)
                rec = read_json(storage.confined(self.root, path), str(path), ManifestError)
                return isinstance(rec, dict) and rec.get("config_fingerprint") == self.fingerprint
            if path.name == TABLE_RECORD:
                rec = read_json(storage.confined(self.root, path), str(path), ManifestError)
                return isinstance(rec, dict) and isinstance(rec.get("entry"), dict) and rec["entry"].get("config_fingerprint") == self.fingerprint
            if M.SHARD_FILE.fullmatch(path.name):
                meta = shards.read_schema(storage.confined(self.root, path)).metadata or {}
                return meta.get(S.META_CONFIG_FP, b"").decode(errors="replace") == self.fingerprint
        except (OSError, ValueError):
            return False
        return False

    def pending(self, num_workers: int = 1, worker_index: int = 0) -> list[int]:
        self._refuse_strays()
        return [i for i in shards_for_worker(self.num_shards, num_workers, worker_index, self.groups) if not self.is_done(i)]

    def write_shard(self, index: int, records: Sequence[dict]) -> shards.ShardInfo:
        return self.write_table(index, self.build_table(records))

    def build_table(self, records: Sequence[dict]) -> pa.Table:
        """A shard's checked Arrow table (every record refused here, not in the write); Records' meta goes into the footer."""
        return shards.build_table(self.kind, self.params, records, self.fingerprint)

    def write_table(self, index: int, table: pa.Table) -> shards.ShardInfo:
        """Encode, compress and hash a built shard; it appears under its final name only when complete."""
        return shards.write_table_atomic(table, self.shard_path(index), self.root)

    def all_done(self) -> bool:
        return all(self.is_done(i) for i in range(self.num_shards))

    def shard_infos(self) -> list[dict]:
        """Re-read every shard's size and hash from disk (the manifest never trusts memory)."""
        infos = []
        for i in range(self.num_shards):
            path = storage.confined(self.root, self.shard_path(i))  # a planted link is never hashed as a shard
            meta = shards.open_parquet(path).metadata
            rows = meta.num_rows
            tokens = shards.table_tokens(shards.read_table(path, [_token_column(self.kind)]))
            infos.append(shards.ShardInfo(
                path=path.relative_to(self.root).as_posix(), rows=rows, tokens=tokens,
                bytes=path.stat().st_size, sha256=sha256_file(path),
            ).to_dict())
        return infos

    def table_entry(self, **extra) -> dict:
        if not self.all_done():
            missing = [i for i in range(self.num_shards) if not self.is_done(i)]
            raise ManifestError(f"{self.table}: shards {missing} are not written yet; run the remaining workers first")
        entry = {
            "kind": self.kind, "params": self.params.to_dict(), "config": self.config,
            "config_fingerprint": self.fingerprint, "shards": self.shard_infos(),
        }
        side = {name: {"bytes": (self.dir / name).stat().st_size, "sha256": sha256_file(self.dir / name)}
                for name in SIDE_FILE_OF_STORE.values() if (self.dir / name).is_file()}
        if side:  # hashed like shards, checked by validate
            entry["files"] = side
        if self.kind == "teacher":
            entry["fidelity"] = self.fidelity_record()
            entry.update(self.store_records())
        entry.update({k: v for k, v in extra.items() if v is not None})
        return entry

    def store_records(self) -> dict:
        """What each enabled store with a manifest record keeps in the table entry, merged from its shards' footers."""
        from opdcache.stores import REGISTRY

        out = {}
        for store in REGISTRY.values():
            if store.record is None or store.name not in self.params.stores or not store.record_when(self.params):
                continue
            metas = [shards.read_schema(self.shard_path(i)).metadata or {} for i in range(self.num_shards)]
            missing = [i for i, meta in enumerate(metas) if store.record_meta not in meta]
            if missing:
                raise ManifestError(f"{self.shard_path(missing[0])} has no {store.name} record in its footer; delete it "
                                    "and rerun the job to rewrite it")
            out[store.name] = store.record(metas, self.params)
        return out

    def fidelity_record(self) -> dict:
        """A teacher table's error against the full vocabulary (opdcache/format/fidelity.py), merged from its shards' footers."""
        from opdcache.format import fidelity

        metas = [shards.read_schema(self.shard_path(i)).metadata or {} for i in range(self.num_shards)]
        return fidelity.record_from_footers(metas, f"{self.table} shard footer", ManifestError)

    def finish(self) -> None:
        """Drop the job file (the manifest holds the finished table)."""
        job_file = self.dir / JOB_FILE
        if job_file.exists():
            job_file.unlink()


def _token_column(kind: str) -> str:
    return "logprobs" if kind == "teacher" else "response_ids"


WRITE_BEHIND = os.environ.get("OPDCACHE_WRITE_BEHIND", "1") != "0"
"""Write each shard in a background thread while the next is made (:func:`run_table_job`); ``OPDCACHE_WRITE_BEHIND=0``
writes inline (the reference the tests and the GPU suite compare against)."""


def run_table_job(
    job: TableJob,
    make_shard: Callable[[int], Sequence[dict]],
    num_workers: int = 1,
    worker_index: int = 0,
    desc: str | None = None,
    progress: bool | None = None,
    finalize: bool = False,
    rows_of: Callable[[int], int] | None = None,
) -> list[int]:
    """Write this worker's missing shards; return the indices written. With ``finalize``, the worker that finds every
    shard present writes the manifest. Progress: with ``rows_of`` (a shard's sequence count) in sequences, advanced by
    the engines batch by batch (opdcache.progress.advance); otherwise in shards.

    Each shard's records are checked and built into a table as soon as they are made (a bad record is refused at its
    own shard), then written (Parquet encoding and compression, sha256, rename or upload) in one background thread
    while the next shard is made (``WRITE_BEHIND``), so a scorer's device does not wait on the writer. At most one
    write is in flight, so memory holds one more shard's table. A shard appears under its final name only when
    complete. When making a shard fails or the job is interrupted, the shard before it still lands (the job waits for
    its write); when a write fails, the shard made meanwhile is written before that error is raised. A resume makes
    the rest."""
    from concurrent.futures import ThreadPoolExecutor

    from opdcache.progress import bar

    job.begin()
    written, tokens = [], 0
    pending = job.pending(num_workers, worker_index)
    by_rows = rows_of is not None
    total = sum(rows_of(i) for i in pending) if by_rows else len(pending)

    def landed(index: int, info: shards.ShardInfo) -> None:
        nonlocal tokens
        written.append(index)
        tokens += info.tokens
        pbar.set_postfix(shards=f"{len(written)}/{len(pending)}", tokens=f"{tokens:,}")  # response tokens written so far
        if not by_rows:
            pbar.update(1)

    # the executor is left (waiting for the write in flight) before the bar, whatever ends the loop
    with bar(total=total, desc=desc or job.table, unit="seq" if by_rows else "shard", enabled=progress, track=by_rows) as pbar, \
            ThreadPoolExecutor(1, thread_name_prefix="opdcache-write") as writer:
        in_flight = None  # (index, future) of the shard being written
        for index in pending:
            table = job.build_table(make_shard(index))
            if in_flight is not None and in_flight[1].exception() is not None:
                try:  # the write before failed: keep this shard's work if the writer still can, then raise that failure
                    landed(index, job.write_table(index, table))
                finally:
                    in_flight[1].result()
            if in_flight is not None:
                landed(in_flight[0], in_flight[1].result())
            if WRITE_BEHIND:
                in_flight = (index, writer.submit(job.write_table, index, table))
            else:
                in_flight = None
                landed(index, job.write_table(index, table))
            del table  # held by the write alone
        if in_flight is not None:
            landed(in_flight[0], in_flight[1].result())
    if finalize and job.all_done():
        finalize_table(job)
    return written


# ---------------------------------------------------------------- reading a cache


class Cache:
    """A finished cache, on a local disk or an object store: its manifest and its tables' shard paths."""

    def __init__(self, root: str | os.PathLike):
        self.root = storage.as_path(root)
        why = M.not_a_cache(self.root)
        if why is not None:
            raise NotACacheError(why)
        if not self.root.is_dir():
            raise ManifestError(f"{self.root} does not exist or is not a directory")
        self.manifest = M.load(self.root)

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def base_table(self) -> str:
        return self.kind  # "sft" or "rollouts"

    @property
    def teachers(self) -> list[str]:
        return sorted(t.split("/", 1)[1] for t in self.manifest["tables"] if t.startswith("teachers/"))

    def table(self, name: str) -> dict:
        tables = self.manifest["tables"]
        if name not in tables:
            if not name.startswith("teachers/") and f"teachers/{name}" in tables:
                return tables[f"teachers/{name}"]
            raise ManifestError(f"{self.root} has no table {name!r}; it has {', '.join(sorted(tables))}")
        return tables[name]

    def tokenizer(self):
        """The tokenizer the cache carries (read from a local copy when the cache is remote), or None without one."""
        path = self.root / "tokenizer"
        if not path.is_dir():
            return None
        from transformers import AutoTokenizer

        storage.confined_tree(self.root, path)  # no tokenizer file read through a link out of the cache
        try:  # a cache is untrusted input: never run code it carries (auto_map), and a bad folder is one line, not a traceback
            with storage.local_copy(path) as local:  # read whole: the copy of a remote cache's folder goes at the block's end
                return AutoTokenizer.from_pretrained(local, trust_remote_code=False)
        except Exception as exc:  # noqa: BLE001 (transformers raises ValueError, OSError, JSONDecodeError, TypeError...)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise ManifestError(f"{path} cannot be loaded as a tokenizer without running code from the cache "
                                f"({type(exc).__name__}: {first}); run `opdcache validate {self.root}`") from None

    def params(self, name: str) -> S.StoreParams:
        return S.StoreParams.from_dict(self.table(name)["params"])

    def shard_paths(self, name: str) -> list[storage.AnyPath]:
        return [storage.confined(self.root, self.root / s["path"]) for s in self.table(name)["shards"]]

    def side_file(self, table: str, name: str) -> storage.AnyPath:
        """A side file of a table (head.safetensors, svd.safetensors), checked against the manifest's size and sha256
        before anything loads it; refused in one line when missing, outside the cache, or changed."""
        from opdcache.errors import SchemaError

        path = storage.confined(self.root, self.root / table / name)
        want = self.table(table).get("files", {}).get(name)
        if not path.is_file():
            raise SchemaError(f"{path} is missing; run `opdcache validate {self.root}`")
        if want is not None and (path.stat().st_size != want["bytes"] or sha256_file(path) != want["sha256"]):
            raise SchemaError(f"{path} does not match the manifest's size and sha256 (truncated, corrupted or replaced); "
                              f"run `opdcache validate {self.root}`, then rescore the teacher or re-pull the cache")
        return path

    def sample_rows(self, table: str, rows: int, seed: int) -> dict[int, list[int]]:
        """{shard index: sorted row indices in it}: ``rows`` rows drawn without replacement over the whole table, a
        function of the seed and the shards' row counts (audit, plan and the svd fit draw their samples here)."""
        counts = [int(s["rows"]) for s in self.table(table)["shards"]]
        total = sum(counts)
        picks = np.sort(np.random.default_rng(seed).choice(total, size=min(rows, total), replace=False))
        starts = np.cumsum([0] + counts)
        out: dict[int, list[int]] = {}
        for g in picks.tolist():
            shard = int(np.searchsorted(starts, g, side="right") - 1)
            out.setdefault(shard, []).append(g - int(starts[shard]))
        return out

    def read_shard(self, table: str, index: int, columns=None, max_row_tokens: int | None = None):
        """Shard ``index`` of ``table`` (some columns), its footer checked against the manifest's rows and tokens before
        anything is decoded (opdcache/format/shardcheck.py, check_footer): the reading layer every command goes through."""
        info = self.table(table)["shards"][index]
        return shards.read_table(self.shard_paths(table)[index], columns, rows=info["rows"], tokens=info["tokens"],
                                 max_row_tokens=max_row_tokens, where=info["path"])

    def sequences(self, table: str, column: str) -> list[np.ndarray]:
        """A per-token column of a whole table, one array per row, in row order over the shards."""
        return [row for i in range(len(self.table(table)["shards"])) for row in shards.row_values(self.read_shard(table, i, [column])[column])]

    def teacher_table(self, slug: str | None) -> str:
        if slug is None:
            if len(self.teachers) != 1:
                raise ConfigError(f"--teacher is needed: the cache has teachers {self.teachers or 'none'}")
            slug = self.teachers[0]
        name = f"teachers/{slug}"
        if name not in self.manifest["tables"]:
            raise ConfigError(f"--teacher {slug!r} not in the cache; it has {', '.join(self.teachers) or 'no teachers'}")
        return name
