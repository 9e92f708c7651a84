"""The manifest ``opdcache.json``: what a cache holds and what produced it.

Written last, atomically: its presence means every table it lists is complete. Adding a teacher
to a cache rewrites it (atomically) with one more table. Its JSON Schema is built here and frozen in
``schemas/manifest-v1.schema.json``; a test compares the two.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import re
from pathlib import Path

import jsonschema

from opdcache import __version__
from opdcache.errors import ManifestError, NotACacheError
from opdcache.format import schema as S
from opdcache.inputs.fingerprint import canonical_json
from opdcache.storage import write_text_atomic
from opdcache.untrusted import quote

MANIFEST_NAME = "opdcache.json"

_SHA = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
_MODEL = {
    "type": "object",
    "required": ["name_or_path", "fingerprint"],
    "properties": {
        "name_or_path": {"type": "string"},
        "revision": {"type": ["string", "null"]},
        "fingerprint": _SHA,
        "dtype": {"type": ["string", "null"]},
        "quantization": {"type": ["string", "null"]},
        "engine": {"type": ["string", "null"]},
        "engine_version": {"type": ["string", "null"]},
        "logprobs_mode": {"type": ["string", "null"]},
    },
}
_SERVED = {
    "type": "object",
    "description": "the server a served engine used (never a URL or a key): its kind (vllm, sglang), version, the name "
                   "it served the model under, its max_logprobs, the log-prob mode its answers were checked to have",
    "required": ["kind"],
    "properties": {"kind": {"type": "string"}, "version": {"type": ["string", "null"]},
                   "served_name": {"type": ["string", "null"]}, "max_logprobs": {"type": ["integer", "null"]},
                   "logprobs_mode": {"type": ["string", "null"]}, "max_model_len": {"type": ["integer", "null"]},
                   "replicas": {"type": "integer"}},
}
_SHARD = {
    "type": "object",
    "required": ["path", "rows", "tokens", "bytes", "sha256"],
    "additionalProperties": False,
    "properties": {
        "path": {"type": "string"},
        "rows": {"type": "integer", "minimum": 0},
        "tokens": {"type": "integer", "minimum": 0},
        "bytes": {"type": "integer", "minimum": 0},
        "sha256": _SHA,
    },
}
_FILE = {
    "type": "object",
    "required": ["bytes", "sha256"],
    "properties": {"bytes": {"type": "integer", "minimum": 0}, "sha256": _SHA},
}
_TABLE = {
    "type": "object",
    "required": ["kind", "params", "config", "config_fingerprint", "shards"],
    "properties": {
        "kind": {"enum": list(S.TABLE_KINDS)},
        "params": {"type": "object"},
        "config": {"type": "object"},
        "config_fingerprint": _SHA,
        "model": _MODEL,
        "shards": {"type": "array", "items": _SHARD},
        "files": {"type": "object", "additionalProperties": _FILE},
        "consistency": {"type": "object"},
        "stats": {"type": "object"},
    },
}


_ASYNC = {
    "type": "object",
    "description": "an async run's rollouts (opdcache async): per shard, the student snapshot that sampled it and the staleness at which the learner consumed it",
    "required": ["staleness", "steps", "shards"],
    "properties": {
        "staleness": {"type": ["integer", "null"]}, "steps": {"type": "integer"}, "batch_size": {"type": "integer"}, "loss": {"type": "string"},
        "shards": {"type": "array", "items": {"type": "object", "required": ["shard", "student_version", "consumed_at_step", "staleness"]}},
    },
}


def _table(version: int) -> dict:
    from opdcache.stores import REGISTRY

    props = dict(_TABLE["properties"])
    if version >= 2:
        props["async"] = _ASYNC
    for name, store in REGISTRY.items():  # what a table entry keeps under a store's name (the svd fit, the compact top-k, ...)
        record = store.record_schema(version)
        if record is not None:
            props[name] = record
    if version >= 7:  # a table scored or sampled through a running server records what served it
        props["model"] = {**_MODEL, "properties": {**_MODEL["properties"], "served": _SERVED}}
    return {**_TABLE, "properties": props}


def json_schema(version: int = S.FORMAT_VERSION) -> dict:
    """JSON Schema (draft 2020-12) of the manifest of format ``version`` (they differ only in that number)."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"opdcache manifest (opdcache.json), format v{version}",
        "type": "object",
        "required": ["format", "format_version", "kind", "opdcache_version", "created", "tokenizer", "tables", "lineage"],
        "properties": {
            "format": {"const": S.FORMAT_NAME},
            "format_version": {"const": version},
            "kind": {"enum": ["sft", "rollouts"]},
            "opdcache_version": {"type": "string"},
            "created": {"type": "string"},
            "tokenizer": {
                "type": "object",
                "required": ["fingerprint"],
                "properties": {"fingerprint": _SHA, "name_or_path": {"type": "string"}, "chat_template_sha256": {"type": ["string", "null"]}},
            },
            "tables": {"type": "object", "additionalProperties": _table(version), "minProperties": 1},
            "lineage": {
                "type": "object",
                "description": "sft_teacher: the teacher pi_ref was fine-tuned on (papers/000 teacher consistency); parent: the fingerprint of the cache this one was built from",
                "properties": {"sft_teacher": {"oneOf": [{"type": "null"}, _MODEL]}, "parent_fingerprint": {"type": ["string", "null"]}},
            },
        },
    }


def new_manifest(kind: str, tokenizer: dict, lineage: dict | None = None) -> dict:
    return {
        "format": S.FORMAT_NAME,
        "format_version": 1,  # raised by finalize to the newest version a table uses (schema.version_of)
        "kind": kind,
        "opdcache_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "tokenizer": tokenizer,
        "tables": {},
        "lineage": lineage or {"sft_teacher": None, "parent_fingerprint": None},
    }


TABLE_NAME = re.compile(r"(sft|rollouts|teachers/[A-Za-z0-9][A-Za-z0-9._-]*)")
SHARD_FILE = re.compile(r"part-\d{5,}-of-\d{5,}\.parquet")


def _check_paths(manifest: dict, where: str) -> None:
    """Every path the manifest names stays inside the cache: a table name is ``sft``, ``rollouts`` or ``teachers/<slug>``
    and a shard is ``<table>/part-<i>-of-<n>.parquet`` (no absolute path, no ``..``, no other folder). A cache is
    untrusted input: a reader must never be sent outside it (symlinks are refused where a file is opened:
    opdcache.storage.confined)."""
    for name, entry in manifest["tables"].items():
        if not TABLE_NAME.fullmatch(name) or ".." in name:
            raise ManifestError(f"{where}: table name {name!r} is not sft, rollouts or teachers/<name>; refusing a manifest "
                                "that points outside its cache")
        for i, shard in enumerate(entry["shards"]):
            rel = shard["path"]
            if rel.rsplit("/", 1)[0] != name or not SHARD_FILE.fullmatch(rel.rsplit("/", 1)[-1]):
                raise ManifestError(f"{where}: tables/{name}/shards/{i}: path {rel!r} is not {name}/part-<i>-of-<n>.parquet; "
                                    "refusing a manifest that points outside its table")


INTEGER_SETTINGS = ("vocab_size", "num_shards", "hidden_size", "mc_samples", "ref_top_k", "top_k", "svd_rank",
                    "generate_batch_size", "max_new_tokens", "samples", "seed", "format_version")  # in params and config
RANGES = {"temperature": (0.0, 1e6), "top_p": (0.0, 1.0), "vocab_size": (1, 1 << 31)}  # inclusive bounds of a setting


def _check_numbers(manifest: dict, where: str) -> None:
    """Numbers a reader acts on are typed: counts are integers (JSON Schema's "integer" also admits 16.0), settings
    finite and in range (json reads NaN and Infinity). One line naming the field."""
    def refuse(path: str, value, why: str):
        raise ManifestError(f"{where}: {path}: {quote(value)} {why}; the manifest is damaged or was not written by opdcache "
                            "(rebuild the cache)")

    def settings(tree, path: str):
        if isinstance(tree, dict):
            for key, value in tree.items():
                here = f"{path}/{key}"
                if key in INTEGER_SETTINGS and value is not None and (type(value) is not int):
                    refuse(here, value, "is not an integer")
                if key in RANGES and value is not None:
                    lo, hi = RANGES[key]
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
                        refuse(here, value, f"is not a number in [{lo:g}, {hi:g}]")
                settings(value, here)
        elif isinstance(tree, list):
            for i, value in enumerate(tree):
                settings(value, f"{path}/{i}")
        elif isinstance(tree, float) and not math.isfinite(tree):
            refuse(path, tree, "is not a finite number")

    for name, entry in manifest["tables"].items():
        for i, shard in enumerate(entry["shards"]):
            for key in ("rows", "tokens", "bytes"):
                if type(shard[key]) is not int:
                    refuse(f"tables/{name}/shards/{i}/{key}", shard[key], "is not an integer")
        for rel, info in (entry.get("files") or {}).items():
            if type(info["bytes"]) is not int:
                refuse(f"tables/{name}/files/{rel}/bytes", info["bytes"], "is not an integer")
        for part in ("params", "config"):
            settings(entry.get(part), f"tables/{name}/{part}")
        stores = entry["params"].get("stores")
        if not (isinstance(stores, list) and all(isinstance(s, str) for s in stores) and len(set(stores)) == len(stores)):
            refuse(f"tables/{name}/params/stores", stores, "is not a list of distinct store names")


def check(manifest: dict, where: str = MANIFEST_NAME) -> dict:
    if not isinstance(manifest, dict) or manifest.get("format") != S.FORMAT_NAME:
        raise ManifestError(f"{where}: not an opdcache manifest (no \"format\": \"{S.FORMAT_NAME}\")")
    version = manifest.get("format_version")
    if version not in S.READABLE_VERSIONS:
        raise ManifestError(
            f"{where}: format version {quote(version)}, this opdcache {__version__} reads versions "
            f"{', '.join(map(str, S.READABLE_VERSIONS))}; install the opdcache version that wrote it, or rebuild the cache"
        )
    exc = jsonschema.exceptions.best_match(_validator(version).iter_errors(manifest))  # the error jsonschema.validate would raise
    if exc is not None:
        path = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
        raise ManifestError(f"{where}: {quote(path)}: {quote(exc.message, 400)}")
    _check_paths(manifest, where)
    _check_numbers(manifest, where)
    _check_records(manifest, where)
    return manifest


def _check_records(manifest: dict, where: str) -> None:
    """The model record's parts that commands branch on have their types: ``model`` an object, ``model.exact`` absent,
    false or an object whose ``arithmetic`` is a name (the frozen schemas leave the record open)."""
    for name, entry in manifest["tables"].items():
        _check_fidelity(entry.get("fidelity"), f"{where}: tables/{name}/fidelity")
        model = entry.get("model")
        if model is None:
            continue
        if not isinstance(model, dict):
            raise ManifestError(f"{where}: tables/{name}/model is {quote(model, 80)}, not an object; the manifest is damaged")
        exact = model.get("exact")
        if exact in (None, False):
            continue
        if not isinstance(exact, dict) or not isinstance(exact.get("arithmetic"), str):
            raise ManifestError(f"{where}: tables/{name}/model/exact is {quote(exact, 80)}, not a record naming its arithmetic; "
                                "the manifest is damaged (run `opdcache validate`, or re-pull the cache)")


@functools.cache
def _validator(version: int = S.FORMAT_VERSION):
    """The manifest validator, built once per version (``jsonschema.validate`` re-checks the schema at every call)."""
    schema = json_schema(version)
    return jsonschema.validators.validator_for(schema)(schema)


def manifest_path(root):
    """The manifest's path under a local or object-store root (opdcache.storage)."""
    from opdcache.storage import as_path

    return as_path(root) / MANIFEST_NAME


def exists(root: str | Path) -> bool:
    return manifest_path(root).is_file()


def not_a_cache(root) -> str | None:
    """Why the local path ``root`` is not a cache at all (no such folder, a file, a model directory, an empty folder),
    or None where it may be one (a cache, or one being built). Object-store roots: None."""
    from opdcache.storage import is_remote

    if is_remote(root) or "://" in str(root):
        return None
    p = Path(root)
    if not p.exists():
        return f"{root}: no such directory (a cache is a folder holding {MANIFEST_NAME})"
    if not p.is_dir():
        return f"{root} is a file, not a cache (a cache is a folder holding {MANIFEST_NAME})"
    if (p / MANIFEST_NAME).exists():
        return None
    if (p / "config.json").is_file():
        return f"{root} is a model directory (config.json), not an opdcache cache; build a cache from it with `opdcache build-rollouts`"
    if not any(p.iterdir()):
        return f"{root} is an empty folder, not an opdcache cache"
    return None


def load(root: str | Path) -> dict:
    path = manifest_path(root)
    if not path.is_file():
        why = not_a_cache(root)
        if why is not None:
            raise NotACacheError(why)
        raise ManifestError(
            f"{root} has no {MANIFEST_NAME}: the cache is incomplete (a job is still running or was stopped; "
            "rerun it to resume) or this is not an opdcache cache"
        )
    from opdcache.storage import as_path, confined
    from opdcache.untrusted import read_json

    confined(as_path(root), path)
    return check(read_json(path, str(path), ManifestError), str(path))


def save(root: str | Path, manifest: dict) -> None:
    from opdcache.storage import as_path, confined_write

    check(manifest)
    write_text_atomic(confined_write(as_path(root), manifest_path(root)), json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def content_view(manifest: dict) -> str:
    """The manifest without its creation time: equal for caches with equal content."""
    return canonical_json({k: v for k, v in manifest.items() if k != "created"})


def _check_fidelity(record, where: str) -> None:
    """A teacher table's fidelity record, where present: an object; each measured quantity an object of finite numbers
    (mean, max) and an integer count (positions), as opdcache/format/fidelity.py writes it."""
    import math

    if record is None:
        return
    if not isinstance(record, dict):
        raise ManifestError(f"{where} is {quote(record, 80)}, not an object; the manifest is damaged (run `opdcache validate`)")
    for key, value in record.items():
        if key in ("measured", "reason"):
            continue
        ok = isinstance(value, dict) and all(isinstance(value.get(k), (int, float)) and not isinstance(value.get(k), bool)
                                             and math.isfinite(value[k]) for k in ("mean", "max")) \
            and isinstance(value.get("positions"), int) and not isinstance(value.get("positions"), bool) \
            and isinstance(value.get("means"), str)
        if not ok:
            raise ManifestError(f"{where}/{key} is {quote(value, 80)}, not a measured quantity (mean, max, positions, means); "
                                "the manifest is damaged (run `opdcache validate`)")
