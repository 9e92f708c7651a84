"""Training batches per second from a cache: opdcache's loader against datasets + DataLoader, in one run.

Cache: synthetic, written with opdcache's writer -- ROWS rollouts of 64-token prompts and 100-400-token
responses (vocabulary 151,936), with one teacher's logprob and top-k (k=20) stores.
Both sides deliver the same padded tensors per batch (input ids, masks, response ids, teacher log-probs,
teacher top-k ids and log-probs) for one full epoch with batch size 32 and no worker processes:

* opdcache: ``CacheLoader`` (flat numpy buffers per shard, sliced per row);
* baseline: ``datasets.load_dataset(<cache>, "rollouts")`` and ``(<cache>, "teacher-t")`` joined column-wise,
  ``.with_format("torch")``, a ``torch.utils.data.DataLoader`` and an equivalent padding collate.

    python benchmarks/bench_loader.py [--rows 4000]
"""

from __future__ import annotations

import argparse
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


def run_opdcache(root: Path, bs: int) -> tuple[int, float]:
    from opdcache.data import CacheLoader, CacheLoaderConfig

    loader = CacheLoader(CacheLoaderConfig(cache=root, teacher="t", stores=("logprob", "topk"), batch_size=bs))
    t0, tokens = time.perf_counter(), 0
    for b in loader:
        tokens += int(b["response_mask"].sum())
    return tokens, time.perf_counter() - t0


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as hf_cache:
        import os

        os.environ["HF_DATASETS_CACHE"] = hf_cache  # a cold datasets cache, as a first epoch has
        root = Path(tmp) / "cache"
        build(root, args.rows)
        a_tokens, a_s = run_opdcache(root, args.batch_size)
        b_tokens, b_s = run_datasets(root, args.batch_size)
        assert a_tokens == b_tokens, (a_tokens, b_tokens)
        a2_tokens, a2_s = run_opdcache(root, args.batch_size)
        b2_tokens, b2_s = run_datasets(root, args.batch_size)
    print(f"{args.rows} rows, {a_tokens:,} response tokens, batch {args.batch_size}, top-k {K}, one epoch\n")
    print(f"{'loader':<28} {'epoch 1 tok/s':>14} {'epoch 2 tok/s':>14}")
    print(f"{'opdcache CacheLoader':<28} {a_tokens / a_s:>14,.0f} {a2_tokens / a2_s:>14,.0f}")
    print(f"{'datasets + DataLoader':<28} {b_tokens / b_s:>14,.0f} {b2_tokens / b2_s:>14,.0f}")
    print(f"{'ratio':<28} {(a_tokens / a_s) / (b_tokens / b_s):>13.1f}x {(a2_tokens / a2_s) / (b2_tokens / b2_s):>13.1f}x")
    print("(epoch 1 of the baseline includes datasets' one-time conversion into its cache; epoch 2 does not)")


if __name__ == "__main__":
    main()
