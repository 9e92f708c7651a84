"""The aligned store: a teacher whose tokenizer differs from pi_ref's, scored on its own tokenization of pi_ref's text.

The teacher renders each prompt with its own chat template and tokenizes exactly the text pi_ref generated (decoded
from pi_ref's ids, byte for byte); the two tokenizations are cut into groups that end at the same byte
(opdcache/teacher/alignment.py). The table stays row- and token-aligned with the rollouts, so every reader works unchanged:

* ``logprobs`` keeps its meaning, generalised: at a token that ends a group, the teacher's log-probability of the
  group's text given everything before it (the sum of its log-probs over its own tokens of the group); 0 inside a
  group. With one tokenizer every token ends its own group, which is the ordinary ``logprobs``; the sum over a row is
  the teacher's log-probability of the whole response either way. ``logsumexp`` belongs to one tokenizer's positions
  and is not written.
* ``span_tokens``: at a token that ends a group, the number of the teacher's tokens in it (at least 1); 0 inside a
  group. A row of zeros could not be aligned (``align_skip`` says why); training skips it and counts it.
* ``teacher_prompt_ids`` / ``teacher_response_ids``: the teacher's own tokens, so the table can be re-scored and audited.
* with ``--top-k K``: at a token that starts a group, the teacher's top-K next tokens at the group's first position
  (where both sides predict from the same text), their log-probs, and pi_ref's token with the same bytes for each
  (``span_topk_*``): what the ULD and GOLD losses compare.

Only the logprob store goes beside it: the other stores' values live on one tokenizer's positions and vocabulary.
"""

from __future__ import annotations

import json

import numpy as np

from opdcache.stores.base import Column, PAD_ID, Store

META = b"opdcache.alignment"
"""The shard footer key of a shard's alignment counts (merged into the manifest table entry ``aligned``)."""
MAX_GROUP_TOKENS = 1 << 16
"""More teacher tokens than this in one group is no alignment opdcache wrote."""
SKIP_EXAMPLES = 5
MAX_K = 1024


def _check_job(job, enabled: bool) -> None:
    from opdcache.errors import ConfigError

    if enabled:
        others = [s for s in job.stores if s not in ("logprob", "aligned")]
        if others:
            raise ConfigError(f"--store {others[0]} is not available for a teacher with its own tokenizer: its values live "
                              "on one tokenizer's positions and vocabulary; such a table holds the teacher's log-prob of "
                              "each aligned group (the logprob store), the alignment and, with --top-k, its top-k where "
                              "each group starts")
        if job.top_k is not None and not 1 <= job.top_k <= MAX_K:
            raise ConfigError(f"--top-k must be between 1 and {MAX_K}, got {job.top_k}")


def _rules(values, vocab: int | None, params) -> list:
    n = values["span_tokens"]
    bad = (n < 0) | (n > MAX_GROUP_TOKENS)
    out = [("span_tokens", bad if bad.any() else None,
            f"span_tokens must be between 0 and {MAX_GROUP_TOKENS} (the teacher's tokens in the group a token ends)")]
    if "span_topk_ids" in values:
        ids, lps, mapped = values["span_topk_ids"], values["span_topk_logprobs"], values["span_topk_student_ids"]
        pad = ids == PAD_ID
        teacher_vocab = params.get("teacher_vocab_size") or np.iinfo(np.int32).max
        with np.errstate(invalid="ignore"):
            bad = (ids < PAD_ID) | (ids >= teacher_vocab) | (pad != (lps == -np.inf)) | (lps > 0) | np.isnan(lps) \
                | (mapped < PAD_ID) | (mapped >= (vocab or np.iinfo(np.int32).max)) | (pad & (mapped != PAD_ID))
        out.append(("span_topk_ids", bad.any(axis=-1) if bad.any() else None,
                    "span top-k entries must be teacher ids within its vocabulary with log-probs <= 0 and pi_ref ids within "
                    "pi_ref's (or -1), or padding (id -1, log-prob -inf, no pi_ref id)"))
    return out


def _flat(column) -> np.ndarray:
    """A list column's values, flat (this module reads the Arrow table itself: it imports nothing of opdcache's
    reading layer, which is built on the registry)."""
    return column.combine_chunks().flatten().to_numpy(zero_copy_only=False)


def _table_rules(table, offsets: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
    """The rules that tie a row's columns together, as (column, bad rows [rows] bool, message): a row's span_tokens
    add up to its teacher tokens, and are all 0 exactly when it was skipped; logprobs is 0 inside a group."""
    span_tokens = _flat(table["span_tokens"]).astype(np.int64)
    logprobs = _flat(table["logprobs"])
    teacher_lengths = np.diff(table["teacher_response_ids"].combine_chunks().offsets.to_numpy())
    skipped = table["align_skip"].to_pylist()
    sums = np.add.reduceat(span_tokens, offsets[:-1]) if len(span_tokens) else np.zeros(len(teacher_lengths), np.int64)
    sums = np.where(np.diff(offsets) > 0, sums, 0)  # reduceat repeats a value for an empty row
    is_skipped = np.array([s is not None for s in skipped], bool)
    out = [("span_tokens", (sums != teacher_lengths) & ~is_skipped,
            "span_tokens must add up to the row's teacher_response_ids"),
           ("align_skip", is_skipped & ((sums != 0) | (teacher_lengths != 0)),
            "a skipped row holds no teacher tokens and no groups")]
    inside = (span_tokens == 0) & (logprobs != 0)
    rows_inside = np.zeros(len(teacher_lengths), bool)
    if inside.any():
        rows_inside[np.searchsorted(offsets, np.flatnonzero(inside), side="right") - 1] = True
    out.append(("logprobs", rows_inside, "logprobs must be 0 inside a group (span_tokens 0)"))
    return [(c, bad, m) for c, bad, m in out if bad.any()]


def footer(counts: dict) -> bytes:
    return json.dumps(counts, sort_keys=True).encode()


def _record(metas: list, params) -> dict:
    """The table's alignment counts, merged from its shards' footers."""
    total = {"rows": 0, "aligned": 0, "groups": 0, "one_to_one": 0, "student_tokens": 0, "teacher_tokens": 0,
             "skipped": {}, "examples": []}
    from opdcache.errors import ManifestError
    from opdcache.untrusted import loads

    for meta in metas:
        part = loads(meta[META], "a shard footer's alignment record", ManifestError)
        for key in ("rows", "aligned", "groups", "one_to_one", "student_tokens", "teacher_tokens"):
            total[key] += int(part[key])
        for reason, n in part["skipped"].items():
            total["skipped"][reason] = total["skipped"].get(reason, 0) + int(n)
        total["examples"] = (total["examples"] + part["examples"])[:SKIP_EXAMPLES]
    return total


RECORD_SCHEMA = {
    "type": "object",
    "description": "a teacher with its own tokenizer (format v6): how many rows were aligned and skipped (and why), and the groups the two tokenizations share, counted while scoring",
    "required": ["rows", "aligned", "groups", "one_to_one", "student_tokens", "teacher_tokens", "skipped"],
    "properties": {"skipped": {"type": "object", "additionalProperties": {"type": "integer"}}, "examples": {"type": "array"}},
}


def _describe(a) -> list[str]:
    skipped = a["rows"] - a["aligned"]
    return [f"aligned with the teacher's tokenizer: {a['aligned']:,} of {a['rows']:,} rows, {a['groups']:,} groups "
            f"({a['one_to_one'] / max(a['groups'], 1):.1%} one token to one); {a['teacher_tokens']:,} teacher tokens for "
            f"{a['student_tokens']:,} of pi_ref's" + (f"; {skipped:,} rows skipped (never trained): "
            + "; ".join(f"{n} x {why}" for why, n in a["skipped"].items()) if skipped else "")]


def _info(params) -> str | None:
    return ("aligned store: a teacher with its own tokenizer; logprobs holds its log-prob of each aligned group at the "
            "group's last token (0 inside a group)")


def _card(config, entry) -> list[str]:
    rec = entry.get("aligned") or {}
    return [
        "### A teacher with its own tokenizer", "",
        "This table's teacher tokenizes differently from the student. Its rows are aligned with the rollouts, and "
        "`span_tokens[t] > 0` marks a token that ends a group of tokens both tokenizations cut at the same byte; "
        "`logprobs[t]` there is the teacher's log-probability of that group's text (0 inside a group). A row whose "
        "`span_tokens` are all 0 could not be aligned (`align_skip`).",
        f"Rows aligned: {rec.get('aligned', '?')} of {rec.get('rows', '?')}; groups: {rec.get('groups', '?')}, of which "
        f"1:1: {rec.get('one_to_one', '?')}.", ""]


STORE = Store(
    name="aligned",
    own_tokenizer=True,
    gives=("groups",),
    summary="aligned: a teacher with its own tokenizer (score-teacher --prompts), its log-probs per aligned group",
    columns=(
        Column("teacher_prompt_ids", "row", "int32_list", "aligned",
               "The prompt in the teacher's tokens: the same prompt rendered with the teacher's chat template."),
        Column("teacher_response_ids", "row", "int32_list", "aligned",
               "pi_ref's response text in the teacher's tokens (its end-of-sequence token for pi_ref's closing one); "
               "empty when the row could not be aligned."),
        Column("span_tokens", "token", "int32", "aligned",
               "At a token that ends a group (both tokenizations end a token at the same byte): the teacher's tokens in "
               "the group (>= 1); 0 inside a group. logprobs at a group's last token is the teacher's log-prob of the "
               "group's text, 0 inside it. All 0: the row could not be aligned."),
        Column("align_skip", "row", "string", "aligned",
               "Why the row could not be aligned (null when it was).", nullable=True),
        Column("span_topk_ids", "token_vector", "int32", "aligned",
               "At a token that starts a group: the teacher's top_k most likely next tokens (its own ids) at the group's "
               "first position, most likely first; -1 elsewhere.", width="top_k", requires=("top_k",)),
        Column("span_topk_logprobs", "token_vector", "float32", "aligned",
               "Their temperature-1 log-probs; -inf where the id is -1.", width="top_k", requires=("top_k",)),
        Column("span_topk_student_ids", "token_vector", "int32", "aligned",
               "For each of those entries, pi_ref's token with the same bytes (its id), -1 where pi_ref has none.",
               width="top_k", requires=("top_k",)),
    ),
    since=6,
    check_job=_check_job,
    params=lambda job, facts: {"top_k": job.top_k},
    needs=("logprobs",),  # and the top-k with --top-k
    rules=_rules,
    table_rules=_table_rules,
    flat=("span_tokens", "span_topk_ids", "span_topk_logprobs", "span_topk_student_ids"),
    record=_record,
    record_meta=META,
    record_schema=lambda version: RECORD_SCHEMA if version >= 6 else None,  # since the store
    describe=_describe,
    info=_info,
    card=_card,
)
