"""Table records and finalize: how a finished table reaches the manifest, and which records may.

Each finished table's manifest entry is first written beside its shards (``<table>/_table.json``); every finalize
merges the records it may into ``opdcache.json``. A record is merged when it is well formed, names the folder it lies
in, and is this job's own or a table the manifest lacks whose shards carry the record's fingerprint in their footers
(a concurrent finalize's); a table the manifest already holds is never replaced by another job's record, so a planted
``_table.json`` cannot change or replace a table, nor add one beside shards its job did not write.
"""

from __future__ import annotations

import json
import sys
from opdcache import storage
from opdcache.errors import ManifestError
from opdcache.format import manifest as M, schema as S, shards
from opdcache.stores import REGISTRY
from opdcache.untrusted import read_json

TABLE_RECORD = "_table.json"
"""Each finished table's manifest entry, beside its shards: finalize merges every table's record into opdcache.json."""


def _record_problem(root, table_dir, rec) -> str | None:
    """Why a table record file is not one a finalize may merge, or None: it must be ``{"table": <its own folder>,
    "entry": {...}}`` with the entry's params, config fingerprint and shard list of the right types."""
    own = table_dir.relative_to(root).as_posix() if not storage.is_remote(table_dir) else table_dir.path.removeprefix(root.path).strip("/")
    if not isinstance(rec, dict) or not isinstance(rec.get("entry"), dict):
        return "not a table record (a JSON object with table and entry)"
    if rec.get("table") != own:
        return f"its table is {str(rec.get('table'))[:80]!r}, not {own!r}, the folder it lies in"
    entry = rec["entry"]
    if not isinstance(entry.get("params"), dict) or not isinstance(entry.get("config_fingerprint"), str) \
            or not isinstance(entry.get("shards"), list):
        return "its entry lacks params, config_fingerprint or shards"
    try:
        S.StoreParams.from_dict(entry["params"])
    except (TypeError, ValueError, KeyError) as exc:
        return f"its params are not a store's ({str(exc)[:120]})"
    return None


def _unwritten(root, table: str, entry: dict) -> str | None:
    """Why a record's shards are not a table its job wrote (one missing, outside the folder, or whose footer carries
    another fingerprint than the entry's), or None. Footers only: a concurrent finalize's table passes, a record
    planted beside nothing, or beside other shards, does not."""
    for info in entry["shards"]:
        rel = info.get("path") if isinstance(info, dict) else None
        if not isinstance(rel, str) or rel.rsplit("/", 1)[0] != table or not M.SHARD_FILE.fullmatch(rel.rsplit("/", 1)[-1]):
            return "its shard list names no shard of the cache"
        path = root / rel
        if not path.is_file():
            return f"its shard {rel[:120]} is missing (a record planted beside shards no job wrote)"
        fp = (shards.read_schema(storage.confined(root, path)).metadata or {}).get(S.META_CONFIG_FP, b"")
        if fp.decode(errors="replace") != entry["config_fingerprint"]:
            return f"its shard {rel[:120]} was written by another job (its fingerprint is not the record's)"
    return None


def _table_records(root, own: str | None = None, tables: dict | None = None) -> tuple[dict[str, dict], list[str]]:
    """({table: entry} of every record a finalize merges, [what was ignored, and why]). A record is merged when it is
    well formed, names the folder it lies in, and is either this job's (``own``) or a table the manifest lacks whose
    shards are there with the record's fingerprint in their footers (a concurrent finalize's). A table the
    manifest already holds is never replaced by another job's record, and a stray record (no running job) is never
    merged: a planted ``_table.json`` cannot change or replace a table, nor add one beside shards its job did not write."""
    tables = tables or {}
    records, ignored = {}, []
    dirs = [root / "sft", root / "rollouts"] + (sorted((root / "teachers").iterdir()) if (root / "teachers").is_dir() else [])
    for table_dir in dirs:
        path = table_dir / TABLE_RECORD
        if not path.is_file():
            continue
        rec = read_json(storage.confined(root, path), str(path), ManifestError)
        problem = _record_problem(root, table_dir, rec)
        if problem is None and rec["table"] != own:
            if rec["table"] in tables:
                continue  # finished before: the manifest's entry stands (the record in its own folder is never read again)
            problem = _unwritten(root, rec["table"], rec["entry"])
        if problem is not None:
            ignored.append(f"{path}: {problem}")
            continue
        records[rec["table"]] = rec["entry"]
    return records, ignored


def stray_records(root, tables: dict) -> list[str]:
    """Record files a finalize would not merge, and records of tables the manifest lacks, each with why (validate names
    them)."""
    records, ignored = _table_records(root, None, tables)
    return ignored + [f"{root / t / TABLE_RECORD}: its table is not in the manifest" for t in records if t not in tables]


def finalize_table(job, tokenizer: dict | None = None, lineage: dict | None = None, **entry_extra) -> dict:
    """Add the finished table of ``job`` (opdcache/format/cache.py's TableJob) to the manifest (creating it for a base
    table): card first, manifest last.

    ``tokenizer`` and ``lineage`` are needed when the manifest does not exist yet (the base table); they and
    the table's extra entries default to what the job recorded in ``job.meta``.
    Safe to call from every worker: it refuses until all shards exist, and rewriting gives the same content.

    Concurrent finalizes of different tables (two score-teacher jobs on one cache) lose nothing, on a local disk or an
    object store alike, without a lock: each writes its table's entry to ``<table>/_table.json`` first, then merges
    every table record it finds into the manifest, writes it, and lists the records again; if one appeared that its
    manifest lacks, it merges and writes again. The last manifest written was written after its writer's final
    listing, and any record written after that listing is merged by its own writer later still, so the last manifest
    holds every table. (Object stores have no rename-based lock and s3fs no portable conditional put; this needs
    neither.)
    """
    from opdcache.format import card

    tokenizer = tokenizer or job.meta.get("tokenizer")
    lineage = lineage or job.meta.get("lineage")
    entry_extra = {k: v for k, v in job.meta.items() if k not in ("tokenizer", "lineage")} | entry_extra
    for store in (REGISTRY[name] for name in job.params.stores if name in REGISTRY):  # a job rebuilt from its job file
        side = job.dir / store.side_file if store.side_file else None      # (finalize, a Ray driver): its side files' records
        if side is not None and store.name not in entry_extra and side.is_file():
            record = store.side_record(side)
            if record is not None:
                entry_extra[store.name] = record
    if job.kind == "teacher" and not M.exists(job.root):
        raise ManifestError(f"{job.root} has no manifest: score a finished rollouts or sft cache")
    storage.write_text_atomic(storage.confined_write(job.root, job.dir / TABLE_RECORD), json.dumps({"table": job.table, "entry": job.table_entry(**entry_extra)},
                                                                 indent=2, sort_keys=True) + "\n")
    for _ in range(100):
        if M.exists(job.root):
            manifest = M.load(job.root)
        else:
            manifest = M.new_manifest(job.kind, dict(tokenizer or {}), lineage)
            if storage.folder_complete(job.root / "tokenizer"):  # hashed, so validate notices a damaged tokenizer folder
                manifest["tokenizer"]["files"] = storage.folder_hashes(job.root / "tokenizer")
        records, ignored = _table_records(job.root, job.table, manifest["tables"])
        manifest["tables"].update(records)
        for entry in records.values():  # the newest format version any table uses
            manifest["format_version"] = max(manifest["format_version"], S.version_of(S.StoreParams.from_dict(entry["params"])))
        card.write(job.root, manifest)
        M.save(job.root, manifest)
        if all(manifest["tables"].get(t) == e for t, e in _table_records(job.root, job.table, manifest["tables"])[0].items()):
            break
    for line in ignored:
        print(f"finalize: not merged: {line}", file=sys.stderr)
    job.finish()
    return manifest
