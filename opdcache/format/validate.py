"""``opdcache validate``: check a cache against its manifest, its declared schema and the data invariants.

Every problem is collected (never the first only) with the file, row and column it concerns; errors exit 1,
warnings do not. What is checked (``quick`` stops after the file-level checks), each with the test that damages
exactly that thing (tests/test_validate.py unless named):

| level | check | reported as | test |
| --- | --- | --- | --- |
| manifest | present, JSON, format name and version, JSON schema | ``has no opdcache.json`` / ``format version N`` | test_missing_or_foreign_manifest |
| manifest | JSON within limits (size, number length, depth, string length; opdcache/untrusted.py) | ``refused (...)`` / ``nested too deeply`` | tests/test_hostile2.py test_a_hostile_manifest_is_one_short_line |
| manifest | an --exact table records what fixes its arithmetic | ``computed by the exact engine but its record lacks`` | tests/test_exact.py test_validate_requires_the_arithmetic_record |
| manifest | a teacher table records its error against the full vocabulary (opdcache/format/fidelity.py), equal to its shards' footer sums (error); a table from before it was recorded is a warning | ``records no error against the full vocabulary`` / ``differs from what its shards' footers record`` | tests/test_fidelity.py test_validate_checks_the_fidelity_record |
| manifest | stats.prompts and stats.prompt_tokens agree with the prompts of the shards' rows | ``prompt_tokens ... (edited by hand?)`` | tests/test_hostile2.py test_a_hand_edited_prompt_token_count_is_found |
| manifest | each table's config hashes to its config_fingerprint (chained to the rollouts') | ``recorded config does not hash`` | test_token_counts_and_config_fingerprint_are_checked_against_the_manifest |
| manifest | teacher tables have as many shards as the rollouts | ``teacher shards must align 1:1`` | test_teacher_shard_count_must_match |
| files | every listed shard exists, with the manifest's size and sha256 | ``missing shard`` / ``size is`` / ``sha256 ... (corrupted)`` | test_deleted_shard, test_truncated_shard, test_flipped_byte |
| files | side files (head.safetensors, svd.safetensors) exist for their stores, with the manifest's size and sha256 | ``missing: the svd store needs it`` / ``sha256 does not match`` | test_side_files_are_hashed_and_checked |
| files | side files are safetensors holding their tensors (header parsed within limits, nothing loaded) | ``not a safetensors file`` | tests/test_hostile2.py test_a_pickle_in_place_of_the_svd_file_is_found_even_with_its_hash_updated |
| files | side files' tensors agree in shape with each other and the table, and are finite | ``holds 1 NaN or infinite values`` / ``holds a [64, 129] matrix where`` | tests/test_hostile3.py test_a_head_of_nan_or_of_the_wrong_width_is_one_line |
| files | no unlisted shard in a table directory (error), none of an unknown table or left from an interrupted write (warnings) | ``extra shard`` / ``unfinished or abandoned job`` / ``leftover temporary file`` | test_extra_shard, test_stray_and_temporary_files_are_warnings |
| files | a table record (``_table.json``) that a finalize would not merge: malformed, naming another folder, beside shards its job did not write, or of a table the manifest lacks (warning) | ``a table record no finalize merges`` | tests/test_planted.py test_a_planted_table_record_is_never_merged |
| shard | readable Parquet; kind, store parameters and Arrow schema as declared | ``unreadable shard`` / ``shard declares kind`` / ``schema differs`` | test_unreadable_shard, test_shard_with_another_schema |
| shard | the shard's own config fingerprint is its table's (not a shard of another run) | ``(a shard from another run)`` | test_shard_from_another_run |
| shard | row count and response-token count as in the manifest | ``N rows, the manifest says`` / ``response tokens, the manifest says`` | test_wrong_row_count, test_token_counts_and_config_fingerprint_are_checked_against_the_manifest |
| shard | the footer's sizes before decoding: at most 8 rows a byte, list entries within the declared tokens (opdcache/format/shardcheck.py check_footer) | ``rows a byte: refused before decoding`` / ``refused before decoding`` | tests/test_hostile2.py test_a_rows_bomb_agreed_by_footer_and_manifest_is_one_line |
| rows | response, top-k and MC ids inside the vocabulary; finish_reason known | ``token id outside the vocabulary`` / ``finish_reason must be one of`` | test_out_of_vocabulary_ids_and_unknown_finish_reasons |
| rows | every per-token column as long as the response (hidden included, streamed) | ``not as long as the responses`` | test_hidden_rows_of_the_wrong_length_are_found_while_streaming |
| rows | log-probs finite and not above 0; logsumexp finite | ``non-finite log-prob`` / ``log-prob above 0`` / ``non-finite logsumexp`` | test_row_level_problems_name_row_and_column, test_non_finite_values |
| rows | top-k: unique ids, sorted descending, total probability at most 1 | ``duplicate token ids`` / ``not sorted descending`` / ``sum to more than 1`` | test_row_level_problems_name_row_and_column |
| rows | v3 compact top-k: padding only in trailing slots, tail in [0, 1], kept mass + tail = 1 | ``padding (id -1, log-prob -inf)`` / ``tail outside [0, 1]`` | tests/test_compact.py test_validate_finds_damaged_compact_and_sampled_rows |
| rows | v3 sampled store: ids in the vocabulary and distinct, padding trailing, counts positive summing to m (0 at padding), log-probs finite at entries (opdcache/stores/rowrules.py, shared with the loader) | ``counts must be positive, sum to`` / ``padding (id -1) must fill the trailing slots`` / ``duplicate token ids in a sampled row`` | tests/test_compact.py test_validate_finds_damaged_compact_and_sampled_rows, tests/test_hostile2.py test_hostile_sampled_rows_are_refused_by_train_and_validate |
| rows | the sampled token's log-prob agrees with its top-k entry, and is not above the k-th when outside | ``disagrees with its top-k entry`` | test_logprob_and_topk_stores_must_agree |
| rows | teacher rows aligned with the rollouts by ``id`` | ``id differs from the rollout row`` | test_teacher_rows_misaligned_or_inconsistent |
| rows | the teacher log-prob rebuilt from the stored hidden state and head equals the stored one | ``log-prob rebuilt from hidden state and head differs`` | test_hidden_state_reconstruction_is_checked |

All row checks are vectorised over a shard's flat buffers; no per-token Python loop. Memory: one shard's columns
at a time except the hidden states (one row group at a time) and a [1024, 8192] float32 logit block for their
reconstruction; never tokens x vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from opdcache import storage
from opdcache.errors import ManifestError, SchemaError
from opdcache.format import manifest as M, schema as S, shardcheck, shards
from opdcache.format.fidelity import check_record
from opdcache.format.sidefiles import side_file_problem
from opdcache.inputs.fingerprint import config_fingerprint, sha256_file
from opdcache.stores import REGISTRY, rowrules
from opdcache.stores.compact import decode_logprobs

MAX_ROWS_LISTED = 5  # per (file, column, check); the rest are counted


@dataclass(frozen=True)
class Problem:
    file: str
    message: str
    row: int | None = None
    column: str | None = None
    warning: bool = False  # harmless (e.g. a leftover temporary file); does not fail validation

    def __str__(self) -> str:
        where = self.file
        if self.row is not None:
            where += f" row {self.row}"
        if self.column is not None:
            where += f" column {self.column}"
        return f"{'warning' if self.warning else 'error'}: {where}: {self.message}"


class _Collector:
    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def add(self, file: str, message: str, row: int | None = None, column: str | None = None, warning: bool = False) -> None:
        self.problems.append(Problem(file, message, row, column, warning))

    def rows(self, file: str, column: str, bad_rows: np.ndarray, message: str) -> None:
        """Record a failed per-row check: the first few rows by number, then a count of the rest."""
        bad_rows = np.unique(bad_rows)
        for r in bad_rows[:MAX_ROWS_LISTED]:
            self.add(file, message, int(r), column)
        if len(bad_rows) > MAX_ROWS_LISTED:
            self.add(file, f"{message} (and {len(bad_rows) - MAX_ROWS_LISTED} more rows)", None, column)


def validate(root: str | Path, quick: bool = False) -> list[Problem]:
    """All problems found in the cache at ``root`` (a local directory or an object-store URL; an empty list means it is
    valid). On an object store each shard is read twice: once whole for its sha256, once by columns to check rows."""
    root = storage.as_path(root)
    out = _Collector()
    try:
        manifest = M.load(root)
    except ManifestError as exc:
        out.add(M.MANIFEST_NAME, str(exc))
        return out.problems
    tables = manifest["tables"]
    base_name = manifest["kind"]
    if base_name not in tables:
        out.add(M.MANIFEST_NAME, f"no {base_name!r} table although the cache kind is {base_name!r}")
        return out.problems
    _check_stray_files(root, tables, out)
    _check_tokenizer(root, manifest, out)
    base_lengths: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # shard index -> (ids, response lengths)
    prompt_lengths: dict[int, int] = {}  # prompt index -> its tokens, over the base table's rows
    base = tables[base_name]
    for name in [base_name] + sorted(t for t in tables if t != base_name):
        entry = tables[name]
        params = S.StoreParams.from_dict(entry["params"])
        if name != base_name and len(entry["shards"]) != len(base["shards"]):
            out.add(name, f"{len(entry['shards'])} shards, but {base_name} has {len(base['shards'])}; teacher shards must align 1:1")
        parent = None if name == base_name else base["config_fingerprint"]
        if config_fingerprint(entry["config"], parent) != entry["config_fingerprint"]:
            out.add(M.MANIFEST_NAME, f"table {name}: the recorded config does not hash to its config_fingerprint "
                                     f"{entry['config_fingerprint'][:12]}... (the manifest was edited by hand)")
        _check_side_files(root, name, entry, params, out)
        _check_arithmetic_record(name, entry, out)
        if entry["kind"] == "teacher" and not quick:
            for where, message, warning in check_record(root, name, entry):
                out.add(where, message, warning=warning)
        for index, info in enumerate(entry["shards"]):
            path = root / info["path"]
            if not _inside(root, path, info["path"], out) or not _check_file(path, info, entry, params, out):
                continue
            if quick:
                continue
            # every column but the vectors vectorcheck streams one row group at a time (the hidden states); the
            # footer's sizes are checked before anything is decoded (opdcache/format/shardcheck.py, check_footer)
            streamed = {c.name for st in REGISTRY.values() if st.rebuilds and st.name in params.stores
                        for c in st.columns if c.shape == "token_vector"}
            try:
                table = shards.read_table(path, [c.name for c in S.columns(entry["kind"], params) if c.name not in streamed],
                                          rows=info["rows"], tokens=info["tokens"], where=info["path"])
            except SchemaError as exc:
                out.add(info["path"], str(exc).split(": ", 1)[-1])
                continue
            tokens = shards.table_tokens(table)
            if tokens != info["tokens"]:
                out.add(info["path"], f"{tokens} response tokens, the manifest says {info['tokens']} (info would report wrong totals)")
            if name == base_name:
                base_lengths[index] = _check_base_rows(info["path"], table, entry, out)
                if "prompt_index" in table.column_names:
                    prompt_lengths.update(zip(table["prompt_index"].to_pylist(), np.diff(shards.list_offsets(table["prompt_ids"])).tolist()))
            else:
                _check_teacher_rows(root, info["path"], table, entry, params, base_lengths.get(index),
                                    root / base["shards"][index]["path"] if index < len(base["shards"]) else None, out,
                                    base["config"].get("vocab_size"))
    if not quick and prompt_lengths:
        _check_stats(base_name, base.get("stats") or {}, prompt_lengths, out)
    return out.problems


def _check_stats(name: str, stats: dict, prompt_lengths: dict[int, int], out: _Collector) -> None:
    """The manifest's derived statistics against the shards: the prompts the rows come from, and their tokens (equal
    when every prompt kept a row; at most the recorded figure when some prompts' samples were all quarantined or
    rejected)."""
    seen, tokens = len(prompt_lengths), sum(prompt_lengths.values())
    want_prompts, want_tokens = stats.get("prompts"), stats.get("prompt_tokens")
    where = f"{M.MANIFEST_NAME} tables/{name}/stats"
    if isinstance(want_prompts, int) and seen > want_prompts:
        out.add(where, f"prompts {want_prompts} is fewer than the {seen} prompts the shards' rows come from (edited by hand?)")
    if isinstance(want_tokens, int) and isinstance(want_prompts, int):
        if (seen == want_prompts and tokens != want_tokens) or tokens > want_tokens:
            out.add(where, f"prompt_tokens {want_tokens:,} differs from the {tokens:,} tokens of the {seen} prompts in the shards (edited by hand?)")


EXACT_RECORD = ("arithmetic", "dtype", "vocab_block", "torch")


def _check_arithmetic_record(name: str, entry: dict, out: _Collector) -> None:
    """A table computed by the exact engine must say what fixes its arithmetic (what `opdcache audit` re-creates): the
    definition, dtype, vocabulary slice and torch version under model.exact, and the thread count under compute."""
    model = entry.get("model") or {}
    if model.get("engine") != "exact":
        return
    record = model.get("exact")
    missing = [k for k in EXACT_RECORD if not isinstance(record, dict) or record.get(k) is None]
    if not isinstance((entry.get("compute") or {}).get("torch_threads"), int):
        missing.append("compute.torch_threads")
    if missing:
        out.add(M.MANIFEST_NAME, f"table {name} was computed by the exact engine but its record lacks {', '.join(missing)}: "
                                 "audit could not re-create its arithmetic")
        return
    from opdcache.exact import ARITHMETICS

    if not isinstance(record["arithmetic"], str) or record["arithmetic"] not in ARITHMETICS:
        out.add(M.MANIFEST_NAME, f"table {name} records the exact arithmetic {str(record['arithmetic'])[:80]!r}, which this "
                                 f"opdcache does not implement ({', '.join(sorted(ARITHMETICS))}): neither train --exact nor "
                                 "audit can re-create it")


def _check_side_files(root: Path, name: str, entry: dict, params: S.StoreParams, out: _Collector) -> None:
    """head.safetensors / svd.safetensors: present for the stores that need them, and equal to the manifest's hashes."""
    from opdcache.format.sidefiles import SIDE_FILE_OF_STORE

    recorded = entry.get("files", {})
    for store, fname in SIDE_FILE_OF_STORE.items():
        rel = f"{name}/{fname}"
        path = root / rel
        if store not in params.stores and fname not in recorded:
            continue
        if not _inside(root, path, rel, out):
            continue
        if not path.is_file():
            out.add(rel, f"missing: the {store} store needs it")
            continue
        want = recorded.get(fname)
        if want is None:
            out.add(rel, "not hashed in the manifest (a cache from before side files were hashed); its content is unchecked", warning=True)
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            out.add(rel, f"size is {size} bytes, the manifest says {want['bytes']} (truncated or replaced)")
        elif sha256_file(path) != want["sha256"]:
            out.add(rel, "sha256 does not match the manifest's (corrupted)")
        else:
            problem = side_file_problem(path, size, fname)
            if problem:
                out.add(rel, problem)


def _check_tokenizer(root, manifest: dict, out: _Collector) -> None:
    """The tokenizer folder: each file against the hash the manifest recorded; for a cache from before those hashes, it
    must at least load (without running any code from it)."""
    folder = root / "tokenizer"
    recorded = manifest["tokenizer"].get("files")
    if recorded is None:
        if folder.is_dir():
            from opdcache.format.cache import Cache

            try:
                Cache(root).tokenizer()
            except ManifestError as exc:
                out.add("tokenizer", str(exc))
        return
    for rel, digest in sorted(recorded.items()):
        path = folder / rel
        if not _inside(root, path, f"tokenizer/{rel}", out):
            continue
        if not path.is_file():
            out.add(f"tokenizer/{rel}", "missing: the manifest records it")
        elif sha256_file(path) != digest:
            out.add(f"tokenizer/{rel}", "sha256 does not match the manifest's (truncated, corrupted or replaced)")


def _inside(root, path, rel: str, out: _Collector) -> bool:
    """False, with a problem, for a file that is a symlink leading out of the cache (never opened, nothing disclosed)."""
    try:
        storage.confined(root, path)
    except ManifestError:
        out.add(rel, "is a symlink that leads outside the cache; not read (replace it with the real file)")
        return False
    return True


def _check_stray_files(root: Path, tables: dict, out: _Collector) -> None:
    listed = {s["path"] for t in tables.values() for s in t["shards"]}
    table_dirs = {root / name for name in tables}
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        if shards.is_temporary(path):
            out.add(rel, "leftover temporary file from an interrupted write (safe to delete)", warning=True)
        elif path.suffix == ".parquet" and rel not in listed:
            if path.parent in table_dirs:
                out.add(rel, "extra shard: not listed in the manifest")
            else:
                out.add(rel, "shard of a table the manifest does not list (an unfinished or abandoned job?)", warning=True)
    from opdcache.format.records import stray_records

    try:
        strays = stray_records(root, tables)
    except (ManifestError, OSError) as exc:
        strays = [str(exc)]
    for line in strays:
        path, _, why = line.partition(": ")
        rel = Path(path).relative_to(root).as_posix() if Path(path).is_relative_to(root) else path
        out.add(rel, f"a table record no finalize merges ({why}); never read: delete it", warning=True)


def _check_file(path: Path, info: dict, entry: dict, params: S.StoreParams, out: _Collector) -> bool:
    rel = info["path"]
    if not path.is_file():
        out.add(rel, "missing shard: listed in the manifest but not on disk")
        return False
    size = path.stat().st_size
    if size != info["bytes"]:
        out.add(rel, f"size is {size} bytes, the manifest says {info['bytes']} (truncated or replaced)")
        return False
    digest = sha256_file(path)
    if digest != info["sha256"]:
        out.add(rel, f"sha256 {digest[:12]}... does not match the manifest's {info['sha256'][:12]}... (corrupted)")
        return False
    try:
        pf = shards.open_parquet(path)
        schema = pf.schema_arrow
        kind, file_params, _ = S.params_from_schema(schema)
    except (SchemaError, pa.ArrowException, OSError) as exc:
        out.add(rel, f"unreadable shard: {exc}")
        return False
    expected = S.arrow_schema(entry["kind"], params, entry["config_fingerprint"])
    if kind != entry["kind"] or file_params != params:
        out.add(rel, f"shard declares kind {kind!r} with {file_params.to_dict()}, the manifest says {entry['kind']!r} with {params.to_dict()}")
        return False
    if not schema.remove_metadata().equals(expected.remove_metadata(), check_metadata=False):
        got = {f.name: str(f.type) for f in schema}
        want = {f.name: str(f.type) for f in expected}
        diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        out.add(rel, "schema differs from the declared format: " + ", ".join(f"{k}: {got.get(k, 'absent')} (expected {want.get(k, 'absent')})" for k in diff))
        return False
    fp = (schema.metadata or {}).get(S.META_CONFIG_FP, b"").decode()
    if fp != entry["config_fingerprint"]:
        out.add(rel, f"config fingerprint {fp[:12]}... differs from the table's {entry['config_fingerprint'][:12]}... (a shard from another run)")
    if pf.metadata.num_rows != info["rows"]:
        out.add(rel, f"{pf.metadata.num_rows} rows, the manifest says {info['rows']}")
        return False
    try:
        shardcheck.check_footer(pf, size, None, rel, info["rows"], tokens=info["tokens"])  # sizes bounded before any column is decoded
    except SchemaError as exc:
        out.add(rel, str(exc).split(": ", 1)[-1])
        return False
    return True


def _row_of(offsets: np.ndarray, positions: np.ndarray) -> np.ndarray:
    return np.searchsorted(offsets, positions, side="right") - 1


def _check_logprobs(file: str, column: str, values: np.ndarray, offsets: np.ndarray, out: _Collector) -> None:
    flat = values.reshape(len(values), -1) if values.size else values.reshape(0, 1)  # no tokens at all: nothing to check
    bad = ~np.isfinite(flat).all(axis=1)
    if bad.any():
        out.rows(file, column, _row_of(offsets, np.flatnonzero(bad)), "non-finite log-prob")
    above = (flat > 0).any(axis=1) & ~bad
    if above.any():
        out.rows(file, column, _row_of(offsets, np.flatnonzero(above)), "log-prob above 0")


def _report(file: str, offsets: np.ndarray, violations, out: _Collector) -> None:
    for column, bad, message in violations:
        out.rows(file, column, _row_of(offsets, np.flatnonzero(bad)), message)


def _check_topk(file: str, prefix: str, ids: np.ndarray, lps: np.ndarray, offsets: np.ndarray, vocab: int | None, out: _Collector,
                tail: np.ndarray | None = None, tol: float = 1e-3, order: str = "logprobs") -> None:
    """ids, lps: [tokens, k]; the rules of opdcache/stores/rowrules.py (the loader refuses the same rows)."""
    _report(file, offsets, rowrules.topk_rules(prefix, ids, lps, vocab, tail, tol, order), out)


def _stored_dtypes(table: pa.Table) -> dict:
    """Each column's stored form its field names (``opdcache.dtype``), for the stores' rules."""
    return {f.name: f.metadata[S.FIELD_DTYPE].decode() for f in table.schema if f.metadata and S.FIELD_DTYPE in f.metadata}


def _check_store_rules(file: str, table: pa.Table, params: S.StoreParams, offsets: np.ndarray, vocab: int | None,
                       out: _Collector, teacher_vocab: int | None = None, rollouts: dict | None = None) -> None:
    """The row rules each store declares (opdcache/stores/; the loader refuses the same rows), on decoded values: ids
    of pi_ref's within ``vocab``, the teacher's own within ``teacher_vocab`` (its table's recorded vocabulary; default
    ``vocab``, as for a teacher of pi_ref's tokenizer). ``rollouts``: the rollouts' per-token values a rule may read
    ({"response_ids": [tokens]})."""
    for store in (s for s in REGISTRY.values() if s.name in params.stores):  # its columns this table's parameters hold
        per_token = [c.name for c in S.columns("teacher", params) if c.store == store.name and c.shape != "row"]
        if store.rules is not None and all(n in table.column_names for n in per_token):
            values = {n: decode_logprobs(shards.token_values(table[n]), table.schema.field(n))
                      for n in per_token + [n for n in store.rules_read if n in table.column_names]}
            values |= {n: v for n, v in (rollouts or {}).items() if n in store.rules_read}
            rule_params = params.to_dict() | {"teacher_vocab_size": teacher_vocab or vocab, "dtypes": _stored_dtypes(table)}
            _report(file, offsets, [v for v in store.rules(values, vocab, rule_params) if v[1] is not None], out)
        for column, bad_rows, message in (store.table_rules(table, offsets) if store.table_rules else []):
            out.rows(file, column, np.flatnonzero(bad_rows), message)


def _check_base_rows(file: str, table: pa.Table, entry: dict, out: _Collector):
    vocab = entry["config"].get("vocab_size")
    offsets = shards.list_offsets(table["response_ids"])
    response = shards.token_values(table["response_ids"])
    empty = rowrules.empty_prompts(shards.list_offsets(table["prompt_ids"]))
    if len(empty):
        out.rows(file, "prompt_ids", empty, rowrules.EMPTY_PROMPT)
    if vocab is not None:
        bad = (response < 0) | (response >= vocab)
        if bad.any():
            out.rows(file, "response_ids", _row_of(offsets, np.flatnonzero(bad)), f"token id outside the vocabulary [0, {vocab})")
    finish = table["finish_reason"].to_pylist()
    bad_finish = [i for i, f in enumerate(finish) if f not in S.FINISH_REASONS]
    if bad_finish:
        out.rows(file, "finish_reason", np.array(bad_finish), f"finish_reason must be one of {S.FINISH_REASONS}")
    for name in ("sampling_logprobs", "ref_logprobs"):
        if name in table.column_names:
            _check_lengths(file, name, table, offsets, out)
            _check_logprobs(file, name, shards.token_values(table[name]), offsets, out)
    if "ref_topk_ids" in table.column_names:
        ids, lps = shards.token_values(table["ref_topk_ids"]), shards.token_values(table["ref_topk_logprobs"])
        _check_lengths(file, "ref_topk_ids", table, offsets, out)
        _check_topk(file, "ref_topk", ids, lps, offsets, vocab, out)
        _report(file, offsets, rowrules.against_topk("ref_logprobs", response, shards.token_values(table["ref_logprobs"]), ids, lps), out)
    if "mc_ids" in table.column_names:
        _check_lengths(file, "mc_ids", table, offsets, out)
        _report(file, offsets, rowrules.ids_in_vocabulary("mc_ids", shards.token_values(table["mc_ids"]), vocab), out)
        _check_logprobs(file, "mc_sampling_logprobs", shards.token_values(table["mc_sampling_logprobs"]), offsets, out)
    return np.asarray(table["id"].to_pylist(), dtype=object), np.diff(offsets), response, offsets


def _check_lengths(file: str, name: str, table: pa.Table, offsets: np.ndarray, out: _Collector, lengths: np.ndarray | None = None) -> None:
    want = np.diff(offsets) if lengths is None else lengths
    got = np.diff(shards.list_offsets(table[name]))
    bad = np.flatnonzero(got != want)
    if len(bad):
        out.rows(file, name, bad, "not as long as the responses (per-token column length differs from the number of response tokens)")


def _check_teacher_rows(root: Path, file: str, table: pa.Table, entry: dict, params: S.StoreParams, base, base_path, out: _Collector,
                        student_vocab: int | None = None) -> None:
    if base is None:  # the rollout shard failed its own checks (already reported) or does not exist
        if base_path is None:
            out.add(file, "no rollout shard of the same index to align with")
        return
    ids, lengths, response, base_offsets = base
    teacher_ids = np.asarray(table["id"].to_pylist(), dtype=object)
    if len(teacher_ids) != len(ids):
        out.add(file, f"{len(teacher_ids)} rows but the rollout shard has {len(ids)}; teacher shards must be row-aligned")
        return
    misaligned = np.flatnonzero(teacher_ids != ids)
    if len(misaligned):
        out.rows(file, "id", misaligned, "id differs from the rollout row at the same position (rows misaligned)")
        return
    offsets = shards.list_offsets(table["logprobs"])
    for name in [c.name for c in S.columns("teacher", params) if c.shape != "row" and c.name in table.column_names]:
        _check_lengths(file, name, table, base_offsets, out, lengths)  # a streamed column: by vectorcheck, as it streams
    if not (np.diff(offsets) == lengths).all():
        return
    logprobs = shards.token_values(table["logprobs"])
    _check_logprobs(file, "logprobs", logprobs, offsets, out)
    lse = shards.token_values(table["logsumexp"]) if "logsumexp" in table.column_names else np.zeros(0)
    if not np.isfinite(lse).all():
        out.rows(file, "logsumexp", _row_of(offsets, np.flatnonzero(~np.isfinite(lse))), "non-finite logsumexp")
    vocab = entry["config"].get("vocab_size")
    _check_store_rules(file, table, params, offsets, vocab if params.same_tokenizer else student_vocab, out, vocab,
                       {"response_ids": response})
    for name in ("ref_topk_logprobs", "mc_logprobs"):
        if name in table.column_names:
            _check_logprobs(file, name, shards.token_values(table[name]), offsets, out)
    for store in REGISTRY.values():  # _check_file verified the shard's schema is the declared one
        if store.rebuilds and store.name in params.stores:
            from opdcache.format.vectorcheck import check_rebuilt

            check_rebuilt(store, root, file, entry, response, logprobs, offsets, lengths, out)
