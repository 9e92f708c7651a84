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

from opdcache.errors import ConfigError, SchemaError

FORMAT_NAME = "opdcache"
FORMAT_VERSION = 2
"""The newest format. A shard (and a manifest) declares the lowest version that holds every column it uses, so a cache
that uses nothing newer than v1 is written exactly as v1 was (same bytes, same fingerprints) and older readers keep
reading it. v2 = v1 + the rollouts' optional ``version`` store (``student_version``: async runs)."""
READABLE_VERSIONS = (1, 2)
STORE_SINCE = {"version": 2}
"""Stores added after v1, with the format version that added them; ``schemas/format-v<N>.json`` freezes each version."""

TABLE_KINDS = ("sft", "rollouts", "teacher")
ROLLOUT_STORES = ("base", "ref_topk", "mc", "task", "version")
TEACHER_STORES = ("logprob", "topk", "hidden", "svd")
HIDDEN_DTYPES = ("float32", "bfloat16", "float16")
FINISH_REASONS = ("stop", "length")

# Parquet key-value metadata keys carried by every shard, so a lone shard is self-describing.
META_FORMAT = b"opdcache.format"
META_VERSION = b"opdcache.format_version"
META_KIND = b"opdcache.kind"
META_PARAMS = b"opdcache.params"
META_CONFIG_FP = b"opdcache.config_fingerprint"
# Field metadata key recording the logical dtype of a column stored as raw bits (bf16 as uint16).
FIELD_DTYPE = b"opdcache.dtype"


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
    Column("logprobs", "token", "float32", "logprob",
           "T_t: teacher log-prob of each sampled response token at temperature 1 (log_softmax of the raw logits)."),
    Column("logsumexp", "token", "float32", "logprob",
           "Teacher log-partition log(sum_v exp(logit_v)) at each position, temperature 1; logprob_v = logit_v - logsumexp."),
    Column("ref_topk_logprobs", "token_vector", "float32", "logprob",
           "Teacher temperature-1 log-probs at the rollout's ref_topk_ids (same order).", width="ref_top_k", requires=("ref_top_k",)),
    Column("mc_logprobs", "token_vector", "float32", "logprob",
           "Teacher temperature-1 log-probs at the rollout's mc_ids (same order).", width="mc_samples", requires=("mc_samples",)),
    Column("topk_ids", "token_vector", "int32", "topk", "Teacher's own k most likely next tokens at temperature 1, most likely first.", width="top_k", requires=("top_k",)),
    Column("topk_logprobs", "token_vector", "float32", "topk", "Teacher temperature-1 log-probs of topk_ids, descending.", width="top_k", requires=("top_k",)),
    Column("hidden", "token_vector", "hidden", "hidden",
           "Teacher final hidden state after the final norm: the exact input of the unembedding in head.safetensors, so "
           "logits = hidden @ weight.T (+ bias). Stored bit-exact in the teacher's compute dtype: float32 as float32; "
           "bfloat16 and float16 as their raw 16-bit patterns in uint16 (field metadata opdcache.dtype names which).",
           width="hidden_size", requires=("hidden_size",)),
    Column("svd", "token_vector", "float32", "svd",
           "Teacher final hidden state projected to rank r by the encoder in svd.safetensors (z = hidden @ encoder); "
           "approximate logits = z @ decoder.T (+ bias).", width="svd_rank", requires=("svd_rank",)),
)

_COLUMNS = {"sft": SFT_COLUMNS, "rollouts": ROLLOUT_COLUMNS, "teacher": TEACHER_COLUMNS}


@dataclass(frozen=True)
class StoreParams:
    """Which stores a table holds, and their widths. Together with the kind it fixes the Arrow schema."""

    stores: tuple[str, ...]
    """Enabled stores, e.g. ("base", "ref_topk") for rollouts or ("logprob", "topk") for a teacher."""
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "stores", tuple(self.stores))
        for name in ("top_k", "ref_top_k", "mc_samples", "hidden_size", "svd_rank"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_dtype is not None and self.hidden_dtype not in HIDDEN_DTYPES:
            raise ConfigError(f"hidden_dtype must be one of {', '.join(HIDDEN_DTYPES)}, got {self.hidden_dtype!r}")
        if "hidden" in self.stores and (self.hidden_size is None or self.hidden_dtype is None):
            raise ConfigError("the hidden store needs hidden_size and hidden_dtype")
        if "topk" in self.stores and self.top_k is None:
            raise ConfigError("the topk store needs top_k (--top-k)")
        if "svd" in self.stores and self.svd_rank is None:
            raise ConfigError("the svd store needs svd_rank (--svd-rank)")
        if "ref_topk" in self.stores and self.ref_top_k is None:
            raise ConfigError("the ref_topk store needs ref_top_k (--ref-top-k)")
        if "mc" in self.stores and self.mc_samples is None:
            raise ConfigError("the mc store needs mc_samples (--mc-samples)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"stores": list(self.stores)}

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
        if col.dtype == "hidden":
            elem = hidden_storage_type(params.hidden_dtype)
            metadata = {FIELD_DTYPE: params.hidden_dtype.encode()}
        else:
            elem = _scalar_type(col.dtype)
        typ = pa.list_(pa.list_(elem, width))
    return pa.field(col.name, typ, nullable=col.nullable, metadata=metadata)


def version_of(params: StoreParams) -> int:
    """The lowest format version holding every store of ``params``."""
    return max([1] + [STORE_SINCE.get(store, 1) for store in params.stores])


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

    return {
        "format": FORMAT_NAME,
        "format_version": version,
        "position_convention": "per-token value t is for predicting response_ids[t] from prompt_ids + response_ids[:t]",
        "tables": {
            kind: [
                {k: v for k, v in dataclasses.asdict(c).items() if k != "requires"} | {"requires": list(c.requires)}
                for c in cols if known(c.store)
            ]
            for kind, cols in _COLUMNS.items()
        },
        "stores": {"rollouts": [s for s in ROLLOUT_STORES if known(s)], "teacher": [s for s in TEACHER_STORES if known(s)]},
        "hidden_dtypes": list(HIDDEN_DTYPES),
        "finish_reasons": list(FINISH_REASONS),
    }


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
