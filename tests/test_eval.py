"""`opdcache eval`: accuracy and pass@k with a verifier through build-rollouts' engines, checked against a plain
model.generate judged by the task, the pass@k estimator's definition, and (--teacher) a float64 reverse KL."""

import itertools
import json
import math

import pytest

from opdcache.cli.main import main
from opdcache.evaluation.evaluate import EvalJob, pass_at_k, run_eval
from opdcache.inputs.prompts import PromptConfig
from opdcache.backends.base import SamplingConfig


def _cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.parametrize("n, c, k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (6, 6, 2), (3, 1, 3)])
def test_pass_at_k_is_the_chance_that_k_of_the_samples_drawn_without_replacement_hold_a_correct_one(n, c, k):
    """Against its definition: every k-subset of n samples (c correct) counted."""
    subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
    from opdcache.demo.task import write_prompts

    return write_prompts(tmp_path_factory.mktemp("eval") / "heldout.jsonl", "heldout", 24)


def _plain_greedy(model, tokenizer, prompts, max_new_tokens=48):
    """The plain reference: model.generate, greedy, each prompt alone, with the chat template applied once."""
    import torch

    from opdcache.demo.evaluate import chat_prompt_ids

    out = []
    for p in prompts:
        ids = torch.tensor([chat_prompt_ids(tokenizer, p)])
        with torch.no_grad():
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        out.append((ids[0].tolist(), g[0, ids.shape[1]:].tolist()))
    return out


@pytest.mark.parametrize("model", ["teacher", "student"])
def test_greedy_accuracy_equals_plain_generate_judged_by_the_task(weights, heldout, model):
    """eval's greedy accuracy (build-rollouts' engine) and the demo's (the same library call on a model in memory)
    equal a plain model.generate judged by the task's own answer check."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opdcache.demo import task
    from opdcache.demo.evaluate import evaluate_prompts

    report = run_eval(EvalJob(model=weights / model, prompts=PromptConfig(heldout), reward="addition",
                              sampling=SamplingConfig(temperature=0.0, samples=1, max_new_tokens=48)))
    m, tok = AutoModelForCausalLM.from_pretrained(weights / model).eval(), AutoTokenizer.from_pretrained(weights / model)
    problems = task.problems("heldout", 24)
    plain = _plain_greedy(m, tok, [p.prompt for p in problems])
    reference = sum(task.is_correct(tok.decode(r, skip_special_tokens=True), p.answer) for (_, r), p in zip(plain, problems)) / 24
    assert 0 < reference or model == "student"
    assert report["prompts"] == 24 and report["accuracy"] == pytest.approx(reference, abs=1e-12)
    assert report["pass_at"] == {1: report["accuracy"]}
    assert evaluate_prompts(m, tok, heldout).accuracy == pytest.approx(reference, abs=1e-12)


def test_reverse_kl_to_a_teacher_equals_a_float64_full_softmax(weights, heldout):
    """The KL eval and the demo report, streamed through both heads in float32 vocabulary slices, against the plain
    definition on the same greedy responses: both models in float64, a full log-softmax, sum_v q (log q - log p) a
    position, the mean over positions. Bound (tests/tolerance.py): each side's float32 log-probs within t_s, t_t of
    float64's; the KL moves by at most t_s (1 + E_q|log q - log p|) + t_t, plus the float32 sum over V terms
    (V u E_q|log q - log p|), per position; the mean's bound is the positions' mean."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opdcache.demo import task
    from opdcache.evaluation.evaluate import reverse_kl_to_teacher
    from tolerance import U32, logprob_tolerance

    student, teacher = (AutoModelForCausalLM.from_pretrained(weights / n).eval() for n in ("student", "teacher"))
    tok = AutoTokenizer.from_pretrained(weights / "student")
    sequences = _plain_greedy(student, tok, [p.prompt for p in task.problems("heldout", 8)])
    got, tokens = reverse_kl_to_teacher(student, teacher, sequences, chunk=64)
    assert tokens == sum(len(r) for _, r in sequences) > 0
    kl, bound = [], []
    with torch.no_grad():
        for prompt, response in sequences:
            ids, at = torch.tensor([prompt + response]), slice(len(prompt) - 1, len(prompt) - 1 + len(response))
            z32 = [m(ids).logits[0, at] for m in (student, teacher)]
            z64 = [m.double()(ids).logits[0, at] for m in (student, teacher)]
            student.float(), teacher.float()
            lq, lp = (torch.log_softmax(z, -1) for z in z64)
            gap = (lq.exp() * (lq - lp).abs()).sum(-1)
            kl.append((lq.exp() * (lq - lp)).sum(-1))
            t_s, t_t = (logprob_tolerance(a, b)[:, 0] for a, b in zip(z32, z64))
            bound.append(t_s * (1 + gap) + t_t + lq.shape[-1] * U32 * gap)
    kl, bound = torch.cat(kl), torch.cat(bound)
    assert abs(got - float(kl.mean())) <= float(bound.mean()), (got, float(kl.mean()), float(bound.mean()))
    assert float(bound.mean()) < 1e-3 * float(kl.mean())  # the check is far finer than the figure


def test_eval_with_a_teacher_reports_the_kl_of_its_own_responses(weights, heldout, capsys):
    from transformers import AutoModelForCausalLM

    from opdcache.evaluation.evaluate import reverse_kl_to_teacher

    code, out, err = _cli(["eval", "--model", weights / "student", "--prompts", heldout, "--reward", "addition",
                           "--max-new-tokens", "48", "--teacher", weights / "teacher", "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    student, teacher = (AutoModelForCausalLM.from_pretrained(weights / n).eval() for n in ("student", "teacher"))
    from transformers import AutoTokenizer

    from opdcache.demo import task

    sequences = _plain_greedy(student, AutoTokenizer.from_pretrained(weights / "student"), [p.prompt for p in task.problems("heldout", 24)])
    kl, tokens = reverse_kl_to_teacher(student, teacher, sequences)
    assert report["kl_tokens"] == tokens and report["reverse_kl_to_teacher"] == pytest.approx(kl, rel=1e-5)
    assert report["reverse_kl_to_teacher"] > 0.01  # the untrained student is far from the teacher
    code, out, err = _cli(["eval", "--model", weights / "student", "--prompts", heldout, "--reward", "addition",
                           "--max-new-tokens", "48", "--teacher", weights / "teacher"], capsys)
    assert code == 0 and f"reverse KL to {weights / 'teacher'} {kl:.4f} nats a token over {tokens} tokens" in out, out + err


def test_a_teacher_with_another_vocabulary_is_one_line_before_any_model_loads(weights, heldout, capsys, monkeypatch):
    import opdcache.backends as backends

    monkeypatch.setattr(backends, "make_backend", lambda *a, **k: pytest.fail("an engine was built"))
    code, out, err = _cli(["eval", "--model", weights / "student", "--prompts", heldout, "--reward", "addition",
                           "--teacher", weights / "teacher_pairs"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "its tokenizer is not the model's" in lines[0] and "share the model's vocabulary" in lines[0], err


def test_sampled_pass_at_k_is_reproducible_and_bounded_by_accuracy(weights, heldout, capsys):
    args = ["eval", "--model", weights / "teacher", "--prompts", heldout, "--reward", "addition", "--samples", "3",
            "--temperature", "1.5", "--max-new-tokens", "48", "--seed", "7", "--json"]
    code, out, err = _cli(args, capsys)
    assert code == 0, err
    first = json.loads(out)
    code, out, _ = _cli(args, capsys)
    assert json.loads(out) == first  # the same seed draws the same responses
    p = first["pass_at"]
    assert first["accuracy"] == pytest.approx(p["1"], abs=1e-12)  # pass@1 is the mean score of binary verdicts
    assert p["1"] <= p["2"] <= p["3"] <= 1.0 and not math.isnan(p["3"])


@pytest.mark.parametrize("args, want", [
    (["--reward", "nope"], "--reward must be one of"),
    (["--reward", "addition", "--samples", "3"], "--samples above 1 with --temperature 0 draws the same greedy response"),
], ids=["verifier", "greedy-samples"])
def test_eval_mistakes_are_one_line_before_any_model_loads(tmp_path, heldout, capsys, args, want):
    code, out, err = _cli(["eval", "--model", tmp_path / "not-loaded", "--prompts", heldout, *args], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and want in lines[0], err


def test_prompts_without_answers_are_one_line(weights, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+1"}) + "\n")
    code, out, err = _cli(["eval", "--model", weights / "teacher", "--prompts", path, "--reward", "addition", "--max-new-tokens", "48"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "no prompt carries an answer" in lines[0], err


def test_train_eval_every_logs_the_eval_commands_figures_for_the_weights_it_has_then(hf_cache, weights, heldout, tmp_path, capsys):
    """--eval-every 2 over 4 steps: steps 2 and 4 carry eval/accuracy and eval/pass@1; the last equals `opdcache eval`
    of the final model (the same prompts, greedy), the others are absent from the steps between."""
    from opdcache.training.train import TrainConfig, run_train

    cfg = TrainConfig(model=weights / "student", cache=hf_cache, out=tmp_path / "run", steps=4, batch_size=8, lr=1e-3,
                      eval_every=2, eval_prompts=heldout, eval_reward="addition", eval_max_new_tokens=48)
    run_train(cfg)
    metrics = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [("eval/accuracy" in m) for m in metrics] == [False, True, False, True]
    final = run_eval(EvalJob(model=tmp_path / "run" / "model", prompts=PromptConfig(heldout), reward="addition",
                             sampling=SamplingConfig(temperature=0.0, samples=1, max_new_tokens=48)))
    assert metrics[-1]["eval/accuracy"] == pytest.approx(final["accuracy"], abs=1e-12)
    assert metrics[-1]["eval/pass@1"] == metrics[-1]["eval/accuracy"]


def test_eval_every_without_its_prompts_is_one_line(tmp_path, capsys):
    code, out, err = _cli(["train", "--model", tmp_path / "m", "--cache", tmp_path / "c", "--out", tmp_path / "o",
                           "--eval-every", "5"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--eval-every N needs a positive N, --eval-prompts" in lines[0], err
