"""Reading JSON that came with a cache or a run directory (untrusted bytes) within stated limits, and quoting its values
in messages without echoing them whole; checking a file claimed to be safetensors by its header alone, and the tensors a
side file holds once loaded.

A manifest, a job record or ``run.json`` is parsed only if it is at most MAX_JSON_BYTES; numbers of more than
MAX_NUMBER_CHARS characters, a key twice in one object (the last one would win silently), nesting deeper than MAX_DEPTH and
strings longer than MAX_STRING_CHARS are refused in one line naming the file, before any command looks at the values. :func:`quote` cuts any value to QUOTE_CHARS for messages.
"""

from __future__ import annotations

import json

MAX_JSON_BYTES = 256 << 20  # a manifest of 100,000 shards is about 40 MB
MAX_NUMBER_CHARS = 40  # digits of any number (Python refuses 4,300-digit integers with a traceback)
MAX_DEPTH = 64  # a manifest nests 6 deep
MAX_STRING_CHARS = 1 << 20
QUOTE_CHARS = 200


def quote(value, limit: int = QUOTE_CHARS) -> str:
    """repr-like text of ``value`` cut to ``limit`` characters, saying how much was cut."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return repr(text) if isinstance(value, str) else text
    return (repr(text[:limit]) if isinstance(value, str) else text[:limit]) + f"... ({len(text) - limit:,} more characters)"


def _number(kind):
    def parse(text: str):
        if len(text) > MAX_NUMBER_CHARS:
            raise ValueError(f"a number of {len(text):,} characters (the limit is {MAX_NUMBER_CHARS})")
        return kind(text)

    return parse


def _unique_keys(pairs: list) -> dict:
    """An object whose keys are unique: a duplicate would let the last one win silently."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {quote(dup)} appears twice in one object")
    return out


def _check_shape(value) -> None:
    """Depth and string lengths, walked without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, str):
            if len(item) > MAX_STRING_CHARS:
                raise ValueError(f"a string of {len(item):,} characters (the limit is {MAX_STRING_CHARS:,})")
        elif isinstance(item, dict):
            for k, v in item.items():
                if len(k) > MAX_STRING_CHARS:
                    raise ValueError(f"a key of {len(k):,} characters")
                stack.append((v, depth + 1))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def loads(data: bytes | str, where: str, error=ValueError):
    """The JSON value of ``data``, or ``error`` (an exception class) with one line naming ``where`` and the problem."""
    size = len(data)
    if size > MAX_JSON_BYTES:
        raise error(f"{where}: {size:,} bytes, over the {MAX_JSON_BYTES >> 20} MiB a cache's JSON may take; the file is damaged or hostile")
    try:
        value = json.loads(data, parse_int=_number(int), parse_float=_number(float), parse_constant=_number(float),
                           object_pairs_hook=_unique_keys)
        _check_shape(value)
    except RecursionError:
        raise error(f"{where}: invalid JSON (nested too deeply to read); the file is damaged or hostile") from None
    except json.JSONDecodeError as exc:
        raise error(f"{where}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{where}: refused ({str(exc)[:QUOTE_CHARS]}); the file is damaged or hostile") from None
    return value


def read_json(path, where: str | None = None, error=ValueError):
    """:func:`loads` of a file (local or object-store path), its size checked before it is read."""
    where = where or str(path)
    try:
        size = path.stat().st_size
    except (OSError, AttributeError, TypeError):
        size = None
    if size is not None and size > MAX_JSON_BYTES:
        raise error(f"{where}: {size:,} bytes, over the {MAX_JSON_BYTES >> 20} MiB a cache's JSON may take; the file is damaged or hostile")
    return loads(path.read_bytes(), where, error)


MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit on its JSON header


def safetensors_problem(path, size: int, required: tuple[str, ...]) -> str | None:
    """What is wrong with a file claimed to be safetensors (its 8-byte header length, its JSON header read within limits,
    the tensors it must hold, each within the file), or None; no tensor is loaded. A pickle (torch.save) fails here even
    when its hash was updated to match."""
    import struct

    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "not a safetensors file (shorter than its 8-byte header length)"
        n = struct.unpack("<Q", head)[0]
        if n > min(MAX_SAFETENSORS_HEADER, size - 8):
            return f"not a safetensors file (its header claims {n:,} bytes in a {size:,}-byte file; a pickle or other format?)"
        try:
            header = loads(f.read(n), "header", ValueError)
        except ValueError as exc:
            return f"not a safetensors file ({str(exc)[:200]})"
    if not isinstance(header, dict):
        return "not a safetensors file (its header is not a JSON object)"
    for name in required:
        info = header.get(name)
        if not isinstance(info, dict) or not isinstance(info.get("data_offsets"), list) or len(info["data_offsets"]) != 2:
            return f"safetensors header has no tensor {name!r} (the store needs it)"
        a, b = info["data_offsets"]
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= size - 8 - n):
            return f"tensor {name!r} lies outside the file (data_offsets {a}..{b})"
    return None


def tensors_problem(tensors: dict, shapes: dict[str, tuple]) -> str | None:
    """What is wrong with a side file's loaded tensors, or None: each named tensor has the rank and the sizes
    ``shapes`` asks (a name: a tuple of ints, or of names bound on first sight and equal after; a missing optional
    tensor is one whose shape starts with "?"), a floating dtype and only finite values (a NaN head would turn every
    rebuilt log-prob into NaN, which no comparison catches)."""
    import torch

    bound: dict[str, int] = {}
    for name, shape in shapes.items():
        optional = bool(shape) and shape[0] == "?"
        shape = shape[1:] if optional else shape
        t = tensors.get(name)
        if t is None:
            if optional:
                continue
            return f"no tensor {name!r}"
        if t.dim() != len(shape):
            return f"tensor {name!r} has {t.dim()} dimensions, {len(shape)} expected"
        for size, want in zip(t.shape, shape):
            want = bound.setdefault(want, size) if isinstance(want, str) else want
            if size != want:
                return f"tensor {name!r} is [{', '.join(map(str, t.shape))}], its sizes disagree with the file's other tensors"
        if not t.is_floating_point():
            return f"tensor {name!r} is {str(t.dtype).replace('torch.', '')}, not a floating-point tensor"
        if not bool(torch.isfinite(t).all()):
            return f"tensor {name!r} holds {int((~torch.isfinite(t)).sum()):,} NaN or infinite values"
    return None
