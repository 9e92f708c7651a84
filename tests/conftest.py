import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _isolated_hash_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("OPDCACHE_HASH_CACHE", str(tmp_path_factory.getbasetemp() / "hashes"))
    monkeypatch.setenv("OPDCACHE_PROGRESS", "0")


@pytest.fixture
def synth_cache(tmp_path):
    from synth import make_cache

    return make_cache(tmp_path / "cache")


DEMO_WEIGHTS = Path(__file__).parent.parent / "opdcache" / "demo" / "weights"


@pytest.fixture(scope="session")
def weights():
    return DEMO_WEIGHTS


@pytest.fixture(scope="module")
def student(weights):
    """The demo student on the transformers engine in float32 (one per test module)."""
    from opdcache.backends.hf import TransformersBackend

    return TransformersBackend(weights / "student", dtype="float32")


@pytest.fixture(scope="session")
def opd_prompts(tmp_path_factory):
    from opdcache.demo.task import write_prompts

    return write_prompts(tmp_path_factory.mktemp("prompts") / "opd.jsonl", "opd", 24)


@pytest.fixture(scope="session")
def hf_cache(tmp_path_factory, weights, opd_prompts):
    """A small rollouts cache from the demo student (lineage: the demo teacher), scored by the teacher in every store."""
    from opdcache.backends.base import SamplingConfig
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate
    from opdcache.teacher.scoring import ScoreJob, run_score

    out = tmp_path_factory.mktemp("hf") / "cache"
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts), out=out, num_shards=3,
                             sampling=SamplingConfig(max_new_tokens=40, samples=2, ref_top_k=5, mc_samples=3),
                             sft_teacher=weights / "teacher", reward="addition"))
    run_score(ScoreJob(cache=out, teacher=weights / "teacher", stores=("logprob", "topk", "hidden", "svd", "sampled"), top_k=6, svd_rank=16,
                       samples_per_position=4))
    return out


@pytest.fixture(scope="session")
def demo_workdir(tmp_path_factory):
    """A work directory `opdcache demo` built, as a user runs it (the installed CLI, the demo's settings), once a session
    for the tests that start where the demo ends: the README's hand-run block and the notebook. Each works on its own
    copy (a few MB), so neither sees the other's runs."""
    import os
    import subprocess

    work = tmp_path_factory.mktemp("demo") / "opdcache-demo"
    env = {**os.environ, "OPDCACHE_PROGRESS": "0"}
    proc = subprocess.run(["opdcache", "demo", "--workdir", str(work)], cwd=work.parent, capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return work



@pytest.fixture(scope="session")
def local_async_run(tmp_path_factory, weights, opd_prompts):
    """That run on local disk with local processes, once a session: the reference of the S3 and Ray async tests."""
    from asyncsmall import small_async

    from opdcache.asyncopd import run_async

    out = tmp_path_factory.mktemp("async-local") / "local"
    run_async(small_async(weights, opd_prompts, out))
    return out
