"""``opdcache info``: what a cache holds -- rows, tokens, stores, bytes per token per store, lineage."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from opdcache.format import schema as S, shards
from opdcache.format.cache import Cache
from opdcache.stores import describe as store_lines, REGISTRY


def store_bytes(cache: Cache, table: str) -> dict[str, int]:
    """Compressed bytes on disk of each store of a table, from the Parquet column-chunk sizes."""
    entry = cache.table(table)
    kind = entry["kind"]
    store_of = {c.name: c.store for c in S.columns(kind)}
    sizes: dict[str, int] = defaultdict(int)
    for path, info in zip(cache.shard_paths(table), entry["shards"]):
        shards.check_shard_footer(path, info["rows"], info["path"], info["tokens"])  # a footer lie is refused here too
        meta = shards.open_parquet(path).metadata
        for rg in range(meta.num_row_groups):
            group = meta.row_group(rg)
            for c in range(group.num_columns):
                col = group.column(c)
                sizes[store_of.get(col.path_in_schema.split(".")[0], "other")] += col.total_compressed_size
    return dict(sizes)


def _reward_mean(cache: Cache, table: str) -> float | None:
    """Mean of the ``reward`` column over the rows that have one (None when no row does)."""
    import pyarrow.compute as pc

    values = [cache.read_shard(table, i, ["reward"])["reward"] for i in range(len(cache.table(table)["shards"]))]
    count = sum(v.length() - v.null_count for v in values)
    return sum(float(pc.sum(v).as_py() or 0.0) for v in values) / count if count else None


def summary(root: str | Path) -> dict:
    cache = Cache(root)
    m = cache.manifest
    tables = {}
    for name, entry in sorted(m["tables"].items()):
        rows = sum(s["rows"] for s in entry["shards"])
        tokens = sum(s["tokens"] for s in entry["shards"])
        nbytes = sum(s["bytes"] for s in entry["shards"]) + sum(f["bytes"] for f in entry.get("files", {}).values())  # + head, svd
        per_store = store_bytes(cache, name)
        tables[name] = {
            "kind": entry["kind"], "shards": len(entry["shards"]), "rows": rows, "tokens": tokens, "bytes": nbytes,
            "stores": list(entry["params"]["stores"]),
            "bytes_per_token": {k: v / tokens for k, v in sorted(per_store.items())} if tokens else {},
            "model": (entry.get("model") or {}).get("name_or_path"),
            "model_fingerprint": (entry.get("model") or {}).get("fingerprint"),
            "engine": "/".join(str(v) for k in ("engine", "dtype", "quantization") if (v := (entry.get("model") or {}).get(k))) or None,
            "consistency": (entry.get("consistency") or {}).get("verdict"),
            "reward_mean": _reward_mean(cache, name) if "task" in entry["params"]["stores"] else None,
            "fidelity": entry.get("fidelity") if entry["kind"] == "teacher" else None,
            "samples_per_position": entry["params"].get("samples_per_position"),
            "store_notes": [note for store in entry["params"]["stores"] if store in REGISTRY
                            and (note := REGISTRY[store].info(entry["params"])) is not None] if entry["kind"] == "teacher" else [],
        }
        # what each store recorded, under its name as in the manifest (the compact top-k's distortion, the svd fit, ...)
        tables[name] |= {store: entry[store] for store in entry["params"]["stores"]
                         if store in REGISTRY and store in entry and store not in tables[name]}
    out = {
        "path": str(root), "kind": m["kind"], "format_version": m["format_version"], "opdcache_version": m["opdcache_version"],
        "created": m["created"], "tokenizer": m["tokenizer"]["fingerprint"], "lineage": m["lineage"], "tables": tables,
    }
    consumed = m["tables"].get("rollouts", {}).get("async")
    if consumed:  # an async run's cache: which snapshot sampled each shard, and how stale it was when consumed
        out["async"] = consumed
    return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render(info: dict) -> str:
    lines = [
        f"cache      {info['path']}",
        f"kind       {info['kind']} (format v{info['format_version']}, opdcache {info['opdcache_version']}, {info['created']})",
        f"tokenizer  {info['tokenizer'][:16]}",
    ]
    sft = info["lineage"].get("sft_teacher")
    if sft:
        lines.append(f"lineage    pi_ref fine-tuned on teacher {sft['fingerprint'][:16]}")
        lines += _wrap(sft["name_or_path"], indent=" " * 11)
    else:
        lines.append("lineage    pi_ref's SFT teacher unknown (no lineage recorded)")
    header = f"{'table':<30} {'shards':>6} {'rows':>10} {'tokens':>13} {'size':>11}"
    lines += ["", header, "-" * len(header)]
    for name, t in info["tables"].items():
        lines.append(f"{name:<30} {t['shards']:>6} {t['rows']:>10,} {t['tokens']:>13,} {_fmt_bytes(t['bytes']):>11}")
        bpt = ", ".join(f"{k} {v:.1f}" for k, v in t["bytes_per_token"].items())
        lines += _wrap(f"bytes/token by store (on disk, per response token): {bpt}")
        if t["model"]:
            extra = f"; consistency: {t['consistency']}" if t["consistency"] else ""
            lines += _wrap(f"model {t['model']} ({(t['model_fingerprint'] or '')[:16]}){extra}")
            if t.get("engine"):
                lines += _wrap(f"computed by {t['engine']}")
        for store in (s for s in t["stores"] if s in REGISTRY and t.get(s)):  # what each store recorded
            for line in store_lines(store, t[store]):
                lines += _wrap(line)
        if t["kind"] == "teacher":
            from opdcache.format.fidelity import describe

            lines += _wrap("against the full vocabulary (measured while scoring): " + "; ".join(describe(t.get("fidelity") or {})))
        for note in t.get("store_notes", []):
            lines += _wrap(note)
        if t.get("reward_mean") is not None:
            lines += _wrap(f"reward mean {t['reward_mean']:.3f} (over the rows that have one)")
    if "async" in info:
        lines += ["", _render_async(info["async"])]
    return "\n".join(lines)


def _wrap(text: str, width: int = 80, indent: str = "    ") -> list[str]:
    """A detail line under a table row, wrapped to the terminal's usual 80 columns (long paths are never cut)."""
    import textwrap

    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent + "  ", break_long_words=False,
                         break_on_hyphens=False) or [indent]


def _render_async(a: dict) -> str:
    """Per shard of an async run: the student snapshot (learner step) that sampled it, the learner step that consumed
    it, and the staleness between them (papers/001 App. B)."""
    k = "no refresh (Lightning)" if a["staleness"] is None else f"K = {a['staleness']}"
    lines = [f"async run: {a['steps']} steps of {a['loss']}, {k}",
             "per shard (batch): sampled by snapshot -> consumed at step (staleness)"]
    cells = [f"{s['shard']:>4}: v{s['student_version']} -> {s['consumed_at_step']} ({s['staleness']})" for s in a["shards"]]
    for i in range(0, len(cells), 4):  # four to a line: fits 80 columns
        lines.append("  " + "   ".join(f"{c:<16}" for c in cells[i: i + 4]).rstrip())
    return "\n".join(lines)
