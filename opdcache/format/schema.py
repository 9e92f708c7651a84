"""The cache format, declared once: every table kind, every column, and what each number means.

A cache holds three kinds of table (DESIGN.md section 3):

* ``sft``      -- teacher trajectories for supervised fine-tuning (papers/000 eq. 5);
* ``rollouts`` -- samples of pi_ref on the OPD prompts (papers/000 eq. 7);
* ``teacher``  -- one teacher's signals on a rollout table, row-aligned with it by ``id``.

Rows are sequences. Per-token columns are lists aligned with ``response_ids``: position ``t``
holds the value for predicting ``response_ids[t]`` from ``prompt_ids + response_ids[:t]``.
Fixed-width per-token vectors (top-k, Monte-Carlo samples, hidden states) are
``list<fixed_size_list<T, width>>``.

Nothing here is inferred from data: the writer builds the Arrow schema from these declarations and
``schemas/format-v1.json`` is a frozen snapshot of :func:`describe` that a test compares with the code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pyarrow as pa

from opdcache import stores as store_registry
from opdcache.errors import ConfigError, SchemaError
from opdcache.stores import REGISTRY as TEACHER_REGISTRY
from opdcache.stores.base import FIELD_DTYPE, PAD_ID, PROB14_STEP, Column  # noqa: F401 (the format's names, declared with the stores)

FORMAT_NAME = "opdcache"
FORMAT_VERSION = 7
"""The newest format. A shard (and a manifest) declares the lowest version that holds every column it uses, so a cache
that uses nothing newer than v1 is written exactly as v1 was (same bytes, same fingerprints) and older readers keep
reading it. v2 = v1 + the rollouts' optional ``version`` store (``student_version``: async runs). v3 = v2 + the compact
top-k store (``topk_precision`` / ``topk_mass``: a residual-mass support padded with id -1, log-probs in float16 bits,
and the ``topk_tail`` column) and the teacher's ``sampled`` store (RS-KD). v4 = v3 + the compact top-k precision
``prob14`` (probabilities as uint16 codes on a 2^-14 grid, kept entries in ascending id order). v5 = v4 + the teacher's
``entropy`` store. v6 = v5 + the teacher's ``aligned`` store (a teacher with its own tokenizer). Each teacher store declares the version that added it (opdcache/stores/)."""
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
STORE_SINCE = {"version": 2} | {s.name: s.since for s in TEACHER_REGISTRY.values() if s.since > 1}
"""Stores added after v1, with the format version that added them; ``schemas/format-v<N>.json`` freezes each version."""

REQUIRES_SINCE = {"same_tokenizer": 6, "has_logsumexp": 7}
"""Column conditions added after v1, with the format version that added them (older snapshots do not list them)."""

TABLE_KINDS = ("sft", "rollouts", "teacher")
ROLLOUT_STORES = ("base", "ref_topk", "mc", "task", "version")
TEACHER_STORES = tuple(TEACHER_REGISTRY)
PADDED_BY = {"topk_ids": ("topk_logprobs",), "sampled_ids": ("sampled_counts", "sampled_logprobs"),
             "span_topk_ids": ("span_topk_logprobs", "span_topk_student_ids")}
"""The v3 id columns whose slots may be padding (PAD_ID), with the columns that share their slots."""
FINISH_REASONS = ("stop", "length")

# Parquet key-value metadata keys carried by every shard, so a lone shard is self-describing.
META_FORMAT = b"opdcache.format"
META_VERSION = b"opdcache.format_version"
META_KIND = b"opdcache.kind"
META_PARAMS = b"opdcache.params"
META_CONFIG_FP = b"opdcache.config_fingerprint"


_ID = Column("id", "row", "string", "base", "Stable row id: sha256 of the prompt token ids (hex, 16 chars) and the sample index, '<hash>-<sample_index>'.")
_PROMPT_INDEX = Column("prompt_index", "row", "int64", "base", "Index of the prompt in the input prompt file (line or row number, 0-based), after nothing is dropped.")
_SAMPLE_INDEX = Column("sample_index", "row", "int32", "base", "Index of this sample among the samples drawn for the prompt (0-based).")
_PROMPT_IDS = Column("prompt_ids", "row", "int32_list", "base", "Prompt token ids exactly as fed to the model (chat template applied, special tokens included).")
_RESPONSE_IDS = Column("response_ids", "row", "int32_list", "base", "Response token ids exactly as sampled (never re-tokenised from text); includes the final EOS when finish_reason is 'stop'.")
_FINISH = Column("finish_reason", "row", "string", "base", "'stop' (EOS sampled) or 'length' (cut at max new tokens).")
_ANSWER = Column("answer", "row", "string", "task", "Reference answer of the prompt, if the prompt file has one.", nullable=True)
_REWARD = Column("reward", "row", "float32", "task", "Task reward of the response (1.0 correct, 0.0 wrong) from the task's checker, if there is one.", nullable=True)
_METADATA = Column("metadata", "row", "string", "task", "Extra fields of the prompt row, as a JSON object.", nullable=True)

SFT_COLUMNS: tuple[Column, ...] = (
    _ID, _PROMPT_INDEX, _SAMPLE_INDEX, _PROMPT_IDS, _RESPONSE_IDS, _FINISH,
    Column("sampling_logprobs", "token", "float32", "base",
           "Log-prob of each sampled token under the distribution it was drawn from: the teacher's softmax with "
           "temperature and top-p applied (renormalised over the top-p nucleus). With temperature 0 (greedy) it is 0."),
    _ANSWER, _REWARD, _METADATA,
)

ROLLOUT_COLUMNS: tuple[Column, ...] = (
    _ID, _PROMPT_INDEX, _SAMPLE_INDEX, _PROMPT_IDS, _RESPONSE_IDS, _FINISH,
    Column("sampling_logprobs", "token", "float32", "base",
           "b_t: log-prob of each sampled token under the distribution it was drawn from: pi_ref's softmax with "
           "temperature and top-p applied (renormalised over the top-p nucleus)."),
    Column("ref_logprobs", "token", "float32", "base",
           "r_t: log-prob of each sampled token under pi_ref at temperature 1 with no top-p, as computed by the rollout "
           "engine (log_softmax of the raw logits)."),
    Column("ref_topk_ids", "token_vector", "int32", "ref_topk",
           "pi_ref's k most likely next tokens at temperature 1, most likely first.", width="ref_top_k", requires=("ref_top_k",)),
    Column("ref_topk_logprobs", "token_vector", "float32", "ref_topk",
           "pi_ref's temperature-1 log-probs of ref_topk_ids, descending.", width="ref_top_k", requires=("ref_top_k",)),
    Column("mc_ids", "token_vector", "int32", "mc",
           "m extra next-token samples per position, drawn i.i.d. from the sampling distribution (temperature and top-p "
           "applied) and not rolled out (papers/001 section 6.1).", width="mc_samples", requires=("mc_samples",)),
    Column("mc_sampling_logprobs", "token_vector", "float32", "mc",
           "Log-prob of each mc_ids sample under the sampling distribution it was drawn from.", width="mc_samples", requires=("mc_samples",)),
    _ANSWER, _REWARD, _METADATA,
    Column("student_version", "row", "int64", "version",
           "Async runs (opdcache async): the learner step whose published student snapshot sampled this row (0: the "
           "initial student). Within an async run, ref_logprobs and sampling_logprobs are that snapshot's."),
)

TEACHER_COLUMNS: tuple[Column, ...] = (
    Column("id", "row", "string", "base", "Row id of the rollout row this row scores (row-aligned 1:1 with the rollout shard of the same index)."),
) + store_registry.columns()

_COLUMNS = {"sft": SFT_COLUMNS, "rollouts": ROLLOUT_COLUMNS, "teacher": TEACHER_COLUMNS}


@dataclass(frozen=True)
class StoreParams:
    """Which stores a table holds, and their widths. Together with the kind it fixes the Arrow schema."""

    stores: tuple[str, ...]
    """Enabled stores, e.g. base and ref_topk for rollouts, or logprob and topk for a teacher (``score-teacher --store``)."""
    top_k: int | None = None
    """Width of the teacher's own top-k store."""
    ref_top_k: int | None = None
    """Width of pi_ref's top-k store in the rollouts (and of the teacher's log-probs at those ids)."""
    mc_samples: int | None = None
    """Monte-Carlo samples per position in the rollouts (and teacher log-probs at them)."""
    hidden_size: int | None = None
    """Width of the teacher hidden state in the hidden store."""
    hidden_dtype: str | None = None
    """Teacher compute dtype in which hidden states are kept: float32, bfloat16 or float16."""
    svd_rank: int | None = None
    """Rank r of the svd store."""
    topk_precision: str | None = None
    """v3 compact top-k: float32 or float16 log-probs (None: the exact v1 store, float32, all k entries)."""
    topk_mass: float | None = None
    """v3 compact top-k: keep entries until the residual teacher mass is at most this (None: all k)."""
    samples_per_position: int | None = None
    """v3 sampled store: teacher draws per position (m)."""
    svd_dtype: str | None = None
    """v3 svd store: "bfloat16" keeps z as bfloat16 bits in uint16 (None: float32, as v1)."""
    logsumexp: bool | None = None
    """v7: False when the logprob store has no logsumexp column (the engine returns normalised log-probs only: a served
    teacher); None: the column is there, as in every earlier table."""

    NEWER = ("topk_precision", "topk_mass", "samples_per_position", "svd_dtype", "logsumexp")
    """Fields added after v1: written only when set, so older tables keep their exact bytes and fingerprints."""

    @property
    def same_tokenizer(self) -> bool | None:
        """True when the teacher shares pi_ref's tokenizer: every table but an aligned one (None otherwise, for
        Column.requires)."""
        return None if any(TEACHER_REGISTRY[s].own_tokenizer for s in self.stores if s in TEACHER_REGISTRY) else True

    @property
    def has_logsumexp(self) -> bool | None:
        """True when the table holds the teacher's log-partition: a teacher of pi_ref's tokenizer whose engine returned
        it (None otherwise, for Column.requires)."""
        return True if self.same_tokenizer and self.logsumexp is not False else None

    @property
    def topk_compact(self) -> bool | None:
        """True when the top-k store is v3's compact form (None otherwise, for Column.requires)."""
        return True if self.topk_precision is not None or self.topk_mass is not None else None  # refused without the store

    def __post_init__(self) -> None:
        object.__setattr__(self, "stores", tuple(self.stores))
        for name in ("top_k", "ref_top_k", "mc_samples", "hidden_size", "svd_rank"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if "ref_topk" in self.stores and self.ref_top_k is None:
            raise ConfigError("the ref_topk store needs ref_top_k (--ref-top-k)")
        if "mc" in self.stores and self.mc_samples is None:
            raise ConfigError("the mc store needs mc_samples (--mc-samples)")
        store_registry.check_params(self)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self) | {"stores": list(self.stores)}
        return {k: v for k, v in out.items() if not (k in self.NEWER and v is None)}

    @classmethod
    def from_dict(cls, data: dict) -> StoreParams:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise SchemaError(f"unknown store parameters {sorted(unknown)}")
        return cls(**data)


def columns(kind: str, params: StoreParams | None = None) -> tuple[Column, ...]:
    """The columns of a table kind; with ``params``, only those its enabled stores write."""
    if kind not in _COLUMNS:
        raise SchemaError(f"unknown table kind {kind!r}; expected one of {', '.join(TABLE_KINDS)}")
    cols = _COLUMNS[kind]
    if params is None:
        return cols
    return tuple(
        c for c in cols
        if (c.store in ("base", "task") or c.store in params.stores)
        and all(getattr(params, r) is not None for r in c.requires)
    )


def _scalar_type(dtype: str) -> pa.DataType:
    return {
        "int32": pa.int32(), "int64": pa.int64(), "float32": pa.float32(),
        "string": pa.string(), "bool": pa.bool_(), "int32_list": pa.list_(pa.int32()),
    }[dtype]


def hidden_storage_type(hidden_dtype: str) -> pa.DataType:
    """Arrow type holding one hidden-state element: float32 as is, 16-bit floats as their raw bits."""
    return pa.float32() if hidden_dtype == "float32" else pa.uint16()


def arrow_field(kind: str, col: Column, params: StoreParams) -> pa.Field:
    metadata = None
    if col.shape == "row":
        typ = _scalar_type(col.dtype)
    elif col.shape == "token":
        typ = pa.list_(_scalar_type(col.dtype))
    else:
        width = getattr(params, col.width)
        if col.precision is not None:  # its precision a store parameter: 16-bit forms as their raw bits, tagged
            dtype, tag = col.precision(params)
            elem = hidden_storage_type(dtype)
            metadata = {FIELD_DTYPE: tag.encode()} if tag else None
        elif col.dtype == "float16":  # v3 columns kept as float16 bits
            elem, metadata = pa.uint16(), {FIELD_DTYPE: b"float16"}
        else:
            elem = _scalar_type(col.dtype)
        typ = pa.list_(pa.list_(elem, width))
    return pa.field(col.name, typ, nullable=col.nullable, metadata=metadata)


def version_of(params: StoreParams) -> int:
    """The lowest format version holding every store of ``params``."""
    forms = [TEACHER_REGISTRY[store].version(params) for store in params.stores if store in TEACHER_REGISTRY]
    return max([1] + forms + [STORE_SINCE.get(store, 1) for store in params.stores] + [7 if params.logsumexp is False else 1])


def arrow_schema(kind: str, params: StoreParams, config_fingerprint: str = "") -> pa.Schema:
    """The exact Arrow schema of a shard, with the key-value metadata that makes it self-describing."""
    import json

    fields = [arrow_field(kind, c, params) for c in columns(kind, params)]
    return pa.schema(fields, metadata={
        META_FORMAT: FORMAT_NAME.encode(),
        META_VERSION: str(version_of(params)).encode(),
        META_KIND: kind.encode(),
        META_PARAMS: json.dumps(params.to_dict(), sort_keys=True).encode(),
        META_CONFIG_FP: config_fingerprint.encode(),
    })


def describe(version: int = FORMAT_VERSION) -> dict:
    """A JSON-able description of format ``version``: the frozen snapshot in ``schemas/format-v<version>.json``."""
    if version not in READABLE_VERSIONS:
        raise SchemaError(f"unknown format version {version}; this opdcache knows {', '.join(map(str, READABLE_VERSIONS))}")

    def known(store: str) -> bool:
        return STORE_SINCE.get(store, 1) <= version

    def entry(c: Column) -> dict:
        requires = [r for r in c.requires if REQUIRES_SINCE.get(r, 1) <= version]
        d = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)
             if f.name not in ("requires", "since", "precision", "dtype_doc")} | {"requires": requires}
        if c.dtype_doc is not None:
            d["dtype"] = c.dtype_doc(version)
        return d

    out = {
        "format": FORMAT_NAME,
        "format_version": version,
        "position_convention": "per-token value t is for predicting response_ids[t] from prompt_ids + response_ids[:t]",
        "tables": {
            kind: [entry(c) for c in cols if known(c.store) and c.since <= version]
            for kind, cols in _COLUMNS.items()
        },
        "stores": {"rollouts": [s for s in ROLLOUT_STORES if known(s)], "teacher": [s for s in TEACHER_STORES if known(s)]},
        "finish_reasons": list(FINISH_REASONS),
    }
    for store in TEACHER_REGISTRY.values():  # what a store adds (its dtypes, the compact top-k's encodings)
        out.update(store.format_notes(version))
    return out


def params_from_schema(schema: pa.Schema) -> tuple[str, StoreParams, int]:
    """Read (kind, params, format_version) back from a shard's key-value metadata."""
    import json

    meta = schema.metadata or {}
    if meta.get(META_FORMAT) != FORMAT_NAME.encode():
        raise SchemaError("not an opdcache shard: Parquet metadata has no opdcache.format key")
    try:
        version = int(meta[META_VERSION])
        kind = meta[META_KIND].decode()
        params = StoreParams.from_dict(json.loads(meta[META_PARAMS]))
    except (KeyError, ValueError) as exc:
        raise SchemaError(f"unreadable opdcache shard metadata: {exc}") from exc
    if version not in READABLE_VERSIONS:
        raise SchemaError(
            f"shard has format version {version}, this opdcache reads versions {', '.join(map(str, READABLE_VERSIONS))}; "
            "install the opdcache version that wrote it or rebuild the cache"
        )
    return kind, params, version
