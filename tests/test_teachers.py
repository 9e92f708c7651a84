"""Several teachers in one cache (train --teacher a,b): the loader yields each table's columns side by side, the loss is
the weighted sum of each teacher's (--teacher-weights), or each row takes the teacher its prompt names (--teacher-route);
what cannot be combined is refused in one line before the student loads."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from opdcache.errors import ConfigError, SchemaError
from opdcache.format import shards

TEACHERS = ("teacher", "teacher_carry")


@pytest.fixture(scope="module")
def two_teachers(tmp_path_factory, weights):
    """24 demo prompts x 2 samples from the demo student, with a "domain" field naming a teacher table per prompt, scored
    by the demo's two teachers (the same tokenizer, other traces)."""
    from opdcache.backends.base import SamplingConfig
    from opdcache.demo.task import problems
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate
    from opdcache.teacher.scoring import ScoreJob, run_score

    root = tmp_path_factory.mktemp("teachers")
    prompts = root / "routed.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer, "domain": TEACHERS[i % 3 == 0]}) + "\n"
                               for i, p in enumerate(problems("opd", 24, seed=0))))
    cache = root / "cache"
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(prompts), out=cache, num_shards=2,
                             sampling=SamplingConfig(max_new_tokens=40, samples=2)))
    for name in TEACHERS:
        run_score(ScoreJob(cache=cache, teacher=weights / name, allow_inconsistent_teacher=True))
    return cache


def _first_loss(cache, weights, out, **settings) -> float:
    """The loss of a run's first step (before any update: every run starts from the same student and batch)."""
    from opdcache.training.train import TrainConfig, run_train

    result = run_train(TrainConfig(cache=cache, model=weights / "student", out=out, steps=1, batch_size=16, checkpoint="none",
                                   **settings))
    return float(result["last"]["loss"])


def test_the_loader_yields_every_teachers_columns_and_each_rows_route(two_teachers):
    from opdcache.format.cache import Cache
    from opdcache.training.data import CacheLoader, CacheLoaderConfig

    loader = CacheLoader(CacheLoaderConfig(cache=two_teachers, teacher="teacher", more_teachers=("teacher_carry",),
                                           route_field="domain", batch_size=48, shuffle=False))
    batch = next(iter(loader))
    cache = Cache(two_teachers)
    rollouts = shards.read_table(cache.shard_paths("rollouts")[0])
    n = rollouts.num_rows
    for prefix, name in (("teacher_", "teacher"), ("teacher1_", "teacher_carry")):
        table = shards.read_table(cache.shard_paths(f"teachers/{name}")[0])
        for i in (0, n - 1):
            values = np.asarray(table["logprobs"][i].as_py(), np.float32)
            assert np.array_equal(batch[prefix + "logprobs"][i, : len(values)].numpy(), values)
    domains = [json.loads(m)["domain"] for m in rollouts["metadata"].to_pylist()]
    want = [TEACHERS.index(d) for d in domains]
    mask = batch["response_mask"][:n].bool()
    for i in range(n):
        assert set(batch["row_teacher"][i][mask[i]].tolist()) == {want[i]}
    assert 0 < sum(want) < n  # both teachers are routed to


def test_the_loss_is_the_weighted_sum_of_each_teachers(two_teachers, weights, tmp_path):
    alone = {name: _first_loss(two_teachers, weights, tmp_path / name, teacher=name) for name in TEACHERS}
    mixed = _first_loss(two_teachers, weights, tmp_path / "mixed", teacher="teacher,teacher_carry", teacher_weights=(0.7, 0.3))
    assert alone["teacher"] != pytest.approx(alone["teacher_carry"], rel=1e-3)  # two teachers that differ
    assert mixed == pytest.approx(0.7 * alone["teacher"] + 0.3 * alone["teacher_carry"], rel=1e-5, abs=1e-6)
    first_only = _first_loss(two_teachers, weights, tmp_path / "first", teacher="teacher,teacher_carry", teacher_weights=(2, 0))
    assert first_only == pytest.approx(alone["teacher"], rel=1e-6, abs=1e-7)


def test_a_lora_student_learns_from_several_teachers_mixed_and_routed(two_teachers, weights, tmp_path):
    """Before any update a LoRA student is its base (every lora_B starts at 0, and base + 0 is the base's value exactly),
    so its first loss from two teachers is the full student's; mixed and routed runs then train its adapters."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    from opdcache.training.train import TrainConfig, run_train

    mix = dict(teacher="teacher,teacher_carry", teacher_weights=(0.7, 0.3))
    full = _first_loss(two_teachers, weights, tmp_path / "full", **mix)
    adapters = _first_loss(two_teachers, weights, tmp_path / "lora", lora_rank=4, **mix)
    assert adapters == full
    out = tmp_path / "routed"
    run_train(TrainConfig(cache=two_teachers, model=weights / "student", out=out, steps=2, batch_size=16, lr=1e-3, lora_rank=4,
                          teacher="teacher,teacher_carry", teacher_route="domain"))
    trained = load_file(str(out / "model" / "adapter_model.safetensors"))
    assert any(float(v.abs().max()) > 0 for k, v in trained.items() if "lora_B" in k)


def test_routed_rows_train_on_their_own_teacher(two_teachers, weights, tmp_path):
    import torch

    from opdcache.training import objective as O
    from opdcache.training.data import CacheLoader, CacheLoaderConfig
    from opdcache.training.estimators import ESTIMATORS
    from opdcache.training.trainconfig import TrainConfig

    cfg = TrainConfig(cache=two_teachers, model=weights / "student", out=tmp_path / "r", teacher="teacher,teacher_carry",
                      teacher_route="domain")
    batch = next(iter(CacheLoader(CacheLoaderConfig(cache=two_teachers, teacher="teacher", more_teachers=("teacher_carry",),
                                                    route_field="domain", batch_size=16, shuffle=False))))
    batch = O.prepare_batch(batch, torch.device("cpu"), two_teachers)
    s = torch.where(batch["response_mask"].bool(), torch.full_like(batch["response_mask"], -1.5), torch.zeros(()))
    terms, _, _ = O.estimator_terms(cfg, batch, s, None, batch["response_mask"].bool(), None, None)
    own = [ESTIMATORS["lightning"].terms(cfg, O.teacher_view(batch, i), s, None, None, None)[0] for i in range(2)]
    picked = torch.where(batch["row_teacher"] == 1, own[1], own[0])
    assert torch.equal(terms, picked) and not torch.equal(own[0], own[1])


def test_what_cannot_be_combined_is_one_line(two_teachers, weights, tmp_path, capsys):
    from opdcache.training.data import CacheLoader, CacheLoaderConfig
    from opdcache.training.trainconfig import TrainConfig
    from opdcache.training.train import run_train

    base = dict(cache=two_teachers, model=weights / "student", out=tmp_path / "x")
    cases = [
        (dict(teacher="teacher,teacher_carry", teacher_weights=(1.0,)), "--teacher-weights takes one weight per teacher of --teacher (2), got 1"),
        (dict(teacher="teacher,teacher_carry", teacher_weights=(-1.0, 2.0)), "--teacher-weights must be finite, at least 0, not all 0"),
        (dict(teacher="teacher,teacher_carry", teacher_weights=(float("inf"), 1.0)), "--teacher-weights must be finite"),
        (dict(teacher="teacher,teacher_carry", teacher_weights=(1e308, 1e308)), "of a finite sum, got 1e+308, 1e+308"),
        (dict(teacher="teacher", teacher_route="domain"), "--teacher-route routes rows among several teachers"),
        (dict(teacher="teacher,teacher_carry", teacher_route="domain", teacher_weights=(1.0, 1.0)), "--teacher-route gives each row one teacher"),
        (dict(teacher="teacher,,x"), "--teacher takes distinct table names separated by commas"),
    ]
    for settings, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            TrainConfig(**base, **settings)
    with pytest.raises(ConfigError, match=re.escape("--loss topk-fkl reads each teacher's own support or vectors")):
        run_train(TrainConfig(**{**base, "model": tmp_path / "not-loaded"}, teacher="teacher,teacher_carry", loss="topk-fkl"))
    loader = CacheLoader(CacheLoaderConfig(cache=two_teachers, teacher="teacher", more_teachers=("teacher_carry",),
                                           route_field="answer_kind", batch_size=8, shuffle=False))
    with pytest.raises(ConfigError, match=re.escape("--teacher-route answer_kind: row 0's prompt has no field 'answer_kind' "
                                                    "(its fields: domain); route by a field the prompts carry")):
        next(iter(loader))
    from opdcache.training.decoded import _routes

    def refuse(what):
        raise SchemaError(what)

    for value, shown in (([1, 2], "a list"), ({"a": 1}, "a dict"), ("teacher_x", "'teacher_x'")):
        with pytest.raises(ConfigError, match=re.escape(f"--teacher-route domain: row 1's 'domain' is {shown}, which names "
                                                        "none of the teachers teacher, teacher_carry; give each row one "
                                                        "teacher's table name")):
            _routes([json.dumps({"domain": "teacher"}), json.dumps({"domain": value})], "domain", TEACHERS, refuse)
    from opdcache.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--cache", str(two_teachers), "--model", str(weights / "student"), "--out", str(tmp_path / "c"),
              "--teacher", "teacher,teacher_carry", "--teacher-weights", "0.7,x"])
    assert exit_.value.code == 2 and "--teacher-weights takes comma-separated numbers, got '0.7,x'" in capsys.readouterr().err


@pytest.mark.parametrize("mix", [dict(teacher_weights=(0.7, 0.3)), dict(teacher_route="domain")])
def test_several_teachers_pack_as_they_pad(two_teachers, weights, tmp_path, mix):
    padded = _first_loss(two_teachers, weights, tmp_path / "padded", teacher="teacher,teacher_carry", **mix)
    packed = _first_loss(two_teachers, weights, tmp_path / "packed", teacher="teacher,teacher_carry", pack=True, **mix)
    assert packed == pytest.approx(padded, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("route", [False, True], ids=["mixed", "routed"])
def test_each_teachers_clip_fraction_is_logged_under_its_name_and_the_mix_is_the_mixs(two_teachers, weights, tmp_path, route):
    """The logged clip_fraction was the first teacher's alone (0.0082 for a mix whose second teacher clips 85%)."""
    import torch

    from opdcache.training import objective as O
    from opdcache.training.data import CacheLoader, CacheLoaderConfig
    from opdcache.training.estimators import ESTIMATORS
    from opdcache.training.trainconfig import TrainConfig

    extra = dict(teacher_route="domain") if route else dict(teacher_weights=(0.25, 0.75))
    cfg = TrainConfig(cache=two_teachers, model=weights / "student", out=tmp_path / "r", teacher="teacher,teacher_carry", tau=0.5, **extra)
    batch = next(iter(CacheLoader(CacheLoaderConfig(cache=two_teachers, teacher="teacher", more_teachers=("teacher_carry",),
                                                    route_field="domain" if route else None, batch_size=16, shuffle=False))))
    batch = O.prepare_batch(batch, torch.device("cpu"), two_teachers)
    mask = batch["response_mask"]
    s = torch.where(mask.bool(), torch.full_like(mask, -1.5), torch.zeros(()))
    _, _, stats = O.estimator_terms(cfg, batch, s, None, mask.bool(), None, None)
    clipped = [ESTIMATORS["lightning"].terms(cfg, O.teacher_view(batch, i), s, None, None, None)[1]["clipped"].float() for i in range(2)]
    if route:
        on = [(batch["row_teacher"] == i).float() * mask for i in range(2)]
        own = [float((clipped[i] * on[i]).sum() / on[i].sum()) for i in range(2)]
        mix = float(((clipped[0] * on[0] + clipped[1] * on[1])).sum() / mask.sum())
    else:
        own = [float((c * mask).sum() / mask.sum()) for c in clipped]
        mix = 0.25 * own[0] + 0.75 * own[1]
    assert own[0] != pytest.approx(own[1], abs=1e-3)  # the two teachers clip differently
    assert stats["teacher/clip_fraction"] == pytest.approx(own[0], rel=1e-6)
    assert stats["teacher_carry/clip_fraction"] == pytest.approx(own[1], rel=1e-6)
    assert stats["clip_fraction"] == pytest.approx(mix, rel=1e-6)
