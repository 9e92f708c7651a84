"""``opdcache audit``: re-compute a seeded random sample of a cache's rows with the models and the arithmetic its
manifest records, and say per column how many stored values the re-computation reproduces bit for bit.

* rollouts (and sft) tables recorded as exact (``--exact``) are *re-generated*: the same prompt, the same per-sample
  random stream, the same engine arithmetic, so the tokens, the sampling and ref log-probs, pi_ref's top-k and the MC
  draws must all come back identical. Tables from other engines are re-scored (teacher-forced, by the transformers
  engine in the table's recorded dtype) and their ``ref_logprobs`` compared within a tolerance: their sampling cannot
  be replayed.
* teacher tables are re-scored on the same rollout rows with the table's own store settings, in its recorded dtype
  (or the exact arithmetic), and encoded as the writer encodes them (compact top-k, sampled ids and counts), then
  compared column by column.

An exact table passes only if every value matches bit for bit. Any other table was computed in an arithmetic whose
last bits depend on the batch it was computed in, so it passes when each float column's max |delta| is within that
column's tolerance, which follows from the dtype (:func:`tolerance_for`): the largest of ``--tolerance``, a few units
of the dtype's rounding, and 4x the spread the re-computation itself shows between two batchings of the same rows
(all sampled rows together, each row alone). Id columns report the share of ids that differ (near-ties reorder under
another batching) and do not decide the verdict. Memory: one engine and the sampled rows' values, twice (the rows are
read from their shards one shard at a time), as score-teacher for those rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from opdcache.backends import engine_for_table, make_backend
from opdcache.errors import ConfigError
from opdcache.format import shards
from opdcache.format.cache import Cache
from opdcache.inputs.lineage import recorded_model

DEFINITIONS = {
    "values": "stored values compared (per-token entries; padding slots included as stored)",
    "exact": "values whose stored bits the re-computation reproduces (floats compared as their bits, NaN never equal)",
    "max_abs_delta": "largest |stored - recomputed| over the float values (0 when every one matches)",
    "differing": "id columns: values whose stored id differs from the recomputed one (share in differing_share)",
    "spread": "float columns of non-exact tables: largest |delta| between two re-computations of the same rows in two "
              "batchings (all sampled rows together, each row alone): the arithmetic's own batch-to-batch variation",
    "tolerance": "float columns of non-exact tables: the largest max |delta| that passes (see reasoning)",
    "smallest_detectable": "the smallest change of one stored value the verdict is sure to see, in the columns' units (nats "
                           "for log-probs): 0 (any) when the values came back bit for bit, else the largest tolerance",
    "replay": "teacher tables: the sampled values re-scored with their whole shards in the batching each shard's footer "
              "records, compared bit for bit (values, exact, per column)",
}
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
ROUNDING_UNITS = 8  # the tolerance floor: this many units of the dtype's rounding (nats, or the stored value's units)
SPREAD_FACTOR = 4  # the table's own batching is a third, unseen one: allow this multiple of the measured spread
REPLAY_AGREEMENT = 0.99
"""A replay of a shard's recorded batching that reproduces at least this share of the sampled values' bits runs this
machine's arithmetic as the writer ran it: every other value was changed after it was written. Below it (another CPU's
kernels, another torch), the values are judged within the tolerance instead, and the report says what that cannot see."""


def tolerance_for(dtype: str, spread: float, floor: float) -> float:
    """A column's tolerance for a table computed in ``dtype``: max(``floor``, ROUNDING_UNITS x the dtype's unit
    roundoff, SPREAD_FACTOR x the measured ``spread``). float32 keeps ``floor`` (1e-4 by default) unless its own
    spread is larger; a bfloat16 table gets at least 8 x 2^-8 = 0.031."""
    measured = SPREAD_FACTOR * spread if np.isfinite(spread) else 0.0  # no re-computation may widen it without bound
    return max(floor, ROUNDING_UNITS * UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF["float32"]), measured)


@dataclass(frozen=True)
class AuditConfig:
    """What to audit and how."""

    cache: str
    """The cache: a directory or a URL (s3://...)."""
    table: str | None = None
    """One table (rollouts, sft or teachers/<name>, or a teacher's name); default every table."""
    rows: int | str = 16
    """Rows sampled per table (all when the table has fewer), or "all"."""
    seed: int = 0
    """Seed of the row sample."""
    model: Path | None = None
    """pi_ref (or the SFT teacher) for the rollout table, when it is not at the path the manifest records."""
    teacher: Path | None = None
    """The teacher for teacher tables, when it is not at the path the manifest records."""
    tolerance: float = 1e-4
    """Largest allowed max |delta| (nats) for tables that do not claim the exact arithmetic."""
    device: str = "auto"
    """Where tables not computed with --exact are re-computed: auto (a CUDA GPU when there is one), cpu, cuda, cuda:N.
    An exact table is re-computed where its arithmetic runs (the CPU's, or a CUDA GPU's)."""
    replay: bool = True
    """Teacher tables a batch-dependent engine wrote: re-score each shard holding a sampled row whole, in the batching
    its footer records (token budget, threads), so the sampled values come back bit for bit and any change is seen;
    False: only the sampled rows, judged within the tolerance."""
    server: object = None
    """Teacher tables: an ``EngineConfig`` of the served engine (``--server-url``) to re-score them through, serving
    the recorded teacher (its identity is checked as score-teacher checks it); default: the in-process reference."""

    def __post_init__(self) -> None:
        rows = self.rows
        if isinstance(rows, str) and rows.strip().isdigit():
            rows = int(rows)
        if rows != "all" and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 1):
            raise ConfigError(f"--rows must be a positive number of rows or all, got {self.rows}")
        object.__setattr__(self, "rows", rows)
        if not self.tolerance >= 0:
            raise ConfigError(f"--tolerance must be >= 0, got {self.tolerance}")
        if self.server is not None and self.table in ("rollouts", "sft"):
            raise ConfigError(f"--server-url re-scores teacher tables; the {self.table} table is re-computed in-process: "
                              "drop --server-url, or pass --table with a teacher table")


def _compare(stored: list[np.ndarray], fresh: list[np.ndarray]) -> dict:
    values = exact = 0
    worst = 0.0
    is_float = False
    for a, b in zip(stored, fresh):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:  # a different length counts every stored value as unreproduced
            values += a.size
            worst = float("inf") if a.dtype.kind == "f" else worst
            continue
        values += a.size
        is_float = is_float or a.dtype.kind == "f"
        if a.dtype.kind == "f":
            same = (a.view(np.uint8).reshape(a.size, -1) == b.astype(a.dtype).view(np.uint8).reshape(b.size, -1)).all(1) if a.size else np.zeros(0, bool)
            exact += int(same.sum())
            if a.size:
                x, y = a.astype(np.float64), b.astype(np.float64)
                with np.errstate(invalid="ignore"):  # equal values (padding's -inf on both sides) differ by 0
                    d = np.where(x == y, 0.0, np.abs(x - y))
                d[np.isnan(d)] = np.inf
                worst = max(worst, float(d.max()))
        else:
            exact += int((a == b).sum())
    out = {"values": values, "exact": exact, "max_abs_delta": worst}
    if not is_float:
        out["differing"] = values - exact
        out["differing_share"] = (values - exact) / values if values else 0.0
    return out


def _spread(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Largest |a - b| over two re-computations of the same values (shapes differ only if a row's length does)."""
    worst = 0.0
    for x, y in zip(a, b):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.shape != y.shape:
            return float("inf")
        if x.size:
            with np.errstate(invalid="ignore"):
                d = np.where(x == y, 0.0, np.abs(x - y))
            d[np.isnan(d)] = np.inf
            worst = max(worst, float(d.max()))
    return worst


def _where(backend) -> str:
    """The device an engine computes on, as the report names it."""
    return str(getattr(backend, "device", "cpu"))


def _recorded_dtype(record: dict) -> str:
    dtype = str(record.get("dtype") or "float32").replace("torch.", "")
    return dtype if dtype in UNIT_ROUNDOFF else "float32"


def _rows_wanted(cache: Cache, name: str, rows: int | str) -> int:
    return sum(int(s["rows"]) for s in cache.table(name)["shards"]) if rows == "all" else rows


ROLLOUT_COLUMNS = ("response_ids", "sampling_logprobs", "ref_logprobs", "ref_topk_ids", "ref_topk_logprobs", "mc_ids", "mc_sampling_logprobs")


def _judge(rep: dict, dtype: str, floor: float, spreads: dict[str, float]) -> dict:
    """Each float column's tolerance and the table's verdict (see the module docstring)."""
    if rep["exact_claimed"]:
        rep["passed"] = all(c["exact"] == c["values"] for c in rep["columns"].values())
        rep["reasoning"] = "computed in the exact arithmetic: every value must come back bit for bit"
        return rep
    for name, col in rep["columns"].items():
        if "differing" in col:
            continue
        col["spread"] = spreads.get(name, 0.0)
        col["tolerance"] = tolerance_for(dtype, col["spread"], floor)
    rep["passed"] = all(c["max_abs_delta"] <= c["tolerance"] for c in rep["columns"].values() if "tolerance" in c)
    rep["smallest_detectable"] = max((c["tolerance"] for c in rep["columns"].values() if "tolerance" in c), default=0.0)
    rep["reasoning"] = (f"computed in {dtype}, whose last bits depend on the batch: a float column passes within "
                        f"max(--tolerance {floor:g}, {ROUNDING_UNITS} x {dtype}'s unit roundoff {UNIT_ROUNDOFF[dtype]:.3g}, "
                        f"{SPREAD_FACTOR} x its spread between two batchings of these rows); ids are counted, not judged")
    return rep


def _recorded_engine(cache: Cache, name: str, given, flag: str, device: str):
    """(table entry, its model record, whether exact, its dtype, the engine that re-computes it in that arithmetic, the
    model's path) for table ``name``, the model being ``given`` (``flag``'s value) or the one the record names."""
    entry = cache.table(name)
    record = entry.get("model") or {}
    path = recorded_model(record, given, flag, f"the {name} table")
    dtype = _recorded_dtype(record)
    return entry, record, bool(record.get("exact")), dtype, engine_for_table(record, path, name, device=device, dtype=dtype), path


def _audit_base(cache: Cache, name: str, cfg: AuditConfig) -> dict:
    from opdcache.backends.base import GenerateRequest, SamplingConfig
    from opdcache.teacher.rollouts import sample_seed
    from opdcache.teacher.scoring import score_requests

    entry, record, exact, dtype, backend, _ = _recorded_engine(cache, name, cfg.model, "--model", cfg.device)
    replay = not exact and record.get("engine") == "transformers" and hasattr(backend, "replay")
    stored_cols = [c for c in ROLLOUT_COLUMNS if c in shards.read_schema(cache.shard_paths(name)[0]).names]
    sampling = SamplingConfig(**entry["config"]["sampling"]) if exact else None
    stored: dict[str, list] = {c: [] for c in stored_cols}
    fresh: dict[str, list] = {c: [] for c in stored_cols}
    alone: list[np.ndarray] = []
    picks = cache.sample_rows(name, _rows_wanted(cache, name, cfg.rows), cfg.seed)
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
        elif replay:  # our engine wrote them while decoding: the stored tokens fed through that same path, batched and alone
            reqs = [GenerateRequest(p, 0) for p in table["prompt_ids"].to_pylist()]
            responses = shards.row_values(table["response_ids"])
            fresh["ref_logprobs"] += [g.ref_logprobs for g in backend.replay(reqs, responses)]
            alone += [backend.replay([r], [x])[0].ref_logprobs for r, x in zip(reqs, responses)]
        else:  # another engine's: the stored tokens' temperature-1 log-probs by a full forward, batched and each row alone
            reqs = score_requests(table.select(["id", "prompt_ids", "response_ids"]))
            fresh["ref_logprobs"] += [sc.logprobs for sc in backend.score(reqs)]
            alone += [backend.score([r])[0].logprobs for r in reqs]
    if not exact:
        stored = {"ref_logprobs": stored["ref_logprobs"]} if "ref_logprobs" in stored else {}
    columns = {c: _compare(stored[c], fresh[c]) for c in stored}
    how = ("re-generated in the exact arithmetic" if exact else
           f"replayed through the transformers engine's generation path (its tokens fed back, KV cache) in {dtype} on {_where(backend)}" if replay else
           f"re-scored (teacher-forced, full forward) by the transformers engine in {dtype} on {_where(backend)}")
    rep = {"table": name, "exact_claimed": exact, "dtype": dtype, "how": how, "rows": sum(map(len, picks.values())), "columns": columns}
    return _judge(rep, dtype, cfg.tolerance, {} if exact else {"ref_logprobs": _spread(fresh["ref_logprobs"], alone)})


def _served_engine(cache: Cache, name: str, cfg: AuditConfig):
    """(entry, record, exact, dtype, the served engine, path) for re-scoring teacher table ``name`` through
    ``cfg.server``; the table's stores must be ones the server computes (refused in one line, before any request)."""
    from opdcache import stores as store_registry
    from opdcache.backends import describe_statistic

    entry = cache.table(name)
    record = entry.get("model") or {}
    path = recorded_model(record, cfg.teacher, "--teacher", f"the {name} table")
    params = cache.params(name)
    for store in params.stores:
        missing = cfg.server.capabilities.missing(store_registry.REGISTRY[store].needs) if store in store_registry.REGISTRY else []
        if missing:
            raise ConfigError(f"the {name} table holds the {store} store, made from {describe_statistic(missing[0])}, which a "
                              "served engine does not return: audit it without --server-url (in-process)")
    return entry, record, False, _recorded_dtype(record), make_backend(path, cfg.server), path


def _recorded_batching(cache: Cache, name: str, shard: int) -> dict | None:
    """The batching a teacher shard's footer records (untrusted: two bounded integers, else None)."""
    import json
    import os

    from opdcache.teacher.scoring import BATCHING_META

    raw = (shards.read_schema(cache.shard_paths(name)[shard]).metadata or {}).get(BATCHING_META)
    if raw is None or len(raw) > 256:
        return None
    try:
        found = json.loads(raw)
    except ValueError:
        return None
    ok = isinstance(found, dict) and set(found) == {"max_batch_tokens", "threads"} and all(
        isinstance(v, int) and not isinstance(v, bool) for v in found.values())
    # threads beyond this machine's cores cannot be the writer's here (and are not started for an untrusted number): such
    # a shard is not replayed, and its values are judged within the tolerance
    cores = os.cpu_count() or 1
    return found if ok and 1 <= found["max_batch_tokens"] <= 1 << 24 and 1 <= found["threads"] <= cores else None


def _judge_replay(rep: dict, replayed: dict[str, dict]) -> dict:
    """The verdict from a replay of the recorded batching (see :data:`REPLAY_AGREEMENT`), over the judged verdict."""
    values = sum(c["values"] for c in replayed.values())
    exact = sum(c["exact"] for c in replayed.values())
    share = exact / values if values else 1.0
    rep["replay"] = {"values": values, "exact": exact, "columns": replayed}
    if share < REPLAY_AGREEMENT:
        rep["reasoning"] += (f"; a replay of the recorded batching reproduced {share:.1%} of the bits here (another machine's "
                             "kernels or torch): judged within the tolerance")
        return rep
    rep["passed"] = exact == values
    rep["smallest_detectable"] = 0.0
    rep["how"] += ", replaying each sampled row's shard in its recorded batching"
    rep["reasoning"] = (f"computed in {rep['dtype']}, whose last bits depend on the batch: replayed each sampled row's shard in "
                        f"the batching it was written with, and {exact:,} of {values:,} values "
                        "come back bit for bit" + ("; any change of a value is seen" if rep["passed"] else
                                                   f"; {values - exact:,} {'value differs' if values - exact == 1 else 'values differ'} "
                                                   "from the bits this machine reproduces for the rest: changed after it was written"))
    return rep


def _audit_teacher(cache: Cache, name: str, cfg: AuditConfig) -> dict:
    import dataclasses

    from opdcache.backends.base import ScoreRequest
    from opdcache.stores import needing_hidden, REGISTRY
    from opdcache.teacher.scoring import score_requests, teacher_columns, teacher_records

    if cfg.server is not None:
        entry, record, exact, dtype, backend, path = _served_engine(cache, name, cfg)
    else:
        entry, record, exact, dtype, backend, path = _recorded_engine(cache, name, cfg.teacher, "--teacher", cfg.device)
    params = cache.params(name)
    seed = int(entry["config"].get("sample_seed", 0))
    # a store whose values come from a fit over the whole table (the svd projection) is left out of the comparison
    unscored = {c.name for st in REGISTRY.values() if st.name in params.stores and not st.rescored for c in st.columns}
    params_rescored = dataclasses.replace(params, stores=tuple(s for s in params.stores if s not in REGISTRY or REGISTRY[s].rescored))
    want_hidden = needing_hidden(params_rescored.stores)
    base = cache.base_table
    names = [c for c in shards.read_schema(cache.shard_paths(name)[0]).names if c != "id" and c not in unscored]
    stored: dict[str, list] = {c: [] for c in names}
    fresh: dict[str, list] = {c: [] for c in names}
    alone: dict[str, list] = {c: [] for c in names}

    aligned = not params.same_tokenizer  # a teacher with its own tokenizer: its own tokens, stored in the table
    if aligned:
        from opdcache.teacher import crossteacher
        from opdcache.teacher.alignment import RowAlignment, TokenText, Unaligned, align_response
        from opdcache.inputs.models import load_tokenizer

        # the response's alignment is computed afresh from pi_ref's ids; the teacher's prompt ids (its chat template on
        # the prompts file, which the cache does not hold) and the skip reasons are taken as stored, not compared
        names = [c for c in names if c not in ("align_skip", "teacher_prompt_ids")]
        student_tt, teacher_tt = TokenText.from_hf(cache.tokenizer()), TokenText.from_hf(load_tokenizer(path))
        student_of = crossteacher.same_bytes(student_tt, teacher_tt)

    def rescore(base_rows, reqs, scores, where):
        if aligned:
            lengths = [len(r) for r in shards.row_values(base_rows["response_ids"])]
            records = crossteacher.records(base_rows["id"].to_pylist(), lengths, rows_aligned, scores, None, where,
                                           student_of, params.top_k)
        else:
            records = teacher_records(base_rows["id"].to_pylist(), scores, params_rescored, None, where)
        return shards.build_table("teacher", params_rescored, records)

    picks = cache.sample_rows(name, _rows_wanted(cache, name, cfg.rows), cfg.seed)
    replays = {}
    if cfg.replay and not exact and not aligned and cfg.server is None and hasattr(backend, "replaying"):
        replays = {shard: b for shard in picks if (b := _recorded_batching(cache, name, shard)) is not None}
    replayed: dict[str, list] = {c: [] for c in names}
    for shard, rows in picks.items():
        table = cache.read_shard(name, shard, names).take(rows)
        if shard in replays:  # the whole shard, as its writer scored it: its sampled rows' bits come back
            whole = cache.read_shard(base, shard, teacher_columns(params))
            every = score_requests(whole, params.samples_per_position, seed)
            with backend.replaying(replays[shard]):
                scores = backend.score(every, top_k=params.top_k, hidden=want_hidden, hidden_dtype=params.hidden_dtype)
            built = rescore(whole, every, scores, f"audit of shard {shard}").take(rows)
            for c in names:
                replayed[c] += shards.row_values(built[c])
        base_rows = whole.take(rows) if shard in replays else cache.read_shard(
            base, shard, teacher_columns(params) + (["response_ids"] if aligned else [])).take(rows)
        if aligned:
            stored_rows = cache.read_shard(name, shard, ["teacher_prompt_ids", "align_skip"]).take(rows)
            rows_aligned = [(align_response(student_tt, teacher_tt, response.tolist()) if len(prompt) else Unaligned("stored", skip),
                             prompt.tolist())
                            for response, prompt, skip in zip(shards.row_values(base_rows["response_ids"]),
                                                              shards.row_values(stored_rows["teacher_prompt_ids"]),
                                                              stored_rows["align_skip"].to_pylist())]
            reqs = [ScoreRequest(prompt, row.teacher_ids.tolist(), None, None, None) for row, prompt in rows_aligned
                    if isinstance(row, RowAlignment)]
        else:
            reqs = score_requests(base_rows, params.samples_per_position, seed)
        built = rescore(base_rows, reqs, backend.score(reqs, top_k=params.top_k, hidden=want_hidden), f"audit of shard {shard}")
        for c in names:
            stored[c] += shards.row_values(table[c])
            fresh[c] += shards.row_values(built[c])
        if not exact:
            one = [backend.score([r], top_k=params.top_k, hidden=want_hidden)[0] for r in reqs]
            built = rescore(base_rows, reqs, one, f"audit of shard {shard}")
            for c in names:
                alone[c] += shards.row_values(built[c])
    columns = {c: _compare(stored[c], fresh[c]) for c in names}
    if cfg.server is not None:
        how = f"re-scored through the served engine given (--server-url; {backend.version})"
    else:
        how = "re-scored in the exact arithmetic" if exact else f"re-scored by the transformers engine in {dtype} on {_where(backend)}"
    how = how + \
        ", with the table's store settings and encodings" + (" (pi_ref's text aligned to the teacher's tokens afresh)" if aligned else "")
    rep = {"table": name, "exact_claimed": exact, "dtype": dtype, "how": how, "rows": sum(map(len, picks.values())), "columns": columns}
    spreads = {} if exact else {c: _spread(fresh[c], alone[c]) for c in names if "differing" not in columns[c]}
    rep = _judge(rep, dtype, cfg.tolerance, spreads)
    if replays and len(replays) == len(picks):
        rep = _judge_replay(rep, {c: _compare(stored[c], replayed[c]) for c in names})
    elif not exact:
        rep["reasoning"] += "; " + ("not replayed (--no-replay)" if not cfg.replay else
                                    "some sampled shards record no batching to replay" if replays else
                                    "no batching recorded to replay (an engine whose batching is not a setting, or an older table)")
    return rep


def audit(cfg: AuditConfig) -> dict:
    """The report: per table and column, values compared, bit-exact matches and max |delta| (float columns: their
    spread and tolerance; id columns: how many differ); ``passed`` and its reasoning per table."""
    from opdcache.backends.loading import resolve_device

    resolve_device(cfg.device)  # a device this machine lacks is refused before any model loads
    cache = Cache(cfg.cache)
    tables = [cache.base_table] + [f"teachers/{t}" for t in cache.teachers]
    if cfg.table is not None:
        wanted = cfg.table if cfg.table in tables else f"teachers/{cfg.table}"
        if wanted not in tables:
            raise ConfigError(f"--table {cfg.table!r}: the cache has tables {', '.join(tables)}; name one of them")
        tables = [wanted]
    out = [_audit_teacher(cache, name, cfg) if name.startswith("teachers/") else _audit_base(cache, name, cfg) for name in tables]
    return {"cache": str(cfg.cache), "seed": cfg.seed, "tables": out, "definitions": DEFINITIONS,
            "passed": all(t["passed"] for t in out)}


def render(report: dict) -> str:
    lines = []
    for t in report["tables"]:
        verdict = "PASS" if t["passed"] else "FAIL"
        if t["passed"] and t.get("smallest_detectable"):
            verdict = f"PASS within tolerance (a change under {t['smallest_detectable']:.3g} in one value cannot be seen)"
        lines.append(f"{t['table']}: {t['rows']} rows {t['how']}: {verdict}")
        lines.append(f"  {t['reasoning']}")
        lines.append(f"  {'column':<22} {'values':>9} {'exact':>9} {'max |delta|':>12} {'tolerance':>10}  ids differing")
        for name, c in t["columns"].items():
            tol = f"{c['tolerance']:>10.3g}" if "tolerance" in c else f"{'-':>10}"
            ids = f"  {c['differing']:,} ({c['differing_share']:.1%})" if "differing" in c else ""
            delta = f"{c['max_abs_delta']:>12.3g}" if "differing" not in c else f"{'-':>12}"
            lines.append(f"  {name:<22} {c['values']:>9,} {c['exact']:>9,} {delta} {tol}{ids}")
    return "\n".join(lines)
