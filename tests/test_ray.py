"""--executor ray on a local Ray cluster started here (CPU only, demo models): 1, 2 and 3 workers write the same shard
bytes as one local process, and a worker killed mid-job leaves no partial shard while the job completes."""

import os
from pathlib import Path

import pytest

from opdcache.backends import EngineConfig
from opdcache.backends.base import SamplingConfig
from opdcache.format import manifest as M
from opdcache.inputs.fingerprint import sha256_file
from opdcache.inputs.prompts import PromptConfig
from opdcache.teacher.rollouts import GenerateJob, run_generate
from opdcache.teacher.scoring import run_score, ScoreJob

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # slow: run by .ci/run, not the README's test command
TESTS = str(Path(__file__).parent)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    root = str(Path(__file__).parent.parent)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([TESTS, root]), "OPDCACHE_PROGRESS": "0"}})
    yield ray
    ray.shutdown()


def _jobs(weights, prompts, out):
    gen = GenerateJob(model=weights / "student", prompts=PromptConfig(prompts, limit=12), out=out, num_shards=6,
                      sampling=SamplingConfig(max_new_tokens=16, samples=1, ref_top_k=3), sft_teacher=weights / "teacher",
                      engine=EngineConfig(generate_batch_size=2))
    score = ScoreJob(cache=out, teacher=weights / "teacher", stores=("logprob", "topk", "hidden", "svd"), top_k=3, svd_rank=8)
    return gen, score


def _local(job_fn, job):
    """A local run with one thread, as a Ray task with one CPU has (Ray sets OMP_NUM_THREADS to its CPUs): CPU float
    reductions depend on the thread count, so byte-identity holds between runs with the same threads per process."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return job_fn(job)
    finally:
        torch.set_num_threads(threads)


def _hashes(out):
    return {p.relative_to(out).as_posix(): sha256_file(p) for p in sorted(out.rglob("*")) if p.suffix in (".parquet", ".safetensors")}


def test_ray_workers_write_the_same_bytes_as_one_local_process(ray_cluster, weights, opd_prompts, tmp_path):
    from opdcache.teacher.executors import RayConfig, run_on_ray
    from opdcache.format.validate import validate

    gen, score = _jobs(weights, opd_prompts, tmp_path / "local")
    _local(run_generate, gen)
    _local(run_score, score)
    local = _hashes(tmp_path / "local")
    for workers in (1, 2, 3):
        out = tmp_path / f"ray{workers}"
        gen, score = _jobs(weights, opd_prompts, out)
        run_on_ray(run_generate, gen, RayConfig(workers=workers), "rollouts")
        run_on_ray(run_score, score, RayConfig(workers=workers), "teachers/teacher")
        assert _hashes(out) == local, workers
        assert validate(out) == []
        # the driver's manifest is the local one (the svd fit's record included, read back from svd.safetensors)
        assert M.content_view(M.load(out)) == M.content_view(M.load(tmp_path / "local")), workers
    # a task runs as many torch threads as CPUs it reserves (--cpus-per-worker), and the cache records it
    gen, _ = _jobs(weights, opd_prompts, tmp_path / "two-cpus")
    run_on_ray(run_generate, gen, RayConfig(workers=1, cpus_per_worker=2), "rollouts")
    assert M.load(tmp_path / "two-cpus")["tables"]["rollouts"]["compute"]["torch_threads"] == 2
    assert M.load(tmp_path / "ray1")["tables"]["rollouts"]["compute"]["torch_threads"] == 1


def test_a_killed_worker_leaves_no_partial_shard_and_the_job_completes(ray_cluster, weights, opd_prompts, tmp_path):
    from opdcache.teacher.executors import RayConfig, run_on_ray
    from ray_helpers import crash_once_after_two_shards

    gen, _ = _jobs(weights, opd_prompts, tmp_path / "c")
    results = run_on_ray(crash_once_after_two_shards, gen, RayConfig(workers=1, max_retries=2), "rollouts")
    assert (tmp_path / "crashed").exists()  # the first attempt died (os._exit) after two shards
    assert sorted(results[0].written) == [2, 3, 4, 5]  # the retry resumed: it wrote only what was missing
    assert not [p for p in (tmp_path / "c").rglob("*") if ".tmp-" in p.name]
    gen_ref, _ = _jobs(weights, opd_prompts, tmp_path / "ref")
    _local(run_generate, gen_ref)
    assert {k: v for k, v in _hashes(tmp_path / "c").items()} == _hashes(tmp_path / "ref")


def test_an_async_run_as_ray_tasks_equals_the_local_processes(ray_cluster, weights, opd_prompts, tmp_path, local_async_run):
    """opdcache async --executor ray: each stage one Ray task with its own engine; same shards and losses as local
    processes (the session's local run)."""
    import json

    from asyncsmall import small_async

    from opdcache.asyncopd import run_async

    ray_run = run_async(small_async(weights, opd_prompts, tmp_path / "ray", executor="ray"))
    assert _hashes(tmp_path / "ray" / "cache") == _hashes(local_async_run / "cache")
    assert [s["staleness"] for s in ray_run["async"]["shards"]] == [0, 1, 1, 1]
    losses = [[json.loads(l)["loss"] for l in (d / "learner" / "metrics.jsonl").read_text().splitlines()] for d in (tmp_path / "ray", local_async_run)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
