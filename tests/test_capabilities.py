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
    assert not capabilities("vllm").hidden_states and capabilities("vllm").max_temperature == 2.0


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
    with pytest.raises(ConfigError, match=re.escape("--store entropy needs the teacher's whole distribution at every position, "
                                                    "which --backend toy does not return")):
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
    assert "note: --backend toy declares no hidden states; the hidden store is scored on the transformers engine" in out
    assert Cache(cache).table("teachers/teacher")["model"]["engine"] == "transformers"
