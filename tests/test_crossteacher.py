"""A teacher with its own tokenizer (opdcache/teacher/crossteacher.py, the aligned store, the span losses): the demo student's
rollouts scored by a teacher whose tokenizer reads digit pairs as one token. The stored group log-probs equal an
independent forward of the teacher over its own rendering of the same text; validate, the loader and train read the
table; every refusal is one line, before any model loads; and the group losses reduce to the per-token ones when
every group is one token to one."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from opdcache.errors import ConfigError, InputError
from opdcache.format import schema as S, shards

STUDENT_STEPS = 2
TOP_K = 6


def _pair_teacher(path: Path, seed: int = 0, normalizer=None) -> Path:
    from transformers import AutoModelForCausalLM

    from opdcache.demo import models

    config = models.model_config("teacher")
    config.vocab_size = models.PAIR_VOCAB_SIZE
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokenizer = models.build_tokenizer(digit_pairs=True)
    if normalizer is not None:
        tokenizer.backend_tokenizer.normalizer = normalizer
    return models.save(model, tokenizer, path)


@pytest.fixture(scope="module")
def cross(tmp_path_factory, weights):
    """(cache, prompts, teacher): 24 demo prompts x 2 samples from the demo student, scored by a pair-tokenizer teacher."""
    from opdcache.backends.base import SamplingConfig
    from opdcache.demo.task import write_prompts
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate
    from opdcache.teacher.scoring import ScoreJob, run_score

    root = tmp_path_factory.mktemp("cross")
    prompts = write_prompts(root / "opd.jsonl", "opd", 24)
    teacher = _pair_teacher(root / "pairs")
    cache = root / "cache"
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(prompts), out=cache, num_shards=2,
                             sampling=SamplingConfig(max_new_tokens=40, samples=2, ref_top_k=TOP_K)))
    result = run_score(ScoreJob(cache=cache, teacher=teacher, prompts=PromptConfig(prompts), top_k=TOP_K))
    assert result["finished"] and result["aligned"]["aligned"] == result["aligned"]["rows"] == 48
    return cache, prompts, teacher


def _forward_logprobs(model_dir: Path, prompt_ids: list[int], response_ids: list[int]) -> np.ndarray:
    """The teacher's log-prob of each response token, in float64, by a plain forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1: -1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response_ids)[:, None])[:, 0].numpy()


def test_group_logprobs_equal_an_independent_forward_over_the_teachers_own_rendering(cross):
    from opdcache.teacher.alignment import TokenText, align_response
    from opdcache.format.cache import Cache
    from opdcache.demo.models import build_tokenizer

    root, prompts, teacher = cross
    cache = Cache(root)
    assert cache.manifest["format_version"] == 6
    entry = cache.table("teachers/pairs")
    assert entry["params"]["stores"] == ["logprob", "aligned"] and "logsumexp" not in shards.read_table(
        cache.shard_paths("teachers/pairs")[0]).column_names
    assert entry["aligned"]["groups"] > entry["aligned"]["one_to_one"] > 0  # digit pairs: many-to-one groups exist
    chars, pairs = build_tokenizer(), build_tokenizer(digit_pairs=True)
    special_s, special_t = set(chars.added_tokens_decoder), set(pairs.added_tokens_decoder)
    lines = [json.loads(line) for line in prompts.read_text().splitlines()]
    rollouts, table = shards.read_table(cache.shard_paths("rollouts")[1]), shards.read_table(cache.shard_paths("teachers/pairs")[1])
    for i in (0, 5):
        response = rollouts["response_ids"][i].as_py()
        messages = [{"role": "user", "content": lines[rollouts["prompt_index"][i].as_py()]["prompt"]}]
        rendered = pairs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_t = pairs(rendered, add_special_tokens=False)["input_ids"]
        text = chars.decode(response, skip_special_tokens=True)
        response_t = pairs(text, add_special_tokens=False)["input_ids"] + ([pairs.eos_token_id] if response[-1] == chars.eos_token_id else [])
        assert table["teacher_prompt_ids"][i].as_py() == prompt_t and table["teacher_response_ids"][i].as_py() == response_t
        row = align_response(TokenText.from_hf(chars), TokenText.from_hf(pairs), response)
        want_T = _forward_logprobs(teacher, prompt_t, response_t)
        stored, spans = np.asarray(table["logprobs"][i].as_py()), np.asarray(table["span_tokens"][i].as_py())
        ends = np.cumsum(row.student_groups) - 1
        assert (np.flatnonzero(spans) == ends).all() and (spans[ends] == row.teacher_groups).all()
        starts_t = np.concatenate([[0], np.cumsum(row.teacher_groups)[:-1]])
        assert np.allclose(stored[ends], np.add.reduceat(want_T, starts_t), rtol=1e-5, atol=1e-5)
        assert (np.delete(stored, ends) == 0).all()
        assert np.isclose(stored.sum(), want_T.sum(), rtol=1e-5)  # the row: the teacher's log-prob of the whole response
        # the top-k where each group starts: the teacher's next-token distribution at the group's first position
        starts_s = np.cumsum(row.student_groups) - row.student_groups
        want_lp, want_ids = _forward_topk(teacher, prompt_t, response_t, starts_t, TOP_K)
        ids_k = np.asarray(table["span_topk_ids"][i].as_py())
        lps_k = np.asarray(table["span_topk_logprobs"][i].as_py())
        assert (ids_k[starts_s] == want_ids).all() and np.allclose(lps_k[starts_s], want_lp, rtol=1e-5, atol=1e-5)
        assert (np.delete(ids_k, starts_s, axis=0) == -1).all() and (np.delete(lps_k, starts_s, axis=0) == -np.inf).all()
        student_k = np.asarray(table["span_topk_student_ids"][i].as_py())[starts_s]
        student_texts = {chars.decode([i]) for i in range(len(chars)) if i not in special_s}
        for t_id, s_id in zip(want_ids.ravel().tolist(), student_k.ravel().tolist()):  # the same text, or -1: none has it
            if t_id == pairs.eos_token_id:
                assert s_id == chars.eos_token_id
            elif s_id == -1:
                assert t_id in special_t or pairs.decode([t_id]) not in student_texts
            else:
                assert s_id not in special_s and pairs.decode([t_id]) == chars.decode([s_id])


def _forward_topk(model_dir: Path, prompt_ids: list[int], response_ids: list[int], positions, k: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + response_ids])).logits[0, len(prompt_ids) - 1: -1].double()
    top = torch.log_softmax(logits, -1)[torch.as_tensor(positions)].topk(k, -1)
    return top.values.numpy(), top.indices.numpy()


def _rewrite_rows(root: Path, table: str, shard: int, change) -> None:
    """Rewrite one shard of ``teachers/<table>`` with ``change(rows)`` applied to its rows (lists of Python values), its
    footer kept, and the manifest's size and hash updated: damage that only the row rules can find."""
    from opdcache.format import manifest as M
    from opdcache.format.cache import Cache

    cache = Cache(root)
    path, entry = cache.shard_paths(f"teachers/{table}")[shard], cache.table(f"teachers/{table}")
    stored = shards.read_table(path)
    rows = stored.to_pylist()
    change(rows)
    records = [{k: (np.asarray(v, np.int32 if k.endswith(("ids", "tokens")) else np.float32) if isinstance(v, list) else v)
                for k, v in row.items()} for row in rows]
    built = shards.build_table("teacher", S.StoreParams.from_dict(entry["params"]), records, entry["config_fingerprint"])
    manifest = cache.manifest
    manifest["tables"][f"teachers/{table}"]["shards"][shard] = shards.write_table_atomic(
        built.replace_schema_metadata(stored.schema.metadata), path, root).to_dict()
    M.save(root, manifest)


def test_validate_passes_it_and_finds_a_damaged_row(cross, tmp_path):
    from opdcache.format.validate import validate

    root = tmp_path / "cache"
    shutil.copytree(cross[0], root)
    assert not [p for p in validate(root) if not p.warning]
    def change(rows):
        inside = int(np.flatnonzero(np.asarray(rows[3]["span_tokens"]) == 0)[0])
        rows[3]["logprobs"][inside] = -0.25  # a value inside a group, where the format has 0
        rows[4]["span_tokens"][-1] += 1  # more teacher tokens than the row holds

    _rewrite_rows(root, "pairs", 0, change)
    problems = sorted((p.row, p.column, p.message) for p in validate(root) if not p.warning and p.column)
    assert problems == [(3, "logprobs", "logprobs must be 0 inside a group (span_tokens 0)"),
                        (4, "span_tokens", "span_tokens must add up to the row's teacher_response_ids")], problems


def test_the_loader_and_train_read_it_and_the_losses_that_compare_ids_are_refused_first(cross, weights, tmp_path):
    from opdcache.training.data import CacheLoader, CacheLoaderConfig
    from opdcache.training.train import TrainConfig, run_train

    root = cross[0]
    batch = next(iter(CacheLoader(CacheLoaderConfig(cache=root, teacher="pairs", stores=("logprob", "aligned"), batch_size=8,
                                                    shuffle=False))))
    assert batch["teacher_span_tokens"].shape == batch["teacher_logprobs"].shape
    ends = batch["teacher_span_tokens"] > 0
    assert (batch["teacher_logprobs"][~ends] == 0).all() and (batch["teacher_logprobs"][ends] < 0).all()
    for loss in ("lightning", "span", "uld", "gold"):
        out = run_train(TrainConfig(cache=root, model=weights / "student", out=tmp_path / loss, loss=loss, steps=STUDENT_STEPS,
                                    batch_size=8, checkpoint="none"))
        assert out["steps"] == STUDENT_STEPS and np.isfinite(out["last"]["loss"]) and out["last"]["tokens"] > 0
    with pytest.raises(ConfigError, match=re.escape("--loss topk-fkl needs a teacher that shares the student's tokenizer; "
                                                    "this teacher table has its own (the aligned store): use --loss "
                                                    "lightning, uld, gold or span")):
        run_train(TrainConfig(cache=root, model=tmp_path / "no-such-model", out=tmp_path / "t", loss="topk-fkl", steps=1))


def test_refusals_are_one_line_and_come_before_the_teacher_loads(cross, weights, tmp_path):
    from tokenizers import normalizers

    from opdcache.teacher.alignment import CrossTokenizerError
    from opdcache.demo.task import write_prompts
    from opdcache.errors import TokenizerMismatchError
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.scoring import ScoreJob, run_score

    root, prompts, teacher = cross
    with pytest.raises(TokenizerMismatchError, match="to score a teacher with its own tokenizer, pass --prompts with the "
                                                     "prompts file the rollouts were built from$"):
        run_score(ScoreJob(cache=root, teacher=teacher, slug="x"))
    with pytest.raises(ConfigError, match="--prompts is for a teacher with its own tokenizer; teacher .* shares the "
                                          "cache's: drop --prompts"):
        run_score(ScoreJob(cache=root, teacher=weights / "teacher", prompts=PromptConfig(prompts), slug="x"))
    other = write_prompts(tmp_path / "other.jsonl", "opd", 24, seed=7)
    with pytest.raises(InputError, match=r"--prompts .*other.jsonl is not the file the rollouts were built from: rollout "
                                         r"row \S+ \(line \d+\) renders to other token ids"):
        run_score(ScoreJob(cache=root, teacher=teacher, prompts=PromptConfig(other), slug="x"))
    spaced = _pair_teacher(tmp_path / "spaced", normalizer=normalizers.Replace("=", " = "))
    with pytest.raises(CrossTokenizerError, match=r"^the teacher's tokenizer \S+ does not reproduce the text it encodes on "
                                                  r"\d+ of 24 texts; the first, pi_ref's response of rollout row 0, \(at "
                                                  r"character \d+ \('=.*' in the text, ' = .*' from the teacher's tokens\)\)"):
        run_score(ScoreJob(cache=root, teacher=spaced, prompts=PromptConfig(prompts), slug="x"))
    with pytest.raises(ConfigError, match="--store topk is not available for a teacher with its own tokenizer"):
        ScoreJob(cache=root, teacher=teacher, prompts=PromptConfig(prompts), stores=("topk",), top_k=4)
    with pytest.raises(ConfigError, match="--store aligned is written for a teacher with its own tokenizer: pass --prompts"):
        ScoreJob(cache=root, teacher=teacher, stores=("aligned",))
    assert not (root / "teachers" / "x").exists()  # nothing was started


def test_the_cli_prints_the_alignment_and_info_names_the_store(cross, tmp_path, capsys):
    from opdcache.cli.main import main

    root, prompts, teacher = cross
    copy = tmp_path / "cache"
    shutil.copytree(root, copy)
    with pytest.raises(SystemExit) as exit_:
        main(["score-teacher", str(copy), "--teacher", str(teacher), "--prompts", str(prompts), "--name", "again"])
    assert exit_.value.code in (0, None)
    out = capsys.readouterr().out
    assert re.search(r"aligned with the teacher's tokenizer: 48 of 48 rows, [\d,]+ groups \(\d+\.\d% one token to one\); "
                     r"[\d,]+ teacher tokens for [\d,]+ of pi_ref's", out), out
    with pytest.raises(SystemExit):
        main(["info", str(copy)])
    assert "aligned store: a teacher with its own tokenizer" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["score-teacher", str(copy), "--teacher", str(teacher), "--name", "x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pass --prompts" in err


# --- the group losses against the per-token ones ---------------------------------------------------------------------


def _span_sums_reference(x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        start = 0
        for t in range(x.shape[1]):
            if ends[b, t]:
                out[b, start: t + 1] = x[b, start: t + 1].sum()
                start = t + 1
    return out


def test_span_sums_equal_a_plain_loop_and_pass_gradients():
    from opdcache.training import losses as L

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 17, generator=g, dtype=torch.float64, requires_grad=True)
    ends = torch.rand(5, 17, generator=g) < 0.4
    ends[0] = False  # a row with no group (could not be aligned)
    ends[1, -1] = True
    got = L.span_sums(x, ends)
    assert torch.allclose(got, _span_sums_reference(x.detach(), ends), rtol=0, atol=1e-12)  # summation order aside
    weights = torch.randn(5, 17, generator=g, dtype=torch.float64)
    (got * weights).sum().backward()
    want = _span_sums_reference(weights, ends)  # d/dx_t of sum_u w_u S_{g(u)} = sum of w over x_t's group
    assert torch.allclose(x.grad, want)


def test_with_every_group_one_token_the_group_losses_are_the_per_token_ones():
    from opdcache.training import losses as L

    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 9, generator=g, dtype=torch.float64).clamp(max=-0.01).requires_grad_()
    teacher = torch.randn(3, 9, generator=g, dtype=torch.float64).clamp(max=-0.01)
    every = torch.ones(3, 9, dtype=torch.bool)
    plain, _ = L.lightning_terms(s, teacher, 0.5)
    grouped, _ = L.lightning_terms(s, teacher, 0.5, every)
    assert torch.equal(plain, grouped)
    # span matching's gradient is lightning's unclipped one, on one-token groups and on longer ones
    ends = torch.rand(3, 9, generator=g) < 0.5
    ends[:, -1] = True
    teacher_at_ends = torch.where(ends, teacher, torch.zeros(()))
    (grad_span,) = torch.autograd.grad(L.span_terms(s, teacher_at_ends, ends)[0].sum(), s)
    (grad_lightning,) = torch.autograd.grad(L.lightning_terms(s, teacher_at_ends, 1e9, ends)[0].sum(), s)
    assert torch.allclose(grad_span, grad_lightning)


def _uld_reference(student_lp: np.ndarray, teacher_lp: np.ndarray) -> float:
    """The plain definition: sort each side's probabilities, pad with zeros, add the remaining mass, sum |differences|."""
    p, q = sorted(np.exp(teacher_lp).tolist(), reverse=True), sorted(np.exp(student_lp).tolist(), reverse=True)
    k = max(len(p), len(q))
    p, q = p + [0.0] * (k - len(p)), q + [0.0] * (k - len(q))
    return sum(abs(a - b) for a, b in zip(p, q)) + abs(max(0.0, 1 - sum(p)) - max(0.0, 1 - sum(q)))


def test_uld_equals_its_plain_definition_and_is_zero_for_the_same_distribution():
    from opdcache.training import losses as L

    g = torch.Generator().manual_seed(2)
    student = torch.log_softmax(torch.randn(2, 5, 9, generator=g, dtype=torch.float64), -1)[..., :4].requires_grad_()
    teacher = torch.log_softmax(torch.randn(2, 5, 12, generator=g, dtype=torch.float64), -1)[..., :6]
    at = torch.rand(2, 5, generator=g) < 0.6
    terms, _ = L.uld_terms(student, teacher, at)
    for b in range(2):
        for t in range(5):
            want = _uld_reference(student[b, t].detach().numpy(), teacher[b, t].numpy()) if at[b, t] else 0.0
            assert float(terms.detach()[b, t]) == pytest.approx(want, abs=1e-12)
    terms.sum().backward()
    assert student.grad.abs().sum() > 0
    same, _ = L.uld_terms(teacher[..., :4], teacher[..., [2, 0, 3, 1]], torch.ones(2, 5, dtype=torch.bool))
    assert torch.allclose(same, torch.zeros_like(same), atol=1e-12)  # the same probabilities in another order: 0


def test_uld_and_gold_need_a_table_with_its_top_k(cross, weights, tmp_path):
    from opdcache.training.train import TrainConfig, run_train

    with pytest.raises(ConfigError, match=re.escape("--loss uld compares a teacher of another tokenizer with the student: it "
                                                    "needs a table scored with `score-teacher --prompts ... --top-k K`")):
        from opdcache.training.trainconfig import stores_for

        stores_for("uld", "teacher", ("logprob",))
    root = tmp_path / "cache"
    shutil.copytree(cross[0], root)
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.scoring import ScoreJob, run_score

    run_score(ScoreJob(cache=root, teacher=cross[2], prompts=PromptConfig(cross[1]), slug="nok"))
    with pytest.raises(ConfigError, match=re.escape("--loss gold reads the teacher's top-k where each group starts: score "
                                                    "the teacher with `score-teacher --prompts ... --top-k K`")):
        run_train(TrainConfig(cache=root, model=tmp_path / "not-loaded", out=tmp_path / "g", loss="gold", teacher="nok"))


def _assert_packed_equals_padded(cache, weights, tmp_path, loss) -> None:
    """The first batch of ``cache`` packed and padded: the same loss, gradients and logged numbers (float32, to its
    rounding)."""
    from opdcache.training.train import TrainConfig, Trainer

    results = []
    for pack in (False, True):
        torch.manual_seed(0)
        trainer = Trainer(TrainConfig(out=tmp_path / str(pack), model=weights / "student", cache=cache, steps=1,
                                      batch_size=6, seed=1, loss=loss, dtype="float32", pack=pack))
        batch = trainer.source.next_batch()
        value, stats = trainer.loss_and_stats(batch)
        value.backward()
        results.append((float(value.detach()), stats, {n: p.grad.clone() for n, p in trainer.model.named_parameters()
                                                        if p.grad is not None}))
    (a, sa, ga), (b, sb, gb) = results
    assert a != 0 and b == pytest.approx(a, rel=1e-5, abs=1e-7)
    assert ga.keys() == gb.keys() and len(ga) > 10
    for name in ga:
        assert float((gb[name] - ga[name]).norm() / ga[name].norm().clamp_min(1e-30)) < 1e-5, name
    assert sb.keys() == sa.keys() and all(sb[k] == pytest.approx(sa[k], rel=1e-4, abs=1e-6) for k in sa)


@pytest.mark.parametrize("loss", ["lightning", "span", "uld", "gold"])
def test_a_packed_step_equals_the_padded_one_on_a_table_of_another_tokenizer(cross, weights, tmp_path, loss):
    """The group columns (span_tokens, the span top-k) survive packing: the same rows packed and padded give the same
    loss, gradients and logged numbers (float32, to its rounding)."""
    _assert_packed_equals_padded(cross[0], weights, tmp_path, loss)


def test_gold_equals_its_plain_definition():
    """At a group's first token: KL(p || q) over the teacher's entries pi_ref shares (renormalised with the rest of the
    teacher's mass as one tail bin, the student's likewise), plus span at each group's last token."""
    from types import SimpleNamespace

    from opdcache.training import losses as L
    from opdcache.training.estimators import ESTIMATORS

    g = torch.Generator().manual_seed(4)
    B, T, K = 2, 5, 3
    teacher_lp = torch.log_softmax(torch.randn(B, T, 7, generator=g, dtype=torch.float64), -1)[..., :K]
    student_lp = torch.log_softmax(torch.randn(B, T, 9, generator=g, dtype=torch.float64), -1)[..., :K].requires_grad_()
    starts = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 0, 0, 1]], dtype=torch.bool)
    ends = torch.tensor([[0, 1, 0, 1, 1], [1, 0, 0, 1, 1]], dtype=torch.bool)
    mapped = torch.randint(0, 9, (B, T, K), generator=g)
    mapped[0, 0, 1] = -1  # an entry pi_ref has no token for
    ids = torch.where(starts[..., None], torch.arange(K).expand(B, T, K), torch.full((B, T, K), -1))
    s = torch.randn(B, T, generator=g, dtype=torch.float64).clamp(max=-0.01)
    t = torch.where(ends, torch.randn(B, T, generator=g, dtype=torch.float64).clamp(max=-0.01), torch.zeros(()))
    batch = {"teacher_span_topk_ids": ids, "teacher_span_topk_logprobs": torch.where(ids >= 0, teacher_lp, torch.full_like(teacher_lp, -1e4)),
             "teacher_span_topk_student_ids": torch.where(ids >= 0, mapped, torch.full_like(mapped, -1)),
             "teacher_span_tokens": ends.long(), "teacher_logprobs": t, "response_mask": torch.ones(B, T)}
    terms, _, _ = ESTIMATORS["gold"].terms(SimpleNamespace(), batch, s, student_lp, None, None)
    span, _ = L.span_terms(s, t, ends)
    for b in range(B):
        for i in range(T):
            want = 0.0
            if starts[b, i]:
                keep = [k for k in range(K) if mapped[b, i, k] >= 0]
                p = [float(teacher_lp[b, i, k].exp()) for k in keep]
                q = [float(student_lp.detach()[b, i, k].exp()) for k in keep]
                p, q = p + [1 - sum(p)], q + [1 - sum(q)]
                want = sum(pi * (np.log(pi) - np.log(qi)) for pi, qi in zip(p, q))
            assert float((terms - span).detach()[b, i]) == pytest.approx(want, abs=1e-9), (b, i)


def test_audit_re_scores_the_teachers_own_tokens_and_finds_a_changed_value(cross, tmp_path):
    from opdcache.teacher.audit import AuditConfig, audit

    report = audit(AuditConfig(cache=cross[0], table="pairs", rows="all"))
    table = report["tables"][0]
    assert report["passed"] and "aligned to the teacher's tokens afresh" in table["how"]
    assert {"logprobs", "span_tokens", "teacher_response_ids", "span_topk_logprobs"} <= set(table["columns"])
    assert table["columns"]["span_tokens"]["differing"] == 0 and table["columns"]["logprobs"]["values"] > 0
    root = tmp_path / "cache"
    shutil.copytree(cross[0], root)
    def change(rows):
        end = int(np.flatnonzero(np.asarray(rows[0]["span_tokens"]))[0])
        rows[0]["logprobs"][end] -= 0.5  # one group's log-prob changed

    _rewrite_rows(root, "pairs", 1, change)
    report = audit(AuditConfig(cache=root, table="pairs", rows="all"))
    assert not report["passed"] and report["tables"][0]["columns"]["logprobs"]["max_abs_delta"] == pytest.approx(0.5, rel=1e-4)


def test_export_carries_the_groups_and_refuses_the_per_token_layout(cross, tmp_path):
    from opdcache.format.export import export

    root = cross[0]
    export(root, "jsonl", tmp_path / "flat", teacher="pairs")
    first = json.loads((tmp_path / "flat" / "rollouts.jsonl").read_text().splitlines()[0])
    assert len(first["teacher_span_tokens"]) == len(first["response_ids"]) == len(first["teacher_logprobs"])
    assert sum(first["teacher_span_tokens"]) > 0 and "teacher_teacher_response_ids" not in first
    with pytest.raises(ConfigError, match="teachers/pairs is a teacher with its own tokenizer: its log-probs are per group"):
        export(root, "lightning-opd", tmp_path / "lo", teacher="pairs")
    assert not (tmp_path / "lo").exists()


def test_a_table_without_the_top_k_has_its_rules_checked_too(cross, tmp_path):
    """The store's optional columns absent (no --top-k): validate and the loader still apply its rules."""
    from opdcache.training.data import CacheLoader, CacheLoaderConfig
    from opdcache.errors import SchemaError
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.scoring import ScoreJob, run_score
    from opdcache.format.validate import validate

    root = tmp_path / "cache"
    shutil.copytree(cross[0], root)
    run_score(ScoreJob(cache=root, teacher=cross[2], prompts=PromptConfig(cross[1]), slug="plain"))
    _rewrite_rows(root, "plain", 0, lambda rows: rows[1]["span_tokens"].__setitem__(0, -3))
    found = {(p.row, p.column) for p in validate(root) if not p.warning and p.column}
    assert (1, "span_tokens") in found
    loader = CacheLoader(CacheLoaderConfig(cache=root, teacher="plain", stores=("logprob", "aligned"), batch_size=64,
                                           shuffle=False))
    with pytest.raises(SchemaError, match="row 1, column span_tokens: span_tokens must be between 0 and 65536"):
        list(loader)


def test_span_top_k_ids_are_bounded_by_the_teachers_vocabulary_and_pi_refs_ids_by_its_own(cross, tmp_path):
    """The teacher's own ids in span_topk_ids lie within its vocabulary (the table's config), pi_ref's mapped ids
    within pi_ref's: validate and the loader hold both, each against its own vocabulary."""
    from opdcache.errors import SchemaError
    from opdcache.format.cache import Cache
    from opdcache.format.validate import validate
    from opdcache.training.data import CacheLoader, CacheLoaderConfig

    teacher_vocab = Cache(cross[0]).table("teachers/pairs")["config"]["vocab_size"]
    student_vocab = Cache(cross[0]).table("rollouts")["config"]["vocab_size"]
    assert teacher_vocab != student_vocab  # the two bounds differ: a check against the wrong one would show
    for column, value, row in (("span_topk_ids", teacher_vocab, 2), ("span_topk_student_ids", student_vocab, 5)):
        root = tmp_path / column
        shutil.copytree(cross[0], root)

        def plant(rows, column=column, value=value, row=row):
            t = next(t for t, ids in enumerate(rows[row]["span_topk_ids"]) if ids[0] != -1)
            rows[row][column][t][0] = value  # one past the end of that vocabulary

        _rewrite_rows(root, "pairs", 0, plant)
        assert (row, "span_topk_ids") in {(p.row, p.column) for p in validate(root) if not p.warning}
        loader = CacheLoader(CacheLoaderConfig(cache=root, teacher="pairs", stores=("logprob", "aligned"), batch_size=64,
                                               shuffle=False))
        with pytest.raises(SchemaError, match=f"row {row}, column span_topk_ids: span top-k entries must be teacher ids within its vocabulary"):
            list(loader)


@pytest.fixture(scope="module")
def cross_with_skips(cross, tmp_path_factory):
    """The cross table with every third row of each shard as the scorer writes a row it could not align (no teacher
    tokens, no groups, ``align_skip`` set): every batch holds such rows, as the demo's 41 of 2,048 do."""
    root = tmp_path_factory.mktemp("cross-skips") / "cache"
    shutil.copytree(cross[0], root)

    def skip(rows):
        for row in rows[1::3]:
            n = len(row["span_tokens"])
            row.update(teacher_response_ids=[], logprobs=[0.0] * n, span_tokens=[0] * n,
                       align_skip="bytes that are not UTF-8 text: planted by the test")
            for column, value in (("span_topk_ids", -1), ("span_topk_logprobs", -np.inf), ("span_topk_student_ids", -1)):
                if column in row:
                    row[column] = [[value] * len(row[column][0]) for _ in range(n)]

    for shard in range(2):
        _rewrite_rows(root, "pairs", shard, skip)
    return root


@pytest.mark.parametrize("loss", ["lightning", "span", "uld", "gold"])
def test_rows_that_could_not_be_aligned_train_packed_and_padded_alike(cross_with_skips, weights, tmp_path, loss):
    """A batch with skipped rows: they leave the loss (no teacher signal), and packed and padded agree (the packed
    forward crashed: its logit positions listed the skipped rows' tokens, which the loss had already dropped)."""
    from opdcache.format.validate import validate

    assert not [p for p in validate(cross_with_skips) if not p.warning]
    _assert_packed_equals_padded(cross_with_skips, weights, tmp_path, loss)


def test_teacher_prompts_longer_than_the_responses_validate_and_train(cross, weights, tmp_path):
    """A teacher whose chat template adds a long system prompt: its prompt tokens are several times the responses'
    (they are the row's, bounded by the context, not by the response tokens), and validate, the loader and export
    all read the table."""
    from opdcache.format.cache import Cache
    from opdcache.format.export import export
    from opdcache.format.validate import validate
    from opdcache.training.train import TrainConfig, run_train

    root = tmp_path / "cache"
    shutil.copytree(cross[0], root)

    def lengthen(rows):
        for row in rows:
            row["teacher_prompt_ids"] = row["teacher_prompt_ids"] * 16

    for shard in range(2):
        _rewrite_rows(root, "pairs", shard, lengthen)
    table = shards.read_table(Cache(root).shard_paths("teachers/pairs")[0])
    prompt_tokens = sum(len(p) for p in table["teacher_prompt_ids"].to_pylist())
    assert prompt_tokens > 3 * Cache(root).table("teachers/pairs")["shards"][0]["tokens"]
    assert not [p for p in validate(root) if not p.warning]
    out = run_train(TrainConfig(cache=root, model=weights / "student", out=tmp_path / "run", loss="span", steps=1,
                                batch_size=8, checkpoint="none"))
    assert out["steps"] == 1 and np.isfinite(out["last"]["loss"])
    export(root, "jsonl", tmp_path / "flat", teacher="pairs")
    assert len((tmp_path / "flat" / "rollouts.jsonl").read_text().splitlines()) == 48


def test_gold_is_exact_where_the_shared_entries_hold_almost_all_the_students_mass():
    """The student's tail bin was floored at 1e-6: with its shared entries at 1 - 1e-9 of its mass (4 of 919 group
    starts on a real SmolLM2-to-Gemma-3 run) the KL was understated. Now it equals the float64 definition there."""
    from types import SimpleNamespace

    from opdcache.training.estimators import ESTIMATORS

    for student_tail in (1e-9, 1e-12, 1e-4):
        student = torch.log(torch.tensor([[[0.6, 0.4 - student_tail]]], dtype=torch.float64))  # [1, 1, 2]
        teacher = torch.log(torch.tensor([[[0.5, 0.3]]], dtype=torch.float64))  # its tail: 0.2
        batch = {"teacher_span_topk_ids": torch.tensor([[[5, 6]]]), "teacher_span_topk_logprobs": teacher,
                 "teacher_span_topk_student_ids": torch.tensor([[[1, 2]]]), "teacher_span_tokens": torch.ones(1, 1, dtype=torch.long),
                 "teacher_logprobs": torch.full((1, 1), -0.5, dtype=torch.float64), "response_mask": torch.ones(1, 1)}
        s = torch.full((1, 1), -0.5, dtype=torch.float64)
        _, stats, _ = ESTIMATORS["gold"].terms(SimpleNamespace(), batch, s, student, None, None)
        p, q = [0.5, 0.3, 0.2], [0.6, 0.4 - student_tail, student_tail]
        want = sum(pi * (np.log(pi) - np.log(qi)) for pi, qi in zip(p, q))
        # the student's tail comes back from log-probs: 1 - exp(log(mass)) holds a relative error of a few float64 roundings
        # of the mass over the tail (8 eps / tail), which the teacher's tail 0.2 weighs; the floor's error was 0.2 log(1e-6/tail)
        bound = 0.2 * 8 * np.finfo(np.float64).eps / student_tail
        assert float(stats["kl"][0, 0]) == pytest.approx(want, abs=bound), student_tail
