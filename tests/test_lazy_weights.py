"""Weights load only when there is work for them: the transformers engine reports its facts (dtype, vocabulary,
context, hidden size, device) from the model's configuration and loads on first use, so a rerun of a finished job never
loads the model; a job with work loads it before writing anything; train checks a cache against the student's
configuration before the student's weights load. Each claim against a load that would fail if it ran."""

import shutil

import pytest

from opdcache.backends import hf
from opdcache.backends.base import SamplingConfig
from opdcache.errors import ConfigError
from opdcache.inputs.models import ModelFacts, model_facts
from opdcache.inputs.prompts import PromptConfig
from opdcache.teacher.rollouts import GenerateJob, run_generate
from opdcache.teacher.scoring import ScoreJob, run_score


def _no_load(*args, **kwargs):
    raise AssertionError("the weights were loaded")


@pytest.mark.parametrize("dtype,quantize", [("float32", None), ("bfloat16", None), ("auto", None), ("float32", "int8"),
                                            ("float32", "w4a16:g32"), ("bfloat16", "w8a8")])
def test_the_facts_reported_before_the_load_are_the_loaded_models(weights, dtype, quantize):
    engine = hf.TransformersBackend(weights / "student", dtype=dtype, quantize=quantize)
    said = (engine.dtype, engine.vocab_size, engine.max_length, engine.hidden_size, engine.device, engine.model_info())
    assert engine._model is None  # nothing loaded yet
    engine.load()
    head = engine.model.get_output_embeddings().weight
    assert said == (str(head.dtype).replace("torch.", ""), head.shape[0], engine.model.config.max_position_embeddings,
                    head.shape[1], head.device, engine.model_info())


def test_a_model_that_is_not_what_its_configuration_says_is_refused_in_one_line(weights, monkeypatch):
    monkeypatch.setattr("opdcache.inputs.models.model_facts", lambda path: ModelFacts(vocab_size=999, max_length=128, hidden_size=32))
    engine = hf.TransformersBackend(weights / "student", dtype="float32")
    with pytest.raises(ConfigError, match=r"not what its config.json says \(vocabulary rows 999 by its configuration, \d+ loaded; "
                                          r"hidden size 32 by its configuration, 64 loaded\)"):
        engine.load()


def _jobs(weights, prompts, out):
    gen = GenerateJob(model=weights / "student", prompts=PromptConfig(prompts), out=out, num_shards=2,
                      sampling=SamplingConfig(max_new_tokens=8, samples=1), progress=False)
    score = ScoreJob(cache=out, teacher=weights / "teacher", stores=("logprob", "hidden"), progress=False)
    return gen, score


def test_a_finished_job_rerun_never_loads_the_model(weights, opd_prompts, tmp_path, monkeypatch):
    gen, score = _jobs(weights, opd_prompts, tmp_path / "cache")
    assert run_generate(gen).written == [0, 1]
    assert run_score(score)["written"] == [0, 1]
    monkeypatch.setattr(hf, "load_model", _no_load)
    assert run_generate(gen).written == [] and run_score(score)["written"] == []


def test_a_job_with_work_loads_the_model_before_it_writes_anything(weights, opd_prompts, tmp_path, monkeypatch):
    gen, score = _jobs(weights, opd_prompts, tmp_path / "cache")
    monkeypatch.setattr(hf, "load_model", _no_load)
    with pytest.raises(AssertionError, match="the weights were loaded"):
        run_generate(gen)
    assert not (tmp_path / "cache" / "rollouts").exists()  # no job record: a rerun after fixing the model starts clean
    monkeypatch.undo()
    run_generate(gen)
    shutil.rmtree(tmp_path / "cache" / "teachers", ignore_errors=True)
    monkeypatch.setattr(hf, "load_model", _no_load)
    with pytest.raises(AssertionError, match="the weights were loaded"):
        run_score(score)
    assert not (tmp_path / "cache" / "teachers").exists()


def test_train_refuses_a_column_of_the_wrong_type_before_the_students_weights_load(hf_cache, weights, tmp_path, monkeypatch):
    """The cache's footers (rows, tokens, the types of the columns train reads) are checked against the student's
    configuration first: at any model size the refusal takes seconds."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from test_hostile2 import _replace

    from opdcache.errors import SchemaError
    from opdcache.training import train as T
    from opdcache.training.trainconfig import TrainConfig

    cache = tmp_path / "cache"
    shutil.copytree(hf_cache, cache)
    for path in sorted((cache / "rollouts").glob("part-*.parquet")):
        table = pq.read_table(path)
        field = pa.field("ref_logprobs", pa.list_(pa.float64()))
        table = table.set_column(table.schema.get_field_index("ref_logprobs"), field, table["ref_logprobs"].cast(field.type))
        _replace(cache, path.relative_to(cache).as_posix(), table)
    monkeypatch.setattr(T, "load_causal_lm", _no_load)
    cfg = TrainConfig(model=weights / "student", cache=cache, loss="lightning", steps=1, out=tmp_path / "run")
    with pytest.raises(SchemaError, match=r"ref_logprobs: list<element: double> \(expected list<item: float>\)"):
        T.Trainer(cfg)


def test_train_refuses_a_value_in_its_first_batch_before_the_students_weights_load(hf_cache, weights, tmp_path, monkeypatch):
    """The shards the first batch reads are decoded and checked before the student's weights load (the next ones
    decode in the loader's threads meanwhile): a top-k id beyond the student's vocabulary there is refused first."""
    import pyarrow.parquet as pq

    from test_hostile2 import _replace, _set_list_column

    from opdcache.errors import SchemaError
    from opdcache.training import train as T
    from opdcache.training.trainconfig import TrainConfig

    cache = tmp_path / "cache"
    shutil.copytree(hf_cache, cache)
    vocab = model_facts(weights / "student").vocab_size
    for path in sorted((cache / "teachers" / "teacher").glob("part-*.parquet")):  # every shard: whichever comes first
        table = pq.read_table(path)
        ids = table["topk_ids"].to_pylist()
        ids[0][0][0] = vocab + 7
        _replace(cache, path.relative_to(cache).as_posix(), _set_list_column(table, "topk_ids", ids))
    monkeypatch.setattr(T, "load_causal_lm", _no_load)
    cfg = TrainConfig(model=weights / "student", cache=cache, loss="topk-fkl", steps=1, out=tmp_path / "run")
    with pytest.raises(SchemaError, match=rf"row 0, column topk_ids: .*outside the vocabulary \[0, {vocab}\)"):
        T.Trainer(cfg)
