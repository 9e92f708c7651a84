"""Caches on object storage, against a real S3 API: moto's standalone server, started on 127.0.0.1 by these tests.

build-rollouts and score-teacher write to s3://, and the shards are byte-identical to a local run; validate, info, the
loader and train read from the URL; a writer killed at random moments never leaves a partial object under a shard's key,
and the rerun resumes to the same bytes; a failing write leaves nothing; push reads a remote cache.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.s3, pytest.mark.slow]  # slow: run by .ci/run, not the README's test command
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from opdcache.backends.base import SamplingConfig  # noqa: E402
from opdcache.cli.main import main  # noqa: E402
from opdcache.inputs.fingerprint import sha256_file  # noqa: E402
from opdcache.inputs.prompts import PromptConfig  # noqa: E402
from opdcache.teacher.rollouts import GenerateJob, run_generate  # noqa: E402
from opdcache.teacher.scoring import ScoreJob, run_score  # noqa: E402

WRITER = Path(__file__).parent / "writer_job.py"
BUCKET = "opd"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free local port; the AWS_* variables point every client (and subprocess) at it."""
    from moto.server import ThreadedMotoServer

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec

    # no listing cache: s3fs answers info()/open() from a cached parent listing, so a key that another process wrote
    # after this client listed the prefix would be "not found" (the fresh-clone failure of the killed-writer test)
    fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)
    fs.mkdir(BUCKET)
    yield fs
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _keys(fs, prefix):
    # only keys below the prefix (a listing taken while an object is uploaded may name the prefix itself)
    return sorted(k.split(f"{prefix}/", 1)[1] for k in fs.find(f"{BUCKET}/{prefix}") if f"{prefix}/" in k)


def _remote_hashes(fs, prefix):
    import hashlib

    return {k: hashlib.sha256(fs.cat_file(f"{BUCKET}/{prefix}/{k}")).hexdigest() for k in _keys(fs, prefix)
            if k.endswith((".parquet", ".safetensors"))}


def _local_hashes(root):
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.suffix in (".parquet", ".safetensors")}


def _cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def _jobs(weights, prompts, out):
    gen = GenerateJob(model=weights / "student", prompts=PromptConfig(prompts, limit=8), out=out, num_shards=2,
                      sampling=SamplingConfig(max_new_tokens=12, samples=2, ref_top_k=3), sft_teacher=weights / "teacher")
    score = ScoreJob(cache=out, teacher=weights / "teacher", stores=("logprob", "topk", "hidden"), top_k=3)
    return gen, score


@pytest.fixture(scope="module")
def local_cache(tmp_path_factory, weights, opd_prompts):
    out = tmp_path_factory.mktemp("s3ref") / "cache"
    gen, score = _jobs(weights, opd_prompts, out)
    run_generate(gen)
    run_score(score)
    return out


@pytest.fixture(scope="module")
def s3_cache(s3, weights, opd_prompts, local_cache):
    url = f"s3://{BUCKET}/runs/cache"
    gen, score = _jobs(weights, opd_prompts, url)
    run_generate(gen)
    run_score(score)
    return url


def test_build_and_score_on_s3_write_the_local_bytes_manifest_last(s3, s3_cache, local_cache):
    from opdcache.format import manifest as M

    assert _remote_hashes(s3, "runs/cache") == _local_hashes(local_cache)
    keys = _keys(s3, "runs/cache")
    assert "opdcache.json" in keys and "README.md" in keys and "tokenizer/tokenizer.json" in keys
    assert not [k for k in keys if "tmp" in k or k.endswith("_opdcache_job.json")]  # no spool or job files left
    assert M.content_view(M.load(s3_cache)) == M.content_view(M.load(local_cache))


def test_validate_and_info_read_the_url(s3_cache, capsys):
    code, out = _cli(["validate", s3_cache], capsys)
    assert code == 0, out
    code, out = _cli(["info", s3_cache, "--json"], capsys)
    assert code == 0, out
    info = json.loads(out)
    assert info["path"] == s3_cache and info["kind"] == "rollouts"


def test_validate_finds_a_corrupted_object(s3, s3_cache, weights, opd_prompts, capsys):
    from opdcache.format.validate import validate

    url = f"s3://{BUCKET}/corrupt/cache"
    s3.copy(f"{BUCKET}/runs/cache", f"{BUCKET}/corrupt/cache", recursive=True)
    key = f"{BUCKET}/corrupt/cache/rollouts/part-00001-of-00002.parquet"
    data = bytearray(s3.cat_file(key))
    data[len(data) // 2] ^= 0xFF
    s3.pipe_file(key, bytes(data))
    problems = [p for p in validate(url) if not p.warning]
    assert len(problems) == 1 and "rollouts/part-00001-of-00002.parquet" in str(problems[0]) and "sha256" in str(problems[0])
    code, out = _cli(["validate", url], capsys)
    assert code == 1 and "Traceback" not in out


def test_the_loader_reads_the_url_like_the_local_cache(s3_cache, local_cache):
    import torch

    from opdcache.training.data import CacheLoader, CacheLoaderConfig

    from opdcache.format.cache import Cache

    slug = Cache(local_cache).teachers[0]

    def batches(cache):
        return list(CacheLoader(CacheLoaderConfig(cache=cache, teacher=slug, stores=("logprob", "hidden"), batch_size=3, seed=5)))

    remote, local = batches(s3_cache), batches(local_cache)
    assert len(remote) == len(local) > 1
    for a, b in zip(remote, local):
        assert a.keys() == b.keys() and "teacher_hidden" in a
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_train_reads_the_url(s3_cache, local_cache, weights, tmp_path, capsys):
    runs = {}
    for name, cache in (("s3", s3_cache), ("local", local_cache)):
        code, out = _cli(["train", "--model", weights / "student", "--cache", cache, "--out", tmp_path / name, "--steps", "2",
                          "--batch-size", "4", "--loss", "full-rkl"], capsys)
        assert code == 0, out
        runs[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert runs["s3"] == runs["local"] and len(runs["s3"]) == 2


def test_cli_writes_to_a_url_and_a_rerun_writes_nothing(s3, weights, opd_prompts, capsys):
    url = f"s3://{BUCKET}/cli/cache"
    args = ["build-rollouts", "--model", weights / "student", "--prompts", opd_prompts, "--limit", 4, "--max-new-tokens", 8,
            "--num-shards", 2, "--out", url, "--sft-teacher", weights / "teacher"]
    code, out = _cli(args, capsys)
    assert code == 0, out
    before = _remote_hashes(s3, "cli/cache")
    code, out = _cli(args, capsys)
    assert code == 0 and "none (all present)" in out
    assert _remote_hashes(s3, "cli/cache") == before and len(before) == 2


def _writer(root, n_shards, wait=True):
    proc = subprocess.Popen([sys.executable, str(WRITER), root, str(n_shards)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if wait:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
    return proc


def test_a_killed_writer_leaves_no_visible_shard_and_the_rerun_resumes(s3):
    import pyarrow.parquet as pq

    from opdcache.format.validate import validate

    n = 6
    _writer(f"s3://{BUCKET}/ref/cache", n)
    ref = _remote_hashes(s3, "ref/cache")
    url, prefix = f"s3://{BUCKET}/killed/cache", "killed/cache"
    rng = random.Random(7)
    for attempt in range(3):
        proc = _writer(url, n, wait=False)
        # kill once a chosen number of shards is visible (an event, not a clock): the kill lands during the next upload
        target = rng.randrange(0, n)
        while len(_remote_hashes(s3, prefix)) < target and proc.poll() is None:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for key, digest in _remote_hashes(s3, prefix).items():  # every visible shard is whole and the reference's bytes
            assert digest == ref[key], f"attempt {attempt}: {key} differs"
            with s3.open(f"{BUCKET}/{prefix}/{key}", "rb") as f:
                pq.read_metadata(f)
        assert "opdcache.json" not in _keys(s3, prefix) or len(_remote_hashes(s3, prefix)) == n  # manifest last
    _writer(url, n)
    assert _remote_hashes(s3, prefix) == ref
    assert not [p for p in validate(url) if not p.warning]


def test_readers_never_trust_a_stale_listing(s3):
    """A cache path opened before another process adds a shard sees and reads the new shard (no listing cache).

    s3fs's default answers open()/info() from a cached parent listing; a reader that listed a prefix would then call a
    shard written afterwards by another worker "not found". storage.as_path turns the listing cache off for s3.
    """
    import fsspec

    from opdcache import storage

    writer = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)
    writer.pipe(f"{BUCKET}/stale/rollouts/part-0.parquet", b"first")
    root = storage.as_path(f"s3://{BUCKET}/stale")
    assert [p.name for p in (root / "rollouts").iterdir()] == ["part-0.parquet"]
    writer.pipe(f"{BUCKET}/stale/rollouts/part-1.parquet", b"second")
    assert (root / "rollouts" / "part-1.parquet").is_file()
    assert (root / "rollouts" / "part-1.parquet").read_bytes() == b"second"
    assert sorted(p.name for p in (root / "rollouts").iterdir()) == ["part-0.parquet", "part-1.parquet"]
    # the same check against a client with s3fs's default listing cache, so the test shows what it guards against
    cached = fsspec.filesystem("s3", skip_instance_cache=True)
    cached.find(f"{BUCKET}/stale")
    writer.pipe(f"{BUCKET}/stale/rollouts/part-2.parquet", b"third")
    with pytest.raises(FileNotFoundError):
        cached.open(f"{BUCKET}/stale/rollouts/part-2.parquet").read()


def test_a_failing_write_leaves_no_object(s3):
    from opdcache import storage

    path = storage.as_path(f"s3://{BUCKET}/fail/shard.parquet")
    with pytest.raises(RuntimeError, match="engine died"):
        with storage.staged(path) as tmp:
            tmp.write_bytes(b"half a shard")
            raise RuntimeError("engine died")
    assert not s3.exists(f"{BUCKET}/fail/shard.parquet")
    assert not path.is_file()


def test_a_missing_bucket_is_one_line(s3, capsys):
    url = f"s3://no-such-bucket-{random.randrange(1 << 30)}/cache"
    code, out = _cli(["validate", url], capsys)
    assert code == 1 and "Traceback" not in out and f"{url} has no opdcache.json" in out
    code, out = _cli(["info", url], capsys)
    assert code == 2 and "Traceback" not in out and "does not exist" in out  # bad input to info; validate's finding above


def test_push_reads_a_remote_cache(s3_cache, monkeypatch, tmp_path):
    """push uploads from a local folder: a remote cache is downloaded first, validated, and handed to the Hub client;
    the downloaded copy is gone when push returns."""
    import tempfile

    from opdcache.format import hub

    seen = {}

    def fake_upload(api, root, repo_id, private, revision):
        seen["root"] = Path(root)
        seen["files"] = sorted(p.relative_to(root).as_posix() for p in Path(root).rglob("*") if p.is_file())
        return f"https://huggingface.co/datasets/{repo_id}"

    monkeypatch.setattr(hub, "_upload", fake_upload)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert hub.push(s3_cache, "org/cache").endswith("org/cache")
    assert "opdcache.json" in seen["files"] and "rollouts/part-00000-of-00002.parquet" in seen["files"]
    assert seen["root"].is_relative_to(tmp_path) and not seen["root"].exists() and list(tmp_path.iterdir()) == []


def test_writing_to_a_missing_bucket_fails_before_any_work_in_one_line(s3, weights, opd_prompts, capsys):
    url = f"s3://no-such-bucket-{random.randrange(1 << 30)}/cache"
    code, out = _cli(["build-rollouts", "--model", weights / "student", "--prompts", opd_prompts, "--limit", 4, "--max-new-tokens", 8,
                      "--out", url], capsys)
    assert code == 1 and "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert out.startswith("error: storage:") and "rerun the same command" in out


def test_missing_credentials_are_one_line_exit_1(capsys, monkeypatch, tmp_path):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # a client made by an earlier test holds credentials
    try:
        code, out = _cli(["info", f"s3://{BUCKET}/nocreds-{random.randrange(1 << 30)}"], capsys)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()  # ...and the one made here holds none: later tests must not reuse it
    assert code == 1 and "Traceback" not in out and len(out.strip().splitlines()) == 1
    assert "NoCredentialsError" in out and "AWS_ACCESS_KEY_ID" in out


def test_ray_workers_write_a_cache_on_s3(s3, weights, opd_prompts, tmp_path):
    """--executor ray with an s3:// cache: every worker uploads its own shards, the driver finalizes, and the bytes
    equal a local one-thread run's (a Ray task with one CPU runs one torch thread)."""
    ray = pytest.importorskip("ray")
    from opdcache.teacher.executors import RayConfig, run_on_ray
    from opdcache.format.validate import validate
    from test_ray import TESTS, _local

    root = str(Path(__file__).parent.parent)
    env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")}
    workers_tmp = tmp_path / "workers-tmp"  # a Ray worker leaves without running atexit: nothing it downloads may stay
    workers_tmp.mkdir()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([TESTS, root]), "OPDCACHE_PROGRESS": "0",
                                       "TMPDIR": str(workers_tmp), **env}})
    try:
        url = f"s3://{BUCKET}/ray/cache"
        gen, score = _jobs(weights, opd_prompts, url)
        run_on_ray(run_generate, gen, RayConfig(workers=2), "rollouts")
        run_on_ray(run_score, score, RayConfig(workers=2), "teachers/teacher")
    finally:
        ray.shutdown()
    assert list(workers_tmp.glob("opdcache-remote-*")) == []
    local = tmp_path / "local"
    gen, score = _jobs(weights, opd_prompts, local)
    _local(run_generate, gen)
    _local(run_score, score)
    assert _remote_hashes(s3, "ray/cache") == _local_hashes(local)
    assert validate(url) == [] and not [k for k in _keys(s3, "ray/cache") if k.endswith("_opdcache_job.json")]


def test_an_async_run_with_its_cache_on_s3_writes_the_local_runs_bytes(s3, tmp_path, weights, opd_prompts, local_async_run):
    """opdcache async with --cache s3://...: the stages meet only through the object store (shards, snapshots), and the
    shards are the bytes of the same run on local disk (the session's local run); the manifest records the consumption;
    validate reads the URL."""
    import json

    from asyncsmall import small_async

    from opdcache.asyncopd import run_async
    from opdcache.format.validate import validate

    url = f"s3://{BUCKET}/async/cache"
    remote = run_async(small_async(weights, opd_prompts, tmp_path / "remote", cache=url))
    assert _remote_hashes(s3, "async/cache") == _local_hashes(local_async_run / "cache")
    assert [s["student_version"] for s in remote["async"]["shards"]] == [0, 0, 1, 2]
    assert not [k for k in _keys(s3, "async/cache") if k.startswith("snapshots/")]  # published, consumed, then removed
    assert not [p for p in validate(url) if not p.warning]
    losses = [[json.loads(l)["loss"] for l in (d / "learner" / "metrics.jsonl").read_text().splitlines()] for d in (tmp_path / "remote", local_async_run)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_audit_reads_the_url(s3, weights, opd_prompts, tmp_path, capsys):
    """An --exact cache written to S3 is audited in place: re-generated and re-scored bit for bit."""
    from opdcache.backends import EngineConfig

    url = f"s3://{BUCKET}/runs/exact"
    gen = GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=6), out=url, num_shards=2,
                      sampling=SamplingConfig(max_new_tokens=10, samples=2, temperature=0.9, top_p=0.9), engine=EngineConfig(exact=True))
    run_generate(gen)
    run_score(ScoreJob(cache=url, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=4, engine=EngineConfig(exact=True),
                       allow_inconsistent_teacher=True))
    code, out = _cli(["audit", url, "--rows", 6, "--json"], capsys)
    assert code in (0, None), out
    report = json.loads(out[out.index("{"):])
    assert report["passed"] and all(t["exact_claimed"] for t in report["tables"])
