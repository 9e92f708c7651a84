"""check-consistency: the lineage verdict, and the empirical probe without lineage, on two teachers of
different trace styles with a pi_ref fine-tuned on teacher 1's trajectories."""

import json

import pytest

from opdcache.backends.base import SamplingConfig
from opdcache.cli.main import main
from opdcache.format import manifest as M
from opdcache.inputs.prompts import PromptConfig
from opdcache.teacher.consistency import check
from opdcache.teacher.rollouts import GenerateJob, run_generate
from opdcache.teacher.scoring import run_score, ScoreJob
from opdcache.training.sft import run_sft, SFTConfig


@pytest.fixture(scope="module")
def two_teacher_cache(tmp_path_factory, weights, opd_prompts):
    root = tmp_path_factory.mktemp("consistency")
    run_generate(GenerateJob(model=weights / "teacher", prompts=PromptConfig(opd_prompts), out=root / "sft", kind="sft", num_shards=2,
                             sampling=SamplingConfig(temperature=0.8, max_new_tokens=40)))
    run_sft(weights / "student", root / "sft", root / "pi_ref", SFTConfig(steps=120, batch_size=24, lr=3e-3, warmup=10))
    cache = root / "rollouts"
    run_generate(GenerateJob(model=root / "pi_ref", prompts=PromptConfig(opd_prompts), out=cache, num_shards=2,
                             sampling=SamplingConfig(temperature=1.0, max_new_tokens=40, samples=2)))
    run_score(ScoreJob(cache=cache, teacher=weights / "teacher"))
    run_score(ScoreJob(cache=cache, teacher=weights / "teacher_carry", allow_inconsistent_teacher=True))
    return cache


def _cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    return e.value.code, capsys.readouterr().out


@pytest.mark.slow
def test_lineage_and_probe_agree_and_flag_teacher_2(two_teacher_cache, capsys):
    report = check(two_teacher_cache)
    t1, t2 = report["teachers"]["teacher"], report["teachers"]["teacher_carry"]
    assert t1["lineage"] == "consistent" and t2["lineage"] == "inconsistent"
    assert t1["gap"]["ci95"][1] < t2["gap"]["ci95"][0]  # the style pi_ref imitates fits far better, beyond the noise
    assert report["consistent_by_lineage"] == report["consistent_empirically"] == "teacher"
    assert report["pairs"]["teacher vs teacher_carry"]["sigma_delta"] > 1.0
    code, out = _cli(["check-consistency", two_teacher_cache, "--train-teacher", "teacher_carry"], capsys)
    assert code == 1 and "training teacher teacher_carry: NOT the consistent teacher" in out
    code, out = _cli(["check-consistency", two_teacher_cache, "--train-teacher", "teacher"], capsys)
    assert code == 0 and "pi_ref looks consistent with: teacher" in out


def _without_lineage(cache, tmp_path):
    """A copy of the cache that records no SFT teacher and no consistency verdicts: the probe alone must decide."""
    import shutil

    copy = tmp_path / "nolineage"
    shutil.copytree(cache, copy)
    m = M.load(copy)
    m["lineage"]["sft_teacher"] = None
    for name in ("teachers/teacher", "teachers/teacher_carry"):
        m["tables"][name].pop("consistency")
    M.save(copy, m)
    return copy


def test_without_lineage_the_probe_alone_decides(two_teacher_cache, tmp_path, capsys):
    copy = _without_lineage(two_teacher_cache, tmp_path)
    report = check(copy)
    assert report["consistent_by_lineage"] is None and report["consistent_with"] == "teacher"
    code, out = _cli(["check-consistency", copy, "--train-teacher", "teacher_carry", "--json"], capsys)
    assert code == 1 and json.loads(out)["consistent_empirically"] == "teacher"


def test_a_misspelt_teacher_is_an_unknown_table_not_an_inconsistent_teacher(two_teacher_cache, capsys):
    with pytest.raises(SystemExit) as e:
        main(["check-consistency", str(two_teacher_cache), "--train-teacher", "teachr"])
    code, out = e.value.code, capsys.readouterr().err
    assert code == 2 and "--train-teacher 'teachr': no such teacher table" in out and "it has teacher, teacher_carry" in out


def test_one_teacher_says_what_the_probe_can_and_cannot_tell(hf_cache, capsys):
    code, out = _cli(["check-consistency", hf_cache], capsys)
    assert code == 0
    assert "with one teacher the probe cannot name the consistent one" in out and "of an untrained (uniform) teacher's" in out


def test_a_lone_teacher_far_from_pi_ref_is_likely_inconsistent(two_teacher_cache, tmp_path, capsys):
    """One teacher, no lineage: the demo's teacher_carry (another trace style) explains pi_ref's samples worse than a
    uniform teacher would (gap > 100% of the uniform gap): flagged, exit 1; pi_ref's own teacher stays far below 25%."""
    from opdcache.teacher.consistency import MAX_GAP_VS_UNIFORM

    copy = _without_lineage(two_teacher_cache, tmp_path)
    carry = check(copy, ["teacher_carry"])
    assert carry["likely_inconsistent"] == "teacher_carry" and carry["teachers"]["teacher_carry"]["gap_vs_uniform"] > 1.0
    own = check(copy, ["teacher"])
    assert own["likely_inconsistent"] is None and own["teachers"]["teacher"]["gap_vs_uniform"] < MAX_GAP_VS_UNIFORM / 2
    code, out = _cli(["check-consistency", copy, "--teacher", "teacher_carry"], capsys)
    assert code == 1 and "LIKELY INCONSISTENT: above the 25% threshold" in out
    code, out = _cli(["check-consistency", copy, "--teacher", "teacher"], capsys)
    assert code == 0 and "LIKELY INCONSISTENT" not in out
    code, out = _cli(["check-consistency", copy, "--teacher", "teacher_carry", "--max-gap-vs-uniform", "2"], capsys)
    assert code == 0
