"""Training batches per second from a cache: opdcache's loader against datasets + DataLoader, in one run.

Cache: synthetic, written with opdcache's writer -- ROWS rollouts of 64-token prompts and 100-400-token
responses (vocabulary 151,936), with one teacher's logprob and top-k (k=20) stores.
Both sides deliver the same padded tensors per batch (input ids, masks, response ids, teacher log-probs,
teacher top-k ids and log-probs) for one full epoch with batch size 32 and no worker processes:

* opdcache: ``CacheLoader`` (flat numpy buffers per shard, sliced per row; each shard's sha256, id alignment and
  lengths checked once per process; decoded shards kept across epochs up to ``keep_decoded_bytes``, 1 GiB);
* baseline: ``datasets.load_dataset(<cache>, "rollouts")`` and ``(<cache>, "teacher-t")`` joined column-wise,
  ``.with_format("torch")``, a ``torch.utils.data.DataLoader`` and an equivalent padding collate;
* hand-written Arrow: the fair baseline, yielding the same 11 tensors as opdcache's loader (prompt + response ids and
  masks, logit positions, sampling and ref log-probs, the teacher's log-probs, logsumexp and top-k) -- what a careful
  user writes with pyarrow alone: each shard pair read with
  ``pq.read_table``, list columns flattened to numpy once per shard (values + offsets), rows sliced and padded with
  numpy per batch. It checks nothing (no sha256, no id alignment, no lengths), which opdcache's loader does once per
  shard and process.

    python benchmarks/bench_loader.py [--rows 4000]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from opdcache import schema as S
from opdcache.cache import TableJob, finalize_table, run_table_job

V, K, SHARDS = 151_936, 20, 8


def build(root: Path, rows: int) -> None:
    rng = np.random.default_rng(0)
    per = rows // SHARDS

    def rollout(i):
        out = []
        for r in range(per):
            T = int(rng.integers(100, 400))
            out.append(dict(id=f"{i}-{r}", prompt_index=i * per + r, sample_index=0, prompt_ids=rng.integers(0, V, 64).astype(np.int32),
                            response_ids=rng.integers(0, V, T).astype(np.int32), finish_reason="stop",
                            sampling_logprobs=-rng.random(T).astype(np.float32), ref_logprobs=-rng.random(T).astype(np.float32)))
        return out

    data = {i: rollout(i) for i in range(SHARDS)}
    job = TableJob(root, "rollouts", "rollouts", S.StoreParams(stores=("base",)), {"bench": True}, SHARDS)
    run_table_job(job, lambda i: data[i])
    finalize_table(job, tokenizer={"fingerprint": "0" * 64})
    tjob = TableJob(root, "teachers/t", "teacher", S.StoreParams(stores=("logprob", "topk"), top_k=K), {"bench": True}, SHARDS,
                    parent_fingerprint=job.fingerprint)

    def teacher(i):
        out = []
        for row in data[i]:
            T = len(row["response_ids"])
            lp = -np.sort(rng.random((T, K)).astype(np.float32) * 10, axis=1)
            out.append(dict(id=row["id"], logprobs=-rng.random(T).astype(np.float32), logsumexp=rng.random(T).astype(np.float32),
                            topk_ids=rng.integers(0, V, (T, K)).astype(np.int32), topk_logprobs=lp))
        return out

    run_table_job(tjob, teacher)
    finalize_table(tjob, model={"name_or_path": "bench", "fingerprint": "1" * 64})


def pad_collate(rows: list[dict]) -> dict:
    """The baseline's collate: the same tensors CacheLoader yields, from per-row torch tensors."""
    B = len(rows)
    T = max(len(r["response_ids"]) for r in rows)
    L = max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    out = {"input_ids": torch.zeros(B, L, dtype=torch.long), "attention_mask": torch.zeros(B, L, dtype=torch.long),
           "response_ids": torch.zeros(B, T, dtype=torch.long), "response_mask": torch.zeros(B, T),
           "teacher_logprobs": torch.zeros(B, T), "teacher_topk_ids": torch.zeros(B, T, K, dtype=torch.long),
           "teacher_topk_logprobs": torch.zeros(B, T, K)}
    for i, r in enumerate(rows):
        p, resp = r["prompt_ids"], r["response_ids"]
        n = len(p) + len(resp)
        out["input_ids"][i, : len(p)] = p
        out["input_ids"][i, len(p): n] = resp
        out["attention_mask"][i, :n] = 1
        out["response_ids"][i, : len(resp)] = resp
        out["response_mask"][i, : len(resp)] = 1
        out["teacher_logprobs"][i, : len(resp)] = r["logprobs"]
        out["teacher_topk_ids"][i, : len(resp)] = r["topk_ids"]
        out["teacher_topk_logprobs"][i, : len(resp)] = r["topk_logprobs"]
    return out


def run_opdcache(root: Path, bs: int, epochs: int = 2) -> list[tuple[int, float]]:
    """Epochs of one CacheLoader (a training run iterates the same loader): (tokens, seconds) per epoch."""
    from opdcache.data import CacheLoader, CacheLoaderConfig

    loader = CacheLoader(CacheLoaderConfig(cache=root, teacher="t", stores=("logprob", "topk"), batch_size=bs))
    out = []
    for _ in range(epochs):
        t0, tokens = time.perf_counter(), 0
        for b in loader:
            tokens += int(b["response_mask"].sum())
        out.append((tokens, time.perf_counter() - t0))
    return out


def run_datasets(root: Path, bs: int) -> tuple[int, float]:
    import datasets

    t0 = time.perf_counter()
    r = datasets.load_dataset(str(root), "rollouts", split="train").select_columns(["prompt_ids", "response_ids"])
    t = datasets.load_dataset(str(root), "teacher-t", split="train").select_columns(["logprobs", "topk_ids", "topk_logprobs"])
    ds = datasets.concatenate_datasets([r, t], axis=1).with_format("torch")
    loader = torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=True, collate_fn=pad_collate,
                                         generator=torch.Generator().manual_seed(0))
    tokens = 0
    for b in loader:
        tokens += int(b["response_mask"].sum())
    return tokens, time.perf_counter() - t0


def run_arrow(root: Path, bs: int) -> tuple[int, float]:
    """The hand-written pyarrow loader: same shards, same per-shard shuffling, same padded tensors."""
    import json

    import pyarrow.parquet as pq

    manifest = json.loads((root / "opdcache.json").read_text())
    r_paths = [root / s["path"] for s in manifest["tables"]["rollouts"]["shards"]]
    t_paths = [root / s["path"] for s in manifest["tables"]["teachers/t"]["shards"]]

    def flat(col, depth: int):
        """(values, offsets) of a list column (depth 2: the inner lists are flattened into the values too)."""
        arr = col.combine_chunks()
        offsets = arr.offsets.to_numpy()
        values = arr.flatten()
        if depth == 2:
            values = values.flatten()
        return values.to_numpy(zero_copy_only=False), offsets

    t0, tokens = time.perf_counter(), 0
    rng = np.random.default_rng(0)
    for rp, tp in zip(r_paths, t_paths):
        r = pq.read_table(rp, columns=["prompt_ids", "response_ids", "sampling_logprobs", "ref_logprobs"])
        t = pq.read_table(tp, columns=["logprobs", "logsumexp", "topk_ids", "topk_logprobs"])
        (pv, po), (rv, ro) = flat(r["prompt_ids"], 1), flat(r["response_ids"], 1)
        (sv, _), (refv, _) = flat(r["sampling_logprobs"], 1), flat(r["ref_logprobs"], 1)
        (lv, _), (lsev, _) = flat(t["logprobs"], 1), flat(t["logsumexp"], 1)
        (kv, _), (klv, _) = flat(t["topk_ids"], 2), flat(t["topk_logprobs"], 2)
        order = rng.permutation(r.num_rows)
        for a in range(0, len(order), bs):
            idx = order[a: a + bs]
            B = len(idx)
            lens_p, lens_r = po[idx + 1] - po[idx], ro[idx + 1] - ro[idx]
            T, L = int(lens_r.max()), int((lens_p + lens_r).max())
            ids, att = np.zeros((B, L), np.int64), np.zeros((B, L), np.int64)
            resp, rmask, pos = np.zeros((B, T), np.int64), np.zeros((B, T), np.float32), np.zeros((B, T), np.int64)
            samp, ref, tl, lse = (np.zeros((B, T), np.float32) for _ in range(4))
            tk, tkl = np.zeros((B, T, K), np.int64), np.zeros((B, T, K), np.float32)
            for i, j in enumerate(idx):
                p, a, b = pv[po[j]: po[j + 1]], ro[j], ro[j + 1]
                n = b - a
                ids[i, : len(p)], ids[i, len(p): len(p) + n], att[i, : len(p) + n] = p, rv[a:b], 1
                resp[i, :n], rmask[i, :n], pos[i, :n] = rv[a:b], 1, len(p) - 1 + np.arange(n)
                samp[i, :n], ref[i, :n], tl[i, :n], lse[i, :n] = sv[a:b], refv[a:b], lv[a:b], lsev[a:b]
                tk[i, :n] = kv[a * K: b * K].reshape(n, K)
                tkl[i, :n] = klv[a * K: b * K].reshape(n, K)
            batch = {k: torch.from_numpy(v) for k, v in dict(
                input_ids=ids, attention_mask=att, response_ids=resp, response_mask=rmask, logit_positions=pos, sampling_logprobs=samp,
                ref_logprobs=ref, teacher_logprobs=tl, teacher_logsumexp=lse, teacher_topk_ids=tk, teacher_topk_logprobs=tkl).items()}
            tokens += int(batch["response_mask"].sum())
    return tokens, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as hf_cache:
        os.environ["HF_DATASETS_CACHE"] = hf_cache  # a cold datasets cache, as a first epoch has
        root = Path(tmp) / "cache"
        build(root, args.rows)
        (a_tokens, a_s), (a2_tokens, a2_s) = run_opdcache(root, args.batch_size)
        b_tokens, b_s = run_datasets(root, args.batch_size)
        assert a_tokens == b_tokens, (a_tokens, b_tokens)
        b2_tokens, b2_s = run_datasets(root, args.batch_size)
        c_tokens, c_s = run_arrow(root, args.batch_size)
        c2_tokens, c2_s = run_arrow(root, args.batch_size)
        assert c_tokens == a_tokens == a2_tokens == c2_tokens, (c_tokens, a_tokens, a2_tokens, c2_tokens)
    print(f"{args.rows} rows, {a_tokens:,} response tokens, batch {args.batch_size}, top-k {K}, one epoch\n")
    print(f"{'loader':<28} {'epoch 1 tok/s':>14} {'epoch 2 tok/s':>14}")
    print(f"{'opdcache CacheLoader':<28} {a_tokens / a_s:>14,.0f} {a2_tokens / a2_s:>14,.0f}")
    print(f"{'datasets + DataLoader':<28} {b_tokens / b_s:>14,.0f} {b2_tokens / b2_s:>14,.0f}")
    print(f"{'hand-written pyarrow':<28} {c_tokens / c_s:>14,.0f} {c2_tokens / c2_s:>14,.0f}")
    print(f"{'ratio vs datasets':<28} {(a_tokens / a_s) / (b_tokens / b_s):>13.1f}x {(a2_tokens / a2_s) / (b2_tokens / b2_s):>13.1f}x")
    print(f"{'ratio vs hand-written':<28} {(a_tokens / a_s) / (c_tokens / c_s):>13.2f}x {(a2_tokens / a2_s) / (c2_tokens / c2_s):>13.2f}x")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("(epoch 1 of the baseline includes datasets' one-time conversion into its cache; epoch 2 does not)")


if __name__ == "__main__":
    main()
