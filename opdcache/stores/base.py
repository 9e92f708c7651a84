"""What a teacher store is: the one small spec that every file in ``opdcache/stores/`` fills in.

A store is a set of columns in a teacher table, the score-teacher settings that shape them and their checks, what it
asks of the engine, how a row's values are made from the engine's scores (encode), the rules a stored row must meet,
and the line ``info`` prints for it. Schema, scoring, validate, the loader and ``info`` loop over the registry
(``opdcache/stores/__init__.py``) instead of naming stores.

This module imports nothing of opdcache, so that the format (opdcache/format/schema.py) can be built from the registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

PAD_ID = -1
"""Padding of a compact top-k or sampled entry that holds no token (its log-prob is -inf, its count 0)."""
FIELD_DTYPE = b"opdcache.dtype"
"""Field metadata key recording the logical dtype of a column stored as raw bits (bf16 as uint16)."""
PROB14_STEP = 2.0 ** -14
"""The grid of the compact top-k's prob14 codes: probability = code x 2^-14."""

SIGNALS = {
    "sampled_logprob": "the teacher's log-prob of each sampled token (per aligned group, for a teacher of its own tokenizer)",
    "top_k": "the teacher's top-k ids and log-probs at each position",
    "draws": "ids drawn from the teacher's distribution at each position, with their counts and log-probs",
    "vectors": "vectors a head turns into the teacher's logits at each position (the whole distribution, recomputed)",
    "groups": "the teacher's own tokens, grouped where both tokenizers cut at the same byte (a teacher of its own tokenizer)",
}
"""What a store's columns mean to a loss, by name: a loss reads signals (``Estimator.reads``), the registry says which
store gives each (``Store.gives``), so no loss names a store."""

Violation = tuple[str, "np.ndarray | None", str]
"""One row rule that some tokens break: (column, bad tokens [tokens] bool or None, message)."""


@dataclass(frozen=True)
class Column:
    """One column of one table kind."""

    name: str
    shape: str  # "row": one value per sequence; "token": a list aligned with response_ids; "token_vector": a list of fixed-width vectors
    dtype: str  # int32, int64, float32, string, bool, or "hidden" (the teacher's compute dtype)
    store: str  # the store that writes it; a table holds a column only when its store is enabled
    doc: str
    width: str | None = None  # StoreParams field giving the vector width ("top_k", "ref_top_k", ...)
    requires: tuple[str, ...] = ()  # StoreParams fields that must be set for the column to exist
    nullable: bool = False  # whether a row may hold null (task fields only)
    since: int = 1  # the format version that added the column (a newer column of an older store); not in describe()
    precision: "Callable[[Any], tuple[str, str | None]] | None" = None
    """For a vector column whose precision is a store parameter: ``precision(params)`` -> (the element's dtype,
    "float32", "bfloat16", "float16" or "prob14"; the field's ``opdcache.dtype`` metadata, or None). Not in describe()."""
    dtype_doc: "Callable[[int], str] | None" = None
    """What format version N's snapshot says its dtype is, where that changed with the version. Not in describe()."""


def _nothing(*_args: Any) -> None:
    return None


@dataclass(frozen=True)
class Implied:
    """The full distribution a store's stored values imply on a block of B positions (``Frontier.implied``), in one of
    three forms: ``log_q`` alone (a reconstruction of the whole distribution); ``log_q`` with ``kept`` and ``tail`` (a
    stored support: log q* on it, the tail bin's probability ``tail`` spread over the rest); or ``counts`` with
    ``spread`` (draws: an unbiased estimate with no q*, reported by its standard error)."""

    log_q: Any = None
    """[B, V] float64 log q*."""
    kept: Any = None
    """[B, V] bool: the stored support."""
    tail: Any = None
    """[B] float64: q*'s probability outside the support."""
    counts: Any = None
    """[B, V] float64: how often each id was drawn."""
    spread: Any = None
    """[B] float64: the standard error of the forward-KL estimate's teacher term, sqrt(Var_p[log p] / m)."""


@dataclass(frozen=True)
class FrontierBlock:
    """What ``Frontier.implied`` is given for one block of B response positions of one row."""

    p_lp: Any
    """[B, V] float64: the teacher's exact log-probs."""
    hidden: Any
    """[B, H]: the teacher's final hidden states."""
    stats: Mapping[str, Any]
    """Engine statistics by name (``opdcache.backends.base.STATISTICS``) at the largest width any setting asks: a
    setting takes its first columns."""
    log_probs: Callable[..., Any]
    """``log_probs(hidden, weight=None, bias=None)``: [B, V] float64 log-probs through the teacher's head (or the given one)."""
    fitted: Any = None
    """What ``Frontier.fit`` returned for this setting."""


def _always(*_args: Any) -> bool:
    return True


@dataclass(frozen=True)
class Frontier:
    """How ``opdcache plan``'s storage frontier (opdcache/teacher/frontier.py) measures a store: a setting is a dict of
    its ``schema.StoreParams`` fields, as score-teacher's flags set them."""

    defaults: Callable[[int, int], list]
    """``defaults(hidden_size, vocab_size)``: the settings plan measures unless told otherwise."""
    scored: Callable[[Any], list]
    """``scored(params)``: the settings a table's recorded store parameters are (for a table holding the store)."""
    label: Callable[[Mapping], str]
    """A setting's row name in plan's table."""
    flags: Callable[[Mapping], str]
    """A setting's score-teacher flags."""
    implied: Callable[[Mapping, FrontierBlock], Implied]
    """``implied(setting, block)``: the distribution the setting's stored values imply on the block."""
    params: Callable[[Mapping, int], Mapping] = lambda setting, hidden_size: setting
    """``params(setting, hidden_size)``: its StoreParams fields as a table records them."""
    fits: Callable[[Mapping, int, int], bool] = _always
    """``fits(setting, hidden_size, vocab_size)``: whether it can be measured on a teacher of these shapes."""
    fit: Callable[[Mapping, Any, Any], tuple] | None = None
    """``fit(setting, teacher, calibration)`` -> (what ``implied`` is given as ``block.fitted``, the store encoding rows
    with it): a store fitted on hidden states [N, H] first (the frontier fits on the first half of the sample and
    measures on the second). ``teacher`` has ``W`` [V, H] and ``b``."""
    exact: Callable[[Mapping], "Mapping | None"] = _nothing
    """``exact(setting)``: the setting whose values this one encodes (its estimates are compared with them), or None."""
    report: Callable[[Mapping, list], Mapping] = lambda setting, records: {}
    """``report(setting, records)``: numbers beside its row, from its stored rows."""


@dataclass(frozen=True)
class Store:
    """One teacher store."""

    name: str
    """What ``score-teacher --store`` and ``train``'s loader call it."""
    summary: str
    """What it holds, in a few words (score-teacher's --store help)."""
    columns: tuple[Column, ...]
    """Its columns in a teacher table, in the order they are written."""
    since: int = 1
    """The format version that added it."""
    check_job: Callable[[Any, bool], None] = _nothing
    """Checks a score-teacher job's settings that shape this store: ``check_job(job, enabled)``, raising ConfigError with
    one line (called before any model loads)."""
    check_params: Callable[[Any], None] = _nothing
    """Checks a table's recorded store parameters (``schema.StoreParams``) for this store, raising ConfigError."""
    check_model: Callable[[Any, Mapping], None] = _nothing
    """``check_model(job, facts)``: checks of an enabled store's settings against the cache and the teacher, raising
    ConfigError: called before any model loads with what the manifest and the teacher's config.json tell ({"positions":
    response positions of the base table, "base": its name, "hidden_size": the config's or None, "where"}), and once
    more with the loaded engine's hidden size (where "its output head")."""
    params: Callable[[Any, Mapping], Mapping] = lambda job, facts: {}
    """``params(job, facts)``: the table's store parameters (``schema.StoreParams`` fields) an enabled store sets from
    the job, with the engine's facts ({"hidden_size": its head's width or None, "dtype": its compute dtype})."""
    config: Callable[[Any], Mapping] = lambda job: {}
    """``config(job)``: the settings of an enabled store that change its values without being store parameters,
    recorded in the table's config (its fingerprint), e.g. the svd fit's method, the draws' seed."""
    config_default: Mapping = field(default_factory=dict)
    """Config entries every teacher table records whether or not it holds the store (their value without it): tables
    written before the store's ``config`` keep their fingerprints."""
    gives: tuple[str, ...] = ()
    """The signals (:data:`SIGNALS`) its columns give a loss; where several stores give one, a table's first in
    registry order is read."""
    head: Callable[[Any, str, Any], tuple] | None = None
    """For a store giving ``vectors``: ``head(cache, table, params)`` -> (the head that turns its vectors into logits,
    an object with ``weight`` [vocab, width] and ``bias``; the width its vectors have; the side file it came from),
    read from its side file (hash-checked first)."""
    needs: tuple[str, ...] = ()
    """The engine statistics its values are made from, by name (``opdcache.backends.base.STATISTICS``: "topk_ids",
    "sampled_ids", "hidden", ...): score-teacher asks the engine for them and refuses one that does not compute them, before
    any model loads (a store needing the hidden states alone is scored on the reference engine instead)."""
    side_file: str | None = None
    """A file beside the table's shards that its rows need (the hidden store's head, the svd projection), written by
    ``prepare``, hashed in the manifest, refused when planted in a table that does not hold the store."""
    side_tensors: tuple[str, ...] = ()
    """The tensors that side file must hold (checked as untrusted bytes before it is loaded)."""
    side_file_problem: Callable[[Any], "str | None"] = _nothing
    """``side_file_problem(path)``: what is wrong with the side file's tensors once loaded (bounded by its bytes), or
    None; validate reports it."""
    side_record: Callable[[Any], "dict | None"] = _nothing
    """``side_record(path)``: what the manifest keeps under the store's name, read back from its side file (a job
    rebuilt from its job file, by finalize or a Ray driver, did not run ``prepare``), or None."""
    encode: Callable[[Any, Any], Mapping[str, np.ndarray]] | None = None
    """``encode(scores, params)``: the row's columns from the engine's ``Scores``, before the finiteness check (None: the
    scoring module writes it, for stores whose encoding spans rows)."""
    pack: Callable[[Any, Any, Mapping], Mapping[str, np.ndarray]] | None = None
    """``pack(scores, params, row)``: the stored form of columns whose exact values ``encode`` gave (checked finite
    first; ``row`` holds them), e.g. draws collapsed to distinct ids and float16 bits (None: stored as encoded)."""
    prepare: Callable[[Any], "Store | None"] | None = None
    """``prepare(preparation)``: run once by a score-teacher job after its job record is written and before any row is
    scored (a :class:`Preparation`): write the store's side file, fit what its rows are encoded with, record what the
    manifest keeps of it in ``preparation.meta``; return the store to encode this job's rows with (its ``encode`` and
    ``pack`` bound to what it fitted), or None to keep this one."""
    rules: Callable[[Mapping[str, np.ndarray], int | None, Mapping], list] | None = None
    """``rules(values, vocab, params)``: the row rules (Violations) on a shard's decoded per-token values {column:
    [tokens, ...]} of its per-token columns, with pi_ref's vocabulary ``vocab`` (the ids the student trains on) and the
    table's recorded store parameters plus ``teacher_vocab_size``, the teacher's own vocabulary (its table's config:
    a teacher's own ids, its draws and its entropy's bound are within it), and ``dtypes``, each column's stored form as
    its field says (``opdcache.dtype``: "float16", "prob14", ...; absent for plain columns); validate reports them and
    the loader refuses a shard that breaks one."""
    rules_read: tuple[str, ...] = ()
    """Columns beyond its own its ``rules`` read, in ``values`` under their names: another store's (the sampled
    token's ``logprobs``) or the rollouts' (``response_ids``), decoded alike."""
    rebuilds: Mapping[str, float] | None = None
    """For a store whose vectors and side-file head rebuild the stored log-probs (the hidden states): the tolerance of
    that rebuild per stored dtype, checked by ``opdcache validate`` (opdcache/format/vectorcheck.py), which streams its
    vector column one row group at a time instead of reading it whole."""
    table_rules: Callable[[Any, np.ndarray], list] | None = None
    """``table_rules(table, offsets)``: rules that tie a row's columns together, on a shard's Arrow table with its
    response offsets, as (column, bad rows [rows] bool, message); validate reports them."""
    record: Callable[[list, Any], dict] | None = None
    """``record(footers, params)``: what the manifest's table entry holds under the store's name, merged from every
    shard's footer key-value metadata (each holding ``record_meta``; untrusted bytes), e.g. counts measured while
    scoring, the distortion measured while encoding."""
    record_meta: bytes | None = None
    """The footer key each shard of a table holding the store carries for ``record``."""
    record_when: Callable[[Any], bool] = _always
    """``record_when(params)``: whether a table holding the store with these parameters keeps the record."""
    record_schema: Callable[[int], "dict | None"] = _nothing
    """``record_schema(version)``: the JSON Schema of what the manifest's table entry keeps under its name at that
    format version (the record, or the fit ``prepare`` records), or None where the version has none."""
    describe: Callable[[Mapping], list] = lambda record: []
    """``describe(record)``: that record as lines, printed by score-teacher when it finishes and by ``opdcache info``."""
    flat: tuple[str, ...] | None = None
    """The columns flat exports (``opdcache export``) carry, decoded to plain numbers (None: all of them)."""
    card: Callable[[str, Mapping], list[str]] = lambda config, entry: []
    """``card(config, entry)``: a section of the dataset card for a table holding it (its Markdown lines), e.g. how to
    decode its columns from what ``datasets`` returns."""
    info: Callable[[Mapping], str | None] = _nothing
    """``info(params)``: the line ``opdcache info`` prints for a table holding it (None: nothing beyond its bytes)."""
    reencode: Callable[[Any, Mapping, str], Mapping] | None = None
    """``reencode(params, options, where)``: for ``opdcache upgrade``, which re-encodes a table holding the store beside
    it without the teacher: the new table's store parameters (StoreParams fields) from the source's and the command's
    options (by StoreParams field), raising ConfigError (naming the table ``where``) when there is nothing to do. The
    new rows are encoded from the source's columns as the engine's statistics of the same names (None: not re-encoded)."""
    version: Callable[[Any], int] = lambda params: 1
    """``version(params)``: the format version a table holding it with these parameters needs (a newer form of the
    store: the compact top-k, the bfloat16 svd codes)."""
    rescored: bool = True
    """``opdcache audit`` re-scores its columns and compares them with the stored ones (False: its values come from a
    fit over the whole table, the svd projection, and are left out of the comparison)."""
    shard_encoder: Callable[[Any], Any] = _nothing
    """``shard_encoder(params)``: for a store whose stored form is made with something measured over the shard's rows
    (the compact top-k and its distortion against the exact top-k), an object with ``pack(scores, row)`` -> (the
    row's stored columns, the row's encoding, given to ``fidelity``), run after the finiteness check, and ``footer()``
    -> the shard footer's key-value metadata it writes (its ``record_meta``); None where the parameters need none."""
    fidelity: Callable[[Any, Any, Any, int], Mapping] = lambda scores, params, encoded, vocab_size: {}
    """``fidelity(scores, params, encoded, vocab_size)``: its per-position error against the teacher's full
    distribution, {quantity: [T] values} (the table's fidelity record, opdcache/format/fidelity.py), from the engine's
    Scores of a row that streamed it (``entropy``, ``variance``, ...) and the row's encoding by ``shard_encoder`` (or
    None)."""
    fidelity_means: Mapping[str, str] = field(default_factory=dict)
    """What each of its ``fidelity`` quantities means (the record's "means", the lines ``info`` prints, in this order)."""
    format_notes: Callable[[int], Mapping] = lambda version: {}
    """``format_notes(version)``: sections its store adds to the format's description at that version
    (``schema.describe``, frozen in schemas/format-v<N>.json), e.g. the compact top-k's encodings."""
    always: bool = False
    """Every teacher table holds it (the scored token's log-prob), whatever ``--store`` names."""
    own_tokenizer: bool = False
    """A teacher table holds it exactly when the teacher scores with its own tokenizer (``score-teacher --prompts``)."""
    frontier: Frontier | None = None
    """How ``opdcache plan`` measures its bytes and error against the full vocabulary (None: not on the frontier)."""


@dataclass
class Preparation:
    """What a store's ``prepare`` is given: the score-teacher job, the cache, the loaded engine, the table's folder,
    the table's manifest metadata (``meta``: the store records under its name), and ``requests(rows)``, the engine's
    score requests for rows of the base table (an Arrow table with prompt_ids and response_ids)."""

    job: Any
    cache: Any
    backend: Any
    table_dir: Any
    meta: dict
    requests: Callable[[Any], list]


def hidden_to_numpy(tensor) -> np.ndarray:
    """A torch tensor of hidden states -> what a hidden or svd column stores (float32, or raw 16-bit patterns)."""
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        return tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
    return tensor.to(torch.float32).numpy()
