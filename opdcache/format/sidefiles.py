"""Side files of a cache (head.safetensors, svd.safetensors) read as untrusted bytes: what each must hold (the checks of
a file claimed to be safetensors and of its tensors are opdcache.untrusted's). Which files there are, and what each
holds, the stores declare (``Store.side_file``)."""

from __future__ import annotations

from opdcache.stores import REGISTRY
from opdcache.untrusted import safetensors_problem

SIDE_FILE_OF_STORE = {s.name: s.side_file for s in REGISTRY.values() if s.side_file}
"""Files next to a table's shards that its stores need, by store, hashed in the manifest."""
_STORE_OF_SIDE_FILE = {s.side_file: s for s in REGISTRY.values() if s.side_file}
SIDE_FILE_TENSORS = {name: store.side_tensors for name, store in _STORE_OF_SIDE_FILE.items()}


def side_file_problem(path, size: int, name: str) -> str | None:
    """What is wrong with side file ``name`` (a key of SIDE_FILE_TENSORS) at ``path``, or None: its safetensors header,
    then its store's own check of the tensors (``Store.side_file_problem``: loaded, bounded by the file's own bytes)."""
    return safetensors_problem(path, size, SIDE_FILE_TENSORS[name]) or _STORE_OF_SIDE_FILE[name].side_file_problem(path)
