"""Side files of a cache (head.safetensors, svd.safetensors) read as untrusted bytes: what each must hold, and a check
of a file claimed to be safetensors that parses only its header, within limits, and loads no tensor."""

from __future__ import annotations

SIDE_FILE_TENSORS = {"head.safetensors": ("weight",), "svd.safetensors": ("encoder", "decoder")}
MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit on its JSON header


def safetensors_problem(path, size: int, required: tuple[str, ...]) -> str | None:
    """What is wrong with a file claimed to be safetensors (its 8-byte header length, its JSON header read within limits,
    the tensors it must hold, each within the file), or None; no tensor is loaded. A pickle (torch.save) fails here even
    when its hash was updated to match."""
    import struct

    from opdcache.untrusted import loads

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


def side_file_problem(path, size: int, name: str) -> str | None:
    """What is wrong with side file ``name`` (a key of SIDE_FILE_TENSORS) at ``path``, or None: its safetensors header,
    and for the svd projection its tensors' shapes and finiteness, loaded (bounded by the file's own bytes). The head's
    tensors are checked where validate loads it to rebuild the hidden store's log-probs."""
    problem = safetensors_problem(path, size, SIDE_FILE_TENSORS[name])
    if problem is None and name == "svd.safetensors":
        from opdcache import svd
        from opdcache.errors import SchemaError

        try:
            svd.load(path)
        except SchemaError as exc:
            return str(exc)
    return problem
