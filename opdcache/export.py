"""``opdcache export``: a cache in flat formats any trainer can read.

* ``jsonl``: one JSON object per rollout (``<out>/rollouts.jsonl``);
* ``parquet-flat``: the same rows as plain Parquet, one file per shard (``<out>/part-XXXXX-of-XXXXX.parquet``).

Each row holds the rollout's columns (ids, token ids, ``finish_reason``, ``sampling_logprobs``, ``ref_logprobs``,
``reward``, ``answer``), its prompt and response decoded with the cache's own tokenizer beside the ids (the ids
stay the truth: text is for reading, never for re-tokenising), and one teacher's per-token columns prefixed
``teacher_`` (``logprobs``, ``logsumexp`` and, when stored, ``topk_ids`` / ``topk_logprobs``). Hidden and svd
states are not exported (kilobytes per token; read them from the cache). Shards are converted one at a time, each
written to a temporary name and renamed: memory is one shard, and a killed export leaves no partial file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from opdcache import shards
from opdcache.cache import Cache
from opdcache.errors import ConfigError

FORMATS = ("jsonl", "parquet-flat")
ROLLOUT_COLUMNS = ("id", "prompt_index", "sample_index", "prompt_ids", "response_ids", "finish_reason", "sampling_logprobs",
                   "ref_logprobs", "reward", "answer")
TEACHER_COLUMNS = ("logprobs", "logsumexp", "topk_ids", "topk_logprobs")


def export(cache_root: str | Path, to: str, out: str | Path, teacher: str | None = None) -> dict:
    """Write the cache's rows in format ``to`` under ``out``; return what was written."""
    if to not in FORMATS:
        raise ConfigError(f"--to must be one of {', '.join(FORMATS)}, got {to!r}")
    from transformers import AutoTokenizer

    cache = Cache(cache_root)
    base = cache.base_table
    table = cache.teacher_table(teacher) if (teacher or cache.teachers) else None
    tokenizer = AutoTokenizer.from_pretrained(cache.root / "tokenizer")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rollout_paths = cache.shard_paths(base)
    teacher_paths = cache.shard_paths(table) if table else [None] * len(rollout_paths)
    rows_written, files = 0, []
    jsonl_tmp = out / f".rollouts.jsonl.tmp-{os.getpid()}"
    sink = open(jsonl_tmp, "w") if to == "jsonl" else None
    try:
        for i, (rpath, tpath) in enumerate(zip(rollout_paths, teacher_paths)):
            rows = _rows(rpath, tpath, tokenizer)
            rows_written += len(rows)
            if sink is not None:
                for row in rows:
                    sink.write(json.dumps(row) + "\n")
            else:
                import pyarrow as pa

                path = out / shards.shard_name(i, len(rollout_paths))
                shards.write_table_atomic(pa.Table.from_pylist(rows), path, out)
                files.append(path)
    finally:
        if sink is not None:
            sink.close()
    if sink is not None:
        final = out / "rollouts.jsonl"
        jsonl_tmp.replace(final)
        files.append(final)
    return {"rows": rows_written, "files": [str(f) for f in files], "teacher": table}


def _rows(rollout_path: Path, teacher_path: Path | None, tokenizer) -> list[dict]:
    r = shards.read_table(rollout_path)
    rows = r.select([c for c in ROLLOUT_COLUMNS if c in r.column_names]).to_pylist()
    if teacher_path is not None:
        t = shards.read_table(teacher_path)
        if t["id"].to_pylist() != [row["id"] for row in rows]:
            raise ConfigError(f"{teacher_path} is not row-aligned with {rollout_path}; run `opdcache validate`")
        cols = [c for c in TEACHER_COLUMNS if c in t.column_names]
        for row, trow in zip(rows, t.select(cols).to_pylist()):
            row.update({f"teacher_{k}": v for k, v in trow.items()})
    for row in rows:
        row["prompt_text"] = tokenizer.decode(row["prompt_ids"])
        row["response_text"] = tokenizer.decode(row["response_ids"])
    return rows
