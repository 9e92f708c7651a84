"""Bytes per token of each store on a realistic shape, against the raw uncompressed size, in one run.

Shape: vocabulary 151,936 (Qwen3), hidden 4,096 (bf16), top-k 20 and 128, SVD rank 512.
Data is synthetic but shaped like a real LM's: logits = Zipf prior over the vocabulary (BPE vocabularies
are roughly frequency-ordered) + a low-rank context term, scaled to a typical mean entropy; hidden states
are bf16 with per-dimension log-normal scales (a few outlier dimensions, as post-norm states have).

For each store it prints the raw size (fixed-width values, no compression), and the size written by
opdcache's writer (BYTE_STREAM_SPLIT for floats + zstd), next to two alternatives measured the same way:
PLAIN + zstd (Parquet's plain default) and PLAIN + snappy. Run:

    python benchmarks/bench_storage.py [--tokens 4096]
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from opdcache import schema as S
from opdcache import shards

V, H = 151_936, 4096


def synthetic_teacher(tokens: int, seq_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prior = -1.2 * torch.log(torch.arange(V, dtype=torch.float32) + 20.0)
    basis = torch.randn(64, V, generator=g) * 0.9
    rows = []
    entropies = []
    for start in range(0, tokens, seq_len):
        T = min(seq_len, tokens - start)
        ctx = torch.randn(T, 64, generator=g)
        logits = prior + ctx @ basis  # [T, V]
        logits *= 1.6
        lse = torch.logsumexp(logits, -1)
        logp = logits - lse[:, None]
        entropies.append(float(-(logp.exp() * logp).sum(-1).mean()))
        sampled = torch.multinomial(logp.exp(), 1, generator=g).squeeze(1)
        top128_lp, top128_ids = logp.topk(128, -1)
        scale = torch.exp(torch.randn(H, generator=g) * 0.7)
        hidden = (torch.randn(T, H, generator=g) * scale).to(torch.bfloat16)
        rows.append(dict(
            id=f"row-{start}", logprobs=logp.gather(1, sampled[:, None]).squeeze(1).numpy(), logsumexp=lse.numpy(),
            top128_ids=top128_ids.numpy().astype(np.int32), top128_lp=top128_lp.numpy(),
            hidden=shards.hidden_to_numpy(hidden), svd=(torch.randn(T, 512, generator=g) * 3).numpy(),
        ))
        del logits, logp
    return rows, float(np.mean(entropies))


def teacher_records(rows, k: int | None, with_hidden: bool, with_svd: bool):
    out = []
    for r in rows:
        rec = {"id": r["id"], "logprobs": r["logprobs"], "logsumexp": r["logsumexp"]}
        if k:
            rec["topk_ids"], rec["topk_logprobs"] = r["top128_ids"][:, :k], r["top128_lp"][:, :k]
        if with_hidden:
            rec["hidden"] = r["hidden"]
        if with_svd:
            rec["svd"] = r["svd"]
        out.append(rec)
    return out


def column_bytes(data: bytes) -> dict[str, int]:
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    sizes: dict[str, int] = {}
    for rg in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            col = meta.row_group(rg).column(c)
            name = col.path_in_schema.split(".")[0]
            sizes[name] = sizes.get(name, 0) + col.total_compressed_size
    return sizes


def write_variant(table, variant: str) -> bytes:
    buf = io.BytesIO()
    if variant == "plain+zstd":
        pq.write_table(table, buf, compression="zstd", compression_level=shards.COMPRESSION_LEVEL, use_dictionary=False, write_statistics=False)
    elif variant == "plain+snappy":
        pq.write_table(table, buf, compression="snappy", use_dictionary=False, write_statistics=False)
    else:
        raise ValueError(variant)
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    rows, entropy = synthetic_teacher(args.tokens, args.seq_len)
    n = args.tokens
    print(f"{n} tokens in rows of {args.seq_len}; vocabulary {V:,}, hidden {H}; mean teacher entropy {entropy:.2f} nats\n")
    stores = {  # store -> (params, columns belonging to it, raw bytes per token)
        "logprob": (S.StoreParams(stores=("logprob",)), ["logprobs", "logsumexp"], 8),
        "topk k=20": (S.StoreParams(stores=("logprob", "topk"), top_k=20), ["topk_ids", "topk_logprobs"], 20 * 8),
        "topk k=128": (S.StoreParams(stores=("logprob", "topk"), top_k=128), ["topk_ids", "topk_logprobs"], 128 * 8),
        "hidden bf16": (S.StoreParams(stores=("logprob", "hidden"), hidden_size=H, hidden_dtype="bfloat16"), ["hidden"], H * 2),
        "svd r=512": (S.StoreParams(stores=("logprob", "svd"), svd_rank=512), ["svd"], 512 * 4),
    }
    header = f"{'store':<13} {'raw B/tok':>10} {'opdcache B/tok':>15} {'ratio':>7} {'plain+zstd':>11} {'plain+snappy':>13}"
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for name, (params, cols, raw) in stores.items():
            k = params.top_k if "topk" in params.stores else None
            records = teacher_records(rows, k, "hidden" in params.stores, "svd" in params.stores)
            table = shards.build_table("teacher", params, records)
            info = shards.write_table_atomic(table, Path(tmp) / f"{name.replace(' ', '_')}.parquet", tmp)
            ours = column_bytes((Path(tmp) / info.path).read_bytes())
            alt = {v: column_bytes(write_variant(table, v)) for v in ("plain+zstd", "plain+snappy")}
            per = lambda sizes: sum(sizes[c] for c in cols) / n  # noqa: E731
            print(f"{name:<13} {raw:>10,.0f} {per(ours):>15,.1f} {raw / per(ours):>6.2f}x {per(alt['plain+zstd']):>11,.1f} {per(alt['plain+snappy']):>13,.1f}")
    print(f"\nfull logits for reference: {V * 2:,} B/token raw in bf16, {V * 4:,} in float32")
    print("DistillKit's published figure for top-k at k=128: ~300 B/token")


if __name__ == "__main__":
    main()
