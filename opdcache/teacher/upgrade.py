"""``opdcache upgrade``: an exact (v1) top-k teacher table re-encoded as a v3 compact one, without the teacher.

Why a new table and not an in-place rewrite: every v1 and v2 table already reads, validates and trains unchanged
under v3 (a reader understands every version it lists), so there is nothing to rewrite for compatibility; what v3
adds is a compact top-k, which is lossy. Rewriting in place would silently replace exact values with rounded ones,
and a crash between shards would leave a table of two encodings. So ``upgrade`` writes ``teachers/<name>`` beside the
source with the source's logprob and topk stores (its hidden, svd and other stores stay in the source), shard by
shard (each shard atomic, the job resumable like every other), records the distortion against the exact values as
score-teacher does, and never touches the source; delete the source once the new table serves you.

The tail column is computed from the source's float32 log-probs in float64, exactly as score-teacher computes it.
Memory: one source shard's columns.
"""

from __future__ import annotations

import re

from opdcache.errors import ConfigError
from opdcache.format import schema as S, shards
from opdcache.format.cache import Cache, run_table_job, TableJob


def run_upgrade(cache_root, teacher: str | None, topk_precision: str | None, topk_mass: float | None, name: str | None = None,
                progress: bool | None = None) -> dict:
    """Re-encode the teacher table ``teacher`` (default: the only one) as ``teachers/<name>``: {"source", "table",
    "written", "records" (what the new table's stores recorded, by store), "describe" (those records as lines)}."""
    from opdcache.backends.base import Scores, STATISTICS
    from opdcache.stores import always, describe, REGISTRY

    options = {"topk_precision": topk_precision, "topk_mass": topk_mass}
    cache = Cache(cache_root)
    source = cache.teacher_table(teacher)
    entry, params = cache.table(source), cache.params(source)
    names = [n for n, st in REGISTRY.items() if st.reencode is not None]
    chosen = [n for n in params.stores if n in names]
    if not chosen:
        raise ConfigError(f"{source} has no {' or '.join(names)} store: nothing to compact (score-teacher --store {names[0]})")
    fields = {}
    for n in chosen:
        fields.update(REGISTRY[n].reencode(params, options, source))
    slug = name or f"{source.split('/', 1)[1]}-compact"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", slug):
        raise ConfigError(f"--name must be letters, digits, '.', '_' or '-', got {slug!r}")
    kept = always() + tuple(chosen)
    new_params = S.StoreParams(stores=kept, ref_top_k=params.ref_top_k, mc_samples=params.mc_samples, **fields)
    columns = [c.name for c in S.columns("teacher", params) if c.store in ("base",) + kept]  # the exact source's
    config = {k: v for k, v in entry["config"].items() if k not in ("table", "kind", "params", "num_shards", "format_version")}
    config["upgraded_from"] = {"table": source, "config_fingerprint": entry["config_fingerprint"]}
    meta = {k: entry[k] for k in ("model", "consistency", "compute") if k in entry}
    job = TableJob(cache.root, f"teachers/{slug}", "teacher", new_params, config, len(entry["shards"]),
                   parent_fingerprint=cache.table(cache.base_table)["config_fingerprint"], meta=meta)

    def make_shard(index: int) -> shards.Records:
        from opdcache.format import fidelity
        from opdcache.teacher.scoring import teacher_records

        table = cache.read_shard(source, index, columns)
        values = {c: shards.row_values(table[c]) for c in columns if c in STATISTICS}  # its columns, as statistics
        scores = [Scores(**{c: v[i] for c, v in values.items()}) for i in range(table.num_rows)]
        records = teacher_records(table["id"].to_pylist(), scores, new_params, None, f"shard {index}")
        records.meta[fidelity.META] = fidelity.unmeasured("re-encoded by opdcache upgrade without the teacher's full distribution; "
                                                         "score-teacher records it")
        return records

    written = run_table_job(job, make_shard, desc=f"upgrade {source} -> teachers/{slug}", progress=progress, finalize=True)
    new_entry = Cache(cache.root).table(f"teachers/{slug}")
    records = {n: new_entry[n] for n in kept if n in new_entry}
    return {"source": source, "table": f"teachers/{slug}", "written": written, "records": records,
            "describe": [line for n, record in records.items() for line in describe(n, record)]}
