"""The only module that reads and writes Parquet.

Writing: records (dicts of numpy arrays) become an Arrow table built from flat buffers and offsets
(no per-token Python objects), checked against the declared schema, and written so that a file under its
final name is always complete (opdcache.storage.staged). The bytes depend only on the
data and the schema, never on the time or the process, so a rerun reproduces the same sha256.

Where the bytes go (a local disk or an object store) is opdcache.storage's business.

Reading: shards come back as Arrow tables, and per-token columns as one flat numpy array plus row
offsets, zero-copy where Arrow allows.

Encodings were chosen by measurement (benchmarks/bench_storage.py, BENCHMARKS.md): floats, int32 ids
and 16-bit hidden-state bit patterns use BYTE_STREAM_SPLIT, everything is zstd-compressed, dictionaries
only for strings.
"""

from __future__ import annotations

import io
import os

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from opdcache import storage
from opdcache.errors import SchemaError
from opdcache.format import schema as S
from opdcache.stores.base import hidden_to_numpy  # noqa: F401 (the writers' bit view of hidden states, declared with the stores)
from opdcache.format.shardcheck import MAX_ROW_TOKENS, check_footer, check_nulls, check_rows, check_types  # noqa: F401 (the reading layer's checks)

COMPRESSION = "zstd"
COMPRESSION_LEVEL = 3
ROW_GROUP_TARGET_BYTES = 8 << 20  # uncompressed Arrow bytes per row group: streaming-friendly, still seekable
ROW_GROUP_MAX_ROWS = 1024


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest records of one shard."""

    path: str  # relative to the cache root, POSIX separators
    rows: int
    tokens: int  # response tokens (per-token positions) in the shard
    bytes: int
    sha256: str

    def to_dict(self) -> dict:
        return {"path": self.path, "rows": self.rows, "tokens": self.tokens, "bytes": self.bytes, "sha256": self.sha256}


def shard_name(index: int, total: int) -> str:
    return f"part-{index:05d}-of-{total:05d}.parquet"


# ---------------------------------------------------------------- building tables


def _list_array(arrays: Sequence[np.ndarray], value_type: pa.DataType) -> pa.Array:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(arrays) if arrays else np.zeros(0)
    if pa.types.is_fixed_size_list(value_type):
        width = value_type.list_size
        elem = value_type.value_type
        values = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1), type=elem), width)
    else:
        values = pa.array(flat, type=value_type)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values)


def _as_vectors(value, width: int, name: str, row: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 2 or arr.shape[1] != width:
        raise SchemaError(f"column {name!r} row {row}: expected shape [tokens, {width}], got {list(arr.shape)}")
    return arr


PADDED = {name: ids for ids, partners in S.PADDED_BY.items() for name in partners if name.endswith("logprobs")}
"""Log-prob column -> its id column, where slots may be padding (id -1, log-prob -inf: v3 compact top-k and sampled)."""


class Records(list):
    """A shard's records plus key-value metadata for the shard's Parquet footer (bytes keys and values)."""

    def __init__(self, records=(), meta: dict | None = None):
        super().__init__(records)
        self.meta = dict(meta or {})


def build_table(kind: str, params: S.StoreParams, records: Sequence[dict], config_fingerprint: str = "") -> pa.Table:
    """Records (one dict per sequence, numpy arrays for per-token values) -> a checked Arrow table. ``Records``' meta
    goes into the schema's key-value metadata."""
    schema = S.arrow_schema(kind, params, config_fingerprint)
    if getattr(records, "meta", None):
        schema = schema.with_metadata({**schema.metadata, **records.meta})
    cols = S.columns(kind, params)
    names = {c.name for c in cols}
    for i, rec in enumerate(records):
        extra = set(rec) - names
        if extra:
            raise SchemaError(f"row {i}: columns {sorted(extra)} are not in the {kind} schema for stores {list(params.stores)}")
    arrays = []
    lengths = None  # per-row token count, fixed by the first per-token column
    for col, field in zip(cols, schema):
        if col.shape == "row":
            values = [rec.get(col.name) for rec in records]
            if not col.nullable and any(v is None for v in values):
                row = next(i for i, v in enumerate(values) if v is None)
                raise SchemaError(f"row {row}: required column {col.name!r} is missing")
            if field.type == pa.list_(pa.int32()):
                lists = [np.asarray(v, dtype=np.int32) for v in values]
                flat = next((i for i, v in enumerate(lists) if v.ndim != 1), None)
                if flat is not None:
                    raise SchemaError(f"row {flat}: column {col.name!r} must be a 1-D list of token ids, got shape {list(lists[flat].shape)}")
                arrays.append(_list_array(lists, pa.int32()))
            else:
                arrays.append(pa.array(values, type=field.type))
            continue
        per_row = []
        for i, rec in enumerate(records):
            if col.name not in rec:
                raise SchemaError(f"row {i}: required column {col.name!r} is missing")
            if col.shape == "token":
                arr = np.asarray(rec[col.name])
                if arr.ndim != 1:
                    raise SchemaError(f"column {col.name!r} row {i}: expected a 1-D array, got shape {list(arr.shape)}")
            else:
                arr = _as_vectors(rec[col.name], field.type.value_type.list_size, col.name, i)
            finite = np.isfinite(arr) if arr.dtype.kind == "f" else None
            if finite is not None and col.name in PADDED and PADDED[col.name] in rec:  # padding slots hold -inf
                finite |= (np.asarray(rec[PADDED[col.name]]) == S.PAD_ID) & (arr == -np.inf)
            if finite is not None and not finite.all():
                bad = int(np.flatnonzero(~finite.reshape(len(arr), -1).all(axis=-1))[0])
                raise SchemaError(f"column {col.name!r} row {i} position {bad}: non-finite value {arr.reshape(len(arr), -1)[bad].tolist()[:4]}")
            per_row.append(arr)
        row_lengths = [len(a) for a in per_row]
        if kind != "teacher":
            expected = [len(rec["response_ids"]) for rec in records]
        else:
            expected = lengths if lengths is not None else row_lengths
        for i, (got, want) in enumerate(zip(row_lengths, expected)):
            if got != want:
                raise SchemaError(f"column {col.name!r} row {i}: {got} positions, but the row has {want} response tokens")
        lengths = expected
        arrays.append(_list_array(per_row, field.type.value_type))
    return pa.Table.from_arrays(arrays, schema=schema)


def first_non_finite(record: dict) -> str | None:
    """'non-finite <column> at position <t>' for the first float column of a record holding NaN or inf, else None."""
    for name, value in record.items():
        if isinstance(value, np.ndarray) and value.dtype.kind == "f" and not np.isfinite(value).all():
            pos = int(np.flatnonzero(~np.isfinite(value.reshape(len(value), -1)).all(-1))[0])
            return f"non-finite {name} at position {pos}"
    return None


def table_tokens(table: pa.Table) -> int:
    """Response tokens in a table: positions of its first per-token column, read from its list offsets. A column
    holding null rows is counted by pyarrow.compute instead (a null row holds no tokens whatever its offsets say);
    otherwise that module, a 0.1 s import, stays unimported."""
    for name in ("response_ids", "logprobs"):
        if name in table.column_names:
            column = table[name]
            if column.null_count:
                import pyarrow.compute as pc

                return int(pc.sum(pc.list_value_length(column)).as_py() or 0)
            return int(list_offsets(column)[-1])
    return 0


# ---------------------------------------------------------------- writing


def _encodings(schema: pa.Schema) -> dict[str, str]:
    """Column path -> encoding: BYTE_STREAM_SPLIT for floats, 16-bit float bit patterns and int32 token ids.

    Measured (BENCHMARKS.md): with zstd it beats PLAIN by 10-25% on every store, e.g. top-k ids 337 -> 281
    B/token at k=128, bf16 hidden states 7,712 -> 5,964 B/token.
    """
    enc = {}
    for field in schema:
        typ, path = _leaf(field)
        if pa.types.is_floating(typ) or typ in (pa.int32(), pa.uint16()):
            enc[path] = "BYTE_STREAM_SPLIT"
    if _prob14(schema):  # ascending ids: zstd finds the common tokens' runs in PLAIN int32 (BENCHMARKS.md: 124 -> 109 B/token)
        enc["topk_ids.list.element.list.element"] = "PLAIN"
    return enc


PROB14_COMPRESSION_LEVEL = 9
"""zstd level of a prob14 store's two columns: their bytes are few, and level 9 takes 10% off them (BENCHMARKS.md)."""
PROB14_PAGE_BYTES = 8 << 20
"""Data page size of a table with a prob14 store. zstd compresses each page on its own, and the ascending id lists
repeat across positions: one page per column chunk instead of pyarrow's 1 MiB pages takes the store from 192.9 to
189.4 B/token on the storage frontier's SmolLM2 positions (bench_storage.py; the levers in bench_topk_codes.py). A
reader decodes a page at a time: 8 MiB at most, as the row group's size bounds it."""


def _leaf(field: pa.Field) -> tuple[pa.DataType, str]:
    """(element type, Parquet column path) of a column: nested lists end in ``name.list.element.list.element``."""
    typ, path = field.type, field.name
    while pa.types.is_list(typ) or pa.types.is_fixed_size_list(typ):
        typ, path = typ.value_type, path + ".list.element"
    return typ, path


def _prob14(schema: pa.Schema) -> bool:
    return "topk_logprobs" in schema.names and (schema.field("topk_logprobs").metadata or {}).get(S.FIELD_DTYPE) == b"prob14"


def _levels(schema: pa.Schema):
    if not _prob14(schema):
        return COMPRESSION_LEVEL
    return {_leaf(f)[1]: PROB14_COMPRESSION_LEVEL if f.name in ("topk_ids", "topk_logprobs") else COMPRESSION_LEVEL for f in schema}


def _row_group_rows(table: pa.Table) -> int:
    if table.num_rows == 0:
        return 1
    per_row = max(1, table.nbytes // table.num_rows)
    return int(max(1, min(ROW_GROUP_MAX_ROWS, ROW_GROUP_TARGET_BYTES // per_row)))


def write_table_atomic(table: pa.Table, path, root) -> ShardInfo:
    """Write ``table`` so that it appears under ``path`` only when complete (opdcache.storage.staged: rename on a local
    disk, one upload on an object store); return what the manifest needs."""
    encodings = _encodings(table.schema)
    dict_cols = [f.name for f in table.schema if f.type == pa.string()]
    with storage.staged(storage.confined_write(root, path)) as tmp:
        pq.write_table(
            table, str(tmp),
            row_group_size=_row_group_rows(table),
            compression=COMPRESSION, compression_level=_levels(table.schema),
            data_page_size=PROB14_PAGE_BYTES if _prob14(table.schema) else None,
            use_dictionary=dict_cols, column_encoding=encodings or None,
            write_statistics=False,  # min/max of list elements is useless and costs bytes
            store_schema=True,
        )
        digest = storage.sha256_of(tmp)
        size = tmp.stat().st_size
    return ShardInfo(
        path=path.relative_to(root).as_posix(), rows=table.num_rows, tokens=table_tokens(table), bytes=size, sha256=digest
    )


def is_temporary(path) -> bool:
    return path.name.startswith(".") and ".tmp-" in path.name


# ---------------------------------------------------------------- reading


def read_schema(path) -> pa.Schema:
    source, fs = storage.arrow_source(path)
    return pq.read_schema(source, filesystem=fs)


def _open(path) -> tuple[pq.ParquetFile, int]:
    if isinstance(path, (bytes, pa.Buffer)):
        return pq.ParquetFile(pa.BufferReader(path)), len(path)
    source, fs = storage.arrow_source(path)
    if fs is None:
        return pq.ParquetFile(source, memory_map=True), os.path.getsize(source)
    return pq.ParquetFile(fs.open(source, "rb")), int(fs.size(source))  # fsspec


def check_shard_footer(path, rows: int | None = None, where: str | None = None, tokens: int | None = None,
                       max_row_tokens: int | None = None, columns: list[str] | None = None) -> None:
    """:func:`check_footer` of a shard, reading its footer only; with ``columns``, also their Arrow types
    (:func:`check_types`), which the footer's schema states."""
    pf, nbytes = _open(path)
    check_footer(pf, nbytes, None, where or str(path), rows, max_row_tokens, tokens)
    if columns is not None:
        check_types(pf.schema_arrow, columns, where or str(path))


def check_pages(path, pf: pq.ParquetFile, nbytes: int, columns: list[str] | None, where: str) -> None:
    """:func:`opdcache.format.pagecheck.check_pages` of a shard's columns: its pages agree with its footer and decompress to a
    size bounded by its bytes on disk. One line naming the shard."""
    from opdcache.format.pagecheck import PageError, check_pages as check

    if isinstance(path, (bytes, pa.Buffer)):
        source = io.BytesIO(bytes(path))
    else:
        src, fs = storage.arrow_source(path)
        source = open(src, "rb") if fs is None else fs.open(src, "rb")
    try:
        with source:
            check(source, pf.metadata, nbytes, columns)
    except PageError as exc:
        raise SchemaError(f"{where}: {exc}: refused before decoding (a shard opdcache did not write, or a damaged one)") from None


def read_table(path, columns: Iterable[str] | None = None, rows: int | None = None, max_row_tokens: int | None = None,
               where: str | None = None, tokens: int | None = None) -> pa.Table:
    """A shard (or some of its columns): memory-mapped on a local disk, ranged reads on an object store, or parsed from
    bytes already in memory. Its footer is checked first (:func:`check_footer`), then its pages' headers against the
    footer and its bytes on disk (:func:`check_pages`): sizes are bounded before any column is decoded. ``rows``: the
    manifest's row count; ``max_row_tokens``: the model's context."""
    cols = list(columns) if columns is not None else None
    pf, nbytes = _open(path)
    where = where or str(getattr(path, "name", "a shard"))
    check_footer(pf, nbytes, cols, where, rows, max_row_tokens, tokens)
    check_pages(path, pf, nbytes, cols, where)
    nullable = check_types(pf.schema_arrow, cols, where)
    table = pf.read(columns=cols)
    if table.num_rows != pf.metadata.num_rows:  # the rows are what the bytes decode to; a footer claiming others lies
        raise SchemaError(f"{where}: its data decodes to {table.num_rows:,} rows, its footer says {pf.metadata.num_rows:,}; "
                          "the shard is damaged or hostile: rebuild it, or re-pull the cache")
    check_nulls(table, nullable, where)
    check_rows(table, where, max_row_tokens)
    return table


def open_parquet(path) -> pq.ParquetFile:
    source, fs = storage.arrow_source(path)
    if fs is None:
        return pq.ParquetFile(source, memory_map=True)
    return pq.ParquetFile(fs.open(source, "rb"))


def _one_array(array: pa.ChunkedArray | pa.Array) -> pa.Array:
    """The column as one array: its only chunk as it is (no copy), several concatenated."""
    if not isinstance(array, pa.ChunkedArray):
        return array
    return array.chunk(0) if array.num_chunks == 1 else array.combine_chunks()


_NUMPY_TYPES = {pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64, pa.uint8(): np.uint8,
                pa.uint16(): np.uint16, pa.uint32(): np.uint32, pa.uint64(): np.uint64, pa.float16(): np.float16,
                pa.float32(): np.float32, pa.float64(): np.float64}


def numpy_view(array: pa.Array) -> np.ndarray:
    """A primitive Arrow array as numpy: a zero-copy, read-only view of its data buffer when it has no nulls.

    What ``Array.to_numpy`` returns, without its cost of importing pandas (0.16-0.3 s, the largest part of a
    loader's first shard); any other array (nulls, booleans, nested types) goes through ``to_numpy``."""
    dtype = _NUMPY_TYPES.get(array.type)
    if dtype is None or array.null_count:
        return array.to_numpy(zero_copy_only=False)
    if len(array) == 0:
        return np.empty(0, dtype)
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * np.dtype(dtype).itemsize)


def list_offsets(array: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Row offsets [rows + 1] of a list column, starting at 0: read from each chunk's offsets, never copying values."""
    chunks = array.chunks if isinstance(array, pa.ChunkedArray) else [array]
    if len(chunks) == 1:
        offsets = numpy_view(chunks[0].offsets)
        return offsets - offsets[0]
    parts, base = [np.zeros(1, np.int64)], 0
    for chunk in chunks:
        o = numpy_view(chunk.offsets).astype(np.int64)
        parts.append(o[1:] - o[0] + base)
        base += int(o[-1] - o[0])
    return np.concatenate(parts)


def list_values(array: pa.Array) -> pa.Array:
    """A list array's values in row order, as ``array.flatten()`` gives them, without its import of pyarrow.compute (0.1
    s, which a training process otherwise never pays): the child array sliced at the row offsets, no copy. An array
    with null rows goes through ``flatten``, which skips them."""
    if array.null_count:
        return array.flatten()
    if pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
        return array.values.slice(array.offset * width, len(array) * width)
    offsets = numpy_view(array.offsets)  # this slice's offsets; ``values`` is the whole child
    return array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])) if len(offsets) else array.values.slice(0, 0)


def token_values(array: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A per-token column as one flat numpy array: shape [tokens] or [tokens, width].

    Zero-copy when the column has no nulls in its values (always true for what opdcache writes).
    16-bit float bit patterns come back as uint16; use :func:`hidden_to_torch` for a typed tensor.
    """
    flat = list_values(_one_array(array))
    if pa.types.is_fixed_size_list(flat.type):
        width = flat.type.list_size
        return numpy_view(list_values(flat)).reshape(-1, width)
    return numpy_view(flat)


def row_values(array: pa.ChunkedArray | pa.Array) -> list[np.ndarray]:
    """A list column as one numpy array per row (views into one flat buffer)."""
    values, offsets = token_values(array), list_offsets(array)
    return [values[offsets[i]: offsets[i + 1]] for i in range(len(offsets) - 1)]


def hidden_dtype_of(field: pa.Field) -> str:
    if field.metadata and S.FIELD_DTYPE in field.metadata:
        return field.metadata[S.FIELD_DTYPE].decode()
    return "float32"


def hidden_to_torch(values, hidden_dtype: str):
    """uint16 bit patterns (or float32) -> a torch tensor of the stored dtype, without changing a bit."""
    import warnings

    import torch

    with warnings.catch_warnings():  # Arrow buffers are read-only; we never write through these tensors
        warnings.simplefilter("ignore", UserWarning)
        if hidden_dtype == "float32":
            return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        target = {"bfloat16": torch.bfloat16, "float16": torch.float16}[hidden_dtype]
        return torch.from_numpy(np.ascontiguousarray(values).view(np.int16)).view(target)
