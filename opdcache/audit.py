"""``opdcache audit``: re-compute a seeded random sample of a cache's rows with the models and the arithmetic its
manifest records, and say per column how many stored values the re-computation reproduces bit for bit.

* rollouts (and sft) tables recorded as exact (``--exact``) are *re-generated*: the same prompt, the same per-sample
  random stream, the same engine arithmetic, so the tokens, the sampling and ref log-probs, pi_ref's top-k and the MC
  draws must all come back identical. Tables from other engines are re-scored (teacher-forced, float32 transformers)
  and their ``ref_logprobs`` compared within a tolerance: their sampling cannot be replayed.
* teacher tables are re-scored on the same rollout rows with the table's own store settings and encoded as the writer
  encodes them (compact top-k, sampled ids and counts), then compared column by column.

An exact table passes only if every value matches bit for bit; any other only if every float column's max |delta|
is within ``tolerance`` and its id columns agree. Memory: one engine and the sampled rows' values (the rows are read
from their shards one shard at a time), as score-teacher for those rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from opdcache import shards
from opdcache.cache import Cache
from opdcache.errors import ConfigError

DEFINITIONS = {
    "values": "stored values compared (per-token entries; padding slots included as stored)",
    "exact": "values whose stored bits the re-computation reproduces (floats compared as their bits, NaN never equal)",
    "max_abs_delta": "largest |stored - recomputed| over the float values (0 when every one matches)",
}


@dataclass(frozen=True)
class AuditConfig:
    """What to audit and how."""

    cache: str
    """The cache: a directory or a URL (s3://...)."""
    table: str | None = None
    """One table (rollouts, sft or teachers/<name>, or a teacher's name); default every table."""
    rows: int = 16
    """Rows sampled per table (all when the table has fewer)."""
    seed: int = 0
    """Seed of the row sample."""
    model: Path | None = None
    """pi_ref (or the SFT teacher) for the rollout table, when it is not at the path the manifest records."""
    teacher: Path | None = None
    """The teacher for teacher tables, when it is not at the path the manifest records."""
    tolerance: float = 1e-4
    """Largest allowed max |delta| (nats) for tables that do not claim the exact arithmetic."""

    def __post_init__(self) -> None:
        if not isinstance(self.rows, int) or self.rows < 1:
            raise ConfigError(f"--rows must be a positive number of rows, got {self.rows}")
        if not self.tolerance >= 0:
            raise ConfigError(f"--tolerance must be >= 0, got {self.tolerance}")


def _compare(stored: list[np.ndarray], fresh: list[np.ndarray]) -> dict:
    values = exact = 0
    worst = 0.0
    for a, b in zip(stored, fresh):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:  # a different length counts every stored value as unreproduced
            values += a.size
            worst = float("inf") if a.dtype.kind == "f" else worst
            continue
        values += a.size
        if a.dtype.kind == "f":
            same = (a.view(np.uint8).reshape(a.size, -1) == b.astype(a.dtype).view(np.uint8).reshape(b.size, -1)).all(1) if a.size else np.zeros(0, bool)
            exact += int(same.sum())
            if a.size:
                d = np.abs(a.astype(np.float64) - b.astype(np.float64))
                d[np.isnan(d)] = np.inf
                worst = max(worst, float(d.max()))
        else:
            exact += int((a == b).sum())
    return {"values": values, "exact": exact, "max_abs_delta": worst}


def _model_path(record: dict, override: Path | None, flag: str, table: str) -> Path:
    from opdcache.fingerprint import model_fingerprint

    path = Path(override) if override is not None else Path(record.get("name_or_path") or "")
    if not (path / "config.json").is_file():
        raise ConfigError(f"audit of {table} needs the model {record.get('name_or_path')!r} (fingerprint {str(record.get('fingerprint'))[:12]}), "
                          f"which is not at {str(path)!r}; pass {flag} PATH")
    if record.get("fingerprint") and model_fingerprint(path) != record["fingerprint"]:
        raise ConfigError(f"{flag} {path} is not the model that wrote {table} (fingerprint {record['fingerprint'][:12]}); "
                          "pass the same weights")
    return path


def _engine(record: dict, path: Path):
    """The engine in the arithmetic the table records: the exact engine for exact tables, else float32 transformers
    (in the recorded emulated low-bit scheme, if any)."""
    from opdcache.quant import recorded_spec

    quant = recorded_spec(record.get("quantization"))
    if record.get("exact"):
        from opdcache.backends.exact import ARITHMETIC, ExactBackend

        if record["exact"].get("arithmetic") != ARITHMETIC:
            raise ConfigError(f"the cache was computed in {record['exact'].get('arithmetic')!r}, this opdcache implements {ARITHMETIC!r}; "
                              "audit it with the opdcache version that wrote it")
        return ExactBackend(path, dtype=record.get("dtype") or "float32", quantize=quant, inject=record["exact"].get("inject"))
    from opdcache.backends.hf import TransformersBackend

    emulated = quant if quant and record.get("engine") == "transformers" and not quant.startswith("int8") else None
    return TransformersBackend(path, dtype="float32", device="cpu", quantize=emulated)


ROLLOUT_COLUMNS = ("response_ids", "sampling_logprobs", "ref_logprobs", "ref_topk_ids", "ref_topk_logprobs", "mc_ids", "mc_sampling_logprobs")


def _audit_base(cache: Cache, name: str, cfg: AuditConfig) -> dict:
    from opdcache.backends.base import GenerateRequest, SamplingConfig
    from opdcache.rollouts import sample_seed
    from opdcache.scoring import score_requests

    entry = cache.table(name)
    record = entry.get("model") or {}
    path = _model_path(record, cfg.model, "--model", name)
    exact = bool(record.get("exact"))
    backend = _engine(record, path)
    stored_cols = [c for c in ROLLOUT_COLUMNS if c in shards.read_schema(cache.shard_paths(name)[0]).names]
    sampling = SamplingConfig(**entry["config"]["sampling"]) if exact else None
    stored: dict[str, list] = {c: [] for c in stored_cols}
    fresh: dict[str, list] = {c: [] for c in stored_cols}
    picks = cache.sample_rows(name, cfg.rows, cfg.seed)
    for shard, rows in picks.items():
        table = cache.read_shard(name, shard).take(rows)
        for c in stored_cols:
            stored[c] += shards.row_values(table[c])
        if exact:  # replay: same prompt, same random stream, same arithmetic
            reqs = [GenerateRequest(p, sample_seed(sampling.seed, p, k))
                    for p, k in zip(table["prompt_ids"].to_pylist(), table["sample_index"].to_pylist())]
            for gen in backend.generate(reqs, sampling):
                for c in stored_cols:
                    fresh[c].append(getattr(gen, c))
        else:  # teacher-forced: the stored tokens' temperature-1 log-probs
            for sc in backend.score(score_requests(table.select(["id", "prompt_ids", "response_ids"]))):
                fresh["ref_logprobs"].append(sc.logprobs)
    if not exact:
        stored = {"ref_logprobs": stored["ref_logprobs"]} if "ref_logprobs" in stored else {}
    columns = {c: _compare(stored[c], fresh[c]) for c in stored}
    return {"table": name, "exact_claimed": exact, "how": "re-generated" if exact else "re-scored (teacher-forced, float32 transformers)",
            "rows": sum(map(len, picks.values())), "columns": columns}


def _audit_teacher(cache: Cache, name: str, cfg: AuditConfig) -> dict:
    from opdcache.scoring import score_requests, teacher_columns, teacher_records

    entry = cache.table(name)
    record = entry.get("model") or {}
    path = _model_path(record, cfg.teacher, "--teacher", name)
    exact = bool(record.get("exact"))
    params = cache.params(name)
    backend = _engine(record, path)
    seed = int(entry["config"].get("sample_seed", 0))
    want_hidden = "hidden" in params.stores
    base = cache.base_table
    names = [c for c in shards.read_schema(cache.shard_paths(name)[0]).names if c not in ("id", "svd")]
    stored: dict[str, list] = {c: [] for c in names}
    fresh: dict[str, list] = {c: [] for c in names}
    params_no_svd = params
    if params.svd_rank:
        import dataclasses

        params_no_svd = dataclasses.replace(params, stores=tuple(s for s in params.stores if s != "svd"), svd_rank=None, svd_dtype=None)
    picks = cache.sample_rows(name, cfg.rows, cfg.seed)
    for shard, rows in picks.items():
        table = cache.read_shard(name, shard, names).take(rows)
        base_rows = cache.read_shard(base, shard, teacher_columns(params)).take(rows)
        scores = backend.score(score_requests(base_rows, params.samples_per_position, seed), top_k=params.top_k, hidden=want_hidden)
        records = teacher_records(base_rows["id"].to_pylist(), scores, params_no_svd, None, f"audit of shard {shard}")
        built = shards.build_table("teacher", params_no_svd, records)
        for c in names:
            stored[c] += shards.row_values(table[c])
            fresh[c] += shards.row_values(built[c])
    columns = {c: _compare(stored[c], fresh[c]) for c in names}
    return {"table": name, "exact_claimed": exact, "how": "re-scored with the table's store settings",
            "rows": sum(map(len, picks.values())), "columns": columns}


def audit(cfg: AuditConfig) -> dict:
    """The report: per table and column, values compared, bit-exact matches and max |delta|; ``passed`` per table."""
    cache = Cache(cfg.cache)
    tables = [cache.base_table] + [f"teachers/{t}" for t in cache.teachers]
    if cfg.table is not None:
        wanted = cfg.table if cfg.table in tables else f"teachers/{cfg.table}"
        if wanted not in tables:
            raise ConfigError(f"--table {cfg.table!r}: the cache has tables {', '.join(tables)}; name one of them")
        tables = [wanted]
    out = []
    for name in tables:
        rep = _audit_teacher(cache, name, cfg) if name.startswith("teachers/") else _audit_base(cache, name, cfg)
        if rep["exact_claimed"]:
            rep["passed"] = all(c["exact"] == c["values"] for c in rep["columns"].values())
        else:
            rep["passed"] = all(c["max_abs_delta"] <= cfg.tolerance for c in rep["columns"].values())
        rep["tolerance"] = None if rep["exact_claimed"] else cfg.tolerance
        out.append(rep)
    return {"cache": str(cfg.cache), "seed": cfg.seed, "tables": out, "definitions": DEFINITIONS,
            "passed": all(t["passed"] for t in out)}


def render(report: dict) -> str:
    lines = []
    for t in report["tables"]:
        claim = "exact (bit for bit)" if t["exact_claimed"] else f"tolerance {t['tolerance']:g} nats"
        lines.append(f"{t['table']}: {t['rows']} rows {t['how']}; claims {claim}: {'PASS' if t['passed'] else 'FAIL'}")
        lines.append(f"  {'column':<22} {'values':>9} {'exact':>9} {'max |delta|':>12}")
        for name, c in t["columns"].items():
            lines.append(f"  {name:<22} {c['values']:>9,} {c['exact']:>9,} {c['max_abs_delta']:>12.3g}")
    return "\n".join(lines)
