"""The teacher's unembedding ("head"), saved next to a hidden store, and log-probs rebuilt from it.

``head.safetensors`` holds ``weight`` [vocab, hidden] (and ``bias`` [vocab] if the model has one) in the
teacher's dtype. The stored hidden state is the exact input of this layer, so
``logits = hidden @ weight.T + bias`` reproduces the teacher's logits (papers/002).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

CHUNK_ROWS = 4096  # positions per block when rebuilding log-probs, bounds memory at [CHUNK_ROWS, vocab]


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
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "opdcache-head-v1"})
    tmp.replace(path)


def load_head(path: str | Path) -> Head:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    return Head(tensors["weight"], tensors.get("bias"))


def token_logprobs_from_hidden(hidden_NH: torch.Tensor, head: Head, ids_N: torch.Tensor) -> torch.Tensor:
    """log softmax(hidden @ W.T + b)[ids] in float32, [N], computed in blocks of positions."""
    weight = head.weight.float()
    bias = None if head.bias is None else head.bias.float()
    out = torch.empty(hidden_NH.shape[0], dtype=torch.float32)
    for start in range(0, hidden_NH.shape[0], CHUNK_ROWS):
        h = hidden_NH[start: start + CHUNK_ROWS].float()
        logits = h @ weight.T
        if bias is not None:
            logits += bias
        lse = torch.logsumexp(logits, dim=-1)
        out[start: start + CHUNK_ROWS] = logits.gather(1, ids_N[start: start + CHUNK_ROWS, None]).squeeze(1) - lse
    return out
