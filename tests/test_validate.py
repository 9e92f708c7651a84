"""`opdcache validate` names every problem (file, row, column) and exits 1; a clean cache exits 0."""

import json
import shutil

import numpy as np
import pytest

from opdcache.cli.main import main
from opdcache.format import manifest as M, schema as S, shards
from opdcache.format.cache import Cache
from opdcache.format.validate import validate
from synth import rollout_rows


def _cli(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    return exit_.value.code, capsys.readouterr().out


def _rewrite_shard(cache_root, table, index, mutate):
    """Replace a shard with mutated data and patch the manifest so only the data checks can catch it."""
    cache = Cache(cache_root)
    path = cache.shard_paths(table)[index]
    entry = cache.table(table)
    t = shards.read_table(path).to_pylist()
    mutate(t)
    params = S.StoreParams.from_dict(entry["params"])
    records = [{k: (np.asarray(v) if isinstance(v, list) else v) for k, v in row.items()} for row in t]
    info = shards.write_table_atomic(shards.build_table(entry["kind"], params, records, entry["config_fingerprint"]), path, cache_root)
    m = cache.manifest
    m["tables"][table]["shards"][index] = info.to_dict()
    M.save(cache_root, m)


def test_clean_cache_exits_0(synth_cache, capsys):
    code, out = _cli(["validate", str(synth_cache)], capsys)
    assert code == 0
    assert out.strip().endswith(": ok")


def test_flipped_byte(synth_cache, capsys):
    path = Cache(synth_cache).shard_paths("rollouts")[1]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    code, out = _cli(["validate", str(synth_cache)], capsys)
    assert code == 1
    assert "rollouts/part-00001-of-00003.parquet: sha256" in out and "(corrupted)" in out


def test_truncated_shard(synth_cache, capsys):
    path = Cache(synth_cache).shard_paths("teachers/synth")[0]
    path.write_bytes(path.read_bytes()[:-100])
    code, out = _cli(["validate", "--quick", str(synth_cache)], capsys)
    assert code == 1 and "teachers/synth/part-00000-of-00003.parquet: size is" in out and "truncated" in out


def test_deleted_shard(synth_cache, capsys):
    Cache(synth_cache).shard_paths("rollouts")[2].unlink()
    code, out = _cli(["validate", str(synth_cache)], capsys)
    assert code == 1 and "rollouts/part-00002-of-00003.parquet: missing shard" in out


def test_extra_shard(synth_cache, capsys):
    src = Cache(synth_cache).shard_paths("rollouts")[0]
    shutil.copy(src, src.with_name("part-00003-of-00003.parquet"))
    code, out = _cli(["validate", str(synth_cache)], capsys)
    assert code == 1 and "rollouts/part-00003-of-00003.parquet: extra shard" in out


def test_wrong_row_count(synth_cache, capsys):
    m = M.load(synth_cache)
    m["tables"]["rollouts"]["shards"][0]["rows"] += 1
    M.save(synth_cache, m)
    code, out = _cli(["validate", str(synth_cache)], capsys)
    assert code == 1 and "rollouts/part-00000-of-00003.parquet: 6 rows, the manifest says 7" in out


def test_shard_with_another_schema(synth_cache, capsys):
    cache = Cache(synth_cache)
    path = cache.shard_paths("rollouts")[0]
    params = S.StoreParams(stores=("base", "task"))
    rows = [{k: v for k, v in r.items() if not k.startswith(("ref_topk", "mc_"))} for r in rollout_rows(0)]
    info = shards.write_table_atomic(shards.build_table("rollouts", params, rows), path, synth_cache)
    m = cache.manifest
    m["tables"]["rollouts"]["shards"][0] = info.to_dict()
    M.save(synth_cache, m)
    code, out = _cli(["validate", str(synth_cache)], capsys)
    assert code == 1 and "rollouts/part-00000-of-00003.parquet: shard declares kind 'rollouts'" in out


def test_row_level_problems_name_row_and_column(synth_cache):
    def break_rows(rows):
        rows[2]["ref_topk_ids"][0][1] = rows[2]["ref_topk_ids"][0][0]  # duplicate id
        rows[3]["ref_topk_logprobs"][0] = rows[3]["ref_topk_logprobs"][0][::-1]  # ascending
        rows[4]["sampling_logprobs"][0] = 0.5  # above 0
    _rewrite_shard(synth_cache, "rollouts", 0, break_rows)
    text = "\n".join(map(str, validate(synth_cache)))
    assert "rollouts/part-00000-of-00003.parquet row 2 column ref_topk_ids: duplicate token ids" in text
    assert "row 3 column ref_topk_logprobs: top-k log-probs not sorted descending" in text
    assert "row 4 column sampling_logprobs: log-prob above 0" in text
    # quick mode skips exactly these checks
    assert validate(synth_cache, quick=True) == []


def test_teacher_rows_misaligned_or_inconsistent(synth_cache):
    _rewrite_shard(synth_cache, "teachers/synth", 1, lambda rows: rows.reverse())
    text = "\n".join(map(str, validate(synth_cache)))
    assert "teachers/synth/part-00001-of-00003.parquet row 0 column id: id differs from the rollout row" in text


def test_hidden_state_reconstruction_is_checked(synth_cache):
    def shift(rows):
        rows[0]["logprobs"][0] -= 0.5
    _rewrite_shard(synth_cache, "teachers/synth", 0, shift)
    text = "\n".join(map(str, validate(synth_cache)))
    assert "row 0 column hidden: log-prob rebuilt from the hidden vectors and head differs" in text


def _cli_all(args, capsys):
    """Exit code and stdout + stderr (a refusal goes to stderr)."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    captured = capsys.readouterr()
    return exit_.value.code, captured.out + captured.err


def test_missing_or_foreign_manifest(tmp_path, capsys):
    code, out = _cli_all(["validate", str(tmp_path)], capsys)
    assert code == 2 and "is an empty folder, not an opdcache cache" in out
    (tmp_path / "rollouts").mkdir()  # a job's folder without its manifest: an unfinished cache, which fails its check
    code, out = _cli(["validate", str(tmp_path)], capsys)
    assert code == 1 and "has no opdcache.json: the cache is incomplete" in out
    (tmp_path / "opdcache.json").write_text(json.dumps({"format": "opdcache", "format_version": 9}))
    code, out = _cli(["validate", str(tmp_path)], capsys)
    assert code == 1 and "format version 9, this opdcache 0.1.0 reads versions 1, 2" in out


def test_info_reports_stores_and_bytes_per_token(synth_cache, capsys):
    code, out = _cli(["info", str(synth_cache)], capsys)
    assert code == 0
    assert "teachers/synth" in out and "hidden" in out and "bytes/token" in out
    code, out = _cli(["info", "--json", str(synth_cache)], capsys)
    data = json.loads(out)
    t = data["tables"]["teachers/synth"]
    assert t["rows"] == 18 and set(t["bytes_per_token"]) == {"base", "logprob", "topk", "hidden"}
    # bf16 hidden of width 16: 32 raw bytes per token; zstd may shrink it but not below 0.
    assert 0 < t["bytes_per_token"]["hidden"] <= 32 * 1.2


def test_info_shows_each_stores_record_and_says_when_one_is_not_opdcaches(hf_cache, tmp_path, capsys):
    """info prints what each store recorded (the svd fit) and keeps it under the store's name in --json; a record of
    another shape planted in the manifest is one line saying so, with no traceback."""
    import shutil

    cache = tmp_path / "c"
    shutil.copytree(hf_cache, cache)
    code, out = _cli(["info", str(cache)], capsys)
    assert code == 0 and "svd prob-weighted" in out and "reconstruction)" in out, out
    code, out = _cli(["info", "--json", str(cache)], capsys)
    t = json.loads(out)["tables"]["teachers/teacher"]
    assert t["svd"] == Cache(cache).table("teachers/teacher")["svd"]
    manifest = json.loads((cache / "opdcache.json").read_text())
    manifest["tables"]["teachers/teacher"]["svd"] = {"distortion": {"prob-weighted": {"rank": "sixteen"}}}
    (cache / "opdcache.json").write_text(json.dumps(manifest))
    code, out = _cli(["info", str(cache)], capsys)
    assert code == 0 and "svd store: its record in the manifest is not one opdcache wrote (nothing to show)" in " ".join(out.split())


def test_hidden_rows_of_the_wrong_length_are_found_while_streaming(synth_cache, monkeypatch):
    """The hidden column is read one row group at a time (row groups of 2 rows here); a short row in a later row
    group is reported with its row number in the shard."""
    import pyarrow as pa

    monkeypatch.setattr(shards, "_row_group_rows", lambda table: 2)
    cache = Cache(synth_cache)
    path = cache.shard_paths("teachers/synth")[0]
    table = shards.read_table(path)
    rows = table.to_pylist()
    rows[3]["hidden"] = rows[3]["hidden"][:-1]  # one position short; build_table would refuse it, so write it raw
    info = shards.write_table_atomic(pa.Table.from_pylist(rows, schema=table.schema), path, synth_cache)
    m = cache.manifest
    m["tables"]["teachers/synth"]["shards"][0] = info.to_dict()
    M.save(synth_cache, m)
    assert shards.open_parquet(path).num_row_groups > 1
    text = "\n".join(map(str, validate(synth_cache)))
    assert "teachers/synth/part-00000-of-00003.parquet row 3 column hidden: not as long as the responses" in text


def test_side_files_are_hashed_and_checked(synth_cache, hf_cache, tmp_path):
    import shutil

    head = synth_cache / "teachers" / "synth" / "head.safetensors"
    entry = Cache(synth_cache).table("teachers/synth")
    assert entry["files"]["head.safetensors"]["sha256"] == __import__("opdcache.inputs.fingerprint", fromlist=["x"]).sha256_file(head)
    data = bytearray(head.read_bytes())
    data[-1] ^= 0x01  # a low bit of the last weight
    head.write_bytes(bytes(data))
    text = "\n".join(map(str, validate(synth_cache, quick=True)))
    assert "teachers/synth/head.safetensors: sha256 does not match the manifest's (corrupted)" in text
    copy = tmp_path / "hf"
    shutil.copytree(hf_cache, copy)
    (copy / "teachers" / "teacher" / "svd.safetensors").unlink()
    text = "\n".join(map(str, validate(copy, quick=True)))
    assert "teachers/teacher/svd.safetensors: missing: the svd store needs it" in text


def test_token_counts_and_config_fingerprint_are_checked_against_the_manifest(synth_cache):
    m = Cache(synth_cache).manifest
    m["tables"]["rollouts"]["shards"][1]["tokens"] += 5
    m["tables"]["teachers/synth"]["config"]["vocab_size"] = 1
    M.save(synth_cache, m)
    text = "\n".join(map(str, validate(synth_cache)))
    assert "rollouts/part-00001-of-00003.parquet: " in text and "response tokens, the manifest says" in text
    assert "table teachers/synth: the recorded config does not hash to its config_fingerprint" in text


def test_info_size_counts_the_side_files(synth_cache):
    from opdcache.format.info import summary

    t = summary(synth_cache)["tables"]["teachers/synth"]
    shard_bytes = sum(p.stat().st_size for p in (synth_cache / "teachers" / "synth").glob("part-*.parquet"))
    assert t["bytes"] == shard_bytes + (synth_cache / "teachers" / "synth" / "head.safetensors").stat().st_size


def _texts(root, quick=False):
    return "\n".join(map(str, validate(root, quick=quick)))


def test_teacher_shard_count_must_match(synth_cache):
    m = M.load(synth_cache)
    m["tables"]["teachers/synth"]["shards"].pop()
    M.save(synth_cache, m)
    assert "teachers/synth: 2 shards, but rollouts has 3; teacher shards must align 1:1" in _texts(synth_cache, quick=True)


def test_stray_and_temporary_files_are_warnings(synth_cache, capsys):
    src = Cache(synth_cache).shard_paths("rollouts")[0]
    (synth_cache / "teachers" / "other").mkdir()
    shutil.copy(src, synth_cache / "teachers" / "other" / "part-00000-of-00001.parquet")
    (synth_cache / "rollouts" / ".part-00000-of-00003.parquet.tmp-123").write_bytes(b"half")
    problems = validate(synth_cache, quick=True)
    assert [p.warning for p in problems] == [True, True]
    text = "\n".join(map(str, problems))
    assert "teachers/other/part-00000-of-00001.parquet: shard of a table the manifest does not list" in text
    assert "leftover temporary file from an interrupted write" in text
    code, _ = _cli(["validate", "--quick", str(synth_cache)], capsys)
    assert code == 0


def _replace_bytes(root, table, index, data):
    """Put ``data`` in a shard and record its size and sha256, so only what is inside can be caught."""
    from opdcache.inputs.fingerprint import sha256_file

    path = Cache(root).shard_paths(table)[index]
    path.write_bytes(data)
    m = M.load(root)
    m["tables"][table]["shards"][index].update(bytes=len(data), sha256=sha256_file(path))
    M.save(root, m)


def test_unreadable_shard(synth_cache):
    _replace_bytes(synth_cache, "rollouts", 1, b"PAR1 this is not parquet PAR1")
    assert "rollouts/part-00001-of-00003.parquet: unreadable shard" in _texts(synth_cache, quick=True)


def test_shard_from_another_run(synth_cache):
    cache = Cache(synth_cache)
    entry = cache.table("rollouts")
    path = cache.shard_paths("rollouts")[0]
    table = shards.build_table("rollouts", S.StoreParams.from_dict(entry["params"]), rollout_rows(0), "0" * 64)
    info = shards.write_table_atomic(table, path, synth_cache)
    m = cache.manifest
    m["tables"]["rollouts"]["shards"][0] = info.to_dict()
    M.save(synth_cache, m)
    assert "rollouts/part-00000-of-00003.parquet: config fingerprint 000000000000... differs" in _texts(synth_cache, quick=True)


def test_out_of_vocabulary_ids_and_unknown_finish_reasons(synth_cache):
    def damage(rows):
        rows[1]["response_ids"][0] = 10 ** 6
        rows[2]["finish_reason"] = "weird"
        rows[3]["mc_ids"][0][0] = -1
    _rewrite_shard(synth_cache, "rollouts", 0, damage)
    text = _texts(synth_cache)
    assert "row 1 column response_ids: token id outside the vocabulary" in text
    assert "row 2 column finish_reason: finish_reason must be one of" in text
    assert "row 3 column mc_ids: token id outside the vocabulary" in text


def test_non_finite_values(synth_cache):
    """Written raw (the writer itself refuses non-finite values): only validate can catch them."""
    import pyarrow as pa

    cache = Cache(synth_cache)
    path = cache.shard_paths("teachers/synth")[2]
    table = shards.read_table(path)
    rows = table.to_pylist()
    rows[0]["logsumexp"][0] = float("nan")
    rows[1]["logprobs"][0] = float("inf")
    info = shards.write_table_atomic(pa.Table.from_pylist(rows, schema=table.schema), path, synth_cache)
    m = cache.manifest
    m["tables"]["teachers/synth"]["shards"][2] = info.to_dict()
    M.save(synth_cache, m)
    text = _texts(synth_cache)
    assert "teachers/synth/part-00002-of-00003.parquet row 0 column logsumexp: non-finite logsumexp" in text
    assert "row 1 column logprobs: non-finite log-prob" in text


def test_logprob_and_topk_stores_must_agree(synth_cache):
    cache = Cache(synth_cache)
    resp = shards.read_table(cache.shard_paths("rollouts")[0])["response_ids"].to_pylist()
    t = shards.read_table(cache.shard_paths("teachers/synth")[0])
    row, pos = next((i, t) for i, (r, ids) in enumerate(zip(resp, t["topk_ids"].to_pylist())) for t in range(len(r)) if r[t] in ids[t])

    def damage(rows):
        k = list(rows[row]["topk_ids"][pos]).index(resp[row][pos])
        rows[row]["logprobs"][pos] = rows[row]["topk_logprobs"][pos][k] - 0.25
    _rewrite_shard(synth_cache, "teachers/synth", 0, damage)
    message = "log-prob of the sampled token disagrees with its top-k entry"
    assert f"row {row} column logprobs: {message}" in _texts(synth_cache)
    # the topk store's rule: the loader refuses the same row (it checked the top-k alone)
    from opdcache.errors import SchemaError
    from opdcache.training.data import CacheLoader, CacheLoaderConfig

    loader = CacheLoader(CacheLoaderConfig(cache=synth_cache, teacher="synth", stores=("logprob", "topk"), batch_size=4, shuffle=False))
    with pytest.raises(SchemaError, match=rf"part-00000-of-00003\.parquet: row {row}, column logprobs: {message}"):
        list(loader)


@pytest.mark.parametrize("command", ["validate", "info", "score-teacher", "export"])
def test_what_is_not_a_cache_is_said_in_one_line_with_exit_2(tmp_path, capsys, weights, command):
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    extra = {"score-teacher": ["--teacher", str(weights / "teacher")], "export": ["--to", "jsonl", "--out", str(tmp_path / "x")]}.get(command, [])
    for target, want in ((tmp_path / "nope", "nope: no such directory"), (text, "notes.txt is a file, not a cache"),
                         (weights / "student", "student is a model directory (config.json), not an opdcache cache; build a cache "
                                               "from it with `opdcache build-rollouts`")):
        code, out = _cli_all([command, str(target), *extra], capsys)
        lines = out.strip().splitlines()
        assert code == 2 and len(lines) == 1 and want in lines[0] and "Traceback" not in out, out


def test_a_row_with_an_empty_prompt_is_refused_by_validate_and_the_loader(synth_cache, capsys):
    """Its first response token is predicted from no position: the padded and the packed layouts each read some other
    position for it (they disagreed: 0.2790 packed, 0.2671 padded), so no reader takes such a row."""
    from opdcache.errors import SchemaError
    from opdcache.stores.rowrules import EMPTY_PROMPT
    from opdcache.training.data import CacheLoader, CacheLoaderConfig

    def empty(rows):
        rows[2]["prompt_ids"] = []

    _rewrite_shard(synth_cache, "rollouts", 1, empty)
    code, out = _cli(["validate", str(synth_cache)], capsys)
    assert code == 1 and f"rollouts/part-00001-of-00003.parquet row 2 column prompt_ids: {EMPTY_PROMPT}" in out, out
    for pack in (False, True):
        with pytest.raises(SchemaError, match=r"row 2, column prompt_ids: prompt_ids is empty"):
            list(CacheLoader(CacheLoaderConfig(cache=synth_cache, teacher="synth", batch_size=4, pack=pack)))


def test_the_loader_names_the_shard_that_breaks_a_rule(synth_cache):
    """A teacher table's top-k id outside the vocabulary: the loader names the teacher's shard (it named the
    rollouts'), and a rollout id outside it names the rollouts' shard."""
    from opdcache.errors import SchemaError
    from opdcache.training.data import CacheLoader, CacheLoaderConfig

    def far_id(rows):
        rows[1]["topk_ids"][0][0] = 10 ** 6

    _rewrite_shard(synth_cache, "teachers/synth", 2, far_id)
    loader = CacheLoader(CacheLoaderConfig(cache=synth_cache, teacher="synth", stores=("logprob", "topk"), batch_size=4, shuffle=False))
    with pytest.raises(SchemaError, match=r"teachers/synth/part-00002-of-00003\.parquet: row 1, column topk_ids: ") as info:
        list(loader)
    assert "rollouts/" not in str(info.value)

    def far_response(rows):
        rows[0]["response_ids"][0] = 10 ** 6

    _rewrite_shard(synth_cache, "rollouts", 0, far_response)
    with pytest.raises(SchemaError, match=r"rollouts/part-00000-of-00003\.parquet: row 0, column response_ids: token id outside"):
        list(CacheLoader(CacheLoaderConfig(cache=synth_cache, teacher="synth", batch_size=4, shuffle=False)))
