"""Verifiers: the contract, the built-ins (exact, math), plugins by entry point and module:function, failures
marking one row, and rejection sampling in build-sft."""

import json

import numpy as np
import pytest

from opdcache.backends.base import Generation, SamplingConfig
from opdcache.backends.hf import TransformersBackend
from opdcache.errors import ConfigError
from opdcache.format import shards
from opdcache.format.cache import Cache
from opdcache.inputs import verifiers as V
from opdcache.inputs.prompts import PromptConfig
from opdcache.teacher.rollouts import GenerateJob, run_generate


def tricky(response: str, task: dict):
    """A custom verifier for the module:function test: raises on one row, returns a reason on others."""
    if task["metadata"].get("explode"):
        raise RuntimeError("cannot read this row")
    return (1.0, "long enough") if len(response) >= 3 else (0.0, "too short")


def test_exact_normalises_whitespace_and_case():
    assert V.exact("  The  Answer\n", {"answer": "the answer"}) == 1.0
    assert V.exact("the answers", {"answer": "the answer"}) == 0.0


@pytest.mark.parametrize("response,answer,expected", [
    (r"so the result is \boxed{\frac{1}{2}}", "1/2", 1.0),        # exact, boxed
    (r"we get \boxed{0.5}", r"\frac{1}{2}", 1.0),                 # equivalent
    (r"thus \boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),                # equivalent
    (r"the answer is \boxed{3}", "4", 0.0),                      # wrong
    ("I do not know", "4", 0.0),                                  # unparseable: no final answer
])
def test_math_verifier_on_constructed_responses(response, answer, expected):
    verdict = V.score(V.math_equivalent, response, {"answer": answer})
    assert verdict.score == expected, verdict
    if response == "I do not know":
        assert verdict.reason.startswith("no \\boxed{} final answer")
        assert V.score(V.math_fallback, response, {"answer": answer}).reason == "no final answer found in the response"


def test_resolution_and_failures_mark_one_row():
    assert V.resolve("exact") is V.exact
    assert V.resolve("addition").__name__ == "verify_addition"  # the demo's plugin, found by entry point
    assert V.resolve("test_verifiers:tricky") is tricky
    with pytest.raises(ConfigError, match="--reward must be one of addition, exact, math, math-fallback or module:function, got 'nope'"):
        V.resolve("nope")
    with pytest.raises(ConfigError, match="--reward no_such_module:f: cannot import 'f' from 'no_such_module'"):
        V.resolve("no_such_module:f")
    assert V.score(tricky, "abc", {"metadata": {"explode": True}}) == V.Verdict(None, "verifier raised RuntimeError: cannot read this row")
    assert V.score(lambda r, t: 2.0, "x", {}).reason == "verifier returned 2.0, outside [0, 1]"
    assert V.score(lambda r, t: "yes", "x", {}).reason == "verifier returned 'yes', not a number in [0, 1]"


MATH_ROWS = [
    {"messages": [{"role": "system", "content": "Answer in \\boxed{}."}, {"role": "user", "content": "123+456"}], "answer": "579"},
    {"messages": [{"role": "user", "content": "200+300"}], "answer": "500", "explode": True},
    {"messages": [{"role": "user", "content": "111+111"}], "answer": "222"},
    {"messages": [{"role": "user", "content": "905+5"}], "answer": "910"},
]


def _scripted(texts):
    """Make the engine return these decoded responses (as token ids of the demo tokenizer), in request order."""
    original = TransformersBackend.generate

    def generate(self, requests, sampling):
        gens = original(self, requests, sampling)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.path)
        out = []
        for r, g in zip(requests, gens):
            ids = tok(texts[r.prompt_ids], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            lp = np.full(len(ids), -0.5, dtype="float32")
            out.append(Generation(response_ids=np.asarray(ids, dtype="int32"), finish_reason="stop", sampling_logprobs=lp, ref_logprobs=lp))
        return out
    return original, generate


def test_build_sft_with_math_verifier_chat_messages_and_rejection_sampling(tmp_path, weights, monkeypatch):
    """Chat-message prompts with a system turn, a custom module:function verifier that raises on one row: that row's reward
    is left empty with the reason recorded (job goes on); `--keep correct` keeps only rows scored 1.0 and counts the rest."""
    src = tmp_path / "math.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in MATH_ROWS))
    from transformers import AutoTokenizer

    from opdcache.inputs.prompts import read_prompts

    tok = AutoTokenizer.from_pretrained(weights / "teacher")
    prompts = read_prompts(PromptConfig(src, messages_field="messages"), tok, None).prompts
    answers = ["=0579", "=0500", "=0223", "no idea"]  # the demo tokenizer has no backslash: the demo's own answer style
    texts = {p.prompt_ids: a for p, a in zip(prompts, answers)}
    original, scripted = _scripted(texts)
    monkeypatch.setattr(TransformersBackend, "generate", scripted)

    for keep in ("all", "correct"):
        out = tmp_path / f"sft-{keep}"
        res = run_generate(GenerateJob(model=weights / "teacher", prompts=PromptConfig(src, messages_field="messages"), out=out, kind="sft",
                                       num_shards=2, sampling=SamplingConfig(max_new_tokens=12), reward="test_verifiers:tricky", keep=keep))
        rows = [r for p in Cache(out).shard_paths("sft") for r in shards.read_table(p).to_pylist()]
        rewards = {r["prompt_index"]: r["reward"] for r in rows}
        if keep == "all":
            assert rewards == {0: 1.0, 1: None, 2: 1.0, 3: 1.0}  # row 1's verifier raised: reward left empty, row kept
            failed = [json.loads(l) for l in (out / "sft" / "verifier_errors.jsonl").read_text().splitlines()]
            assert [(f["prompt_index"], f["reason"]) for f in failed] == [(1, "verifier raised RuntimeError: cannot read this row")]
        else:
            assert sorted(rewards) == [0, 2, 3] and res.rejected == 1 and "1 samples rejected by the verifier" in res.summary()
            stats = Cache(out).table("sft")["stats"]
            assert stats["keep"] == "correct" and stats["samples_drawn"] == 4


def test_the_math_verifier_through_build_rollouts(tmp_path, weights, monkeypatch):
    src = tmp_path / "math.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in MATH_ROWS))
    from transformers import AutoTokenizer

    from opdcache.inputs.prompts import read_prompts

    tok = AutoTokenizer.from_pretrained(weights / "student")
    prompts = read_prompts(PromptConfig(src, messages_field="messages"), tok, None).prompts
    texts = dict(zip((p.prompt_ids for p in prompts), ["=579", "=0500", "=223", "=="]))
    monkeypatch.setattr(TransformersBackend, "generate", _scripted(texts)[1])
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(src, messages_field="messages"), out=tmp_path / "c",
                             num_shards=1, sampling=SamplingConfig(max_new_tokens=12), reward="math-fallback"))
    rows = shards.read_table(Cache(tmp_path / "c").shard_paths("rollouts")[0]).to_pylist()
    # the demo tokenizer spells no backslash, so the opt-in fallback judges the last number: "=579" vs 579, "=0500" vs 500 (equivalent), "=223" vs 222 (wrong), "==" (no answer)
    assert [r["reward"] for r in sorted(rows, key=lambda r: r["prompt_index"])] == [1.0, 1.0, 0.0, 0.0]


def test_info_shows_the_reward_mean_per_table(hf_cache, capsys):
    from opdcache.cli.main import main
    from opdcache.format.info import summary

    rewards = [r for p in Cache(hf_cache).shard_paths("rollouts") for r in shards.read_table(p, ["reward"])["reward"].to_pylist()]
    assert summary(hf_cache)["tables"]["rollouts"]["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    with pytest.raises(SystemExit):
        main(["info", str(hf_cache)])
    assert "reward mean" in capsys.readouterr().out


TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% elif m['role'] == 'user' %}<|user|>"
            "{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% if enable_thinking %};{% endif %}{% endif %}")


def test_system_prompt_and_chat_template_kwargs_decide_the_ids_and_the_fingerprint(tmp_path, weights):
    import shutil

    from transformers import AutoTokenizer

    from opdcache.inputs.prompts import read_prompts

    model = tmp_path / "m"
    shutil.copytree(weights / "student", model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    tok = AutoTokenizer.from_pretrained(model)
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "12+34"}) + "\n" + json.dumps({"messages": [{"role": "system", "content": "1="}, {"role": "user", "content": "5+5"}]}) + "\n")

    def ids(**kw):
        return [p.prompt_ids for p in read_prompts(PromptConfig(src, **kw), tok, None).prompts], read_prompts(PromptConfig(src, **kw), tok, None).fingerprint

    plain, fp_plain = ids()
    with_system, fp_system = ids(system_prompt="9=")
    thinking, fp_thinking = ids(chat_template_kwargs={"enable_thinking": True})
    semicolon, nine = tok.convert_tokens_to_ids(";"), tok.convert_tokens_to_ids("9")
    assert with_system[0][0] == nine and plain[0][0] != nine  # the system turn leads the plain-prompt row
    assert thinking[0][-1] == semicolon and plain[0][-1] != semicolon  # the template variable reaches the template
    assert len({fp_plain, fp_system, fp_thinking}) == 3
    with pytest.raises(ConfigError, match="--chat-template-kwargs must be a JSON object"):
        PromptConfig(src, chat_template_kwargs=["x"])


def test_prompts_from_a_hub_dataset_id_offline(tmp_path, weights, monkeypatch):
    """A dataset repo in the Hub cache's real layout; --prompts org/name@main reads its train split, offline."""
    import hashlib

    from test_models import COMMIT

    repo = tmp_path / "hub" / "datasets--org--prompts"
    data = "".join(json.dumps({"prompt": f"{100 + i}+{200 + i}", "answer": str(300 + 2 * i)}) + "\n" for i in range(3)).encode()
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / blob).write_bytes(data)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    snap = repo / "snapshots" / COMMIT / "data"
    snap.mkdir(parents=True)
    (snap / "train-00000.jsonl").symlink_to(f"../../../blobs/{blob}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig("org/prompts@main"), out=tmp_path / "c", num_shards=1,
                                   sampling=SamplingConfig(max_new_tokens=8), reward="addition"))
    assert len(res.prompts.prompts) == 3 and [p.answer for p in res.prompts.prompts] == ["300", "302", "304"]
    with pytest.raises(ConfigError, match="org/missing is not in the local Hub cache and HF_HUB_OFFLINE is set"):
        run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig("org/missing"), out=tmp_path / "d"))


def _math_models(tmp_path, weights):
    """The demo models with a tokenizer whose first three reserved tokens are '\\', '{' and '}', so \\boxed{...} answers
    are tokenizable (same vocabulary size, so the same weights run)."""
    import shutil

    from transformers import AutoTokenizer

    from opdcache.demo.models import build_tokenizer

    tok = build_tokenizer()
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for old, new in zip(("<|reserved_0|>", "<|reserved_1|>", "<|reserved_2|>"), ("\\", "{", "}")):
        vocab[new] = vocab.pop(old)
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token=tok.eos_token,
                                   pad_token=tok.pad_token, unk_token=tok.unk_token)
    fast.chat_template = tok.chat_template
    out = {}
    for role in ("teacher", "student"):
        shutil.copytree(weights / role, tmp_path / role)
        fast.save_pretrained(tmp_path / role)
        out[role] = tmp_path / role
    loaded = AutoTokenizer.from_pretrained(out["student"])
    assert loaded.decode(loaded.encode("so \\boxed{0.5}", add_special_tokens=False)) == "so \\boxed{0.5}"  # round-trips exactly
    return out, loaded


def test_math_task_end_to_end_build_sft_build_rollouts_score_teacher(tmp_path, weights, monkeypatch):
    """A math-style prompt file (chat messages with a system turn, LaTeX answers) through build-sft (math verifier,
    --keep correct) -> build-rollouts (math verifier) -> score-teacher, on the demo models' machinery, with constructed
    responses: exact, equivalent, wrong and unparseable."""
    from opdcache.inputs.prompts import read_prompts
    from opdcache.teacher.scoring import ScoreJob, run_score
    from opdcache.format.validate import validate

    models, tok = _math_models(tmp_path, weights)
    rows = [{"messages": [{"role": "system", "content": "answer in a box."}, {"role": "user", "content": "1+1"}], "answer": "2"},
            {"messages": [{"role": "user", "content": "1/2+0"}], "answer": "\\frac{1}{2}"},
            {"messages": [{"role": "user", "content": "2*3"}], "answer": "6"},
            {"messages": [{"role": "user", "content": "9-4"}], "answer": "5"}]
    src = tmp_path / "math.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    responses = ["so \\boxed{2}", "we get \\boxed{0.5}", "it is \\boxed{7}", "no idea"]  # exact, equivalent, wrong, none
    prompts = read_prompts(PromptConfig(src, messages_field="messages"), tok, None).prompts
    monkeypatch.setattr(TransformersBackend, "generate", _scripted(dict(zip((p.prompt_ids for p in prompts), responses)))[1])
    cfg = PromptConfig(src, messages_field="messages")
    sft = run_generate(GenerateJob(model=models["teacher"], prompts=cfg, out=tmp_path / "sft", kind="sft", num_shards=2,
                                   sampling=SamplingConfig(max_new_tokens=24), reward="math", keep="correct"))
    kept = {r["prompt_index"]: r["reward"] for p in Cache(tmp_path / "sft").shard_paths("sft") for r in shards.read_table(p).to_pylist()}
    assert kept == {0: 1.0, 1: 1.0} and sft.rejected == 2
    run_generate(GenerateJob(model=models["student"], prompts=cfg, out=tmp_path / "ro", num_shards=2, sampling=SamplingConfig(max_new_tokens=24),
                             reward="math", sft_teacher=models["teacher"]))
    rewards = {r["prompt_index"]: r["reward"] for p in Cache(tmp_path / "ro").shard_paths("rollouts") for r in shards.read_table(p).to_pylist()}
    assert rewards == {0: 1.0, 1: 1.0, 2: 0.0, 3: 0.0}
    result = run_score(ScoreJob(cache=tmp_path / "ro", teacher=models["teacher"], stores=("logprob", "topk"), top_k=4))
    assert result["consistency"]["verdict"] == "consistent" and validate(tmp_path / "ro") == []


@pytest.mark.parametrize("response,finish,fn,credit,expected", [
    (r"so \boxed{4}", "stop", "math", False, 1.0),                                   # boxed, finished
    ("... The remaining 2 slices are", "length", "math-fallback", False, 0.0),        # cut off: no credit, even by luck
    ("... The remaining 2 slices are", "length", "math-fallback", True, 0.0),         # asked for: judged, ends on 2, not 4
    ("... that leaves 4", "length", "math-fallback", True, 1.0),                      # asked for: the last number judged
    ("so the answer is 4", "stop", "math", False, 0.0),                               # unboxed: math wants \boxed{}
    ("so the answer is 4", "stop", "math-fallback", False, 1.0),                      # the opt-in fallback takes it
    (r"so \boxed{\frac{8}{2}} and then 7", "stop", "math", False, 1.0),              # the boxed answer, not the last number
    (r"\boxed{4} \boxed{5}", "stop", "math", False, 0.0),                            # the last box counts
    (r"so \boxed{4", "length", "math", True, 0.0),                                   # unclosed box: no final answer
])
def test_truncated_boxed_unboxed_and_equivalent_answers(response, finish, fn, credit, expected):
    verdict = V.score(V.resolve(fn), response, {"answer": "4", "finish_reason": finish}, credit_truncated=credit)
    assert verdict.score == expected, verdict
    if finish == "length" and not credit:
        assert verdict.reason.startswith("cut off by --max-new-tokens")
