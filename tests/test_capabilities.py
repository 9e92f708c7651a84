"""Engines declare what they compute and every check reads the declaration, before any model loads: a toy engine
registered in one line (tests/toy_engine.py) is checked as the built-in ones are."""

import re

import pytest

from opdcache.backends import ENGINES, EngineConfig, capabilities, reference_engine
from opdcache.errors import ConfigError


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(ENGINES, "toy", "toy_engine")
    return EngineConfig(backend="toy")


def test_every_engine_declares_its_capabilities_and_one_is_the_reference():
    assert reference_engine() == "transformers"
    assert sum(capabilities(name).reference for name in ENGINES) == 1
    assert capabilities("exact").exact_arithmetic and not capabilities("exact").batch_size_changes_bits
    assert "hidden" not in capabilities("vllm").statistics and capabilities("vllm").max_temperature == 2.0


def test_stores_ask_for_statistics_engines_declare_and_scores_carry_them_by_name():
    import numpy as np
    import torch

    from opdcache.backends.base import STATISTICS, Scores, split_scores
    from opdcache.stores import REGISTRY

    for store in REGISTRY.values():
        assert set(store.needs) <= set(STATISTICS), store.name
    for name in ENGINES:
        assert capabilities(name).statistics <= set(STATISTICS) and "logprobs" in capabilities(name).statistics, name
    assert capabilities("transformers").statistics == set(STATISTICS)
    assert capabilities("server").missing(("logprobs", "logsumexp", "entropy")) == ["logsumexp", "entropy"]
    assert capabilities("server").missing(("sampled_ids", "variance")) == ["sampled_ids", "variance"]
    assert capabilities("exact").missing(("sampled_ids", "variance", "hidden", "rounding_kl")) == ["rounding_kl"]
    # an engine's flat values become each sequence's, finished by the statistic's kind
    cat = {"logprobs": torch.tensor([-1.0, 1e-7, -2.0]), "topk_ids": torch.tensor([[3, 1], [2, 0], [1, 4]]),
           "entropy": torch.tensor([0.5, 0.25, 1.0], dtype=torch.float32), "hidden": torch.ones(3, 2, dtype=torch.bfloat16)}
    first, second = split_scores(cat, [2, 1])
    assert first.logprobs.tolist() == [-1.0, 0.0] and first.topk_ids.dtype == np.int32 and first.entropy.dtype == np.float64
    assert second.hidden.dtype == torch.bfloat16 and second.hidden.shape == (1, 2)
    assert first.logsumexp is None and "logsumexp" not in first and {n for n in STATISTICS if n in first} == {"logprobs", "topk_ids", "entropy", "hidden"}
    with pytest.raises(TypeError, match="unknown statistics \\['lp'\\]; add them to opdcache.backends.base.STATISTICS"):
        Scores(lp=np.zeros(2))
    with pytest.raises(KeyError):
        split_scores({"lp": torch.zeros(2)}, [2])


def test_a_new_engine_is_checked_by_what_it_declares(toy, weights, opd_prompts, tmp_path, monkeypatch):
    from opdcache.backends.base import SamplingConfig
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob
    from opdcache.teacher.scoring import ScoreJob

    with pytest.raises(ConfigError, match=re.escape("--temperature must be at most 1.5 with --backend toy (the engine's own "
                                                    "limit), got 1.8; use --backend transformers for hotter sampling")):
        GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts), out=tmp_path / "c", engine=toy,
                    sampling=SamplingConfig(temperature=1.8))
    # its quantization is opdcache's emulated schemes: checked against the model's config before it loads
    with pytest.raises(ConfigError, match="does not divide the model's hidden_size"):
        GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts), out=tmp_path / "c",
                    engine=EngineConfig(backend="toy", quantize="w4a16"))
    with pytest.raises(ConfigError, match=re.escape("--store entropy needs the teacher's full-distribution entropy -E_p[log p] (statistic entropy), "
                                                    "which --backend toy does not compute: score this table with an engine that does "
                                                    "(transformers, exact)")):
        ScoreJob(cache=tmp_path / "c", teacher=weights / "teacher", stores=("logprob", "entropy"), engine=toy)
    assert not (tmp_path / "c").exists()


def test_a_new_engine_records_its_generation_batch_size_and_hands_hidden_stores_to_the_reference(toy, weights, opd_prompts,
                                                                                                  tmp_path, capsys):
    from opdcache.backends.base import SamplingConfig
    from opdcache.format.cache import Cache
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate
    from opdcache.teacher.scoring import ScoreJob, run_score

    cache = tmp_path / "c"
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=4), out=cache, num_shards=1,
                             engine=EngineConfig(backend="toy", generate_batch_size=3),
                             sampling=SamplingConfig(max_new_tokens=8)))
    config = Cache(cache).table("rollouts")["config"]
    assert config["generate_batch_size"] == 3  # its batch changes its bits, as it declares: a resume must keep it
    run_score(ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob", "hidden"), engine=toy,
                       allow_inconsistent_teacher=True))
    out = capsys.readouterr().out
    assert "note: --backend toy does not compute the final post-norm hidden states (statistic hidden); the hidden store is scored on the transformers engine" in out
    assert Cache(cache).table("teachers/teacher")["model"]["engine"] == "transformers"
