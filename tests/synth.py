"""Synthetic but internally consistent caches for tests: no model needed.

Teacher values come from a random head and random hidden states, so log-probs, logsumexp, top-k and the
hidden-state reconstruction all agree exactly as a real teacher's would.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from opdcache.format import schema as S
from opdcache.format.cache import finalize_table, run_table_job, TableJob
from opdcache.stores.head import Head, save_head
from opdcache.format.shards import hidden_to_numpy
from opdcache.inputs.fingerprint import row_id

VOCAB, HIDDEN = 50, 16
TOKENIZER = {"fingerprint": "a" * 64, "name_or_path": "synthetic", "chat_template_sha256": None}
MODEL = {"name_or_path": "synthetic-teacher", "fingerprint": "b" * 64, "dtype": "float32", "engine": "synthetic"}


def _topk(logp: torch.Tensor, k: int):
    vals, ids = logp.topk(k, dim=-1)
    return ids.numpy().astype(np.int32), vals.numpy()


def rollout_rows(shard: int, n_rows: int = 6, ref_top_k: int = 4, mc: int = 3, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed * 1000 + shard)
    rows = []
    for r in range(n_rows):
        prompt = torch.randint(0, VOCAB, (3 + r % 5,), generator=g).numpy().astype(np.int32)  # prompts of 3-7 tokens
        T = int(torch.randint(1, 12, (1,), generator=g))
        logp = torch.log_softmax(torch.randn(T, VOCAB, generator=g) * 2, -1)
        resp = torch.multinomial(logp.exp(), 1, generator=g).squeeze(1)
        mc_ids = torch.multinomial(logp.exp(), mc, replacement=True, generator=g)
        ids, vals = _topk(logp, ref_top_k)
        lp = logp.gather(1, resp[:, None]).squeeze(1).numpy()
        pi = shard * n_rows + r
        rows.append(dict(
            id=row_id(prompt, 0) + f"s{pi}", prompt_index=pi, sample_index=0, prompt_ids=prompt,
            response_ids=resp.numpy().astype(np.int32), finish_reason="stop" if r % 2 else "length",
            sampling_logprobs=lp, ref_logprobs=lp, ref_topk_ids=ids, ref_topk_logprobs=vals,
            mc_ids=mc_ids.numpy().astype(np.int32), mc_sampling_logprobs=logp.gather(1, mc_ids).numpy(),
            answer=str(pi), reward=float(r % 2), metadata='{"k": 1}',
        ))
    return rows


def teacher_rows(rollouts: list[dict], head: Head, hidden_dtype: str, top_k: int = 5, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed + 7)
    out = []
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[hidden_dtype]
    for row in rollouts:
        T = len(row["response_ids"])
        hidden = torch.randn(T, HIDDEN, generator=g).to(torch_dtype)
        logits = hidden.float() @ head.weight.float().T
        lse = torch.logsumexp(logits, -1)
        logp = logits - lse[:, None]
        resp = torch.from_numpy(row["response_ids"].astype(np.int64))
        ids, vals = _topk(logp, top_k)
        out.append(dict(
            id=row["id"], logprobs=logp.gather(1, resp[:, None]).squeeze(1).clamp(max=0).numpy(), logsumexp=lse.numpy(),
            ref_topk_logprobs=logp.gather(1, torch.from_numpy(row["ref_topk_ids"].astype(np.int64))).numpy(),
            mc_logprobs=logp.gather(1, torch.from_numpy(row["mc_ids"].astype(np.int64))).numpy(),
            topk_ids=ids, topk_logprobs=vals, hidden=hidden_to_numpy(hidden),
        ))
    return out


def make_cache(root: Path, num_shards: int = 3, hidden_dtype: str = "bfloat16", rows: int = 6) -> Path:
    root = Path(root)
    rparams = S.StoreParams(stores=("base", "ref_topk", "mc", "task"), ref_top_k=4, mc_samples=3)
    job = TableJob(root, "rollouts", "rollouts", rparams, {"vocab_size": VOCAB, "synthetic": True}, num_shards)
    data = {i: rollout_rows(i, rows) for i in range(num_shards)}
    run_table_job(job, lambda i: data[i])
    finalize_table(job, tokenizer=TOKENIZER)
    head = Head(torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(3)), None)
    tparams = S.StoreParams(stores=("logprob", "topk", "hidden"), top_k=5, ref_top_k=4, mc_samples=3,
                            hidden_size=HIDDEN, hidden_dtype=hidden_dtype)
    tjob = TableJob(root, "teachers/synth", "teacher", tparams, {"vocab_size": VOCAB, "teacher": "synth"}, num_shards,
                    parent_fingerprint=job.fingerprint)
    tjob.begin()  # the job's record first: a new table's folder holds only what its job wrote
    save_head(head, root / "teachers/synth/head.safetensors")
    run_table_job(tjob, lambda i: teacher_rows(data[i], head, hidden_dtype))
    finalize_table(tjob, model=MODEL)
    return root
