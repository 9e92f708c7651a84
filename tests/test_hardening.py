"""Bad inputs end in one line and the right exit code; a resume never mixes inputs or settings."""

import json

import pytest

from opdcache.backends import EngineConfig
from opdcache.backends.base import SamplingConfig
from opdcache.cli.main import main
from opdcache.errors import ResumeError
from opdcache.inputs.prompts import PromptConfig
from opdcache.teacher.rollouts import GenerateJob, run_generate

FAST = SamplingConfig(max_new_tokens=12)


def _cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def _write(path, rows):
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return path


def test_a_missing_prompts_file_is_one_line_exit_2(tmp_path, weights, capsys):
    code, out = _cli(["build-rollouts", "--model", weights / "student", "--prompts", tmp_path / "nope.jsonl", "--out", tmp_path / "c"], capsys)
    assert code == 2 and "Traceback" not in out
    assert f"prompt file {tmp_path / 'nope.jsonl'} does not exist; check --prompts" in out


def test_an_undecodable_line_goes_to_the_errors_file_and_the_rest_is_kept(tmp_path, weights):
    src = _write(tmp_path / "p.jsonl", [{"prompt": "123+456", "answer": "0579"}, b'{"prompt": "1\xff2+3"}', {"prompt": "200+300", "answer": "0500"}])
    res = run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(src), out=tmp_path / "c", num_shards=1, sampling=FAST))
    assert len(res.prompts.prompts) == 2 and [p.index for p in res.prompts.prompts] == [0, 2]
    errors = [json.loads(l) for l in (tmp_path / "c" / "rollouts_errors.jsonl").read_text().splitlines()]
    assert errors == [{"line": 2, "reason": "undecodable bytes (not UTF-8) at byte 13"}]


def test_too_long_prompts_are_not_counted_as_malformed_and_unknown_tokens_are_reported(tmp_path, weights):
    long = "+".join(["123"] * 40)  # 159 characters: longer than the student's 128 positions minus the response
    src = _write(tmp_path / "p.jsonl", [{"prompt": "123+456"}, {"prompt": long}, "{bad", {"prompt": "12€+3"}])
    res = run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(src), out=tmp_path / "c", num_shards=1, sampling=FAST))
    p = res.prompts
    assert (p.malformed, p.too_long, len(p.prompts)) == (1, 1, 2)
    assert "2 prompts read; 1 malformed rows skipped; 1 too long for the model skipped" in res.summary()
    assert p.unknown_tokens == 1 and "1 unknown tokens" in res.summary()
    stats = json.loads((tmp_path / "c" / "opdcache.json").read_text())["tables"]["rollouts"]["stats"]
    assert stats["unknown_tokens"] == 1 and stats["prompt_tokens"] == p.prompt_tokens


def test_resume_with_changed_answers_or_shifted_rows_is_refused_and_the_errors_file_kept(tmp_path, weights):
    rows = [{"prompt": f"{100 + i}+{200 + i}", "answer": str(300 + 2 * i), "src": "a"} for i in range(6)]
    src = _write(tmp_path / "p.jsonl", rows + ["{junk"])
    out = tmp_path / "c"
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(src), out=out, num_shards=2, sampling=FAST))
    errors_before = (out / "rollouts_errors.jsonl").read_text()
    changed = [dict(r, answer="0") for r in rows]  # same prompts, other answers
    for variant in (changed, ["{junk"] + rows, [dict(r, src="b") for r in rows]):  # answers; every row shifted; metadata
        _write(src, variant)
        with pytest.raises(ResumeError, match="prompts"):
            run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(src), out=out, num_shards=2, sampling=FAST))
        assert (out / "rollouts_errors.jsonl").read_text() == errors_before


def test_resume_with_another_batch_size_is_refused(tmp_path, weights, opd_prompts):
    def job(batch):
        return GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=4), out=tmp_path / "c", num_shards=2,
                           sampling=FAST, engine=EngineConfig(generate_batch_size=batch))
    run_generate(job(4))
    with pytest.raises(ResumeError, match="generate_batch_size: 4 -> 2"):
        run_generate(job(2))


def test_vllm_temperature_above_its_limit_is_refused_before_any_engine_starts(tmp_path, weights, opd_prompts):
    from opdcache.errors import ConfigError

    with pytest.raises(ConfigError, match="--temperature must be at most 2.0 with --backend vllm"):
        GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts), out=tmp_path / "c",
                    sampling=SamplingConfig(temperature=2.5), engine=EngineConfig(backend="vllm"))


@pytest.mark.parametrize("loss", ["lightning", "topk-rkl", "full-rkl"])
def test_training_on_a_non_finite_teacher_value_is_one_line_exit_2(hf_cache, weights, tmp_path, capsys, loss):
    """A NaN in the teacher's stores (logprobs and top-k log-probs of row 0 of every shard; its hidden state) stops training
    at once with the column named and `opdcache validate` suggested, whatever the estimator (topk-rkl trained through it)."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from opdcache.format import manifest as M
    from opdcache.format import shards

    cache = tmp_path / "cache"
    shutil.copytree(hf_cache, cache)
    manifest = M.load(cache)
    for index, path in enumerate(sorted((cache / "teachers" / "teacher").glob("part-*.parquet"))):
        table = pq.read_table(path)
        rows = table.to_pylist()
        for r in rows:
            r["logprobs"][1] = float("nan")
            r["topk_logprobs"][1][0] = float("nan")
            r["hidden"][1][0] = 0x7FC0  # a bf16/fp16 NaN pattern, or a huge float32: either way not a valid state
        if pa.types.is_floating(table.schema.field("hidden").type.value_type.value_type):
            for r in rows:
                r["hidden"][1][0] = float("nan")
        info = shards.write_table_atomic(pa.Table.from_pylist(rows, schema=table.schema), path, cache)
        manifest["tables"]["teachers/teacher"]["shards"][index] = info.to_dict()  # so only the values are wrong
    M.save(cache, manifest)
    code, out = _cli(["train", "--model", weights / "student", "--cache", cache, "--out", tmp_path / "run", "--loss", loss,
                      "--steps", "2", "--batch-size", "48", "--no-progress"], capsys)
    assert code == 2 and "Traceback" not in out  # bad input: exit 2, as every command but validate says of a damaged cache
    # the loader's row rules (opdcache/stores/rowrules.py) name the shard, row and column of a top-k store; the trainer's
    # finiteness check names the batch's column for the rest
    assert ("non-finite values in teacher_" in out and f"run `opdcache validate {cache}`" in out) or \
        ("row 0, column topk_logprobs: non-finite log-prob" in out and "run `opdcache validate`" in out)
    assert not (tmp_path / "run" / "model").exists()


def test_training_refuses_a_shard_that_does_not_match_the_manifest(hf_cache, weights, tmp_path, capsys):
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(hf_cache, cache)
    shard = sorted((cache / "rollouts").glob("part-*.parquet"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    shard.write_bytes(bytes(data))
    code, out = _cli(["train", "--model", weights / "student", "--cache", cache, "--out", tmp_path / "run", "--steps", "1",
                      "--batch-size", "48", "--no-progress"], capsys)
    assert code == 2 and "Traceback" not in out  # a damaged cache is bad input to train (validate reports it with 1)
    assert f"{shard} does not match the manifest's size and sha256" in out


def test_trust_band_defaults_are_the_papers_and_act_on_int8_rollouts(tmp_path, weights, opd_prompts):
    """papers/004 App. B bands (3e-4 / 4e-4 / dual clip 1 + 7e-4, cap 2) reject sequences of the demo's int8 rollouts once
    the student moves; the old defaults (0.2 / 0.2 / 3) kept every one."""
    from opdcache.training.losses import Corrections
    from opdcache.teacher.scoring import ScoreJob, run_score
    from opdcache.training.train import TrainConfig, run_train

    c = Corrections(trust_band=True)
    assert (c.band_low, c.band_high, c.dual_clip, c.band_cap) == (3e-4, 4e-4, 1.0007, 2.0)
    cache = tmp_path / "int8"
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=16), out=cache, num_shards=2,
                             sampling=SamplingConfig(max_new_tokens=24, temperature=1.0), engine=EngineConfig(quantize="int8"),
                             sft_teacher=weights / "teacher"))
    run_score(ScoreJob(cache=cache, teacher=weights / "teacher"))
    common = dict(model=weights / "student", cache=cache, loss="lightning", steps=3, batch_size=16, lr=2e-5, deterministic=True)
    fractions = {}
    for name, corr in (("paper", c), ("wide", Corrections(trust_band=True, band_low=0.2, band_high=0.2, dual_clip=3.0))):
        run_train(TrainConfig(out=tmp_path / name, corrections=corr, **common))
        metrics = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        fractions[name] = [m["band_rejected_fraction"] for m in metrics]
    assert fractions["paper"][0] == 0.0  # step 1: the student is pi_ref, every proximal ratio is 1
    assert max(fractions["paper"][1:]) > 0.5 and fractions["wide"] == [0.0, 0.0, 0.0], fractions


def test_progress_is_reported_per_sequence_as_plain_lines_when_not_on_a_terminal(tmp_path, weights, opd_prompts, capsys, monkeypatch):
    """--progress with stderr redirected: periodic lines (here every update) counting sequences within shards."""
    monkeypatch.setenv("OPDCACHE_PROGRESS_INTERVAL", "0")
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=6), out=tmp_path / "c", num_shards=2,
                             sampling=FAST, engine=EngineConfig(generate_batch_size=2), progress=True))
    every = [l for l in capsys.readouterr().err.splitlines() if l.startswith("build-rollouts:")]
    assert "(decoding 2 sequences: token 1/" in every[0]  # inside a batch: its decode step
    lines = [l for l in every if ": token " not in l]
    counts = [l.split(":")[1].split()[0] for l in lines]
    assert counts[:4] == ["2/6", "3/6", "5/6", "6/6"], lines  # per generation batch (3 rows a shard: 2 + 1), not per shard
    assert "shards=2/2" in lines[-1] and "seq" in lines[-1]
    from opdcache.format.cache import Cache

    total = sum(s["tokens"] for s in Cache(tmp_path / "c").table("rollouts")["shards"])
    assert f"tokens={total:,}" in lines[-1]  # the tokens written so far, not the last shard's
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=6), out=tmp_path / "d", num_shards=2,
                             sampling=FAST, progress=False))
    assert "build-rollouts:" not in capsys.readouterr().err


@pytest.mark.parametrize("exact", [False, True])
def test_the_first_progress_line_comes_within_the_first_batch(tmp_path, weights, opd_prompts, capsys, monkeypatch, exact):
    """At the default interval (30 s), the first report is printed at once, from inside the first batch (its first
    decode step), however large the batch: a long first batch on a real model no longer means minutes of silence.
    Both engines that decode in opdcache (transformers, exact)."""
    monkeypatch.delenv("OPDCACHE_PROGRESS_INTERVAL", raising=False)
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=6), out=tmp_path / "c", num_shards=1,
                             sampling=FAST, progress=True, engine=EngineConfig(exact=exact)))
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("build-rollouts:")]
    assert lines[0].startswith("build-rollouts: 0/6 seq (decoding 6 sequences: token 1/"), lines
    assert lines[-1].startswith("build-rollouts: 6/6 seq") and len(lines) <= 3  # then one per 30 s, and the final state


def test_a_url_whose_filesystem_is_not_installed_is_one_line_exit_2(capsys):
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed")
    code, out = _cli(["info", "gs://bucket/cache"], capsys)
    assert code == 2 and "Traceback" not in out
    assert "gs://bucket/cache" in out and "pip install 'opdcache[gcs]'" in out


def test_the_last_progress_line_of_a_train_run_is_printed_once_with_its_loss(tmp_path, weights, hf_cache, capsys, monkeypatch):
    """The final line came twice, the first with the previous step's loss."""
    import json

    from opdcache.cli.main import main

    monkeypatch.setenv("OPDCACHE_PROGRESS_INTERVAL", "0")
    with pytest.raises(SystemExit):
        main(["train", "--model", str(weights / "student"), "--cache", str(hf_cache), "--steps", "2", "--batch-size", "4",
              "--out", str(tmp_path / "run"), "--progress"])
    captured = capsys.readouterr()
    lines = [l for l in captured.err.splitlines() if l.startswith("train lightning:")]
    losses = [json.loads(l)["loss"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # what the run left on disk is said, with what to delete (2.1 GB on SmolLM2, unannounced)
    model = sum(p.stat().st_size for p in (tmp_path / "run" / "model").rglob("*") if p.is_file())
    assert f"on disk: the model {model / 1024:.1f} KiB (float32), the checkpoint" in captured.out and "run/checkpoint once the run is final" in captured.out
    counts = [l.split(":")[1].split()[0] for l in lines]
    assert counts[-2:] == ["1/2", "2/2"] and len(counts) == len(set(counts)), lines  # each state once
    assert f"loss={losses[-1]:.4f}" in lines[-1] and f"loss={losses[0]:.4f}" in lines[-2]
