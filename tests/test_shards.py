"""Every column type round-trips exactly, and users' tools (pyarrow, datasets, DuckDB) read the shards."""

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from opdcache.errors import SchemaError
from opdcache.format import schema as S, shards
from opdcache.format.cache import Cache
from synth import rollout_rows


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_hidden_states_round_trip_bit_exact(tmp_path, dtype):
    torch_dtype = getattr(torch, dtype)
    hidden = (torch.randn(7, 24) * 100).to(torch_dtype)
    hidden[0, :4] = torch.tensor([float("1e-38"), -0.0, 65504, 3.0e-5]).to(torch_dtype)
    params = S.StoreParams(stores=("logprob", "hidden"), hidden_size=24, hidden_dtype=dtype)
    rec = dict(id="r", logprobs=-np.ones(7, np.float32), logsumexp=np.zeros(7, np.float32), hidden=shards.hidden_to_numpy(hidden))
    info = shards.write_table_atomic(shards.build_table("teacher", params, [rec]), tmp_path / "t.parquet", tmp_path)
    table = shards.read_table(tmp_path / info.path)
    back = shards.hidden_to_torch(shards.token_values(table["hidden"]), shards.hidden_dtype_of(table.schema.field("hidden")))
    assert back.dtype == torch_dtype
    assert torch.equal(back.view(torch.int16 if dtype != "float32" else torch.int32),
                       hidden.view(torch.int16 if dtype != "float32" else torch.int32))


def test_every_rollout_column_round_trips(tmp_path):
    rows = rollout_rows(0, n_rows=5)
    params = S.StoreParams(stores=("base", "ref_topk", "mc", "task"), ref_top_k=4, mc_samples=3)
    shards.write_table_atomic(shards.build_table("rollouts", params, rows), tmp_path / "r.parquet", tmp_path)
    table = shards.read_table(tmp_path / "r.parquet")
    offsets = shards.list_offsets(table["response_ids"])
    for name in ("response_ids", "sampling_logprobs", "ref_logprobs", "ref_topk_ids", "ref_topk_logprobs", "mc_ids", "mc_sampling_logprobs"):
        flat = shards.token_values(table[name])
        for i, row in enumerate(rows):
            np.testing.assert_array_equal(flat[offsets[i]: offsets[i + 1]], row[name])
    for name in ("id", "prompt_index", "sample_index", "finish_reason", "answer", "reward", "metadata"):
        assert table[name].to_pylist() == [r[name] for r in rows]
    assert table["prompt_ids"].to_pylist() == [r["prompt_ids"].tolist() for r in rows]


def test_shard_metadata_makes_a_lone_shard_self_describing(synth_cache):
    path = Cache(synth_cache).shard_paths("teachers/synth")[0]
    kind, params, version = S.params_from_schema(pq.read_schema(path))
    assert kind == "teacher" and params.hidden_dtype == "bfloat16" and version == 1
    assert pq.read_schema(path).metadata[S.META_CONFIG_FP] == Cache(synth_cache).table("teachers/synth")["config_fingerprint"].encode()


def test_floats_use_byte_stream_split(synth_cache):
    path = Cache(synth_cache).shard_paths("teachers/synth")[0]
    meta = pq.ParquetFile(path).metadata.row_group(0)
    enc = {meta.column(i).path_in_schema.split(".")[0]: meta.column(i).encodings for i in range(meta.num_columns)}
    assert "BYTE_STREAM_SPLIT" in enc["logprobs"] and "BYTE_STREAM_SPLIT" in enc["hidden"]
    assert meta.column(0).compression == "ZSTD"


def test_non_finite_values_are_never_written(tmp_path):
    rows = rollout_rows(0, n_rows=2)
    rows[1]["ref_logprobs"] = rows[1]["ref_logprobs"].copy()
    rows[1]["ref_logprobs"][0] = np.nan
    params = S.StoreParams(stores=("base", "ref_topk", "mc", "task"), ref_top_k=4, mc_samples=3)
    with pytest.raises(SchemaError, match="column 'ref_logprobs' row 1 position 0: non-finite value"):
        shards.build_table("rollouts", params, rows)


def test_length_and_shape_errors_name_row_and_column():
    rows = rollout_rows(0, n_rows=2)
    params = S.StoreParams(stores=("base", "ref_topk", "mc", "task"), ref_top_k=4, mc_samples=3)
    bad = [dict(r) for r in rows]
    bad[1]["sampling_logprobs"] = bad[1]["sampling_logprobs"][:-1]
    with pytest.raises(SchemaError, match="column 'sampling_logprobs' row 1: .* positions, but the row has"):
        shards.build_table("rollouts", params, bad)
    bad = [dict(r) for r in rows]
    bad[0]["ref_topk_ids"] = bad[0]["ref_topk_ids"][:, :2]
    with pytest.raises(SchemaError, match=r"column 'ref_topk_ids' row 0: expected shape \[tokens, 4\]"):
        shards.build_table("rollouts", params, bad)
    bad = [dict(r) for r in rows]
    bad[0]["surprise"] = 1
    with pytest.raises(SchemaError, match=r"row 0: columns \['surprise'\] are not in the rollouts schema"):
        shards.build_table("rollouts", params, bad)


def test_datasets_reads_every_shard_and_column(synth_cache, tmp_path):
    import datasets

    cache = Cache(synth_cache)
    for config, table in (("rollouts", "rollouts"), ("teacher-synth", "teachers/synth")):
        ds = datasets.load_dataset(str(synth_cache), config, split="train", cache_dir=str(tmp_path / "hf"))
        direct = pq.read_table(cache.shard_paths(table))
        assert ds.num_rows == direct.num_rows
        assert set(ds.column_names) == set(direct.column_names)
        np_ds = ds.with_format("numpy")
        for name in direct.column_names:
            assert ds[name] == direct[name].to_pylist(), name
        assert np_ds[0]["id"] == direct["id"][0].as_py()


def test_duckdb_queries_a_shard_with_plain_sql(synth_cache):
    duckdb = pytest.importorskip("duckdb")
    path = Cache(synth_cache).shard_paths("rollouts")[0]
    tokens, rows, stops = duckdb.sql(
        f"SELECT sum(len(response_ids)), count(*), count(*) FILTER (WHERE finish_reason = 'stop') FROM '{path}'"
    ).fetchall()[0]
    table = pq.read_table(path)
    assert rows == table.num_rows
    assert tokens == sum(len(r) for r in table["response_ids"].to_pylist())
    assert stops == table["finish_reason"].to_pylist().count("stop")
    worst = duckdb.sql(f"SELECT id, list_min(ref_logprobs) AS m FROM '{path}' ORDER BY m LIMIT 1").fetchall()[0]
    assert worst[1] == min(min(r) for r in table["ref_logprobs"].to_pylist())


def test_the_cards_hidden_state_recipe_decodes_what_datasets_returns_bit_exact(synth_cache, tmp_path):
    """The card says per table how to decode 16-bit hidden states; its code, run on a `datasets` row, gives exactly the
    loader's tensor (bit for bit)."""
    import re

    import datasets
    import torch

    from opdcache.format.cache import Cache

    card = (synth_cache / "README.md").read_text()
    assert "### Decoding `hidden` in `teacher-synth` (bfloat16)" in card
    code = re.search(r"### Decoding `hidden` in `teacher-synth`.*?```python\n(.*?)```", card, re.S).group(1)
    row = datasets.load_dataset(str(synth_cache), "teacher-synth", split="train", cache_dir=str(tmp_path / "hf"))[0]
    scope = {"row": row}
    exec(code, scope)
    path = Cache(synth_cache).shard_paths("teachers/synth")[0]
    table = shards.read_table(path)
    want = shards.hidden_to_torch(shards.row_values(table["hidden"])[0], "bfloat16")
    got = scope["hidden"]
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_the_loader_decodes_16_bit_hidden_states_bit_exact(synth_cache):
    import torch

    from opdcache.format.cache import Cache
    from opdcache.training.data import CacheLoader, CacheLoaderConfig

    batch = next(iter(CacheLoader(CacheLoaderConfig(cache=synth_cache, teacher="synth", stores=("logprob", "hidden"), batch_size=6,
                                                    shuffle=False))))
    table = shards.read_table(Cache(synth_cache).shard_paths("teachers/synth")[0])
    for i, raw in enumerate(shards.row_values(table["hidden"])):
        want = shards.hidden_to_torch(raw, "bfloat16")
        got = batch["teacher_hidden"][i, : want.shape[0]]
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_offsets_and_values_of_chunked_and_sliced_columns_match_the_combined_column():
    """list_offsets reads each chunk's offsets (no copy of the values) and token_values takes a lone chunk as it is:
    both must equal what the whole column, combined into one array, gives; sliced chunks (a row group read from the
    middle) included."""
    import pyarrow as pa

    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 9, (int(n), 3)).astype(np.int32) for n in rng.integers(0, 6, 40)]
    whole = pa.array([r.tolist() for r in rows], type=pa.list_(pa.list_(pa.int32(), 3)))
    for column in (pa.chunked_array([whole]), pa.chunked_array([whole[:7], whole[7:7], whole[7:23], whole[23:]]), whole[5:31],
                   pa.chunked_array([], type=whole.type)):
        combined = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        want = combined.offsets.to_numpy() - combined.offsets.to_numpy()[0]
        np.testing.assert_array_equal(shards.list_offsets(column), want)
        np.testing.assert_array_equal(shards.token_values(column), np.asarray(combined.flatten().flatten()).reshape(-1, 3))


def test_numpy_view_equals_pyarrows_to_numpy_and_a_loaded_shard_never_imports_pandas(synth_cache):
    """numpy_view is Array.to_numpy without pyarrow's import of pandas (0.16-0.3 s of a loader's first shard): equal
    to to_numpy for every primitive type, sliced, empty and with nulls (which fall back to to_numpy); and a fresh
    process that loads a cache's batches never imports pandas."""
    import subprocess
    import sys

    import pyarrow as pa

    rng = np.random.default_rng(1)
    for dtype in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"):
        array = pa.array(rng.integers(-50 if dtype[0] in "if" else 0, 100, 30).astype(dtype))
        for part in (array, array[7:19], array[30:], array.slice(3, 0)):
            got = shards.numpy_view(part)
            assert got.dtype == part.to_numpy().dtype and np.array_equal(got, part.to_numpy(zero_copy_only=False))
    with_nulls = pa.array([1.0, None, 3.0], pa.float32())
    np.testing.assert_array_equal(shards.numpy_view(with_nulls), with_nulls.to_numpy(zero_copy_only=False))
    code = ("import sys; from opdcache.training.data import CacheLoader, CacheLoaderConfig; "
            f"n = sum(1 for _ in CacheLoader(CacheLoaderConfig(cache={str(synth_cache)!r}, teacher='synth', stores=('logprob', 'topk', 'hidden')))); "
            "print(n, 'pandas' in sys.modules, 'pyarrow.compute' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) > 0 and out[1:] == ["False", "False"]  # nor pyarrow.compute (0.1 s), which list flatten imports


def test_list_values_and_table_tokens_equal_pyarrows_flatten_and_list_lengths():
    """token_values reads a list column's values by its offsets instead of ``flatten`` (which imports pyarrow.compute);
    both agree on plain, sliced, chunked, fixed-size and null-holding columns, as table_tokens agrees with
    pyarrow.compute's list lengths."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rng = np.random.default_rng(2)
    rows = [rng.integers(0, 100, int(n)).astype(np.int32) for n in rng.integers(0, 6, 12)]
    plain = pa.array(rows, pa.list_(pa.int32()))
    vectors = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)),
                                       pa.FixedSizeListArray.from_arrays(pa.array(np.concatenate(rows).repeat(3).astype(np.float32)), 3))
    nulls = pa.array([[1, 2], None, [3], [], None, [4, 5, 6]], pa.list_(pa.int32()))
    cases = [plain, plain[3:9], plain[12:], vectors, vectors[2:7], nulls, nulls[1:5], pa.chunked_array([plain[:5], plain[5:]]),
             pa.chunked_array([vectors[4:], vectors[:4]])]
    for case in cases:
        arr = case.combine_chunks() if isinstance(case, pa.ChunkedArray) else case
        flat = arr.flatten()
        want = flat.flatten().to_numpy().reshape(-1, 3) if pa.types.is_fixed_size_list(flat.type) else flat.to_numpy()
        got = shards.token_values(case)
        assert got.shape == want.shape and np.array_equal(got, want), case
        column = case if isinstance(case, pa.ChunkedArray) else pa.chunked_array([case])
        assert shards.table_tokens(pa.table({"response_ids": column})) == int(pc.sum(pc.list_value_length(column)).as_py() or 0)
