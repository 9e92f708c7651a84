"""The teacher's unembedding ("head"), saved next to a hidden store, and log-probs rebuilt from it.

``head.safetensors`` holds ``weight`` [vocab, hidden] (and ``bias`` [vocab] if the model has one) in the
teacher's dtype. The stored hidden state is the exact input of this layer, so
``logits = hidden @ weight.T + bias`` reproduces the teacher's logits (papers/002).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

CHUNK_ROWS = 1024  # positions per block when rebuilding log-probs (with 8,192-column slices: 32 MiB of float32 logits)


@dataclass(frozen=True)
class Head:
    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None  # [V]

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]


def head_of(model) -> Head:
    out = model.get_output_embeddings()
    return Head(out.weight.detach(), None if getattr(out, "bias", None) is None else out.bias.detach())


def save_head(head: Head, path: str | Path) -> None:
    from safetensors.torch import save_file

    tensors = {"weight": head.weight.contiguous().cpu()}
    if head.bias is not None:
        tensors["bias"] = head.bias.contiguous().cpu()
    from opdcache import storage

    with storage.staged(storage.as_path(path)) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "opdcache-head-v1"})


def load_head(path: str | Path) -> Head:
    from safetensors.torch import load_file

    from opdcache.storage import as_path, local_copy

    from opdcache.errors import SchemaError

    from opdcache.untrusted import tensors_problem

    try:
        with local_copy(as_path(path)) as local:
            tensors = load_file(str(local))
    except Exception as exc:  # noqa: BLE001 (safetensors raises its own error type for a truncated or foreign file)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise SchemaError(f"{path} is not a readable unembedding (safetensors with a 'weight' tensor): "
                          f"{type(exc).__name__}: {first}; run `opdcache validate` on the cache") from None
    problem = tensors_problem(tensors, {"weight": ("V", "H"), "bias": ("?", "V")})
    if problem is not None:
        raise SchemaError(f"{path} is not a usable unembedding: {problem}; score the teacher again, or run `opdcache validate` on the cache")
    return Head(tensors["weight"], tensors.get("bias"))


def token_logprobs_from_hidden(hidden_NH: torch.Tensor, head: Head, ids_N: torch.Tensor) -> torch.Tensor:
    """log softmax(hidden @ W.T + b)[ids] in float32, [N]: blocks of CHUNK_ROWS positions, each streamed over
    vocabulary slices (opdcache/logits/logprobs.py), so memory is O(CHUNK_ROWS x slice), never O(N x V)."""
    from opdcache.logits.logprobs import chunked_logprobs

    weight = head.weight.float()
    bias = None if head.bias is None else head.bias.float()
    out = torch.empty(hidden_NH.shape[0], dtype=torch.float32)
    with torch.no_grad():
        for start in range(0, hidden_NH.shape[0], CHUNK_ROWS):
            h = hidden_NH[start: start + CHUNK_ROWS].float()
            out[start: start + h.shape[0]] = chunked_logprobs(h, weight, ids_N[start: start + h.shape[0], None], bias)[0][:, 0]
    return out
