"""`opdcache eval`: accuracy and pass@k with a verifier through build-rollouts' engines, checked against the demo's
own greedy evaluation (model.generate, a plain reference) and against the pass@k estimator's definition."""

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


@pytest.mark.parametrize("model", ["teacher", "student"])
def test_greedy_accuracy_equals_the_demos_own_greedy_evaluation(weights, heldout, model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opdcache.demo.evaluate import evaluate_accuracy

    report = run_eval(EvalJob(model=weights / model, prompts=PromptConfig(heldout), reward="addition",
                              sampling=SamplingConfig(temperature=0.0, samples=1, max_new_tokens=48)))
    m = AutoModelForCausalLM.from_pretrained(weights / model).eval()
    reference = evaluate_accuracy(m, AutoTokenizer.from_pretrained(weights / model), n=24, split="heldout")
    assert report["prompts"] == 24 and report["accuracy"] == pytest.approx(reference.accuracy, abs=1e-12)
    assert report["pass_at"] == {1: report["accuracy"]}


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
