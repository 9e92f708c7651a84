"""``opdcache validate``'s check of a store whose vectors rebuild the stored log-probs exactly (``Store.rebuilds``:
the hidden states): every stored log-prob rebuilt from the stored vector and the head in the store's side file
(``head.safetensors``), within the rounding of the stored dtype."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from opdcache.errors import SchemaError
from opdcache.format import shards


def check_rebuilt(store, root: Path, file: str, entry: dict, response: np.ndarray, logprobs: np.ndarray, offsets: np.ndarray,
                  lengths: np.ndarray, out) -> None:
    """Reconstruct T_t = log_softmax(vector @ W.T + b)[a_t] from the stored vectors and head; compare, within
    ``store.rebuilds[stored dtype]``. The vectors' column is read one row group at a time and each block streamed over
    vocabulary slices: memory grows with one row group of vectors and a [1024, 8192] logit block, never with tokens x
    vocabulary. ``out``: validate's collector (``add(file, message)``, ``rows(file, column, rows, message)``)."""
    import torch

    from opdcache.stores.head import load_head, token_logprobs_from_hidden

    column = next(c for c in store.columns if c.shape == "token_vector")
    head_path = root / Path(file).parent / store.side_file
    if not head_path.is_file():
        out.add(file, f"{store.name} store without {store.side_file} next to it")
        return
    try:
        head = load_head(head_path)
    except SchemaError as exc:
        out.add(file, f"cannot check the {column.name} vectors: {exc}")
        return
    width, vocab = entry["params"].get(column.width), entry["config"].get("vocab_size")
    if (width is not None and head.weight.shape[1] != width) or (vocab is not None and head.vocab_size != vocab):
        out.add(file, f"{store.side_file} holds a [{head.vocab_size}, {head.weight.shape[1]}] matrix where the table's vocabulary "
                      f"and its {column.name} vectors need [{vocab}, {width}]; score the teacher again")
        return
    pf = shards.open_parquet(root / file)
    dtype = shards.hidden_dtype_of(pf.schema_arrow.field(column.name))
    tol = store.rebuilds[dtype]
    rebuilt = np.empty(len(logprobs), dtype=np.float32)
    in_vocab = (response >= 0) & (response < head.vocab_size)  # ids outside are reported with the rollouts; skip them here
    ids_all = np.where(in_vocab, response, 0).astype(np.int64)
    at, row = 0, 0
    for group in range(pf.num_row_groups):
        values = pf.read_row_group(group, [column.name])[column.name]
        got = np.diff(shards.list_offsets(values))
        bad = np.flatnonzero(got != lengths[row: row + len(got)])
        if len(bad):
            out.rows(file, column.name, bad + row, "not as long as the responses (per-token column length differs from the number of response tokens)")
            return
        row += len(got)
        hidden = shards.hidden_to_torch(shards.token_values(values), dtype)
        n = hidden.shape[0]
        rebuilt[at: at + n] = token_logprobs_from_hidden(hidden, head, torch.from_numpy(ids_all[at: at + n])).numpy()
        at += n
    bad = (np.abs(rebuilt - logprobs) > tol) & in_vocab
    if bad.any():
        worst = float(np.abs(rebuilt - logprobs)[in_vocab].max())
        out.rows(file, column.name, np.searchsorted(offsets, np.flatnonzero(bad), side="right") - 1,
                 f"log-prob rebuilt from the {column.name} vectors and head differs from the stored log-prob (max |diff| {worst:.2e} > {tol} for {dtype})")
