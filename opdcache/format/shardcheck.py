"""The reading layer's checks on a shard, made before (and, for nulls, right after) its columns are decoded: sizes
from the footer against the manifest and the shard's bytes, the exact Arrow types of the declared format version, and
no null where the format has none. opdcache/format/shards.py opens the file and calls them in order for every reader
(validate, the loader, export, audit, mismatch-report, check-consistency, upgrade, async, plan); opdcache/format/pagecheck.py
checks the pages against the footer between the two.
"""

from __future__ import annotations

from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from opdcache.errors import SchemaError
from opdcache.format import schema as S

MAX_ROW_TOKENS = 1 << 20  # list entries per row and column a reader accepts when it knows no model context (1M tokens)
MAX_STRING_BYTES = 16 << 20  # bytes of one string value (a task field): far above any task, far below a memory bomb
ROWS_PER_BYTE = 8  # an honest row takes bytes (its id alone is a unique hash); more rows than 8 per byte is a size bomb


def list_width(field: pa.Field) -> int | None:
    """Entries per token of a list column (1 for list<x>, k for list<fixed_size_list<x, k>>); None for other columns."""
    t = field.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return None
    width, inner = 1, t.value_type
    while pa.types.is_fixed_size_list(inner):
        width, inner = width * inner.list_size, inner.value_type
    return width


def per_token_columns(schema: pa.Schema) -> set[str] | None:
    """The shard's columns aligned with response_ids (a value or a vector per response token), by its declared kind and
    store parameters; None when it declares none readable (check_types refuses such a shard)."""
    try:
        kind, params, _ = S.params_from_schema(schema)
        return {c.name for c in S.columns(kind, params) if c.shape in ("token", "token_vector")}
    except (SchemaError, ValueError, TypeError, AttributeError):
        return None


def check_footer(pf: pq.ParquetFile, nbytes: int | None, columns: Iterable[str] | None, where: str,
                 rows: int | None = None, max_row_tokens: int | None = None, tokens: int | None = None) -> None:
    """Refuse, from the footer alone and before anything is decoded, a shard whose row count differs from ``rows`` (the
    manifest's) or exceeds ROWS_PER_BYTE x its bytes, or whose list columns hold more entries than rows x
    ``max_row_tokens`` (the model's context; default MAX_ROW_TOKENS) x the column's width, or (``tokens``: the
    manifest's response tokens) whose per-token columns hold more than tokens x width (a row-level list, such as the
    prompt or a teacher's own tokens, has only the context's bound). So what a reader decodes is
    bounded by the shard's own declared size, whatever its bytes claim. One line naming the shard."""
    md = pf.metadata
    n = md.num_rows
    if rows is not None and n != rows:
        raise SchemaError(f"{where}: the file holds {n:,} rows, the manifest says {rows:,} (a replaced or damaged shard); "
                          "run `opdcache validate` and rebuild it")
    if nbytes is not None and n > ROWS_PER_BYTE * nbytes + 1024:
        raise SchemaError(f"{where}: {n:,} rows in {nbytes:,} bytes, more than {ROWS_PER_BYTE} rows a byte: refused before decoding "
                          "(a size bomb, not a shard opdcache wrote)")
    limit = max_row_tokens or MAX_ROW_TOKENS
    wanted = None if columns is None else set(columns)
    schema = pf.schema_arrow
    per_token = per_token_columns(schema) if tokens is not None else None
    leaves: dict[str, int] = {}
    for g in range(md.num_row_groups):
        group = md.row_group(g)
        for j in range(group.num_columns):
            col = group.column(j)
            top = col.path_in_schema.split(".", 1)[0]
            leaves[top] = leaves.get(top, 0) + col.num_values
    for name, count in leaves.items():
        if (wanted is not None and name not in wanted) or schema.get_field_index(name) < 0:
            continue
        width = list_width(schema.field(name))
        aligned = name in per_token if per_token is not None else name != "prompt_ids"
        if width is not None and tokens is not None and aligned and count > tokens * width + n:
            raise SchemaError(f"{where}: column {name} holds {count:,} entries, the manifest's {tokens:,} response tokens allow "
                              f"{tokens * width:,}: refused before decoding")
        if width is not None and count > n * limit * width:
            what = f"the model's context of {limit:,}" if max_row_tokens else f"the reading limit of {limit:,}"
            raise SchemaError(f"{where}: column {name} holds {count:,} entries for {n:,} rows, more than {what} tokens a row: "
                              "refused before decoding")



def check_types(schema: pa.Schema, columns: list[str] | None, where: str) -> set[str]:
    """Refuse, before decoding, a shard that does not declare an opdcache kind and store parameters, or whose
    ``columns`` (default all) are not of exactly the Arrow types the format gives them for that declaration (ids
    int32, log-probs float32, lists nested as declared): the check validate makes, for every reader. Returns the
    columns that may hold null rows (the task fields)."""
    try:
        kind, params, _ = S.params_from_schema(schema)
        expected = S.arrow_schema(kind, params)
    except (SchemaError, ValueError, TypeError, AttributeError) as exc:
        raise SchemaError(f"{where}: {str(exc).splitlines()[0][:300]}; run `opdcache validate`") from None
    names = columns if columns is not None else schema.names
    diff = []
    for name in names:
        i, j = schema.get_field_index(name), expected.get_field_index(name)
        if i < 0:
            continue  # a column the shard lacks: the caller asked for it and pyarrow names it
        if j < 0 or not schema.field(i).type.equals(expected.field(j).type):
            diff.append(f"{name}: {schema.field(i).type} (expected {expected.field(j).type if j >= 0 else 'absent'})")
    if diff:
        raise SchemaError(f"{where}: schema differs from the declared format: {', '.join(diff)[:600]}; run `opdcache validate`")
    return {f.name for f in expected if f.nullable}


def _nulls_inside(array: pa.Array) -> int:
    """Nulls at any depth below a list column's rows (a fixed-width vector or value that is null)."""
    count = 0
    while pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or pa.types.is_fixed_size_list(array.type):
        # the values within the rows' spans, by the offsets (``flatten`` would import pyarrow.compute, 0.1 s a process)
        if pa.types.is_fixed_size_list(array.type):
            size = array.type.list_size
            array = array.values.slice(array.offset * size, len(array) * size)
        else:
            start, end = (array.offsets[0].as_py(), array.offsets[-1].as_py()) if len(array) else (0, 0)
            array = array.values.slice(start, end - start)
        count += array.null_count
    return count


def check_nulls(table: pa.Table, nullable: set[str], where: str) -> None:
    """Refuse a shard with a null where the format has none: a null row in a column that is not a task field, or a
    null anywhere inside a list (a token id, a log-prob, a top-k entry)."""
    for name in table.column_names:
        column = table[name]
        rows = column.null_count if name not in nullable else 0
        inside = sum(_nulls_inside(chunk) for chunk in column.chunks)
        if rows or inside:
            what = f"{rows:,} null rows" if rows else f"{inside:,} null values inside its lists"
            raise SchemaError(f"{where}: column {name} holds {what}, which the format never has; run `opdcache validate`")


def _row_lengths(array: pa.Array):
    """Per-row lengths of a list, string or binary array, from its offsets (nothing is copied)."""
    import numpy as np

    if pa.types.is_large_list(array.type) or pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type):
        dtype = np.int64
    else:
        dtype = np.int32
    offsets = np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array) + 1, offset=array.offset * np.dtype(dtype).itemsize)
    return np.diff(offsets)


def check_rows(table: pa.Table, where: str, max_row_tokens: int | None = None) -> None:
    """Refuse, row by row, a list column with more than ``max_row_tokens`` (the model's context; default MAX_ROW_TOKENS)
    tokens in one row, or a string longer than MAX_STRING_BYTES: the footer bounds a shard's total, this bounds each
    row, so one huge row cannot hide among short ones. One line naming the row."""
    limit = max_row_tokens or MAX_ROW_TOKENS
    for name in table.column_names:
        t = table.schema.field(name).type
        is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
        is_text = pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)
        if not (is_list or is_text):
            continue
        cap = limit if is_list else MAX_STRING_BYTES
        first = 0
        for chunk in table[name].chunks:
            lengths = _row_lengths(chunk)
            if len(lengths) and int(lengths.max()) > cap:
                row = first + int(lengths.argmax())
                bound = "the model's context of" if max_row_tokens else "the reading limit of"
                what = (f"{int(lengths.max()):,} tokens, more than {bound} {cap:,}" if is_list
                        else f"a {int(lengths.max()):,}-byte string, more than the reading limit of {cap:,} bytes")
                raise SchemaError(f"{where}: row {row} of column {name} holds {what}: refused (a shard opdcache did not write, "
                                  "or a damaged one); run `opdcache validate`")
            first += len(chunk)
