"""``opdcache export``: a cache in flat formats any trainer can read.

* ``jsonl``: one JSON object per rollout (``<out>/rollouts.jsonl``);
* ``parquet-flat``: the same rows as plain Parquet, one file per shard (``<out>/part-XXXXX-of-XXXXX.parquet``);
* ``lightning-opd``: the layout the Lightning OPD release's slime fork trains from (its
  ``data_curation/prepare_lightning_opd.py`` writes it; ``slime/rollout/sglang_rollout.py`` reads it): per row a
  ``prompt`` string (the chat-templated prompt, which the reader re-encodes with ``tokenizer.encode(prompt,
  add_special_tokens=False)``), ``label`` ``"0"``, and ``metadata`` {``is_lightning_opd``: true, ``response_tokens``:
  the cached ids, used as they are; ``loss_mask``: all ones (the reader asserts its length is the response length);
  ``response``: the decoded text; ``teacher_log_probs``: the cached teacher ``logprobs``; with ``ref_logprobs=True``
  also ``student_log_probs``: the cached ``ref_logprobs`` (pi_ref at temperature 1), which the reader passes on as
  rollout log-probs for the importance weight pi_theta / pi_ref}. A row whose decoded prompt does not re-encode to
  exactly the cached prompt ids is refused and counted: training on it would feed other ids than were scored.

Each row holds the rollout's columns (ids, token ids, ``finish_reason``, ``sampling_logprobs``, ``ref_logprobs``,
``reward``, ``answer``), its prompt and response decoded with the cache's own tokenizer beside the ids (the ids
stay the truth: text is for reading, never for re-tokenising), and one teacher's per-token columns prefixed
``teacher_`` (``logprobs``, ``logsumexp`` and, when stored, ``topk_ids`` / ``topk_logprobs``, a compact top-k's
``topk_tail``, the sampled store's ``sampled_ids`` / ``sampled_counts`` / ``sampled_logprobs``, and any
other store's columns it declares flat: opdcache/stores/). v3 values are
decoded to plain numbers: float16 log-probs to floats, and padding slots (id -1) dropped, so each position lists
only its entries. Hidden and svd
states are not exported (kilobytes per token; read them from the cache). Shards are converted one at a time, each
written to a temporary name and renamed: memory is one shard, and a killed export leaves no partial file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from opdcache import storage
from opdcache.errors import ConfigError, SchemaError
from opdcache.format import schema as S, shards
from opdcache.format.cache import Cache
from opdcache.stores import REGISTRY

FORMATS = ("jsonl", "parquet-flat", "lightning-opd")
ROLLOUT_COLUMNS = ("id", "prompt_index", "sample_index", "prompt_ids", "response_ids", "finish_reason", "sampling_logprobs",
                   "ref_logprobs", "reward", "answer")
TEACHER_COLUMNS = tuple(c.name for store in REGISTRY.values() for c in store.columns if store.flat is None or c.name in store.flat)
"""The teacher columns flat exports carry: each store's ``flat`` columns (opdcache/stores/)."""


def export(cache_root: str | Path, to: str, out: str | Path, teacher: str | None = None, ref_logprobs: bool = False) -> dict:
    """Write the cache's rows in format ``to`` under ``out``; return what was written."""
    if to not in FORMATS:
        raise ConfigError(f"--to must be one of {', '.join(FORMATS)}, got {to!r}")

    cache = Cache(cache_root)
    out = Path(out)
    if not storage.is_remote(cache.root) and out.resolve().is_relative_to(Path(cache.root).resolve()):
        raise ConfigError(f"--out {out} is inside the cache {cache_root}: an export there would overwrite or mix with the "
                          "cache's own files; give a directory outside it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} is not empty (an earlier export?): a reader of *.parquet or *.jsonl there would mix two "
                          "exports; give a new or empty directory")
    base = cache.base_table
    table = cache.teacher_table(teacher) if (teacher or cache.teachers) else None
    if to == "lightning-opd" and table is not None and not cache.params(table).same_tokenizer:
        raise ConfigError(f"{table} is a teacher with its own tokenizer: its log-probs are per group of tokens, and the "
                          "lightning-opd layout holds one per token; export --to jsonl or parquet-flat (they carry "
                          "span_tokens, which marks the groups)")
    tokenizer = cache.tokenizer()
    if tokenizer is None:
        raise ConfigError(f"{cache_root} carries no tokenizer folder; rebuild it with this opdcache version")
    out.mkdir(parents=True, exist_ok=True)
    rollout_paths = cache.shard_paths(base)
    teacher_paths = cache.shard_paths(table) if table else [None] * len(rollout_paths)
    if to == "lightning-opd" and table is None:
        raise ConfigError(f"{cache_root} has no teacher scores: lightning-opd needs teacher log-probs (run `opdcache score-teacher`)")
    rows_written, refused, files = 0, 0, []
    jsonl_tmp = out / f".rollouts.jsonl.tmp-{os.getpid()}"
    sink = open(jsonl_tmp, "w") if to == "jsonl" else None
    try:
        for i, (rpath, tpath) in enumerate(zip(rollout_paths, teacher_paths)):
            rows = _rows(cache, base, table, i, tokenizer)
            if to == "lightning-opd":
                rows, bad = _lightning_opd_rows(rows, tokenizer, ref_logprobs)
                refused += bad
            rows_written += len(rows)
            if sink is not None:
                for j, row in enumerate(rows):
                    sink.write(_json_line(row, f"{rollout_paths[i]} row {j}", cache_root) + "\n")
            else:
                import pyarrow as pa

                path = out / shards.shard_name(i, len(rollout_paths))
                schema = LIGHTNING_OPD_SCHEMA if to == "lightning-opd" else None
                shards.write_table_atomic(pa.Table.from_pylist(rows, schema=schema), path, out)
                files.append(path)
    finally:
        if sink is not None:
            sink.close()
    if sink is not None:
        final = out / "rollouts.jsonl"
        jsonl_tmp.replace(final)
        files.append(final)
    # what the flat formats leave out, said rather than silently dropped (the cache itself keeps everything)
    present = {c for path in rollout_paths[:1] for c in shards.open_parquet(path).schema_arrow.names}
    if table:
        present |= {f"teacher_{c}" for path in teacher_paths[:1] for c in shards.open_parquet(path).schema_arrow.names}
    kept = set(ROLLOUT_COLUMNS) | {f"teacher_{c}" for c in TEACHER_COLUMNS} | {"teacher_id"}
    left_out = sorted(present - kept)
    return {"rows": rows_written, "refused": refused, "files": [str(f) for f in files], "teacher": table, "left_out": left_out}


def _lightning_opd_schema():
    import pyarrow as pa

    return pa.schema([("prompt", pa.string()), ("label", pa.string()), ("metadata", pa.struct([
        ("is_lightning_opd", pa.bool_()), ("response_tokens", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())),
        ("response", pa.string()), ("teacher_log_probs", pa.list_(pa.float64())), ("student_log_probs", pa.list_(pa.float64())),
        ("opdcache_id", pa.string()),  # the cache row's id: the release's reader ignores it; a refused row's absence can be joined
    ]))])


LIGHTNING_OPD_SCHEMA = _lightning_opd_schema()


def _lightning_opd_rows(rows: list[dict], tokenizer, ref_logprobs: bool) -> tuple[list[dict], int]:
    """Rows in the release's layout; those whose prompt text does not re-encode to the cached ids are dropped (counted)."""
    out, refused = [], 0
    for row in rows:
        prompt = tokenizer.decode(row["prompt_ids"], skip_special_tokens=False)
        if tokenizer.encode(prompt, add_special_tokens=False) != list(row["prompt_ids"]):
            refused += 1
            continue
        n = len(row["response_ids"])
        out.append({"prompt": prompt, "label": "0", "metadata": {
            "is_lightning_opd": True, "response_tokens": list(row["response_ids"]), "loss_mask": [1] * n,
            "response": tokenizer.decode(row["response_ids"], skip_special_tokens=True),
            "teacher_log_probs": [float(x) for x in row["teacher_logprobs"]],
            "student_log_probs": [float(x) for x in row["ref_logprobs"]] if ref_logprobs and row.get("ref_logprobs") is not None else None,
            "opdcache_id": row["id"],
        }})
    return out, refused


def _plain(trow: dict, coded: dict) -> dict:
    """A v3/v4 teacher row's values as plain numbers: the ``coded`` columns (name -> field) decoded to float32 log-probs
    (float16 bits, prob14 codes), padding slots (id -1) dropped, so each position lists only its entries (ragged). v1
    rows pass through unchanged."""
    import numpy as np

    from opdcache.stores.compact import decode_logprobs

    for name, field in coded.items():
        trow[name] = [decode_logprobs(np.asarray(v, np.uint16), field).tolist() for v in trow[name]]
    for ids_name, partners in S.PADDED_BY.items():
        if ids_name not in trow or not any(i == S.PAD_ID for pos in trow[ids_name] for i in pos):
            continue
        keep = [[j for j, i in enumerate(pos) if i != S.PAD_ID] for pos in trow[ids_name]]
        for name in (ids_name,) + partners:
            trow[name] = [[pos[j] for j in kept] for pos, kept in zip(trow[name], keep)]
    return trow


def _rows(cache, base: str, table: str | None, index: int, tokenizer) -> list[dict]:
    """Shard ``index``'s rows, teacher columns beside the rollout columns; refused unless the teacher rows are the
    rollout rows (same ids) and every per-token teacher column is as long as its row's response, as train refuses."""
    r = cache.read_shard(base, index)
    rows = r.select([c for c in ROLLOUT_COLUMNS if c in r.column_names]).to_pylist()
    if table is not None:
        t = cache.read_shard(table, index)
        where = cache.table(table)["shards"][index]["path"]
        if t["id"].to_pylist() != [row["id"] for row in rows]:
            raise SchemaError(f"{where} is not row-aligned with the rollout rows (ids differ); run `opdcache validate`")
        lengths = np.diff(shards.list_offsets(r["response_ids"]))
        for name in TEACHER_COLUMNS:
            if name in t.column_names and pa.types.is_list(t.schema.field(name).type) and not np.array_equal(np.diff(shards.list_offsets(t[name])), lengths):
                raise SchemaError(f"{where}: teacher column {name} is not as long as the responses (shifted or truncated rows); "
                                  "run `opdcache validate` and rebuild that shard")
        cols = [c for c in TEACHER_COLUMNS if c in t.column_names]
        coded = {c: t.schema.field(c) for c in cols if (t.schema.field(c).metadata or {}).get(S.FIELD_DTYPE) in (b"float16", b"prob14")}
        for row, trow in zip(rows, t.select(cols).to_pylist()):
            row.update({f"teacher_{k}": v for k, v in _plain(trow, coded).items()})
    for row in rows:
        row["prompt_text"] = tokenizer.decode(row["prompt_ids"])
        row["response_text"] = tokenizer.decode(row["response_ids"])
    return rows


def _json_line(row: dict, where: str, cache_root) -> str:
    """One JSON line of a row; a value JSON cannot carry (NaN, infinity: only a cache that breaks its rules holds one)
    is refused, naming the row and column, never written as non-JSON ``NaN``."""
    try:
        return json.dumps(row, allow_nan=False)
    except ValueError:
        bad = next((k for k, v in row.items() if "NaN" in json.dumps(v) or "Infinity" in json.dumps(v)), "?")
        raise SchemaError(f"{where}: column {bad} holds a NaN or infinite value, which JSON cannot carry (a cache "
                          f"that breaks its rules); run `opdcache validate {cache_root}`") from None
