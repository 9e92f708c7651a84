"""Side files of a cache (head.safetensors, svd.safetensors) read as untrusted bytes: what each must hold (the checks of
a file claimed to be safetensors and of its tensors are opdcache.untrusted's)."""

from __future__ import annotations

from opdcache.untrusted import safetensors_problem

SIDE_FILE_OF_STORE = {"hidden": "head.safetensors", "svd": "svd.safetensors"}
"""Files next to a table's shards that its stores need (hidden: the head; svd: the projection), hashed in the manifest."""
SIDE_FILE_TENSORS = {"head.safetensors": ("weight",), "svd.safetensors": ("encoder", "decoder")}
def side_file_problem(path, size: int, name: str) -> str | None:
    """What is wrong with side file ``name`` (a key of SIDE_FILE_TENSORS) at ``path``, or None: its safetensors header,
    and for the svd projection its tensors' shapes and finiteness, loaded (bounded by the file's own bytes). The head's
    tensors are checked where validate loads it to rebuild the hidden store's log-probs."""
    problem = safetensors_problem(path, size, SIDE_FILE_TENSORS[name])
    if problem is None and name == "svd.safetensors":
        from opdcache.stores import svdprojection as svd
        from opdcache.errors import SchemaError

        try:
            svd.load(path)
        except SchemaError as exc:
            return str(exc)
    return problem
