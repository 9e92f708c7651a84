"""score-teacher for a teacher with its own tokenizer: the prompts rendered its way, pi_ref's text tokenized its way,
and its log-probs gathered onto the groups both tokenizations share (the aligned store, opdcache/stores/aligned.py).

The rollouts keep pi_ref's prompt ids, not the prompt's messages, so the job reads the prompts file again (``--prompts``,
with the fields build-rollouts was given): every rollout row's prompt must render, with the rollouts' recorded chat
template settings and pi_ref's tokenizer, to exactly its stored prompt ids (a different file is refused before the
teacher loads); the teacher's chat template renders the same messages. Responses are aligned by
opdcache/teacher/alignment.py; a row that cannot be aligned is written with no groups and its reason, and counted.

Memory: both tokenizers' byte tables (linear in each vocabulary), the prompts' ids in both tokenizations, and one
shard's rows at a time; nothing grows with the product of the two vocabularies.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from opdcache.backends.base import ScoreRequest
from opdcache.errors import InputError
from opdcache.format import shards
from opdcache.inputs.prompts import PromptConfig, read_prompts
from opdcache.stores.aligned import footer, META, SKIP_EXAMPLES
from opdcache.stores.base import PAD_ID
from opdcache.teacher.alignment import align_response, check_round_trip, RowAlignment, TokenText, Unaligned

PROBE_ROWS = 64
"""Rollout rows whose text the teacher's tokenizer must give back before its weights load ..."""
PROBE_TOLERATED = 0.5
"""... but for fewer than this share of them: a few texts it cannot represent (a vocabulary-padding token pi_ref
sampled, a character the teacher has no token for) are rows to skip; a tokenizer that normalises fails on most."""


@dataclass(frozen=True)
class CrossPlan:
    """What a cross-tokenizer scoring job knows before the teacher loads."""

    student: TokenText
    teacher: TokenText
    teacher_prompts: dict  # prompt index -> the teacher's prompt ids
    teacher_prompt_errors: dict  # prompt index -> why the teacher's chat template could not render it
    fingerprint: str  # the teacher tokenizer's
    student_of: np.ndarray  # [teacher vocabulary] int32: pi_ref's id with the same bytes, PAD_ID where none


def prepare(cache, prompts: PromptConfig, teacher_tokenizer, teacher_name: str, fingerprint: str) -> CrossPlan:
    """Check the prompts file against the rollouts and the teacher's tokenizer against its own text; render the
    prompts the teacher's way. Raises InputError or CrossTokenizerError (one line) before any model loads."""
    base = cache.base_table
    settings = cache.table(base)["config"].get("prompt_settings") or {}
    cfg = replace(prompts, chat_template=settings.get("chat_template", prompts.chat_template),
                  system_prompt=settings.get("system_prompt"), chat_template_kwargs=settings.get("chat_template_kwargs"),
                  answer_field=None, strict=False, limit=None)
    student_tokenizer = cache.tokenizer()
    student, teacher = TokenText.from_hf(student_tokenizer), TokenText.from_hf(teacher_tokenizer, name=teacher_name)
    check_round_trip(teacher, _probe_texts(cache, student), "pi_ref's response of rollout row", tolerated=PROBE_TOLERATED)
    student_prompts = {p.index: p.prompt_ids for p in read_prompts(cfg, student_tokenizer, None).prompts}
    for index in range(len(cache.shard_paths(base))):
        rows = cache.read_shard(base, index, ["id", "prompt_index", "prompt_ids"])
        for row_id, prompt_index, ids in zip(rows["id"].to_pylist(), rows["prompt_index"].to_pylist(),
                                             rows["prompt_ids"].to_pylist()):
            if student_prompts.get(prompt_index) != tuple(ids):
                raise InputError(
                    f"--prompts {prompts.path} is not the file the rollouts were built from: rollout row {row_id} "
                    f"(line {prompt_index + 1}) renders to other token ids; pass the prompts file and --prompt-field / "
                    "--messages-field that build-rollouts was given")
    rendered = read_prompts(cfg, teacher_tokenizer, None)
    errors = {e["line"] - 1: e["reason"] for e in rendered.errors}
    return CrossPlan(student, teacher, {p.index: list(p.prompt_ids) for p in rendered.prompts},
                     errors, fingerprint, same_bytes(student, teacher))


def same_bytes(student: TokenText, teacher: TokenText) -> np.ndarray:
    """[teacher vocabulary] int32: for each teacher token, pi_ref's token with the same bytes (PAD_ID where pi_ref has
    none); the two end-of-sequence tokens map to each other. Linear in the two vocabularies."""
    index = {}
    for i, piece in enumerate(student.table):
        if piece is not None:
            index.setdefault(piece, i)
    out = np.array([PAD_ID if piece is None else index.get(piece, PAD_ID) for piece in teacher.table], np.int32)
    if teacher.eos_id is not None and student.eos_id is not None and 0 <= teacher.eos_id < len(out):
        out[teacher.eos_id] = student.eos_id
    return out


def _probe_texts(cache, student: TokenText) -> list[str]:
    """The texts of the first shard's first PROBE_ROWS responses (their special tokens left out)."""
    rows = cache.read_shard(cache.base_table, 0, ["response_ids"])
    texts = []
    for ids in shards.row_values(rows["response_ids"])[:PROBE_ROWS]:
        data = b"".join(p for p in student.bytes_of(ids.tolist()) if p is not None)
        texts.append(data.decode("utf-8", errors="ignore"))
    return texts


def align_rows(plan: CrossPlan, table, max_length: int | None) -> tuple[list, list[ScoreRequest]]:
    """Per rollout row, its RowAlignment (with the teacher's prompt ids) or why it cannot be aligned; and the score
    requests of the aligned rows, in order."""
    out, requests = [], []
    for prompt_index, response in zip(table["prompt_index"].to_pylist(), shards.row_values(table["response_ids"])):
        prompt = plan.teacher_prompts.get(prompt_index)
        if prompt is None:
            out.append((Unaligned("a prompt the teacher's chat template could not render",
                                  plan.teacher_prompt_errors.get(prompt_index, "no such prompt")), []))
            continue
        row = align_response(plan.student, plan.teacher, response.tolist())
        if isinstance(row, RowAlignment) and max_length is not None and len(prompt) + len(row.teacher_ids) > max_length:
            row = Unaligned("more of the teacher's tokens than its context holds",
                            f"{len(prompt) + len(row.teacher_ids)}, its context {max_length}")
        out.append((row, prompt))
        if isinstance(row, RowAlignment):
            requests.append(ScoreRequest(prompt, row.teacher_ids.tolist(), None, None, None))
    return out, requests


def span_logprobs(row: RowAlignment, teacher_logprobs_T: np.ndarray, response_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(logprobs [S], span_tokens [S]) on pi_ref's tokens: at each group's last token the sum of the teacher's
    log-probs over the group's tokens (in float64, stored float32) and the group's teacher token count; 0 elsewhere."""
    starts_t = np.concatenate([[0], np.cumsum(row.teacher_groups)[:-1]])
    sums = np.add.reduceat(teacher_logprobs_T.astype(np.float64), starts_t) if len(starts_t) else np.zeros(0)
    ends_s = np.cumsum(row.student_groups) - 1
    logprobs, span_tokens = np.zeros(response_length, np.float32), np.zeros(response_length, np.int32)
    logprobs[ends_s] = sums
    span_tokens[ends_s] = row.teacher_groups
    return logprobs, span_tokens


def span_topk(row: RowAlignment, sc, response_length: int, top_k: int, student_of: np.ndarray) -> dict:
    """At each group's first pi_ref token, the teacher's top-k at the group's first position (ids, log-probs, and
    pi_ref's id with the same bytes); padding (-1, -inf, -1) at every other token. [S, top_k] each."""
    starts_s = np.cumsum(row.student_groups) - row.student_groups
    starts_t = np.cumsum(row.teacher_groups) - row.teacher_groups
    ids = np.full((response_length, top_k), PAD_ID, np.int32)
    lps = np.full((response_length, top_k), -np.inf, np.float32)
    ids[starts_s], lps[starts_s] = sc.topk_ids[starts_t], sc.topk_logprobs[starts_t]
    mapped = np.where(ids == PAD_ID, PAD_ID, student_of[np.clip(ids, 0, len(student_of) - 1)]).astype(np.int32)
    return {"span_topk_ids": ids, "span_topk_logprobs": lps, "span_topk_student_ids": mapped}


def records(ids: list[str], response_lengths: list[int], aligned: list, scores: list, vocab_size: int | None,
            where: str, student_of: np.ndarray | None = None, top_k: int | None = None) -> shards.Records:
    """The aligned table's rows (row-aligned with the rollouts), the alignment counts and the fidelity sums in the
    footer; with ``top_k``, the teacher's top-k where each group starts (``student_of``: pi_ref's id of each teacher
    token's bytes, :func:`same_bytes`)."""
    from opdcache.format import fidelity
    from opdcache.errors import SchemaError

    out, errors, skipped, examples = shards.Records(), [], Counter(), []
    counts = dict(rows=len(ids), aligned=0, groups=0, one_to_one=0, student_tokens=0, teacher_tokens=0)
    next_score = iter(scores)
    for row_id, length, (row, prompt) in zip(ids, response_lengths, aligned):
        rec = {"id": row_id, "teacher_prompt_ids": np.asarray(prompt, np.int32)}
        if isinstance(row, Unaligned):
            skipped[row.kind] += 1
            if len(examples) < SKIP_EXAMPLES:
                examples.append({"id": row_id, "reason": str(row)})
            rec.update(teacher_response_ids=np.zeros(0, np.int32), logprobs=np.zeros(length, np.float32),
                       span_tokens=np.zeros(length, np.int32), align_skip=str(row))
            if top_k:
                rec.update(span_topk_ids=np.full((length, top_k), PAD_ID, np.int32),
                           span_topk_logprobs=np.full((length, top_k), -np.inf, np.float32),
                           span_topk_student_ids=np.full((length, top_k), PAD_ID, np.int32))
            out.append(rec)
            continue
        sc = next(next_score)
        if not np.isfinite(sc.logprobs).all():
            raise SchemaError(f"teacher produced a non-finite log-prob for rollout row {row_id} ({where}); nothing was "
                              "written for this shard. Check the teacher's dtype (try --dtype float32)")
        logprobs, span_tokens = span_logprobs(row, sc.logprobs, length)
        rec.update(teacher_response_ids=row.teacher_ids, logprobs=logprobs, span_tokens=span_tokens, align_skip=None)
        if top_k:
            rec.update(span_topk(row, sc, length, top_k, student_of))
        out.append(rec)
        counts["aligned"] += 1
        counts["groups"] += len(row.student_groups)
        counts["one_to_one"] += int(((row.student_groups == 1) & (row.teacher_groups == 1)).sum())
        counts["student_tokens"] += length
        counts["teacher_tokens"] += len(row.teacher_ids)
        if vocab_size:
            errors.append(fidelity.row_sums(sc, _NO_STORES, vocab_size))
    out.meta[META] = footer(counts | {"skipped": dict(skipped), "examples": examples})
    out.meta[fidelity.META] = fidelity.encode(fidelity.merge(errors)) if vocab_size else fidelity.unmeasured(
        "the engine returns no full distribution")
    return out


@dataclass(frozen=True)
class _Params:
    stores: tuple = ()


_NO_STORES = _Params()
"""What fidelity.row_sums reads of the store parameters: an aligned table's stores record no error against the full
vocabulary of their own (its group log-probs are the teacher's; only the entropy is recorded)."""
