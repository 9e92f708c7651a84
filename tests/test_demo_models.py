"""The embedded task and the shipped tiny models, loaded through the real Hugging Face code."""

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from opdcache.demo import models, task
from opdcache.demo.build import build, RECIPES, WEIGHTS
from opdcache.demo.evaluate import chat_prompt_ids, evaluate_accuracy

VLLM_CPU_HEAD_SIZES = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}


def test_solution_traces_are_right_and_checked():
    rng = random.Random(0)
    for _ in range(200):
        p = task.Problem(rng.randint(0, 999), rng.randint(0, 999), 3)
        for style in task.STYLES:
            trace = task.solution(p, style)
            assert task.is_correct(trace, p.answer)
            assert int(task.extract_answer(trace)) == p.a + p.b
    assert task.solution(task.Problem(347, 589, 3)) == "7+9+0=16;4+8+1=13;3+5+1=09;=0936"
    assert task.solution(task.Problem(347, 589, 3), "carry") == "c0:7+9=16;c1:4+8=13;c1:3+5=09;=0936"
    assert not task.is_correct("7+9+0=16;=0935", "0936")
    assert not task.is_correct("no answer", "0936")


def test_a_problem_has_several_valid_traces():
    """Each column's two digits in either order: every trace is graded right, and all 2 x 2 x 2 traces occur."""
    rng = random.Random(0)
    p = task.Problem(347, 589, 3)
    traces = {style: {task.solution(p, style, rng) for _ in range(400)} for style in task.STYLES}
    for style, found in traces.items():
        assert all(task.is_correct(t, p.answer) for t in found)
        assert len(found) == 2 ** 3, style
    assert {t.split(";")[0] for t in traces["columns"]} == {"7+9+0=16", "9+7+0=16"}
    assert {t.split(";")[1] for t in traces["carry"]} == {"c1:4+8=13", "c1:8+4=13"}
    assert task.solution(p, "columns", random.Random(1)) == task.solution(p, "columns", random.Random(1))  # seeded


def test_splits_are_deterministic_and_disjoint():
    assert task.problems("opd", 50, seed=3) == task.problems("opd", 50, seed=3)
    sets = {s: {(p.a, p.b) for p in task.problems(s, 300, seed=0)} for s in task.SPLITS}
    assert not sets["train"] & sets["heldout"] and not sets["opd"] & sets["heldout"] and not sets["train"] & sets["opd"]


def test_tokenizer_is_character_level_with_a_chat_template():
    tok = AutoTokenizer.from_pretrained(WEIGHTS / "teacher")
    ids = chat_prompt_ids(tok, "347+589")
    assert tok.convert_ids_to_tokens(ids) == ["<|user|>", "3", "4", "7", "+", "5", "8", "9", "<|assistant|>"]
    trace = task.solution(task.Problem(347, 589, 3))
    assert tok.decode(tok(trace, add_special_tokens=False)["input_ids"]) == trace
    assert tok.eos_token == models.EOS and tok.eos_token_id == 1 and tok.pad_token_id == 0
    assert len(tok) == models.VOCAB_SIZE


@pytest.mark.parametrize("name, arch", [("teacher", "Qwen3ForCausalLM"), ("teacher_carry", "Qwen3ForCausalLM"), ("student", "LlamaForCausalLM")])
def test_shipped_models_load_and_fit_vllm_cpu(name, arch):
    model = AutoModelForCausalLM.from_pretrained(WEIGHTS / name)
    assert type(model).__name__ == arch
    cfg = model.config
    assert cfg.head_dim in VLLM_CPU_HEAD_SIZES
    report = json.loads((WEIGHTS / name / "build_report.json").read_text())
    assert report["steps"] == RECIPES[name]["steps"]


def test_teacher_solves_the_task_and_the_student_is_clearly_weaker():
    torch.manual_seed(0)
    loaded = {n: (AutoModelForCausalLM.from_pretrained(WEIGHTS / n), AutoTokenizer.from_pretrained(WEIGHTS / n)) for n in ("teacher", "student")}
    acc = {n: evaluate_accuracy(m, t, n=100).accuracy for n, (m, t) in loaded.items()}
    assert acc["teacher"] >= 0.95
    assert acc["student"] <= 0.2
    size = {n: sum(p.numel() for p in m.parameters()) for n, (m, _) in loaded.items()}
    assert size["student"] * 4 < size["teacher"]


@pytest.mark.parametrize("role, arch", [("teacher", "llama"), ("student", "qwen3")])
def test_both_architectures_build_for_both_roles(tmp_path, role, arch):
    model = models.new_model(role, arch)
    models.save(model, models.build_tokenizer(), tmp_path / "m")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    ids = torch.tensor([[3, 4, 5]])
    torch.testing.assert_close(back(ids).logits, model(ids).logits)


@pytest.mark.slow
def test_build_script_produces_a_loadable_model(tmp_path):
    report = build("student", tmp_path, steps=5, progress=False)
    assert report["steps"] == 5 and 0.0 <= report["heldout_accuracy"] <= 1.0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "student") is not None


def test_a_second_conversion_of_the_real_model_keeps_the_first_and_removes_its_own(tmp_path):
    """Two processes converting SmolLM2 at once (two test workers, two jobs): the first rename wins, the second's
    temporary folder goes; a rename that fails for another reason is raised."""
    from opdcache.demo.real import publish

    out = tmp_path / "smollm2-135m-instruct"
    for pid, text in ((1, "first"), (2, "second")):
        tmp = tmp_path / f"smollm2-135m-instruct.tmp-{pid}"
        tmp.mkdir()
        (tmp / "model.safetensors").write_text(text)
        assert publish(tmp, out) == out and not tmp.exists()
    assert (out / "model.safetensors").read_text() == "first"
    (out / "model.safetensors").unlink()  # a folder in the way that is not a finished conversion
    (out / "other").write_text("x")
    tmp = tmp_path / "smollm2-135m-instruct.tmp-3"
    tmp.mkdir()
    (tmp / "model.safetensors").write_text("third")
    with pytest.raises(OSError):
        publish(tmp, out)
    assert tmp.exists()


def test_a_shipped_model_missing_from_the_install_is_one_line_naming_the_reinstall(tmp_path, monkeypatch, capsys):
    """A wheel built without a model folder: the demo names the install, not the work directory's storage."""
    import shutil

    from opdcache.cli.main import main
    from opdcache.demo import pipeline

    partial = tmp_path / "weights"
    for name in pipeline.SHIPPED[:-1]:
        shutil.copytree(WEIGHTS / name, partial / name)
    monkeypatch.setattr(pipeline, "WEIGHTS", partial)
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 1 and len(err) == 1, err
    assert f"shipped model {pipeline.SHIPPED[-1]!r} is not in this install" in err[0] and "reinstall opdcache" in err[0]
    assert "disk space" not in err[0]
