"""Never lose work: killed writers leave no partial file under a final name, resumes are exact,
and a resume with different settings is refused with the difference shown."""

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from opdcache.errors import ConfigError, ResumeError, SchemaError
from opdcache.format import manifest as M
from opdcache.format.cache import run_table_job
from opdcache.format.workers import shards_for_worker, worker_from_env
from opdcache.inputs.fingerprint import sha256_file
from synth import rollout_rows
from writer_job import job

WRITER = Path(__file__).parent / "writer_job.py"
N_SHARDS = 6


def _run(root, *extra, wait=True):
    proc = subprocess.Popen([sys.executable, str(WRITER), str(root), str(N_SHARDS), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if wait:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
    return proc


def _final_shards(root):
    return sorted((Path(root) / "rollouts").glob("part-*.parquet"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref") / "cache"
    start = time.perf_counter()
    _run(root)
    return root, {p.name: sha256_file(p) for p in _final_shards(root)}, time.perf_counter() - start


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_gives_identical_shards(tmp_path, reference):
    ref_root, ref_hashes, _ = reference
    root = tmp_path / "cache"
    rng = random.Random(1234)
    for attempt in range(4):
        proc = _run(root, wait=False)
        # kill once a chosen number of shards exists (an event, not a clock): the kill lands while the next is written
        target = rng.randrange(0, N_SHARDS)
        while len(_final_shards(root)) < target and proc.poll() is None:
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # Whatever exists under a final name is complete and byte-identical to the reference.
        for path in _final_shards(root):
            pq.read_metadata(path)
            assert sha256_file(path) == ref_hashes[path.name], f"attempt {attempt}: {path.name} differs"
    _run(root)
    assert {p.name: sha256_file(p) for p in _final_shards(root)} == ref_hashes
    from opdcache.format.validate import validate

    problems = validate(root)
    assert not [p for p in problems if not p.warning]  # ...but are only ever warnings
    assert M.content_view(M.load(root)) == M.content_view(M.load(ref_root))


def test_resume_writes_only_missing_shards(tmp_path):
    j = job(tmp_path, N_SHARDS)
    first = run_table_job(j, lambda i: rollout_rows(i, 3), num_workers=2, worker_index=0)
    assert first == [0, 2, 4]
    mtimes = {p: p.stat().st_mtime_ns for p in _final_shards(tmp_path)}
    calls = []
    second = run_table_job(job(tmp_path, N_SHARDS), lambda i: calls.append(i) or rollout_rows(i, 3))
    assert second == calls == [1, 3, 5]
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items())


def _hashes(root):
    return {p.name: sha256_file(p) for p in _final_shards(root)}


def test_each_shard_is_written_while_the_next_is_made_and_equals_an_inline_write(tmp_path, monkeypatch):
    """The write of shard i waits until shard i + 1 has started being made: that completes only if the write runs in
    the background (inline, it would wait for a shard that is never started: the wait's guard fails the test)."""
    import threading

    import opdcache.format.cache as cache_mod

    j = job(tmp_path / "behind", 4)
    started = {i: threading.Event() for i in range(5)}
    overlapped = []
    write = j.write_table

    def slow_write(index, table):
        overlapped.append(index == 3 or started[index + 1].wait(timeout=60))  # the last shard has no next
        return write(index, table)

    def make(i):
        started[i].set()
        return rollout_rows(i, 50)

    j.write_table = slow_write
    assert run_table_job(j, make) == [0, 1, 2, 3]
    assert overlapped == [True] * 4
    monkeypatch.setattr(cache_mod, "WRITE_BEHIND", False)
    assert run_table_job(job(tmp_path / "inline", 4), lambda i: rollout_rows(i, 50)) == [0, 1, 2, 3]
    assert _hashes(tmp_path / "behind") == _hashes(tmp_path / "inline") and len(_hashes(tmp_path / "inline")) == 4


def test_a_failure_loses_no_shard_already_made(tmp_path):
    """make_shard failing: the shard before it, still being written, lands. A write failing: the shard made meanwhile
    is written, then that write's error is raised. A bad record is refused at its own shard, before the next is made.
    A resume makes only what is missing."""
    root = tmp_path / "a"

    def make(i):
        if i == 2:
            raise RuntimeError("teacher produced NaN")
        return rollout_rows(i, 20)

    with pytest.raises(RuntimeError, match="teacher produced NaN"):
        run_table_job(job(root, 4), make)
    assert [p.name for p in _final_shards(root)] == ["part-00000-of-00004.parquet", "part-00001-of-00004.parquet"]
    calls = []
    assert run_table_job(job(root, 4), lambda i: calls.append(i) or rollout_rows(i, 20)) == calls == [2, 3]

    root = tmp_path / "b"
    j = job(root, 4)
    write = j.write_table

    def failing_write(index, table):
        if index == 1:
            raise OSError("No space left on device")
        return write(index, table)

    j.write_table = failing_write
    with pytest.raises(OSError, match="No space left on device"):
        run_table_job(j, lambda i: rollout_rows(i, 20))
    assert [p.name for p in _final_shards(root)] == ["part-00000-of-00004.parquet", "part-00002-of-00004.parquet"]
    calls = []
    assert run_table_job(job(root, 4), lambda i: calls.append(i) or rollout_rows(i, 20)) == calls == [1, 3]
    assert _hashes(root) == _hashes(tmp_path / "a")

    root, calls = tmp_path / "c", []

    def bad_record(i):
        calls.append(i)
        rows = rollout_rows(i, 20)
        if i == 1:
            rows[3]["response_ids"] = rows[3]["response_ids"][:, None]  # [T, 1]: not a token list
        return rows

    with pytest.raises(SchemaError, match=r"row 3: column 'response_ids' must be a 1-D list of token ids, got shape \[\d+, 1\]"):
        run_table_job(job(root, 4), bad_record)
    assert calls == [0, 1] and [p.name for p in _final_shards(root)] == ["part-00000-of-00004.parquet"]


def test_resume_with_changed_setting_is_refused_with_the_difference(tmp_path):
    run_table_job(job(tmp_path, N_SHARDS), lambda i: rollout_rows(i, 3), num_workers=3, worker_index=1)
    with pytest.raises(ResumeError) as err:
        run_table_job(job(tmp_path, N_SHARDS, temperature=1.0), lambda i: rollout_rows(i, 3))
    assert "sampling.temperature: 0.8 -> 1.0" in str(err.value)
    assert "Rerun with the original settings" in str(err.value) and "\n" not in str(err.value)  # one line


def test_changed_setting_after_finish_is_refused_too(tmp_path):
    _run(tmp_path / "c")
    proc = subprocess.run([sys.executable, str(WRITER), str(tmp_path / "c"), str(N_SHARDS), "0.5"], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "sampling.temperature: 0.8 -> 0.5" in proc.stderr


def test_workers_get_disjoint_deterministic_shards(monkeypatch):
    parts = [shards_for_worker(10, 3, w) for w in range(3)]
    assert sorted(sum(parts, [])) == list(range(10))
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert worker_from_env() == (4, 3)
    monkeypatch.delenv("SLURM_ARRAY_TASK_COUNT")
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert worker_from_env() == (2, 1)
    with pytest.raises(ConfigError, match=r"--worker-index must be between 0 and 1, got 5"):
        worker_from_env(2, 5)


def test_generation_groups_fill_a_batch_across_shards():
    from opdcache.teacher.rollouts import generation_groups

    assert generation_groups([2, 2, 2, 2, 2], 4) == [[0, 1], [2, 3], [4]]
    assert generation_groups([8, 1, 1], 4) == [[0], [1, 2]]
    assert generation_groups([3, 3], 1) == [[0], [1]]
    groups = generation_groups([2] * 7, 4)
    parts = [shards_for_worker(7, 2, w, groups) for w in range(2)]
    assert parts == [[0, 1, 4, 5], [2, 3, 6]]  # whole groups per worker, every shard once


def test_batches_spanning_shards_give_the_same_shards_for_any_worker_count_and_resume(tmp_path, weights, opd_prompts):
    """16 prompts over 8 shards decode 4 at a time (not 2, a shard's size); 1 worker, 3 workers, and a job resumed after
    a shard was lost all write identical shard bytes."""
    from opdcache.backends.base import SamplingConfig
    from opdcache.backends.hf import TransformersBackend
    from opdcache.inputs.fingerprint import sha256_file
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.backends import EngineConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate

    def job(out, **kw):
        return GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=16), out=out, num_shards=8,
                           sampling=SamplingConfig(max_new_tokens=12, samples=1), engine=EngineConfig(generate_batch_size=4), **kw)

    def hashes(out):
        return [sha256_file(p) for p in sorted((out / "rollouts").glob("part-*.parquet"))]

    calls = []
    original = TransformersBackend.generate
    TransformersBackend.generate = lambda self, reqs, s: calls.append(len(reqs)) or original(self, reqs, s)
    try:
        run_generate(job(tmp_path / "one"))
        assert calls == [4, 4, 4, 4]
        for w in range(3):
            run_generate(job(tmp_path / "three", num_workers=3, worker_index=w))
        lost = sorted((tmp_path / "three" / "rollouts").glob("part-*.parquet"))[3]
        lost.unlink()
        (tmp_path / "three" / "opdcache.json").unlink()
        run_generate(job(tmp_path / "three"))  # regenerates shard 3 with its group (shards 2 and 3), writes only 3
    finally:
        TransformersBackend.generate = original
    assert len(hashes(tmp_path / "one")) == 8 and hashes(tmp_path / "one") == hashes(tmp_path / "three")
