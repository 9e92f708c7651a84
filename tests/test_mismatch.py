"""mismatch-report and quantized rollouts: the measured delta = log pi_train - log pi_rollout (papers/003 eq. 1)
checked against a plain float32 recomputation, int8 rollouts showing a far larger delta, teacher-engine pairs,
thresholds gating the exit code, and the error messages."""

import json

import numpy as np
import pytest
import torch

from opdcache.backends import EngineConfig
from opdcache.backends.base import SamplingConfig
from opdcache.cli.main import main
from opdcache.format.cache import Cache
from opdcache.format.validate import validate
from opdcache.inputs.prompts import PromptConfig
from opdcache.teacher import mismatch as MM
from opdcache.teacher.rollouts import GenerateJob, run_generate
from opdcache.teacher.scoring import run_score, ScoreJob


@pytest.fixture(scope="module")
def int8_cache(tmp_path_factory, weights, opd_prompts):
    out = tmp_path_factory.mktemp("int8") / "cache"
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=12), out=out, num_shards=2,
                             sampling=SamplingConfig(temperature=1.0, max_new_tokens=40, samples=2, ref_top_k=4),
                             engine=EngineConfig(quantize="int8"), sft_teacher=weights / "teacher"))
    return out


def _plain_deltas(cache_root, model_dir) -> list[np.ndarray]:
    """The reference: one sequence at a time, full float32 log-softmax, minus the stored ref_logprobs."""
    from transformers import AutoModelForCausalLM

    from opdcache.format import shards

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for path in Cache(cache_root).shard_paths("rollouts"):
        t = shards.read_table(path)
        for p, r, stored in zip(t["prompt_ids"].to_pylist(), shards.row_values(t["response_ids"]), shards.row_values(t["ref_logprobs"])):
            ids = torch.tensor([p + r.tolist()])
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0].double(), -1)[len(p) - 1: len(p) - 1 + len(r)]
            out.append(lp.gather(-1, torch.as_tensor(r, dtype=torch.long)[:, None]).squeeze(-1).numpy() - stored.astype(np.float64))
    return out


def test_report_matches_a_plain_recomputation(hf_cache, weights):
    rep, _ = MM.report(hf_cache)
    fig = rep["sections"]["rollouts"]
    plain = np.concatenate(_plain_deltas(hf_cache, weights / "student"))
    assert fig["tokens"] == plain.size
    assert fig["mean_abs_delta"] == pytest.approx(np.abs(plain).mean(), abs=1e-6)
    assert fig["max_abs_delta"] == pytest.approx(np.abs(plain).max(), abs=1e-5)
    assert fig["k1"] == pytest.approx(-plain.mean(), abs=1e-6)
    assert fig["max_abs_delta"] < 1e-4  # same weights, float32 both sides: only kernel-order noise
    assert fig["argmax_flip_fraction"] == 0.0
    assert sum(fig["histogram"]["counts"]) == plain.size
    worst = fig["worst_sequences"][0]
    assert worst["max_abs_delta"] == pytest.approx(fig["max_abs_delta"]) and "[[" in worst["text"]


def test_int8_rollouts_are_recorded_and_show_a_larger_delta(int8_cache, hf_cache, weights):
    entry = Cache(int8_cache).table("rollouts")
    assert entry["model"]["quantization"] == "int8"
    q = MM.report(int8_cache)[0]["sections"]["rollouts"]
    full = MM.report(hf_cache)[0]["sections"]["rollouts"]
    plain = np.concatenate(_plain_deltas(int8_cache, weights / "student"))
    assert q["mean_abs_delta"] == pytest.approx(np.abs(plain).mean(), abs=1e-6)
    assert q["mean_abs_delta"] > 100 * full["mean_abs_delta"]
    assert q["k3"] > 0 and "int8" in q["description"]


def test_cli_writes_json_and_png_and_exits_1_on_a_crossed_threshold(int8_cache, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["mismatch-report", str(int8_cache), "--out", str(tmp_path / "r")])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "rollouts" in out and "worst sequences" in out
    assert max(len(line) for line in out.splitlines() if str(tmp_path) not in line) <= 80  # the table was 134 columns
    rep = json.loads((tmp_path / "r" / "mismatch_report.json").read_text())
    assert rep["crossed"] == []
    assert (tmp_path / "r" / "mismatch_hist.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    limit = rep["sections"]["rollouts"]["mean_abs_delta"] / 2
    with pytest.raises(SystemExit) as e:
        main(["mismatch-report", str(int8_cache), "--out", str(tmp_path / "r2"), "--no-png", "--max-mean-abs-delta", str(limit)])
    assert e.value.code == 1
    assert "rollouts: mean_abs_delta" in capsys.readouterr().err
    assert not (tmp_path / "r2" / "mismatch_hist.png").exists()


def test_teacher_engine_pairs_are_found_and_compared(hf_cache, tmp_path, weights):
    import shutil

    cache = tmp_path / "c"
    shutil.copytree(hf_cache, cache)
    run_score(ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=6, slug="bf16",
                       engine=EngineConfig(dtype="bfloat16")))
    assert MM.engine_pairs(Cache(cache)) == [("teacher", "bf16")]
    rep, _ = MM.report(cache, rollouts=False)
    fig = rep["sections"]["teachers teacher vs bf16"]
    a, b = (np.concatenate(Cache(cache).sequences(f"teachers/{s}", "logprobs")).astype(np.float64) for s in ("teacher", "bf16"))
    assert fig["mean_delta"] == pytest.approx((a - b).mean(), abs=1e-9)
    assert fig["max_abs_delta"] > 1e-4  # bfloat16 weights and activations really differ from float32
    assert fig["argmax_flip_fraction"] is not None and "bfloat16" in fig["description"]


def test_errors_say_how_to_fix(hf_cache, tmp_path, weights):
    from opdcache.errors import ConfigError

    with pytest.raises(ConfigError, match="is not the model that wrote the rollouts table"):
        MM.report(hf_cache, model=weights / "teacher")
    with pytest.raises(ConfigError, match="--model .* is not a local Hugging Face model directory"):
        MM.report(hf_cache, model=tmp_path)
    with pytest.raises(ConfigError, match="nothing to compare"):
        MM.report(hf_cache, rollouts=False)
    with pytest.raises(ConfigError, match="--worst must be 0 or more, got -1"):
        MM.report(hf_cache, worst=-1)
    with pytest.raises(ConfigError, match="exactly two teacher tables"):
        MM.report(hf_cache, teachers=["teacher"])


def test_cli_writes_under_the_cache_by_default_not_the_current_directory(int8_cache, tmp_path, monkeypatch, capsys):
    import shutil

    cache = tmp_path / "c"
    shutil.copytree(int8_cache, cache)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["mismatch-report", str(cache)])
    assert e.value.code == 0
    assert (cache / "mismatch-report" / "mismatch_report.json").is_file() and (cache / "mismatch-report" / "mismatch_hist.png").is_file()
    assert not (tmp_path / "mismatch-report").exists()
    assert validate(cache) == []  # the report does not disturb the cache
