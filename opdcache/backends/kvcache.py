"""A key/value cache for the decode loop that is written in place instead of concatenated.

transformers' ``DynamicLayer`` appends a step's keys and values with ``torch.cat``: every decode step copies each
layer's whole cache into a new tensor, so a generation of N tokens after a prompt of L moves O(N (L + N)) bytes beside
what attention reads. :class:`PreallocatedLayer` allocates each layer's buffers once, at the length the loop will reach
(prompt + max_new_tokens), writes each step's keys and values into them, and hands attention views of the filled part:
the same values over the same length as ``DynamicLayer``'s, so generations are bit-identical (tests/test_kvcache.py).
What it costs: the cache is held at its final length from the first step, so rows that all stop early leave the last
positions unused (SmolLM2, 16 rows, 1,024-token prompts, 128 new tokens: peak 1,601 MiB against 1,525). What it saves
grows with the cache against the weights: 1.08-1.10x on that SmolLM2 run (benchmarks/bench_generate.py --context 1024,
BENCHMARKS.md), more where the cache is larger beside the weights (longer contexts, larger batches).

Only a model whose default cache is all ``DynamicLayer`` (full attention) gets it; a sliding-window or hybrid model,
or a transformers without layered caches, keeps its own (:func:`preallocated` returns None).
"""

from __future__ import annotations

import torch

try:
    from transformers.cache_utils import DynamicLayer as _DynamicLayer
except ImportError:  # a transformers before layered caches: preallocated() returns None and no layer is made
    _DynamicLayer = object


def preallocated(model, capacity: int):
    """The cache the decoder would make for itself (``DynamicCache(config=...)``) with every layer replaced by a
    :class:`PreallocatedLayer` of ``capacity`` positions, or None where that is not the same computation (a layer of
    another kind: sliding window, shared key/values) or this transformers has no layered caches."""
    try:
        from transformers.cache_utils import DynamicCache
        cache = DynamicCache(config=model.config)
    except (ImportError, TypeError, ValueError, KeyError, AttributeError):
        return None
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not _DynamicLayer for layer in layers):
        return None
    cache.layers = [PreallocatedLayer(capacity) for _ in layers]
    return cache


class PreallocatedLayer(_DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in buffers of ``capacity`` positions, allocated at the first update.
    ``keys`` and ``values`` are views of the filled part. Past the capacity, or after something replaced the views
    (a crop keeps them; a batch reorder does not), the buffers are reallocated, twice the needed length, and the filled
    part copied once. Memory: the two buffers, [batch, kv heads, capacity, head dim] each."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self.get_seq_length(), key_states.shape[-2]
        if self._buffers is None or n + m > self._buffers[0].shape[-2] or (n and self.keys.data_ptr() != self._buffers[0].data_ptr()):
            size = self.capacity if self._buffers is None and m <= self.capacity else 2 * (n + m)
            k = key_states.new_empty(key_states.shape[:-2] + (size, key_states.shape[-1]))
            v = value_states.new_empty(value_states.shape[:-2] + (size, value_states.shape[-1]))
            if n:
                k[..., :n, :] = self.keys
                v[..., :n, :] = self.values
            self._buffers = (k, v)
        k, v = self._buffers
        k[..., n: n + m, :] = key_states
        v[..., n: n + m, :] = value_states
        self.keys, self.values = k[..., : n + m, :], v[..., : n + m, :]
        return self.keys, self.values
