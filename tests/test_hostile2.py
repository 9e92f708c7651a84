"""Untrusted input, round two: each hostile cache or input, and its outcome.

Every case runs the installed CLI's main in a child whose address space is capped (RLIMIT_AS, MEMORY_BOUND), one child
for all the probes (tests/cliserver.py: it imports torch once), and checks that the probe's peak resident memory stays
within 1 GiB of that child's before any probe (RSS_ABOVE_BASELINE); and asserts one line naming the problem, the exit
code, and that no file of the cache changed.
"""

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opdcache.format import shards

pytestmark = pytest.mark.slow  # run by .ci/run (pytest -m slow), not by the README's test command

from capped import MEMORY_BOUND, RSS_ABOVE_BASELINE, baseline_rss, run as _run  # noqa: F401 (test_hostile3 imports _run from here)


def _one_line(out: str) -> str:
    lines = [line for line in out.strip().splitlines() if line.startswith("error")]
    assert "Traceback" not in out and len(lines) == 1, out[-3000:]
    assert len(lines[0]) < 2200, lines[0][:300]
    return lines[0]


def _digest(root) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()
            and "mismatch-report" not in p.parts}


@pytest.fixture
def cache(hf_cache, tmp_path):
    root = tmp_path / "cache"
    shutil.copytree(hf_cache, root)
    return root


def _replace(root, rel: str, table: pa.Table, **entry) -> None:
    """Write ``table`` as the shard ``rel`` and make the manifest agree with it (size, hash, and ``entry`` fields)."""
    path = root / rel
    pq.write_table(table, path)
    manifest = json.loads((root / "opdcache.json").read_text())
    for t in manifest["tables"].values():
        for s in t["shards"]:
            if s["path"] == rel:
                s.update(bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest(), **entry)
    (root / "opdcache.json").write_text(json.dumps(manifest))


def _teacher_shard(root):
    rel = sorted((root / "teachers" / "teacher").glob("part-*.parquet"))[0].relative_to(root).as_posix()
    return rel, pq.read_table(root / rel)


def _set_list_column(table: pa.Table, name: str, rows: list) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), table.schema.field(name), pa.array(rows, table.schema.field(name).type))


def _train_args(root, tmp_path, weights, loss="sampled-fkl"):
    return ["train", "--model", weights / "student", "--cache", root, "--loss", loss, "--steps", 1, "--batch-size", 64,
            "--out", tmp_path / "run", "--allow-other-model"]


# ------------------------------------------------------------------------------------------ 1. v3 rows where trained
@pytest.mark.parametrize("damage", ["id-beyond-vocabulary", "negative-id", "huge-counts", "padding-first"])
def test_hostile_sampled_rows_are_refused_by_train_and_validate(cache, tmp_path, weights, damage):
    rel, table = _teacher_shard(cache)
    ids, counts = table["sampled_ids"].to_pylist(), table["sampled_counts"].to_pylist()
    row = ids[2]
    if damage == "id-beyond-vocabulary":
        row[0][0] = 10_000
    elif damage == "negative-id":
        row[0][0] = -5
    elif damage == "huge-counts":
        counts[2][0] = [2 ** 31 - 1] + [-(2 ** 31 - 1) + 4] + counts[2][0][2:]
    else:  # the padding slot moved first
        pos = next(i for i, p in enumerate(row) if -1 in p)
        row[pos] = sorted(row[pos])
        counts[2][pos] = sorted(counts[2][pos])
    table = _set_list_column(_set_list_column(table, "sampled_ids", ids), "sampled_counts", counts)
    _replace(cache, rel, table)
    before = _digest(cache)
    code, out = _run(["validate", cache])
    assert code == 1 and "row 2" in out and "sampled_" in out and "Traceback" not in out, out
    code, out = _run(_train_args(cache, tmp_path, weights))
    line = _one_line(out)
    assert code == 2 and "row 2" in line and "sampled_" in line and "validate" in line, line
    assert _digest(cache) == before and not (tmp_path / "run" / "model").exists()


def test_a_topk_id_beyond_the_vocabulary_is_refused_by_train(cache, tmp_path, weights):
    rel, table = _teacher_shard(cache)
    ids = table["topk_ids"].to_pylist()
    ids[0][1][3] = 999_999
    _replace(cache, rel, _set_list_column(table, "topk_ids", ids))
    code, out = _run(_train_args(cache, tmp_path, weights, loss="topk-fkl"))
    line = _one_line(out)
    assert code == 2 and "row 0" in line and "topk_ids" in line and "outside the vocabulary" in line


# ------------------------------------------------------------------------------------------ 2. size bombs
def _bomb_like(table: pa.Table, rows: int) -> pa.Table:
    """``rows`` rows of the table's schema: empty lists, and the first row's scalars repeated (compresses to nothing)."""
    cols = []
    for field in table.schema:
        if pa.types.is_list(field.type):
            cols.append(pa.ListArray.from_arrays(pa.array(np.zeros(rows + 1, np.int32)), pa.array([], field.type.value_type)))
        else:
            cols.append(pa.repeat(table[field.name][0], rows).cast(field.type))
    return pa.Table.from_arrays(cols, schema=table.schema)


def test_rows_beyond_the_shards_bytes_are_refused_before_decoding(tmp_path):
    table = pa.table({"id": pa.array(["x"]), "response_ids": pa.array([[1, 2]], pa.list_(pa.int32()))})
    bomb = _bomb_like(table, 3_000_000)
    pq.write_table(bomb, tmp_path / "b.parquet")
    assert (tmp_path / "b.parquet").stat().st_size < 300_000
    before = pa.total_allocated_bytes()
    with pytest.raises(Exception, match="rows a byte: refused before decoding"):
        shards.read_table(tmp_path / "b.parquet")
    assert pa.total_allocated_bytes() - before < 1 << 20


def test_a_row_of_many_tokens_is_refused_from_the_footer(tmp_path):
    run = pa.array([np.zeros(3_000_000, np.int32)], pa.list_(pa.int32()))  # one row, 3M tokens of one value (RLE: KBs)
    pq.write_table(pa.table({"id": ["a"], "response_ids": run}), tmp_path / "t.parquet")
    assert (tmp_path / "t.parquet").stat().st_size < 200_000
    with pytest.raises(Exception, match="more than the reading limit"):
        shards.read_table(tmp_path / "t.parquet")
    with pytest.raises(Exception, match="allow 100"):
        shards.read_table(tmp_path / "t.parquet", tokens=100)


@pytest.mark.parametrize("command", ["validate", "info", "export", "train"])
def test_a_rows_bomb_agreed_by_footer_and_manifest_is_one_line(cache, tmp_path, weights, command):
    rel = sorted((cache / "rollouts").glob("part-*.parquet"))[0].relative_to(cache).as_posix()
    bomb = _bomb_like(pq.read_table(cache / rel), 2_000_000)
    _replace(cache, rel, bomb, rows=2_000_000)
    before = _digest(cache)
    args = {"validate": ["validate", cache], "info": ["info", cache], "export": ["export", cache, "--to", "jsonl", "--out", tmp_path / "x"],
            "train": _train_args(cache, tmp_path, weights, loss="lightning")}[command]
    code, out = _run(args)
    if command == "validate":
        assert code == 1 and "rows a byte" in out and "Traceback" not in out, out[-2000:]
    else:
        line = _one_line(out)
        assert code == 2 and "rows a byte" in line, line
    assert _digest(cache) == before


# ------------------------------------------------------------------------------------------ 3. prompt files
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_prompts_that_are_not_files_are_refused_at_argument_checking(tmp_path, weights, kind):
    if kind == "fifo":
        path = tmp_path / "p.jsonl"
        os.mkfifo(path)
    else:
        path = "/dev/zero"
    for args in (["build-rollouts", "--model", weights / "student", "--prompts", path, "--out", tmp_path / "c"],
                 ["async", "--model", weights / "student", "--teacher", weights / "teacher", "--prompts", path, "--out", tmp_path / "a"]):
        start = time.monotonic()
        code, out = _run(args, timeout=60)
        line = _one_line(out)
        assert code == 2 and ("FIFO" if kind == "fifo" else "device") in line and "--prompts" in line
        assert time.monotonic() - start < 30  # refused, not blocked (the child's start-up included)
    assert not (tmp_path / "c").exists()


def test_an_overlong_prompt_line_is_skipped_without_being_held(tmp_path):
    from opdcache.inputs.prompts import MAX_LINE_BYTES, _rows

    path = tmp_path / "p.jsonl"
    with open(path, "w") as f:
        f.write('{"prompt": "a"}\n')
        f.write('{"prompt": "' + "x" * (MAX_LINE_BYTES + 10) + '"}\n')
        f.write('{"prompt": "b"}\n')
    rows = list(_rows(path))
    assert [r[1] for r in rows if r[1]] == [{"prompt": "a"}, {"prompt": "b"}]
    assert rows[1][2].startswith("line longer than")


# ------------------------------------------------------------------------------------------ 4. the async run directory
def _async_args(weights, prompts, out):
    return ["async", "--model", weights / "student", "--teacher", weights / "teacher", "--prompts", prompts, "--out", out,
            "--steps", 2, "--batch-size", 4, "--max-new-tokens", 8]


def test_a_second_async_run_on_one_directory_is_refused(tmp_path, weights, opd_prompts):
    out = tmp_path / "run"
    out.mkdir()
    fd = os.open(out / "run.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"host testhost pid 4242\n")
    try:
        code, text = _run(_async_args(weights, opd_prompts, out))
    finally:
        os.close(fd)
    line = _one_line(text)
    assert code == 2 and "in use by another opdcache async run" in line and "pid 4242" in line
    assert sorted(p.name for p in out.iterdir()) == ["run.lock"]


@pytest.mark.parametrize("content", ["garbage{", "[" * 100_000 + "]" * 100_000, json.dumps({"config": 1})])
def test_a_hostile_run_file_is_one_line(tmp_path, weights, opd_prompts, content):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(content)
    code, text = _run(_async_args(weights, opd_prompts, out))
    line = _one_line(text)
    assert code == 2 and "run.json" in line
    assert (out / "run.json").read_text() == content


# ------------------------------------------------------------------------------------------ 5. manifests
@pytest.mark.parametrize("hostile", ["deep", "long-number", "huge-string"])
@pytest.mark.parametrize("command", ["validate", "info", "export", "train"])
def test_a_hostile_manifest_is_one_short_line(cache, tmp_path, weights, hostile, command):
    text = (cache / "opdcache.json").read_text()
    if hostile == "deep":
        text = text[:-2] + ', "x": ' + "[" * 50_000 + "]" * 50_000 + "}"
    elif hostile == "long-number":
        text = text.replace('"format_version": 3', '"format_version": ' + "9" * 5001, 1)
    else:
        text = text.replace('"kind": "rollouts"', '"kind": "' + "k" * (20 << 20) + '"', 1)
    (cache / "opdcache.json").write_text(text)
    before = _digest(cache)
    args = {"validate": ["validate", cache], "info": ["info", cache], "export": ["export", cache, "--to", "jsonl", "--out", tmp_path / "x"],
            "train": _train_args(cache, tmp_path, weights, loss="lightning")}[command]
    code, out = _run(args)
    assert code in ((1, 2) if command == "validate" else (2,)) and "Traceback" not in out and len(out) < 4000, out[:500]
    assert "opdcache.json" in out and ("refused" in out or "nested too deeply" in out)
    assert _digest(cache) == before


# ------------------------------------------------------------------------------------------ 6. still open from the last round
def test_export_refuses_teacher_rows_shifted_by_one(cache, tmp_path):
    rel, table = _teacher_shard(cache)
    lp = table["logprobs"].to_pylist()
    lp[0] = lp[0] + [-1.0]  # one more teacher log-prob than response tokens
    _replace(cache, rel, _set_list_column(table, "logprobs", lp))
    code, out = _run(["export", cache, "--to", "jsonl", "--out", tmp_path / "x"])
    line = _one_line(out)
    assert code == 2 and "not as long as the responses" in line
    assert not list((tmp_path / "x").glob("*.jsonl")) if (tmp_path / "x").exists() else True


def test_a_pickle_in_place_of_the_svd_file_is_found_even_with_its_hash_updated(cache):
    import torch

    path = cache / "teachers" / "teacher" / "svd.safetensors"
    torch.save({"decoder": torch.zeros(2, 2)}, path)
    manifest = json.loads((cache / "opdcache.json").read_text())
    rec = manifest["tables"]["teachers/teacher"]["files"]["svd.safetensors"]
    rec.update(bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    (cache / "opdcache.json").write_text(json.dumps(manifest))
    code, out = _run(["validate", cache])
    assert code == 1 and "svd.safetensors" in out and "not a safetensors file" in out, out[-1500:]


def test_a_hand_edited_prompt_token_count_is_found(cache):
    manifest = json.loads((cache / "opdcache.json").read_text())
    manifest["tables"]["rollouts"]["stats"]["prompt_tokens"] += 7
    (cache / "opdcache.json").write_text(json.dumps(manifest))
    code, out = _run(["validate", cache])
    assert code == 1 and "prompt_tokens" in out and "edited by hand" in out, out[-1500:]


def test_a_verifier_that_calls_sys_exit_marks_its_rows_and_the_job_finishes(tmp_path, weights, opd_prompts):
    (tmp_path / "exiting_verifier.py").write_text("import sys\ndef verify(response, task):\n    sys.exit(3)\n")
    env_path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    p = subprocess.run([sys.executable, "-m", "opdcache.cli.main", "build-rollouts", "--model", str(weights / "student"),
                        "--prompts", str(opd_prompts), "--out", str(tmp_path / "c"), "--num-shards", "1", "--limit", "4",
                        "--max-new-tokens", "6", "--reward", "exiting_verifier:verify", "--credit-truncated"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": env_path, "OPDCACHE_PROGRESS": "0"}, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "c" / "opdcache.json").is_file()
    errors = (tmp_path / "c" / "rollouts" / "verifier_errors.jsonl").read_text()
    assert "sys.exit(3)" in errors


def test_a_verifier_raising_keyboardinterrupt_itself_marks_the_row():
    import signal

    from opdcache.inputs.verifiers import score

    def rude(response, task):
        raise KeyboardInterrupt

    # Python's own SIGINT handler, whatever the runner inherited (a background job starts with SIGINT ignored, and then
    # every KeyboardInterrupt counts as a real Ctrl-C by design)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        verdict = score(rude, "x", {})
    finally:
        signal.signal(signal.SIGINT, previous)
    assert verdict.score is None and "KeyboardInterrupt" in verdict.reason
