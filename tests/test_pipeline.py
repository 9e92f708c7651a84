"""build-sft / build-rollouts / score-teacher: bad input, lineage and consistency, tokenizers, workers."""

import json
import shutil

import numpy as np
import pytest

from opdcache.backends import EngineConfig
from opdcache.backends.base import SamplingConfig
from opdcache.backends.hf import TransformersBackend
from opdcache.cli.main import main
from opdcache.errors import ConsistencyError, InputError, TokenizerMismatchError
from opdcache.format import manifest as M, shards
from opdcache.format.cache import Cache
from opdcache.format.validate import validate
from opdcache.inputs.fingerprint import sha256_file
from opdcache.inputs.prompts import PromptConfig
from opdcache.teacher.rollouts import GenerateJob, run_generate
from opdcache.teacher.scoring import run_score, ScoreJob

FAST = SamplingConfig(max_new_tokens=30)


def _prompts(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def _rows(cache, table="rollouts"):
    return [r for p in Cache(cache).shard_paths(table) for r in shards.read_table(p).to_pylist()]


def test_malformed_rows_go_to_the_errors_file_and_the_rest_is_kept(tmp_path, weights):
    src = _prompts(tmp_path / "p.jsonl", [
        {"prompt": "123+456", "answer": "0579"}, "{not json", {"question": "no prompt field"}, {"prompt": "   "},
        [1, 2], {"prompt": 7}, {"prompt": "123+456", "answer": "0579"}, {"prompt": "900+100", "answer": "1000", "src": "x"},
    ])
    res = run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(src), out=tmp_path / "c", num_shards=2, sampling=FAST))
    errors = [json.loads(l) for l in (tmp_path / "c" / "rollouts_errors.jsonl").read_text().splitlines()]
    by_line = {e.get("line"): e["reason"] for e in errors if "line" in e}
    assert by_line[2].startswith("invalid JSON")
    assert by_line[3] == "missing field 'prompt'"
    assert by_line[4] == "empty prompt"
    assert by_line[5] == "expected a JSON object, got list"
    assert by_line[6] == "field 'prompt' must be a string, got int"
    assert {"lines": [1, 7], "reason": "duplicate prompt (all copies kept)"} in errors
    rows = _rows(tmp_path / "c")
    assert sorted(r["prompt_index"] for r in rows) == [0, 6, 7]
    assert json.loads([r for r in rows if r["prompt_index"] == 7][0]["metadata"]) == {"src": "x"}
    assert res.prompts.too_long == 0 and len(res.prompts.errors) == 5
    assert validate(tmp_path / "c") == []


def test_strict_stops_at_the_first_malformed_row(tmp_path, weights):
    src = _prompts(tmp_path / "p.jsonl", [{"prompt": "123+456"}, {"prompt": ""}])
    with pytest.raises(InputError, match=r"p.jsonl line 2: empty prompt \(drop --strict to skip such rows\)"):
        run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(src, strict=True), out=tmp_path / "c", sampling=FAST))
    assert not (tmp_path / "c" / "opdcache.json").exists()


def test_too_long_prompts_are_skipped_and_counted(tmp_path, weights):
    # the demo models allow 128 positions; with 100 new tokens a prompt may have at most 28
    src = _prompts(tmp_path / "p.jsonl", [{"prompt": "1+2"}, {"prompt": "1" * 40 + "+2"}])
    res = run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(src), out=tmp_path / "c", num_shards=1,
                                   sampling=SamplingConfig(max_new_tokens=100)))
    assert res.prompts.too_long == 1
    assert "prompt has 44 tokens, more than the 28 allowed" in (tmp_path / "c" / "rollouts_errors.jsonl").read_text()
    assert Cache(tmp_path / "c").table("rollouts")["stats"]["too_long"] == 1
    assert len(_rows(tmp_path / "c")) == 1


def test_no_usable_prompts_is_an_error_that_says_why(tmp_path, weights):
    src = _prompts(tmp_path / "p.jsonl", [{"text": "x"}])
    with pytest.raises(InputError, match="no usable prompts .* first problem: line 1: missing field 'prompt'"):
        run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(src), out=tmp_path / "c", sampling=FAST))


def test_messages_field_parquet_and_datasets_inputs(tmp_path, weights):
    import datasets

    rows = [{"msgs": [{"role": "user", "content": "111+222"}], "answer": "0333"}]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "ds"))
    ids = []
    for i, src in enumerate((tmp_path / "p.parquet", tmp_path / "ds")):
        run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(src, messages_field="msgs"), out=tmp_path / f"c{i}",
                                 num_shards=1, sampling=FAST))
        ids.append(_rows(tmp_path / f"c{i}")[0]["prompt_ids"])
    assert ids[0] == ids[1] and ids[0][0] == 3 and ids[0][-1] == 4  # <|user|> ... <|assistant|>


def test_non_finite_rollouts_are_quarantined_with_a_reason(tmp_path, weights, opd_prompts, monkeypatch):
    original = TransformersBackend.generate

    def poisoned(self, requests, sampling):
        gens = original(self, requests, sampling)
        gens[0].ref_logprobs = gens[0].ref_logprobs.copy()
        gens[0].ref_logprobs[1] = np.nan
        return gens

    monkeypatch.setattr(TransformersBackend, "generate", poisoned)
    res = run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=6), out=tmp_path / "c",
                                   num_shards=2, sampling=FAST))
    assert res.quarantined == 1  # the first row of the one generation batch that spans both shards
    q = [json.loads(l) for l in (tmp_path / "c" / "rollouts" / "quarantine.jsonl").read_text().splitlines()]
    assert [e["reason"] for e in q] == ["non-finite ref_logprobs at position 1"]
    assert len(_rows(tmp_path / "c")) == 5
    assert validate(tmp_path / "c") == []


def _copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_teacher_with_another_tokenizer_is_refused_naming_the_difference(hf_cache, tmp_path, weights):
    teacher = _copy_model(weights / "teacher", tmp_path / "t2")
    cfg = json.loads((teacher / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|pad|>"
    (teacher / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerMismatchError, match=r"special token eos_token: '<\|eos\|>' vs '<\|pad\|>'"):
        run_score(ScoreJob(cache=hf_cache, teacher=teacher, slug="t2"))
    assert not (hf_cache / "teachers" / "t2").exists()


def test_inconsistent_teacher_is_refused_unless_allowed_and_the_decision_recorded(tmp_path, weights, opd_prompts):
    out = tmp_path / "c"
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=4), out=out, num_shards=1,
                             sampling=FAST, sft_teacher=weights / "teacher"))
    with pytest.raises(ConsistencyError, match="is not pi_ref's SFT teacher: pi_ref was fine-tuned on .*teacher.*--allow-inconsistent-teacher"):
        run_score(ScoreJob(cache=out, teacher=weights / "teacher_carry"))
    assert "teachers/teacher_carry" not in M.load(out)["tables"]
    res = run_score(ScoreJob(cache=out, teacher=weights / "teacher_carry", allow_inconsistent_teacher=True))
    rec = M.load(out)["tables"]["teachers/teacher_carry"]["consistency"]
    assert rec["verdict"] == "inconsistent" and rec["allowed"] is True and "allowed by --allow-inconsistent-teacher" in rec["note"]
    assert res["consistency"] == rec


def test_without_lineage_the_verdict_is_unknown(tmp_path, weights, opd_prompts):
    out = tmp_path / "c"
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=3), out=out, num_shards=1, sampling=FAST))
    assert run_score(ScoreJob(cache=out, teacher=weights / "teacher"))["consistency"]["verdict"] == "unknown"


def test_sft_lineage_file_and_conflicting_flag(tmp_path, weights, opd_prompts):
    from opdcache.errors import ConfigError
    from opdcache.inputs.lineage import model_info, write_sft_lineage

    pi_ref = _copy_model(weights / "student", tmp_path / "pi_ref")
    write_sft_lineage(pi_ref, model_info(weights / "teacher"), "d" * 64, model_info(weights / "student"))
    out = tmp_path / "c"
    run_generate(GenerateJob(model=pi_ref, prompts=PromptConfig(opd_prompts, limit=3), out=out, num_shards=1, sampling=FAST))
    assert M.load(out)["lineage"]["sft_teacher"]["fingerprint"] == model_info(weights / "teacher")["fingerprint"]
    with pytest.raises(ConfigError, match="is not the teacher recorded in"):
        run_generate(GenerateJob(model=pi_ref, prompts=PromptConfig(opd_prompts, limit=3), out=tmp_path / "c2", sampling=FAST,
                                 sft_teacher=weights / "teacher_carry"))


def test_one_two_or_three_workers_give_identical_caches(tmp_path, weights, opd_prompts):
    hashes, views = [], []
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        for w in range(workers):
            job = GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=9), out=out, num_shards=4,
                              sampling=SamplingConfig(max_new_tokens=30, ref_top_k=3), num_workers=workers, worker_index=w,
                              engine=EngineConfig(generate_batch_size=1))  # each shard its own generation group
            res = run_generate(job)
            assert res.finished == (w == workers - 1)
        run_score(ScoreJob(cache=out, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=3))
        hashes.append({p.relative_to(out).as_posix(): sha256_file(p) for p in sorted(out.rglob("*.parquet"))})
        views.append(M.content_view({**M.load(out), "tables": {k: {**v, "model": None} for k, v in M.load(out)["tables"].items()}}))
    assert hashes[0] == hashes[1] == hashes[2]
    assert len(hashes[0]) == 8


def test_finalize_command_completes_a_job_whose_workers_are_done(tmp_path, weights, opd_prompts, monkeypatch):
    import opdcache.format.cache

    out = tmp_path / "c"
    with monkeypatch.context() as m:
        m.setattr(opdcache.format.cache, "finalize_table", lambda job: None)  # as if both workers finished at the same moment
        for w in range(2):
            run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=4), out=out, num_shards=2,
                                     sampling=FAST, num_workers=2, worker_index=w))
    assert not (out / "opdcache.json").exists()
    with pytest.raises(SystemExit) as e:
        main(["finalize", str(out), "--table", "rollouts"])
    assert e.value.code == 0 and validate(out) == []


def test_cli_chain_build_sft_rollouts_score(tmp_path, weights, opd_prompts, capsys):
    def run(*args):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in args])
        captured = capsys.readouterr()
        return e.value.code, captured.out + captured.err

    code, out = run("build-sft", "--teacher", weights / "teacher", "--prompts", opd_prompts, "--out", tmp_path / "sft",
                    "--limit", "4", "--num-shards", "2", "--max-new-tokens", "40", "--reward", "addition", "--temperature", "0")
    assert code == 0 and "cache complete" in out
    sft = _rows(tmp_path / "sft", "sft")
    assert all(r["reward"] == 1.0 for r in sft)  # the teacher solves the task
    code, out = run("score-teacher", tmp_path / "nope", "--teacher", weights / "teacher")
    assert code == 2 and "nope: no such directory (a cache is a folder holding opdcache.json)" in out
    code, out = run("score-teacher", tmp_path / "sft", "--teacher", weights / "teacher", "--store", "logprob,bogus")
    assert code == 2 and "--store takes logprob, topk, hidden, svd, sampled, entropy, aligned; got bogus" in out


def test_svd_full_rank_is_exact_and_distortion_falls_with_rank():
    import torch

    from opdcache.stores import svdprojection as svd

    g = torch.Generator().manual_seed(0)
    W = torch.randn(200, 32, generator=g) * torch.logspace(0, -2, 32)
    calib = torch.randn(512, 32, generator=g) * 2
    held = torch.randn(256, 32, generator=g) * 2
    for method in svd.METHODS:
        full = svd.fit(W, None, calib, 32, method)
        torch.testing.assert_close(full.logits(full.encode(held)), held @ W.T, atol=1e-3, rtol=1e-4)
        d = {r: svd.distortion(svd.fit(W, None, calib, r, method), W, None, held)["mean_kl"] for r in (4, 12, 24, 32)}
        assert d[4] > d[12] > d[24] >= 0 and d[32] < 1e-6, (method, d)
    # distortion's chunked KL equals a plain float64 computation
    p = svd.fit(W, None, calib, 8, "naive")
    true = torch.log_softmax((held @ W.T).double(), -1)
    approx = torch.log_softmax(p.logits(p.encode(held)).double(), -1)
    kl = (true.exp() * (true - approx)).sum(-1)
    measured = svd.distortion(p, W, None, held)
    assert measured["mean_kl"] == pytest.approx(float(kl.mean()), rel=1e-4)
    assert measured["kl_stderr"] == pytest.approx(float(kl.std() / len(kl) ** 0.5), rel=1e-3)  # over positions


def test_svd_store_records_the_chosen_variant_and_its_measured_distortion(hf_cache):
    import torch

    from opdcache.stores import svdprojection as svd

    cache = Cache(hf_cache)
    svd_info = cache.table("teachers/teacher")["svd"]
    assert svd_info["method"] == "prob-weighted" and svd_info["rank"] == 16 and svd_info["dtype"] == "bfloat16"
    assert list(svd_info["distortion"]) == ["prob-weighted"]  # only the chosen method is fitted and measured
    d = svd_info["distortion"]["prob-weighted"]
    assert d["mean_kl"] >= 0 and 0 <= d["top1_agreement"] <= 1 and d["positions"] > 0
    # the stored z is the projection of the stored hidden state, rounded to bfloat16, bit for bit
    proj = svd.load(cache.side_file("teachers/teacher", "svd.safetensors"))
    table = shards.read_table(cache.shard_paths("teachers/teacher")[0], ["hidden", "svd"])
    assert table.schema.field("svd").metadata[b"opdcache.dtype"] == b"bfloat16"
    hidden = shards.hidden_to_torch(shards.token_values(table["hidden"]), cache.params("teachers/teacher").hidden_dtype)
    z = shards.hidden_to_torch(shards.token_values(table["svd"]), "bfloat16")
    assert torch.equal(proj.encode(hidden).to(torch.bfloat16).view(torch.int16), z.view(torch.int16))


@pytest.mark.parametrize("method", ["naive", "importance", "prob-weighted"])
def test_bounded_svd_fit_equals_the_plain_fit(method, monkeypatch):
    """Gram-matrix eigenvectors and streamed mean probabilities give the same projection as full SVDs (blocks smaller
    than the vocabulary and the positions, so every blocked path runs)."""
    import torch

    from opdcache.stores import svdprojection as svd

    monkeypatch.setattr(svd, "ROW_BLOCK", 37)
    monkeypatch.setattr(svd, "BLOCK", 50)
    g = torch.Generator().manual_seed(1)
    W = torch.randn(300, 24, generator=g) * torch.logspace(0, -1.5, 24)
    b = torch.randn(300, generator=g) * 0.1
    calib, held = torch.randn(130, 24, generator=g) * 2, torch.randn(70, 24, generator=g) * 2
    mine, ref = svd.fit(W, b, calib, 9, method), svd.fit_reference(W, b, calib, 9, method)
    torch.testing.assert_close(mine.logits(mine.encode(held)), ref.logits(ref.encode(held)), atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(svd.mean_probs(W, b, calib, chunk=64), torch.softmax(calib.double() @ W.double().T + b.double(), -1).mean(0))
    exact_top1 = (held @ W.T + b).argmax(-1) == mine.logits(mine.encode(held)).argmax(-1)
    assert svd.distortion(mine, W, b, held, chunk=64)["top1_agreement"] == pytest.approx(float(exact_top1.double().mean()))


def test_a_teacher_producing_nan_stops_the_shard_with_a_reason_and_writes_nothing(tmp_path, weights, opd_prompts, monkeypatch):
    from opdcache.errors import SchemaError
    from opdcache.teacher.scoring import ScoreJob, run_score

    cache = tmp_path / "c"
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=4), out=cache, num_shards=2, sampling=FAST,
                             sft_teacher=weights / "teacher"))
    original = TransformersBackend.score

    def poisoned(self, requests, top_k=None, hidden=False, hidden_dtype=None):
        scores = original(self, requests, top_k, hidden, hidden_dtype)
        scores[0].logsumexp = scores[0].logsumexp.copy()
        scores[0].logsumexp[2] = np.inf
        return scores

    monkeypatch.setattr(TransformersBackend, "score", poisoned)
    with pytest.raises(SchemaError, match=r"teacher produced non-finite logsumexp at position 2 for rollout row \S+ \(shard 0\); "
                                          r"nothing was written for this shard"):
        run_score(ScoreJob(cache=cache, teacher=weights / "teacher"))
    assert not list((cache / "teachers" / "teacher").glob("*.parquet"))
    assert set(json.loads((cache / "opdcache.json").read_text())["tables"]) == {"rollouts"}
