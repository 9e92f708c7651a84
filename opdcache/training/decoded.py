"""One shard of a cache as the loader trains on it: its bytes checked against the manifest (:func:`verify_shard`), then
read, checked row by row against the model and the stores' rules, and decoded into flat numpy columns with row offsets
(:class:`DecodedShard`), which the padded and packed collations slice (opdcache/training/data.py,
opdcache/training/packing.py). Memory: the shard's decoded columns (an object-store shard's bytes too, while decoded).
"""

from __future__ import annotations

import numpy as np

from opdcache import storage
from opdcache.format import shards
from opdcache.stores import REGISTRY, rowrules, signal_columns
from opdcache.stores.base import FIELD_DTYPE


def verify_shard(path, entry: dict, root):
    """Refuse a shard whose size or sha256 differs from the manifest's (truncated, replaced or corrupted).

    Returns what to decode: the local path, or, for an object-store shard, the bytes fetched for the hash (so the
    shard is downloaded once, not once to hash and once to decode)."""
    import hashlib

    from opdcache.errors import SchemaError
    from opdcache.inputs.fingerprint import sha256_file

    if not path.is_file():
        raise SchemaError(f"{path} is listed in the manifest but missing; run `opdcache validate {root}`")
    if storage.is_remote(path):
        data = path.read_bytes()
        good = len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"]
    else:
        data = path
        good = path.stat().st_size == entry["bytes"] and sha256_file(path) == entry["sha256"]
    if not good:
        raise SchemaError(f"{path} does not match the manifest's size and sha256 (corrupted or replaced); "
                          f"run `opdcache validate {root}` and rebuild or re-pull that shard")
    return data


class DecodedShard:
    """One shard's columns as flat numpy arrays plus row offsets (decoded once, sliced per row).

    What it trains on is checked first: teacher rows aligned with the rollout rows by id, every per-token column as
    long as its row's response, and (with ``max_length``) every prompt + response within the model's context; a
    violation is one line naming the shard and `opdcache validate`, never a misaligned or oversized batch."""

    def __init__(self, rollout_path, teacher_path, rollout_cols: list[str], teacher_cols: list[str], where: str = "this shard",
                 max_length: int | None = None, rows: int | None = None, vocab: int | None = None, params: dict | None = None,
                 tokens: int | None = None, more: tuple = (), route: tuple[str, tuple[str, ...]] | None = None,
                 teacher_where: dict[str, str] | None = None):
        """Each source: a local path, an object-store path, or a shard's bytes already fetched (opdcache.format.shards.read_table).
        ``rows``: the manifest's row count (the footer must agree, and sizes are checked before decoding); ``vocab``: ids
        must lie in [0, vocab); ``params``: the teacher table's recorded store parameters, for the rules each store declares
        (opdcache/stores/: the sampled store's m, ...). The row rules are validate's. ``more``: further teachers, (prefix,
        source, columns, params) each; ``route``: (metadata field, teacher names) for ``row_teacher``;
        ``teacher_where``: each teacher's shard as messages name it, by column prefix (default: ``where``)."""
        from opdcache.errors import SchemaError

        def refuse(what: str, shard: str = where):
            raise SchemaError(f"{shard}: {what}; run `opdcache validate` on the cache and rebuild that shard")

        teacher_where = teacher_where or {}

        r = shards.read_table(rollout_path, list(dict.fromkeys(["id"] + rollout_cols + (["metadata"] if route else []))),
                              rows=rows, max_row_tokens=max_length, where=where, tokens=tokens)
        self.offsets = shards.list_offsets(r["response_ids"])
        self.prompt_offsets = shards.list_offsets(r["prompt_ids"])
        lengths = np.diff(self.offsets)
        empty = rowrules.empty_prompts(self.prompt_offsets)
        if len(empty):
            refuse(f"row {int(empty[0])}, column prompt_ids: {rowrules.EMPTY_PROMPT}")
        if max_length is not None:
            total = lengths + np.diff(self.prompt_offsets)
            if len(total) and total.max() > max_length:
                refuse(f"row {int(total.argmax())} has {int(total.max())} prompt + response tokens, more than the model's "
                       f"context of {max_length}")
        for name in rollout_cols:
            if name not in ("prompt_ids", "response_ids") and not np.array_equal(np.diff(shards.list_offsets(r[name])), lengths):
                refuse(f"per-token column {name} is not as long as the responses")
        self.cols = {name: shards.token_values(r[name]) for name in rollout_cols}
        self.vector_dtypes: dict[str, str | None] = {}  # column: the stored dtype of its vectors (their bits are kept)
        self.stored_dtypes: dict[str, dict] = {}  # teacher prefix: {column: its field's opdcache.dtype}
        vectors = signal_columns("vectors")
        teachers = ([("teacher_", teacher_path, teacher_cols, params)] if teacher_path is not None else []) + list(more)
        for prefix, source, columns, _ in teachers:
            shard = teacher_where.get(prefix, where)
            t = shards.read_table(source, ["id"] + columns, rows=rows, max_row_tokens=max_length, where=shard, tokens=tokens)
            if t.num_rows != r.num_rows or t["id"].to_pylist() != r["id"].to_pylist():
                refuse("teacher rows are not aligned with the rollout rows (ids differ)", shard)
            for name in columns:  # per-token columns only (CacheDataset leaves out row columns such as id)
                if not np.array_equal(np.diff(shards.list_offsets(t[name])), lengths):
                    refuse(f"teacher column {name} is not as long as the responses (shifted or truncated rows)", shard)
                values = shards.token_values(t[name])
                field = t.schema.field(name)
                if field.metadata and FIELD_DTYPE in field.metadata:  # its stored form, for the stores' rules
                    self.stored_dtypes.setdefault(prefix, {})[name] = field.metadata[FIELD_DTYPE].decode()
                if name in vectors:
                    self.vector_dtypes[prefix + name] = shards.hidden_dtype_of(t.schema.field(name))
                else:  # v3 float16 bits (compact top-k, sampled log-probs) -> float32
                    from opdcache.stores.compact import decode_logprobs

                    values = decode_logprobs(values, t.schema.field(name))
                self.cols[prefix + name] = values
        if route is not None:
            self.cols["row_teacher"] = np.repeat(_routes(r["metadata"].to_pylist(), *route, refuse), lengths)
        checks = [(where, self._rollout_violations(vocab))]
        checks += [(teacher_where.get(prefix, where), self._teacher_violations(vocab, table_params, prefix))
                   for prefix, _, _, table_params in teachers]
        for shard, violations in checks:
            for column, bad, message in violations:
                row = int(np.searchsorted(self.offsets, np.flatnonzero(bad)[0], side="right") - 1)
                refuse(f"row {row}, column {column}: {message}", shard)

    def _rollout_violations(self, vocab: int | None) -> list:
        """The rules validate applies to the rollouts' columns (opdcache/stores/rowrules.py), on the decoded values."""
        c = self.cols
        out = rowrules.ids_in_vocabulary("response_ids", c["response_ids"], vocab)
        for name in ("ref_topk_ids", "mc_ids"):
            if name in c:
                out += rowrules.ids_in_vocabulary(name, c[name], vocab)
        return out

    def _teacher_violations(self, vocab: int | None, params: dict | None, prefix: str) -> list:
        """The rules validate applies to the columns of the teacher whose columns carry ``prefix``."""
        c, out = self.cols, []
        for store in REGISTRY.values():  # the rules each teacher store declares (opdcache/stores/), on the columns loaded
            names = [col.name for col in store.columns if col.shape != "row" and prefix + col.name in c]
            if store.rules is not None and names:
                values = {n: c[prefix + n] for n in names}
                values |= {n: c[prefix + n] if prefix + n in c else c[n] for n in store.rules_read if prefix + n in c or n in c}
                rule_params = dict(params or {}) | {"dtypes": self.stored_dtypes.get(prefix, {})}
                out += [v for v in store.rules(values, vocab, rule_params) if v[1] is not None]
        return out

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.cols.values()) + self.offsets.nbytes + self.prompt_offsets.nbytes

    def row(self, i: int) -> dict:
        a, b = self.offsets[i], self.offsets[i + 1]
        out = {name: values[a:b] for name, values in self.cols.items() if name != "prompt_ids"}
        out["prompt_ids"] = self.cols["prompt_ids"][self.prompt_offsets[i]: self.prompt_offsets[i + 1]]
        return out


def _routes(metadata: list, field: str, names: tuple[str, ...], refuse) -> np.ndarray:
    """[rows] int8: the index in ``names`` of the teacher each row's metadata ``field`` names."""
    from opdcache.errors import ConfigError, SchemaError
    from opdcache.untrusted import loads

    index = {name: i for i, name in enumerate(names)}
    out = np.zeros(len(metadata), np.int8)
    for row, text in enumerate(metadata):
        value = (loads(text, f"row {row}'s metadata", SchemaError) if text else {}) if isinstance(text, str) else {}
        fields = value if isinstance(value, dict) else {}
        if field not in fields:  # the setting names a field these prompts do not carry: the cache is not at fault
            carried = ", ".join(sorted(map(str, fields))[:8]) or "none"
            raise ConfigError(f"--teacher-route {field}: row {row}'s prompt has no field {field!r} (its fields: {carried}); "
                              "route by a field the prompts carry")
        value = fields[field]
        if not isinstance(value, str) or value not in index:
            shown = repr(value) if isinstance(value, str) else f"a {type(value).__name__}"
            raise ConfigError(f"--teacher-route {field}: row {row}'s {field!r} is {shown[:80]}, which names none of the "
                              f"teachers {', '.join(names)}; give each row one teacher's table name")
        out[row] = index[value]
    return out
