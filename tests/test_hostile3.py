"""Untrusted input, round three: nothing written or read outside a cache through a link, and a manifest's recorded
model path taken only as a hint.

Each probe runs the installed CLI in a child whose address space is capped, and asserts one line naming the problem,
the exit code, that no file outside the cache was touched and that the cache's bytes did not change.
"""

import hashlib
import json
import os
import shutil

import pytest

from test_hostile2 import _digest, _one_line, _run

pytestmark = pytest.mark.slow  # run by .ci/run (pytest -m slow), not by the README's test command


@pytest.fixture
def cache(hf_cache, tmp_path):
    root = tmp_path / "cache"
    shutil.copytree(hf_cache, root)
    return root


def _outside(tmp_path):
    """A folder outside the cache with one file whose bytes must survive every probe."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "precious.txt").write_text("keep me\n")
    return folder


def _tree(folder) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


# ---------------------------------------------------------------- writes


@pytest.mark.parametrize("planted", ["file", "folder"])
def test_mismatch_report_never_writes_through_a_link_in_its_default_folder(cache, tmp_path, planted):
    outside = _outside(tmp_path)
    report = cache / "mismatch-report"
    if planted == "file":
        report.mkdir()
        (report / "mismatch_hist.png").symlink_to(outside / "precious.txt")
    else:
        report.symlink_to(outside, target_is_directory=True)
    before, outside_before = _digest(cache), _tree(outside)
    code, out = _run(["mismatch-report", cache])
    line = _one_line(out)
    assert code == 2 and "leads outside the cache" in line and "refusing to write" in line, line
    assert ("mismatch_hist.png" if planted == "file" else "mismatch-report") in line
    assert _tree(outside) == outside_before and _digest(cache) == before
    assert "float32 recompute" not in out  # refused before any model was loaded


def test_score_teacher_never_writes_a_table_through_a_linked_teachers_folder(cache, tmp_path, weights):
    outside = _outside(tmp_path)
    shutil.move(str(cache / "teachers"), str(outside / "teachers"))
    (cache / "teachers").symlink_to(outside / "teachers", target_is_directory=True)
    outside_before = _tree(outside)
    code, out = _run(["score-teacher", cache, "--teacher", weights / "teacher", "--store", "logprob", "--name", "newt"])
    line = _one_line(out)
    assert code == 2 and "teachers" in line and "leads outside the cache" in line and "refusing to write" in line, line
    assert _tree(outside) == outside_before  # no shard, no _table.json, no job file appeared outside


def test_a_manifest_linked_to_a_file_elsewhere_is_neither_read_nor_rewritten(cache, tmp_path, weights):
    outside = _outside(tmp_path)
    real = outside / "opdcache.json"
    shutil.move(str(cache / "opdcache.json"), str(real))
    (cache / "opdcache.json").symlink_to(real)
    outside_before = _tree(outside)
    for args in (["validate", cache], ["info", cache], ["export", cache, "--to", "jsonl", "--out", tmp_path / "x"],
                 ["train", "--model", weights / "student", "--cache", cache, "--loss", "lightning", "--steps", 1, "--out", tmp_path / "run"]):
        code, out = _run(args)
        line = _one_line(out)
        assert code == (1 if args[0] == "validate" else 2) and "opdcache.json" in line and "leads outside the cache" in line, (args, line)
    assert _tree(outside) == outside_before


def test_a_tokenizer_file_linked_outside_is_not_opened(cache, tmp_path):
    outside = _outside(tmp_path)
    target = cache / "tokenizer" / "tokenizer.json"
    shutil.move(str(target), str(outside / "tokenizer.json"))
    target.symlink_to(outside / "tokenizer.json")
    code, out = _run(["export", cache, "--to", "jsonl", "--out", tmp_path / "x"])
    line = _one_line(out)
    assert code == 2 and "tokenizer.json" in line and "leads outside the cache" in line, line
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_a_hard_linked_file_is_not_written_through(tmp_path):
    from opdcache import storage
    from opdcache.errors import ManifestError

    root = tmp_path / "cache"
    root.mkdir()
    outside = _outside(tmp_path)
    os.link(outside / "precious.txt", root / "README.md")
    with pytest.raises(ManifestError, match="hard link shared with 1 other name"):
        storage.confined_write(root, root / "README.md")
    assert (outside / "precious.txt").read_text() == "keep me\n"


def test_writes_inside_a_cache_reached_through_a_linked_root_are_allowed(tmp_path):
    """A user's own cache folder may be a link (a scratch disk mounted elsewhere): only links below the root count."""
    from opdcache import storage

    real = tmp_path / "disk" / "cache"
    (real / "teachers").mkdir(parents=True)
    link = tmp_path / "cache"
    link.symlink_to(real, target_is_directory=True)
    assert storage.confined_write(link, link / "teachers" / "t" / "part-0.parquet") == link / "teachers" / "t" / "part-0.parquet"
    (real / "inner").mkdir()
    (real / "teachers" / "alias").symlink_to(real / "inner", target_is_directory=True)  # a link that stays inside
    storage.confined_write(link, link / "teachers" / "alias" / "x.json")


def test_the_temporary_file_is_created_new_and_never_through_a_link(tmp_path):
    from opdcache import storage

    target = tmp_path / "a.txt"
    with storage.staged(target) as tmp:
        assert tmp.is_file() and not tmp.is_symlink() and tmp.parent == tmp_path
        assert tmp.name.startswith(".a.txt.tmp-")
        tmp.write_text("whole")
    assert target.read_text() == "whole" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]


# ---------------------------------------------------------------- reads: the Hugging Face cache layout


def test_a_cache_in_a_hugging_face_snapshot_reads_its_blob_links(hf_cache, tmp_path):
    """snapshots/<revision>/ holds links into the repository's blobs/ folder: the one layout of links allowed."""
    repo = tmp_path / "hub" / "datasets--me--cache"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    for src in sorted(p for p in hf_cache.rglob("*") if p.is_file()):
        digest = hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copyfile(src, blobs / digest)
        dest = snap / src.relative_to(hf_cache)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.symlink_to(os.path.relpath(blobs / digest, dest.parent))
    code, out = _run(["validate", snap])
    assert code == 0, out[-2000:]
    code, out = _run(["info", snap])
    assert code == 0 and "rollouts" in out, out[-2000:]


def test_a_link_from_a_snapshot_to_elsewhere_is_still_refused(hf_cache, tmp_path):
    repo = tmp_path / "hub" / "datasets--me--cache"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    shutil.copytree(hf_cache, snap)
    outside = _outside(tmp_path)
    shutil.move(str(snap / "opdcache.json"), str(outside / "opdcache.json"))
    (snap / "opdcache.json").symlink_to(outside / "opdcache.json")
    code, out = _run(["info", snap])
    assert code == 2 and "leads outside the cache" in _one_line(out)


# ---------------------------------------------------------------- the recorded model path is a hint


def _record_model(cache, table: str, path, fingerprint="keep"):
    manifest = json.loads((cache / "opdcache.json").read_text())
    record = manifest["tables"][table]["model"]
    record["name_or_path"] = str(path)
    if fingerprint != "keep":
        record["fingerprint"] = fingerprint
    (cache / "opdcache.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("command", [["audit", "--table", "rollouts", "--rows", 2], ["mismatch-report", "--no-png", "--out", "REPORT"]])
def test_a_recorded_model_path_with_other_weights_is_refused_asking_for_model(cache, tmp_path, weights, command):
    """A stranger's manifest names a model folder on this machine: the command does not load it unless its weights carry
    the recorded fingerprint (here they are the teacher's, not pi_ref's), and asks for --model."""
    _record_model(cache, "rollouts", weights / "teacher")
    args = [a if a != "REPORT" else tmp_path / "report" for a in command]
    code, out = _run([args[0], cache, *args[1:]])
    line = _one_line(out)
    assert code == 2 and "does not carry the recorded fingerprint" in line and "pass --model PATH" in line, line


def test_a_recorded_model_folder_with_pickled_weights_is_not_loaded(cache, tmp_path, weights):
    planted = tmp_path / "planted"
    shutil.copytree(weights / "student", planted)
    (planted / "pytorch_model.bin").write_bytes(b"\x80\x04not a model")
    _record_model(cache, "rollouts", planted)
    code, out = _run(["audit", cache, "--table", "rollouts", "--rows", 2])
    line = _one_line(out)
    assert code == 2 and "pickle" in line and "pytorch_model.bin" in line and "pass --model PATH" in line, line


def test_a_recorded_model_with_its_fingerprint_is_used_and_named(cache, weights):
    code, out = _run(["audit", cache, "--table", "rollouts", "--rows", 2])
    assert code == 0, out[-2000:]
    assert "the rollouts table: the recorded model, fingerprint" in out and str(weights / "student") in out


# ---------------------------------------------------------------- memory by the bytes on disk: pages against the footer


def _varint(n: int, width: int | None = None) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
        if not n:
            break
    out[-1] &= 0x7F
    while width is not None and len(out) < width:  # a non-canonical varint of the same value: zero payload, continued
        out[-1] |= 0x80
        out.append(0)
    return bytes(out)


def _lie_in_footer(path, true_values: int, claimed: int) -> None:
    """Rewrite one column's value count in the footer (Thrift compact: zigzag varint) from ``true_values`` to ``claimed``,
    keeping the footer's length, as a hostile writer would."""
    data = bytearray(path.read_bytes())
    footer_len = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - footer_len
    old = _varint(true_values << 1)
    new = _varint(claimed << 1, len(old))
    assert len(new) == len(old) and data.count(old, start) >= 1
    data[start:] = data[start:].replace(old, new)  # the column's count (and its size statistics' copy, where written)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("values, refusal", [
    (5_000_000, "its pages hold 5,000,000 values, its footer says 512: refused before decoding"),  # 20 MB decoded
    (20_000_000, r"its pages decode to more than 67,\d+,\d+ bytes \(64x its [\d,]+ bytes on disk \+ 64 MiB\)"),  # 80 MB
])
def test_a_page_holding_more_values_than_its_footer_says_is_refused_before_decoding(tmp_path, values, refusal):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from opdcache.format import shards
    from opdcache.errors import SchemaError

    path = tmp_path / "bomb.parquet"  # a few KB on disk
    pq.write_table(pa.table({"response_ids": pa.array([np.zeros(values, np.int32)], pa.list_(pa.int32()))}), path,
                   compression="zstd", use_dictionary=False)
    assert path.stat().st_size < 100_000
    _lie_in_footer(path, values, 512)
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).num_values == 512  # the footer now claims 512
    with pytest.raises(SchemaError, match=refusal):
        shards.read_table(path)


def test_pages_that_decompress_far_beyond_the_files_bytes_are_refused(tmp_path, monkeypatch):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from opdcache.format import pagecheck, shards
    from opdcache.errors import SchemaError

    path = tmp_path / "zeros.parquet"
    rows = [np.zeros(1_000_000, np.float32)] * 4  # 16 MB decoded, a few KB on disk
    pq.write_table(pa.table({"x": pa.array(rows, pa.list_(pa.float32()))}), path, compression="zstd", use_dictionary=False)
    with pytest.raises(SchemaError, match="not an opdcache shard"):  # 16 MB from a few KB is within the floor: the page check
        shards.read_table(path)                                        # passes, and the next check refuses a foreign file
    monkeypatch.setattr(pagecheck, "EXPANSION_FLOOR", 1 << 20)
    with pytest.raises(SchemaError, match=r"pages decode to more than .* \(64x its .* bytes on disk \+ 1 MiB\)"):
        shards.read_table(path)


def test_page_headers_of_every_store_agree_with_their_footers(hf_cache):
    """Every shard opdcache writes (rollouts with top-k and MC, teacher tables in every store) passes the page check, and
    decompresses to a small multiple of its bytes on disk."""
    from opdcache.format import pagecheck, shards

    paths = sorted(hf_cache.rglob("part-*.parquet"))
    assert len(paths) >= 6
    for path in paths:
        pf, nbytes = shards._open(path)
        with open(path, "rb") as f:
            total = pagecheck.check_pages(f, pf.metadata, nbytes)
        assert 0 < total < 8 * nbytes, (path.name, total, nbytes)


def test_the_page_header_parser_reads_what_pyarrow_wrote(tmp_path):
    """Data pages v1 and v2, dictionary pages and page statistics: every header parses and the counts add up."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from opdcache.format import pagecheck

    table = pa.table({"ids": pa.array([np.arange(i, dtype=np.int32) for i in range(300)], pa.list_(pa.int32())),
                      "name": pa.array([f"row-{i % 7}" for i in range(300)]),
                      "score": pa.array(np.linspace(0, 1, 300), pa.float64())})
    for version in ("1.0", "2.0"):
        path = tmp_path / f"t{version}.parquet"
        pq.write_table(table, path, data_page_version=version, write_statistics=True, data_page_size=512, row_group_size=100)
        pf = pq.ParquetFile(path)
        with open(path, "rb") as f:
            total = pagecheck.check_pages(f, pf.metadata, path.stat().st_size)
        assert total > 0


# ---------------------------------------------------------------- types and nulls, checked where every command reads


@pytest.mark.parametrize("damage", ["int64-ids", "float64-logprobs", "null-inside-ids"])
@pytest.mark.parametrize("command", ["validate", "export", "train"])
def test_wrong_types_and_nulls_are_refused_by_every_command(cache, tmp_path, weights, damage, command):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from test_hostile2 import _replace

    for rel in sorted(p.relative_to(cache).as_posix() for p in (cache / "rollouts").glob("part-*.parquet")):  # train reads any
        table = pq.read_table(cache / rel)
        if damage == "int64-ids":
            field = pa.field("response_ids", pa.list_(pa.int64()))
            table = table.set_column(table.schema.get_field_index("response_ids"), field, table["response_ids"].cast(field.type))
        elif damage == "float64-logprobs":
            field = pa.field("ref_logprobs", pa.list_(pa.float64()))
            table = table.set_column(table.schema.get_field_index("ref_logprobs"), field, table["ref_logprobs"].cast(field.type))
        else:
            rows = table["response_ids"].to_pylist()
            rows[1][2] = None
            table = table.set_column(table.schema.get_field_index("response_ids"), table.schema.field("response_ids"),
                                     pa.array(rows, table.schema.field("response_ids").type))
        _replace(cache, rel, table)
    before = _digest(cache)
    args = {"validate": ["validate", cache], "export": ["export", cache, "--to", "jsonl", "--out", tmp_path / "x"],
            "train": ["train", "--model", weights / "student", "--cache", cache, "--loss", "lightning", "--steps", 1, "--out",
                      tmp_path / "run"]}[command]
    code, out = _run(args)
    assert code == (1 if command == "validate" else 2) and "Traceback" not in out, out[-2000:]
    want = {"int64-ids": "response_ids: list<element: int64>", "float64-logprobs": "ref_logprobs: list<element: double>",
            "null-inside-ids": "column response_ids holds 1 null values inside its lists"}[damage]
    assert want in out, out[-2000:]
    if command != "validate":
        line = _one_line(out)
        assert want in line
    assert _digest(cache) == before


@pytest.mark.parametrize("command", ["validate", "info"])
def test_a_manifest_with_a_key_twice_is_one_line(cache, command):
    text = (cache / "opdcache.json").read_text()
    (cache / "opdcache.json").write_text(text.replace('"kind": "rollouts"', '"kind": "rollouts", "kind": "sft"', 1))
    code, out = _run([command, cache])
    line = _one_line(out)
    assert code in ((1, 2) if command == "validate" else (2,)) and "the key 'kind' appears twice in one object" in line and "opdcache.json" in line, line


@pytest.mark.parametrize("damage,want", [
    (("shards", "rows", 16.0), "tables/rollouts/shards/0/rows: 16.0 is not an integer"),
    (("sampling", "temperature", float("nan")), "tables/rollouts/config/sampling/temperature: nan is not a number in [0, 1e+06]"),
    (("config", "vocab_size", float("-inf")), "tables/rollouts/config/vocab_size: -inf is not an integer"),
])
@pytest.mark.parametrize("command", ["validate", "train"])
def test_manifest_numbers_are_typed_and_finite_for_every_command(cache, tmp_path, weights, damage, want, command):
    manifest = json.loads((cache / "opdcache.json").read_text())
    entry = manifest["tables"]["rollouts"]
    where, key, value = damage
    target = {"shards": entry["shards"][0], "sampling": entry["config"]["sampling"], "config": entry["config"]}[where]
    target[key] = value
    (cache / "opdcache.json").write_text(json.dumps(manifest, indent=2))
    before = _digest(cache)
    args = {"validate": ["validate", cache],
            "train": ["train", "--model", weights / "student", "--cache", cache, "--loss", "lightning", "--steps", 1, "--out", tmp_path / "run"]}
    code, out = _run(args[command])
    line = _one_line(out)
    assert code in ((1, 2) if command == "validate" else (2,)) and want in line and "rebuild the cache" in line, line
    assert _digest(cache) == before


def _rewrite_side_file(cache, name: str, tensors: dict) -> None:
    """Replace a teacher side file with ``tensors`` (valid safetensors) and make the manifest's size and hash agree."""
    from safetensors.torch import save_file

    path = cache / "teachers" / "teacher" / name
    save_file(tensors, str(path))
    manifest = json.loads((cache / "opdcache.json").read_text())
    manifest["tables"]["teachers/teacher"]["files"][name].update(bytes=path.stat().st_size,
                                                                  sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    (cache / "opdcache.json").write_text(json.dumps(manifest, indent=2))


@pytest.mark.parametrize("damage,want", [
    ("nan", "tensor 'weight' holds 1 NaN or infinite values"),
    ("wide", "head.safetensors holds a [64, 129] matrix where the table's vocabulary and its hidden vectors need [64, 128]"),
])
@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_head_of_nan_or_of_the_wrong_width_is_one_line(cache, tmp_path, weights, damage, want, command):
    import torch
    from safetensors.torch import load_file

    weight = load_file(str(cache / "teachers" / "teacher" / "head.safetensors"))["weight"].clone()
    if damage == "nan":
        weight[3, 5] = float("nan")
    else:
        weight = torch.cat([weight, torch.zeros(weight.shape[0], 1, dtype=weight.dtype)], 1)
    _rewrite_side_file(cache, "head.safetensors", {"weight": weight.contiguous()})
    before = _digest(cache)
    args = {"validate": ["validate", cache],
            "train": ["train", "--model", weights / "student", "--cache", cache, "--loss", "full-rkl", "--steps", 1, "--out", tmp_path / "run"]}
    code, out = _run(args[command])
    assert code in ((1, 2) if command == "validate" else (2,)) and "Traceback" not in out, out[-2000:]
    if command == "train" and damage == "wide":
        want = "holds a [64, 129] matrix, where the student's vocabulary and the stored vectors need [64, 128]"
    assert want in (out if command == "validate" else _one_line(out)), out[-2000:]
    assert "--lr" not in out
    assert _digest(cache) == before


def test_an_svd_file_of_nan_is_one_line(cache):
    import torch
    from safetensors.torch import load_file, save_file

    path = cache / "teachers" / "teacher" / "svd.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    tensors["decoder"] = tensors["decoder"].clone()
    tensors["decoder"][0, 0] = float("inf")
    save_file(tensors, str(path), metadata=metadata)
    manifest = json.loads((cache / "opdcache.json").read_text())
    manifest["tables"]["teachers/teacher"]["files"]["svd.safetensors"].update(bytes=path.stat().st_size,
                                                                              sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    (cache / "opdcache.json").write_text(json.dumps(manifest, indent=2))
    code, out = _run(["validate", cache])
    assert code == 1 and "Traceback" not in out and "tensor 'decoder' holds 1 NaN or infinite values" in out, out[-2000:]
    assert torch.isinf(load_file(str(path))["decoder"]).any()


@pytest.mark.parametrize("command", ["check-consistency", "validate"])
def test_a_teacher_row_one_position_longer_is_one_line(cache, command):
    from test_hostile2 import _replace, _set_list_column, _teacher_shard

    rel, table = _teacher_shard(cache)
    rows = table["logprobs"].to_pylist()
    rows[2] = rows[2] + [-1.0]
    _replace(cache, rel, _set_list_column(table, "logprobs", rows), tokens=None)
    manifest = json.loads((cache / "opdcache.json").read_text())
    for s in manifest["tables"]["teachers/teacher"]["shards"]:  # keep the recorded token count an integer
        if s["tokens"] is None:
            s["tokens"] = sum(len(r) for r in rows)
    (cache / "opdcache.json").write_text(json.dumps(manifest))
    before = _digest(cache)
    code, out = _run([command, cache])
    assert code in ((1, 2) if command == "validate" else (2,)) and "Traceback" not in out, out[-2000:]
    assert "logprobs" in out, out[-2000:]
    if command == "check-consistency":  # the loader's and export's words, which validate's line also carries
        assert "teacher column logprobs is not as long as the responses (row 2" in _one_line(out)
    else:
        assert "row 2 column logprobs: not as long as the responses" in out
    assert _digest(cache) == before


def test_an_async_ledger_with_lines_that_are_not_entries_is_one_line(tmp_path):
    """Each line an entry of typed fields (batch 2.5, no consumed_at_step, a string time: one line each); a line cut by
    a crash ends the file."""
    from opdcache.asyncopd import queue as Q
    from opdcache.errors import OpdcacheError

    def entry(b, **kw):
        return json.dumps({"batch": b, "student_version": 0, "consumed_at_step": 1, "time": 1.0, **kw})

    ledger = tmp_path / Q.LEDGER
    ledger.write_text(entry(0) + "\n" + entry(1) + '\n{"batch": 2, "stal')  # cut by a crash
    assert [e["batch"] for e in Q.read_jsonl(ledger)] == [0, 1]
    wanted = ("a JSON object with batch (a non-negative integer), consumed_at_step (a non-negative integer), "
              "student_version (a non-negative integer), time (a number or null)")
    for bad in ('[1, 2]', '"text"', '{"staleness": 0}', entry("zero"), entry(True), entry(2.5), entry(1, time="noon"),
                json.dumps({"batch": 1, "student_version": 1, "time": 1.0}), 'not json'):
        ledger.write_text(entry(0) + "\n" + bad + "\n" + entry(2) + "\n")
        with pytest.raises(OpdcacheError) as e:
            Q.read_jsonl(ledger)
        assert str(e.value).startswith(f"{ledger}: line 2 is not an entry of the run ({wanted})"), str(e.value)
        assert "\n" not in str(e.value)
    (tmp_path / "stages").mkdir()
    busy = tmp_path / "stages" / "rollout.busy.jsonl"
    busy.write_text('{"batch": 0, "start": 1.5}\n{"batch": 1, "start": 1.5, "end": 2.0}\n')
    with pytest.raises(OpdcacheError, match=r"batch \(a non-negative integer\), start \(a number\), end \(a number\)"):
        Q.read_jsonl(busy)


@pytest.mark.parametrize("command", ["validate", "export", "check-consistency", "train"])
def test_one_huge_row_among_short_ones_is_refused_row_by_row(cache, tmp_path, weights, command):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from opdcache.format.shardcheck import MAX_ROW_TOKENS
    from test_hostile2 import _replace, _set_list_column

    rel = sorted(p.relative_to(cache).as_posix() for p in (cache / "rollouts").glob("part-*.parquet"))[0]
    table = pq.read_table(cache / rel)
    column = "ref_logprobs" if command == "check-consistency" else "prompt_ids"  # one it reads
    rows = table[column].to_pylist()
    rows[2] = np.full(MAX_ROW_TOKENS + 10, -1.0 if column == "ref_logprobs" else 7)  # the shard's total stays far below rows x the limit
    extra = {"tokens": int(sum(len(r) for r in table["response_ids"].to_pylist())) + MAX_ROW_TOKENS} if column == "ref_logprobs" else {}
    _replace(cache, rel, _set_list_column(table, column, rows), **extra)
    before = _digest(cache)
    args = {"validate": ["validate", cache], "export": ["export", cache, "--to", "jsonl", "--out", tmp_path / "x"],
            "check-consistency": ["check-consistency", cache],
            "train": ["train", "--model", weights / "student", "--cache", cache, "--loss", "lightning", "--steps", 1, "--out", tmp_path / "run"]}
    code, out = _run(args[command])
    assert code in ((1, 2) if command == "validate" else (2,)) and "Traceback" not in out, out[-2000:]
    want = f"row 2 of column {column} holds 1,048,586 tokens, more than the reading limit of 1,048,576"
    if command == "train":  # the loader knows the model's context (128): the footer's total is refused before decoding
        total = sum(len(r) for r in rows)  # the row's MAX_ROW_TOKENS + 10 and the other 15 rows' own prompts
        want = f"column {column} holds {total:,} entries for 16 rows, more than the model's context of 128 tokens a row"
    assert want in (out if command == "validate" else _one_line(out)), out[-2000:]
    assert _digest(cache) == before


def test_a_huge_string_is_refused_row_by_row(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from opdcache.format import shardcheck
    from opdcache.errors import SchemaError

    monkeypatch.setattr(shardcheck, "MAX_STRING_BYTES", 1000)
    table = pa.table({"task": pa.array(["short", "x" * 1001, "short"]), "ids": pa.array([[1], [2, 3], []], pa.list_(pa.int32()))})
    with pytest.raises(SchemaError, match="row 1 of column task holds a 1,001-byte string, more than the reading limit of 1,000 bytes"):
        shardcheck.check_rows(table, "t.parquet")
    with pytest.raises(SchemaError, match="row 1 of column ids holds 2 tokens, more than the model's context of 1"):
        shardcheck.check_rows(table.drop_columns(["task"]), "t.parquet", max_row_tokens=1)
    shardcheck.check_rows(table.slice(2), "t.parquet", max_row_tokens=1)  # an offset slice: rows counted from its start
    pq.write_table(table, tmp_path / "t.parquet")


def test_a_run_length_bomb_agreed_by_footer_and_manifest_is_refused_before_decoding(tmp_path):
    """64 rows of a million zero tokens: a few KB on disk, their pages a few KB decompressed (run-length and dictionary
    encoded), 256 MB decoded; the footer's counts are true, so only the decoded size can refuse it."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from opdcache.errors import SchemaError
    from opdcache.format import pagecheck, shards

    path = tmp_path / "rle.parquet"
    pq.write_table(pa.table({"response_ids": pa.array([np.zeros(1_000_000, np.int32)] * 64, pa.list_(pa.int32()))}), path,
                   compression="zstd")
    assert path.stat().st_size < 200_000
    pf = pq.ParquetFile(path)
    with open(path, "rb") as f:
        with pytest.raises(pagecheck.PageError, match=r"its pages decode to more than [\d,]+ bytes \(64x its"):
            pagecheck.check_pages(f, pf.metadata, path.stat().st_size, ["response_ids"])
    with pytest.raises(SchemaError, match="decode to more than"):
        shards.read_table(path, ["response_ids"])
