"""The format is declared once in code; frozen snapshots in schemas/ must match it exactly."""

import json
from pathlib import Path

import pyarrow as pa
import pytest

from opdcache.errors import ConfigError, SchemaError
from opdcache.format import manifest as M, schema as S

SCHEMAS = Path(__file__).parent.parent / "schemas"


@pytest.mark.parametrize("version", S.READABLE_VERSIONS)
def test_format_snapshot_matches_code(version):
    frozen = json.loads((SCHEMAS / f"format-v{version}.json").read_text())
    assert frozen == S.describe(version), "schema changed: bump FORMAT_VERSION and add a new snapshot, never edit one in place"


@pytest.mark.parametrize("version", S.READABLE_VERSIONS)
def test_manifest_json_schema_snapshot_matches_code(version):
    frozen = json.loads((SCHEMAS / f"manifest-v{version}.schema.json").read_text())
    assert frozen == M.json_schema(version)


def test_a_cache_without_newer_stores_is_written_as_v1():
    """Writers declare the lowest version that holds their columns: a cache using only v1 stores is byte-for-byte v1."""
    v1 = S.StoreParams(stores=("base", "task"))
    v2 = S.StoreParams(stores=("base", "task", "version"))
    assert S.version_of(v1) == 1 and S.version_of(v2) == 2
    assert S.arrow_schema("rollouts", v1).metadata[S.META_VERSION] == b"1"
    assert S.arrow_schema("rollouts", v2).metadata[S.META_VERSION] == b"2"
    assert "student_version" in S.arrow_schema("rollouts", v2).names and "student_version" not in S.arrow_schema("rollouts", v1).names
    assert "student_version" not in json.dumps(S.describe(1))


def test_every_column_is_documented_once():
    for kind in S.TABLE_KINDS:
        names = [c.name for c in S.columns(kind)]
        assert len(names) == len(set(names))
        assert all(len(c.doc) > 20 for c in S.columns(kind))


def test_arrow_types_of_every_store():
    p = S.StoreParams(stores=("logprob", "topk", "hidden", "svd"), top_k=8, ref_top_k=4, mc_samples=2,
                      hidden_size=32, hidden_dtype="bfloat16", svd_rank=6)
    schema = S.arrow_schema("teacher", p, "f" * 64)
    assert schema.field("topk_ids").type == pa.list_(pa.list_(pa.int32(), 8))
    assert schema.field("ref_topk_logprobs").type == pa.list_(pa.list_(pa.float32(), 4))
    assert schema.field("mc_logprobs").type == pa.list_(pa.list_(pa.float32(), 2))
    assert schema.field("hidden").type == pa.list_(pa.list_(pa.uint16(), 32))
    assert schema.field("hidden").metadata[S.FIELD_DTYPE] == b"bfloat16"
    assert schema.field("svd").type == pa.list_(pa.list_(pa.float32(), 6))
    kind, params, version = S.params_from_schema(schema)
    assert (kind, params, version) == ("teacher", p, 1)


def test_optional_stores_add_columns_only_when_enabled():
    plain = [c.name for c in S.columns("rollouts", S.StoreParams(stores=("base",)))]
    assert "ref_topk_ids" not in plain and "mc_ids" not in plain and "ref_logprobs" in plain
    teacher = [c.name for c in S.columns("teacher", S.StoreParams(stores=("logprob",)))]
    assert teacher == ["id", "logprobs", "logsumexp"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(stores=("topk",)), "needs top_k (--top-k)"),
    (dict(stores=("logprob",), top_k=0), "top_k must be a positive integer, got 0"),
    (dict(stores=("hidden",), hidden_size=8), "needs hidden_size and hidden_dtype"),
    (dict(stores=("hidden",), hidden_size=8, hidden_dtype="int8"), "hidden_dtype must be one of"),
])
def test_store_params_errors_name_the_problem(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        S.StoreParams(**kwargs)


def test_foreign_or_future_shard_metadata_is_refused():
    with pytest.raises(SchemaError, match="not an opdcache shard"):
        S.params_from_schema(pa.schema([pa.field("x", pa.int32())]))
    schema = S.arrow_schema("rollouts", S.StoreParams(stores=("base",)))
    future = schema.with_metadata({**schema.metadata, S.META_VERSION: b"9"})
    with pytest.raises(SchemaError, match="format version 9, this opdcache reads versions 1, 2"):
        S.params_from_schema(future)
