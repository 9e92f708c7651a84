"""A cache's tables are what its manifest says, written by the job that wrote them: a shard or a table record planted
in a cache is never adopted or merged by score-teacher, and validate names it."""

import json
import shutil

import pyarrow.parquet as pq
import pytest

from capped import run as _capped
from cli_helpers import cli as _in_process, one_line as _one_line
from opdcache.format import manifest as M

pytestmark = pytest.mark.slow  # run by .ci/run (pytest -m slow), beside the other hostile suites


def _cli(args, capsys=None):
    """(exit code, output) of the CLI on ``args`` in the hostile suites' capped child (tests/capped.py: address space
    capped, peak memory checked), as a probe of this round runs."""
    return _capped(args)




@pytest.fixture
def cache(hf_cache, tmp_path):
    root = tmp_path / "cache"
    shutil.copytree(hf_cache, root)
    return root


def _score(cache, weights, name, capsys):
    return _cli(["score-teacher", cache, "--teacher", weights / "teacher", "--store", "logprob", "--name", name, "--no-progress"], capsys)


def test_a_shard_planted_in_a_new_tables_folder_is_not_adopted(cache, weights, capsys):
    teacher = M.load(cache)["tables"]
    existing = next(t for t in teacher if t.startswith("teachers/"))
    (cache / "teachers" / "new").mkdir()
    planted = sorted((cache / existing).glob("part-*.parquet"))[0]
    shutil.copy(planted, cache / "teachers" / "new" / planted.name)
    before = M.load(cache)
    code, out = _score(cache, weights, "new", capsys)
    line = _one_line(out)
    assert code == 2 and "teachers/new holds files no job of this table wrote (teachers/new/part-" in line, line
    assert "refusing to adopt them" in line and "another --name" in line
    assert M.load(cache) == before  # nothing merged


def test_a_writers_temporary_in_a_new_tables_folder_is_neither_stray_nor_read(cache, weights, capsys):
    # another worker of the same job mid-write leaves its temporary in the folder: it is not a stray, and a temporary
    # planted under that name is never read (the table's shards and records are the job's own)
    (cache / "teachers" / "tmpd").mkdir()
    (cache / "teachers" / "tmpd" / "._opdcache_job.json.tmp-1-0badc0de").write_text("{not json")
    (cache / "teachers" / "tmpd" / ".part-00000.parquet.tmp-1-0badc0de").write_bytes(b"PAR1 planted")
    code, out = _score(cache, weights, "tmpd", capsys)
    assert code == 0, out
    assert "teachers/tmpd" in M.load(cache)["tables"]
    assert _cli(["validate", cache], capsys)[0] == 0


def test_a_shard_of_another_run_beside_a_partial_job_is_refused(cache, weights, capsys, monkeypatch):
    from opdcache.format import cache as C

    stopped = {"n": 0}
    real = C.TableJob.write_table

    def stop_after_one(self, index, table):  # the job killed after its first shard
        if stopped["n"] == 1:
            raise KeyboardInterrupt
        stopped["n"] += 1
        return real(self, index, table)

    monkeypatch.setattr(C.TableJob, "write_table", stop_after_one)
    code, _ = _in_process(["score-teacher", cache, "--teacher", weights / "teacher", "--store", "logprob", "--name", "partial",
                           "--no-progress"], capsys)  # the patch lives in this process
    assert code == 130
    monkeypatch.setattr(C.TableJob, "write_table", real)
    existing = next(t for t in M.load(cache)["tables"] if t.startswith("teachers/") and t != "teachers/partial")
    done = sorted((cache / "teachers" / "partial").glob("part-*.parquet"))
    assert len(done) == 1
    other = sorted((cache / existing).glob("part-*.parquet"))[1]
    shutil.copy(other, cache / "teachers" / "partial" / other.name)  # a shard of another table where the next one goes
    code, out = _score(cache, weights, "partial", capsys)
    line = _one_line(out)
    assert code == 2 and f"teachers/partial/{other.name} was not written by this job" in line and "a shard of another run" in line, line


@pytest.mark.parametrize("record", [
    "rollouts-model",  # names another table: would rewrite the rollouts' recorded model
    "replace-teacher",  # names the teacher table of its folder's neighbour
    "list", "no-table", "new-table-no-shards",
])
def test_a_planted_table_record_is_never_merged(cache, weights, capsys, record):
    manifest = M.load(cache)
    existing = next(t for t in manifest["tables"] if t.startswith("teachers/"))
    folder = cache / "teachers" / "zzz"
    folder.mkdir()
    if record == "rollouts-model":
        entry = json.loads(json.dumps(manifest["tables"]["rollouts"]))
        entry["model"] = {"name_or_path": "/planted/model"}
        content = {"table": "rollouts", "entry": entry}
    elif record == "replace-teacher":
        entry = json.loads(json.dumps(manifest["tables"][existing]))
        entry["shards"] = entry["shards"][:1]
        content = {"table": existing, "entry": entry}
    elif record == "list":
        content = [1, 2]
    elif record == "no-table":
        content = {"entry": {}}
    else:  # a well-formed record of its own folder, beside no shard
        entry = json.loads(json.dumps(manifest["tables"][existing]))
        entry["shards"] = [{**s, "path": s["path"].replace(existing, "teachers/zzz")} for s in entry["shards"]]
        content = {"table": "teachers/zzz", "entry": entry}
    (folder / "_table.json").write_text(json.dumps(content))
    code, out = _score(cache, weights, "fresh", capsys)
    assert code == 0 and "Traceback" not in out, out
    assert "finalize: not merged: " in out and "teachers/zzz/_table.json" in out
    after = M.load(cache)
    assert after["tables"]["rollouts"] == manifest["tables"]["rollouts"]
    assert after["tables"][existing] == manifest["tables"][existing]
    assert set(after["tables"]) == set(manifest["tables"]) | {"teachers/fresh"}
    code, out = _cli(["validate", cache], capsys)
    assert code == 0 and "teachers/zzz/_table.json" in out and "a table record no finalize merges" in out, out


def _claim_one_more_row(cache, rel: str) -> int:
    """Rewrite the footer of shard ``rel`` to claim one row more than its data holds (the file's and the row group's
    row counts, each a Thrift compact i64 field 3 after field 2, zigzag varint: the first and last such bytes of the
    footer; the columns' value counts between them stay true), and make the manifest agree with the footer (rows,
    bytes, sha256), as a hostile writer would."""
    import hashlib

    path = cache / rel
    rows = pq.ParquetFile(path).metadata.num_rows
    assert rows < 63  # one-byte varints
    data = bytearray(path.read_bytes())
    start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    old, new = bytes([0x16, rows << 1]), bytes([0x16, (rows + 1) << 1])
    first, last = data.find(old, start), data.rfind(old, start)
    assert start <= first < last
    data[first:first + 2], data[last:last + 2] = new, new
    path.write_bytes(bytes(data))
    assert pq.ParquetFile(path).metadata.num_rows == rows + 1
    manifest = M.load(cache)
    for table in manifest["tables"].values():
        for info in table["shards"]:
            if info["path"] == rel:
                info.update(rows=rows + 1, bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    M.save(cache, manifest)
    return rows


def test_a_footer_claiming_more_rows_than_its_data_is_refused_by_every_reader(cache, weights, tmp_path, capsys):
    rel = M.load(cache)["tables"]["rollouts"]["shards"][0]["path"]
    rows = _claim_one_more_row(cache, rel)
    want = f"its data decodes to {rows:,} rows, its footer says {rows + 1:,}"
    code, out = _cli(["validate", cache], capsys)
    assert code == 1 and want in out, out
    for args in (["export", cache, "--to", "jsonl", "--out", tmp_path / "x"],
                 ["train", "--model", weights / "student", "--cache", cache, "--out", tmp_path / "run", "--steps", "1",
                  "--batch-size", "48", "--no-progress"],
                 ["train", "--model", weights / "student", "--cache", cache, "--out", tmp_path / "run2", "--steps", "1",
                  "--batch-size", "48", "--no-pack", "--no-progress"]):
        code, out = _cli(args, capsys)
        line = _one_line(out)
        assert code == 2 and want in line, (args[0], line)


def test_export_never_writes_a_non_json_nan(cache, tmp_path, capsys):
    import hashlib

    import pyarrow as pa

    manifest = M.load(cache)
    name = next(t for t in manifest["tables"] if t.startswith("teachers/"))
    info = manifest["tables"][name]["shards"][0]
    path = cache / info["path"]
    table = pq.read_table(path)
    rows = table.to_pylist()
    rows[0]["logprobs"][0] = float("nan")
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
    info.update(bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    M.save(cache, manifest)
    code, out = _cli(["export", cache, "--to", "jsonl", "--teacher", name.split("/", 1)[1], "--out", tmp_path / "x"], capsys)
    line = _one_line(out)
    assert code == 2 and ("NaN" in line or "non-finite" in line), line
    assert not any("NaN" in p.read_text() for p in (tmp_path / "x").rglob("*") if p.is_file())


@pytest.mark.parametrize("record, want", [
    ([1, 2, 3], "fidelity is [1, 2, 3], not an object"),
    ({"measured": True, "entropy": {"mean": "x", "max": 1, "positions": 3, "means": "m"}}, "fidelity/entropy is "),
    ({"measured": True, "entropy": 5}, "not a measured quantity (mean, max, positions, means)"),
], ids=["list", "string-mean", "number"])
def test_a_fidelity_record_of_the_wrong_shape_is_one_line(cache, capsys, record, want):
    manifest = json.loads((cache / "opdcache.json").read_text())
    name = next(t for t in manifest["tables"] if t.startswith("teachers/"))
    manifest["tables"][name]["fidelity"] = record
    (cache / "opdcache.json").write_text(json.dumps(manifest))
    for args, code_wanted in ((["info", cache], 2), (["validate", cache], 1)):
        code, out = _cli(args, capsys)
        line = _one_line(out)
        assert code == code_wanted and want in line, (args[0], line)


def test_validate_on_a_shard_whose_rows_are_all_empty_is_a_report_not_a_traceback(cache, capsys):
    import hashlib
    import os

    import pyarrow as pa

    manifest = M.load(cache)
    info = manifest["tables"]["rollouts"]["shards"][0]
    path = cache / info["path"]
    table = pq.read_table(path)
    rows = [{k: ([] if isinstance(v, list) and k != "prompt_ids" else v) for k, v in r.items()} for r in table.to_pylist()]
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
    info.update(bytes=os.path.getsize(path), sha256=hashlib.sha256(path.read_bytes()).hexdigest(), tokens=0)
    M.save(cache, manifest)
    code, out = _cli(["validate", cache], capsys)
    assert code == 1 and "Traceback" not in out and "INVALID" in out, out[-2000:]


def test_a_job_file_another_worker_began_meanwhile_is_the_jobs_own_not_a_stray(tmp_path):
    """Workers of one job start together (Ray, Slurm arrays): one may list the folder after another wrote the job file
    it did not see a moment before. That file, with the job's fingerprint, is the job's own; one of another job is not."""
    from opdcache.format import schema as S
    from opdcache.format.cache import JOB_FILE, TableJob

    params = S.StoreParams(stores=("base",))
    first = TableJob(tmp_path, "rollouts", "rollouts", params, {"x": 1}, 2)
    first.begin()
    same = TableJob(tmp_path, "rollouts", "rollouts", params, {"x": 1}, 2)
    other = TableJob(tmp_path, "rollouts", "rollouts", params, {"x": 2}, 2)
    assert same._written_by_this_job(tmp_path / "rollouts" / JOB_FILE)
    assert not other._written_by_this_job(tmp_path / "rollouts" / JOB_FILE)
