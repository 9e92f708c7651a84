"""Packed batches: a batch's rows end to end, no padding (``CacheLoaderConfig(pack=True)``, ``opdcache train``'s default).

:func:`collate_packed` lays out rows of decoded shards (opdcache/training/decoded.py ``DecodedShard``: their flat per-token
buffers and row offsets) as one sequence with its position ids and offsets, every per-token column flat;
:func:`unpack` gives a flat column back as the padded [B, T] of the padded loader. Memory: the batch's tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from opdcache.format import shards
from opdcache.stores import signal_columns

BIT_COLUMNS = tuple("teacher_" + name for name in signal_columns("vectors"))
"""Columns of 16-bit (or float32) vectors: batched as their stored bits, a typed tensor of the stored dtype."""


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of arange(s, s + n) over (starts, lengths), without a Python loop: int64 [sum(lengths)]."""
    lengths = lengths.astype(np.int64)
    ends = np.cumsum(lengths)
    return np.repeat(starts.astype(np.int64) - (ends - lengths), lengths) + np.arange(int(ends[-1]) if len(ends) else 0)


def _as_tensor(values: np.ndarray) -> torch.Tensor:
    import warnings

    if values.flags.writeable:
        return torch.from_numpy(values)
    with warnings.catch_warnings():  # views of read-only Arrow buffers: a packed batch's tensors are read-only
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(values)


def collate_packed(runs: list[tuple]) -> dict[str, torch.Tensor]:
    """A batch's rows as one packed sequence, no padding anywhere: ``runs`` are its rows in batch order as runs of one
    decoded shard each, (``DecodedShard``, row indices) (the loader's batches: opdcache/training/data.py).

    Shapes (B sequences, N = their prompt + response tokens, R = their response tokens): input_ids [1, N] (each
    sequence's prompt then response, one after another), position_ids [1, N] (restarting at 0 for each sequence: a
    model given them with no attention mask attends within each sequence only), cu_seqlens [B + 1] int32 (where each
    sequence starts in input_ids, flash-attention's varlen layout), response_ids [R], logit_positions [R] (index in
    input_ids of the position whose logits predict each response token), sequence_index [R] (the sequence each
    response token belongs to), cu_response [B + 1] (where each sequence's response tokens start), then every
    per-token column flat as [R] or [R, k] in its stored dtype (ids stay int32; hidden and svd vectors their stored
    dtype).

    Zero-copy where the layout allows: a run of consecutive rows (the loader with ``shuffle=False``) gives every
    per-token column as a view of the shard's decoded Arrow buffers (read-only); rows apart are taken with one
    vectorised ``np.take`` a column, and nothing here loops over rows in Python. input_ids interleave prompts and
    responses, so they are always built. Memory: the batch's tokens, never the longest row times the batch size."""
    first = runs[0][0]
    names = [name for name in first.cols if name not in ("prompt_ids", "response_ids")]
    parts: dict[str, list[np.ndarray]] = {name: [] for name in ["response_ids"] + names}
    prompt_parts, n_parts, p_parts = [], [], []
    for d, idx in runs:
        idx = np.asarray(idx, np.int64)
        a, b = d.offsets[idx], d.offsets[idx + 1]
        p0, p1 = d.prompt_offsets[idx], d.prompt_offsets[idx + 1]
        if idx[-1] - idx[0] == len(idx) - 1 and bool((np.diff(idx) == 1).all()):  # a run is a view of each column
            for name in parts:
                parts[name].append(d.cols[name][int(a[0]): int(b[-1])])
        else:  # rows apart: one take a column
            take = _ranges(a, b - a)
            for name in parts:
                parts[name].append(np.take(d.cols[name], take, axis=0))
        prompt_parts.append(d.cols["prompt_ids"][_ranges(p0, p1 - p0)])
        n_parts.append(b - a)
        p_parts.append(p1 - p0)
    n, prompt = np.concatenate(n_parts), np.concatenate(p_parts)
    seq, B = n + prompt, len(n)
    cu_seqlens, cu_response = np.zeros(B + 1, np.int64), np.zeros(B + 1, np.int64)
    np.cumsum(seq, out=cu_seqlens[1:])
    np.cumsum(n, out=cu_response[1:])
    flat = {name: v[0] if len(v) == 1 else np.concatenate(v) for name, v in parts.items()}
    prompts = prompt_parts[0] if len(prompt_parts) == 1 else np.concatenate(prompt_parts)
    N = int(cu_seqlens[-1])
    position_ids = np.arange(N) - np.repeat(cu_seqlens[:-1], seq)
    response = position_ids >= np.repeat(prompt, seq)  # each sequence's prompt, then its response
    input_ids = np.empty(N, np.int64)
    input_ids[~response] = prompts
    input_ids[response] = flat["response_ids"]
    batch = {"input_ids": torch.from_numpy(input_ids[None]),
             "position_ids": torch.from_numpy(position_ids[None]),
             "cu_seqlens": torch.from_numpy(cu_seqlens.astype(np.int32)),
             "response_ids": torch.from_numpy(flat["response_ids"].astype(np.int64)),
             "logit_positions": torch.from_numpy(np.flatnonzero(response) - 1),
             "sequence_index": torch.from_numpy(np.repeat(np.arange(B), n)),
             "cu_response": torch.from_numpy(cu_response)}
    for name in names:
        if name in BIT_COLUMNS:
            batch[name] = shards.hidden_to_torch(flat[name], first.vector_dtypes.get(name) or "float32")
        else:
            batch[name] = _as_tensor(flat[name])
    return batch


def unpack(batch: dict[str, torch.Tensor], name: str, fill=0) -> torch.Tensor:
    """A packed batch's flat per-token column [R, ...] as the padded [B, T, ...] of :func:`collate_decoded` (for a
    consumer that needs padding; memory B x T)."""
    cu = batch["cu_response"]
    n = cu[1:] - cu[:-1]
    values = batch[name]
    out = values.new_full((len(n), max(1, int(n.max()) if len(n) else 1)) + tuple(values.shape[1:]), fill)
    t = torch.arange(len(values)) - torch.repeat_interleave(cu[:-1], n)
    out[batch["sequence_index"], t] = values
    return out


def split_batch(batch: dict[str, torch.Tensor], max_tokens: int) -> list[dict[str, torch.Tensor]]:
    """A batch (padded or packed) cut into consecutive groups of rows of at most ``max_tokens`` prompt + response tokens
    each (a row longer than that alone), every group laid out as the batch is: a padded group cropped to its own longest
    row, a packed group sliced from the flat buffers with its offsets rebased. ``train --max-batch-tokens`` runs one
    forward and backward a group. Memory: the views, and the cropped copies of a padded batch's columns."""
    packed = "cu_seqlens" in batch
    if packed:
        cu = batch["cu_seqlens"].long()
        seq = (cu[1:] - cu[:-1]).tolist()
    else:
        seq = batch["attention_mask"].sum(1).tolist()
    groups, start, used = [], 0, 0
    for i, n in enumerate(seq):
        if i > start and used + n > max_tokens:
            groups.append((start, i))
            start, used = i, 0
        used += n
    groups.append((start, len(seq)))
    if len(groups) == 1:
        return [batch]
    return [_packed_rows(batch, a, b) if packed else _padded_rows(batch, a, b) for a, b in groups]


def _padded_rows(batch: dict, a: int, b: int) -> dict:
    L = int(batch["attention_mask"][a:b].sum(1).max())
    T = max(1, int(batch["response_mask"][a:b].sum(1).max()))
    out = {}
    for name, v in batch.items():
        if name in ("input_ids", "attention_mask"):
            out[name] = v[a:b, :L]
        else:  # [B, T, ...]
            out[name] = v[a:b, :T]
    return out


def _packed_rows(batch: dict, a: int, b: int) -> dict:
    cu, cr = batch["cu_seqlens"].long(), batch["cu_response"].long()
    t0, t1, r0, r1 = int(cu[a]), int(cu[b]), int(cr[a]), int(cr[b])
    out = {}
    for name, v in batch.items():
        if name in ("input_ids", "position_ids"):
            out[name] = v[:, t0:t1]
        elif name == "cu_seqlens":
            out[name] = (v[a:b + 1] - t0).to(v.dtype)
        elif name == "cu_response":
            out[name] = v[a:b + 1] - r0
        elif name == "logit_positions":
            out[name] = v[r0:r1] - t0
        elif name == "sequence_index":
            out[name] = v[r0:r1] - a
        else:  # a flat per-token column
            out[name] = v[r0:r1]
    return out
