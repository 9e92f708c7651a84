"""What a Parquet shard's pages will cost to decode, read from their headers before any page is decompressed.

A footer states each column chunk's value count, and opdcache/format/shards.py bounds reads by it; but the pages are what a
reader decompresses and decodes, and a hostile file's pages need not agree with its footer (a 9.6 KB shard whose
footer says 512 values and whose page holds 10^8). So before a shard is decoded, every page header of the columns to
be read is parsed (Thrift compact protocol, a few dozen bytes each, read through the file object: nothing else is
loaded) and the shard is refused, in one line, when

* a column chunk's pages hold another number of values than its footer says,
* a page would decompress to more than MAX_PAGE_BYTES, or
* all its pages together would decode to more than MAX_EXPANSION x the shard's bytes on disk + EXPANSION_FLOOR: a data
  page counts the larger of its decompressed size and its values times their width (run-length and dictionary
  encodings make a page of 10^6 zeros a few bytes decompressed, and 4 MB decoded).

With the footer's counts then true, the decoded size is bounded by a stated function of the bytes actually on disk.
"""

from __future__ import annotations

from typing import Iterable

MAX_PAGE_BYTES = 256 << 20  # one page's decompressed size (opdcache writes 1 MiB pages; other writers up to tens of MiB)
MAX_EXPANSION = 64  # decompressed bytes per byte on disk over a whole shard (opdcache's own shards: see BENCHMARKS.md)
EXPANSION_FLOOR = 64 << 20  # small shards may expand more than MAX_EXPANSION: a bound that costs little at any size
MAX_HEADER_BYTES = 1 << 16  # a page header with its statistics; longer is not a header opdcache reads
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3
VALUE_BYTES = {"BOOLEAN": 1, "INT32": 4, "FLOAT": 4, "INT64": 8, "DOUBLE": 8, "INT96": 12}
"""Decoded bytes a value of each fixed-width physical type takes (an Arrow boolean is a bit; 1 bounds it); byte arrays
count their decompressed bytes, and 4 bytes of each value's offset."""


class PageError(ValueError):
    """A page header that cannot be parsed or does not agree with the footer (the message says which)."""


class _Reader:
    """The Thrift compact protocol over a bytes buffer: just enough to read a PageHeader and skip what it does not need."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise PageError("a page header runs past its bytes")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = value = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise PageError("a page header holds an integer of more than 64 bits")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip(self, kind: int, depth: int = 0) -> None:
        if depth > 32:
            raise PageError("a page header nests too deeply")
        if kind in (1, 2):  # booleans live in the field header
            return
        if kind == 3:
            self.byte()
        elif kind in (4, 5, 6):
            self.varint()
        elif kind == 7:
            self.pos += 8
        elif kind == 8:
            length = self.varint()  # read first: `self.pos += self.varint()` would add to the position before the length
            self.pos += length
        elif kind in (9, 10):
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            for _ in range(size):
                self.skip(head & 0x0F, depth + 1)
        elif kind == 11:
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.skip(types >> 4, depth + 1)
                    self.skip(types & 0x0F, depth + 1)
        elif kind == 12:
            self.struct(lambda fid, ftype: self.skip(ftype, depth + 1))
        else:
            raise PageError(f"a page header holds an unknown Thrift type {kind}")
        if self.pos > len(self.data):
            raise PageError("a page header runs past its bytes")

    def struct(self, field) -> None:
        """Call ``field(id, type)`` for each field of a struct; ``field`` consumes the value."""
        last = 0
        while True:
            head = self.byte()
            kind = head & 0x0F
            if kind == 0:
                return
            fid = last + (head >> 4) if head >> 4 else self.zigzag()
            last = fid
            field(fid, kind)


def parse_header(data: bytes) -> tuple[dict, int]:
    """(the fields of a PageHeader opdcache checks, the header's length in bytes)."""
    r = _Reader(data)
    out = {"type": None, "uncompressed": None, "compressed": None, "num_values": 0}

    def inner(fid: int, kind: int) -> None:  # DataPageHeader, DictionaryPageHeader, DataPageHeaderV2: field 1 is num_values
        if fid == 1 and kind == 5:
            out["num_values"] = r.zigzag()
        else:
            r.skip(kind)

    def top(fid: int, kind: int) -> None:
        if fid in (1, 2, 3) and kind == 5:
            out[{1: "type", 2: "uncompressed", 3: "compressed"}[fid]] = r.zigzag()
        elif fid in (5, 7, 8) and kind == 12:
            r.struct(inner)
        else:
            r.skip(kind)

    r.struct(top)
    if out["type"] is None or out["uncompressed"] is None or out["compressed"] is None:
        raise PageError("a page header lacks its type or sizes")
    if out["uncompressed"] < 0 or out["compressed"] < 0 or out["num_values"] < 0:
        raise PageError("a page header states a negative size")
    return out, r.pos


def _header_at(source, pos: int, end: int) -> tuple[dict, int]:
    """The page header at ``pos``: a short read first (opdcache writes no page statistics), a long one if it runs past."""
    for length in (512, MAX_HEADER_BYTES):
        source.seek(pos)
        data = source.read(min(length, end - pos))
        try:
            return parse_header(data)
        except PageError:
            if length == MAX_HEADER_BYTES or len(data) < length:
                raise
    raise AssertionError("unreachable")


def check_pages(source, metadata, nbytes: int, columns: Iterable[str] | None = None) -> int:
    """Parse the page headers of every column chunk (of ``columns``, default all) of a Parquet file opened as the binary
    file object ``source`` with footer ``metadata``; raise PageError naming the column on any disagreement or excess
    (see the module docstring); return the bytes its pages decode to."""
    wanted = None if columns is None else set(columns)
    total = 0
    budget = MAX_EXPANSION * nbytes + EXPANSION_FLOOR
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        for j in range(group.num_columns):
            col = group.column(j)
            name = col.path_in_schema
            if wanted is not None and name.split(".", 1)[0] not in wanted:
                continue
            start = col.dictionary_page_offset if col.has_dictionary_page and col.dictionary_page_offset else col.data_page_offset
            end = start + col.total_compressed_size
            if start < 0 or end > nbytes:
                raise PageError(f"column {name}: its pages lie outside the file")
            values, pos = 0, start
            width = VALUE_BYTES.get(col.physical_type, 4)
            while pos < end:
                head, size = _header_at(source, pos, end)
                if head["uncompressed"] > MAX_PAGE_BYTES:
                    raise PageError(f"column {name}: a page decompresses to {head['uncompressed']:,} bytes, over the "
                                    f"{MAX_PAGE_BYTES >> 20} MiB a page may take")
                decoded = head["uncompressed"]
                if head["type"] in (DATA_PAGE, DATA_PAGE_V2):
                    values += head["num_values"]
                    decoded = max(decoded, head["num_values"] * width)
                total += decoded
                if total > budget:
                    raise PageError(f"its pages decode to more than {budget:,} bytes ({MAX_EXPANSION}x its {nbytes:,} bytes on "
                                    f"disk + {EXPANSION_FLOOR >> 20} MiB) by column {name}")
                pos += size + head["compressed"]
            if values != col.num_values:
                raise PageError(f"column {name}: its pages hold {values:,} values, its footer says {col.num_values:,}")
    return total
