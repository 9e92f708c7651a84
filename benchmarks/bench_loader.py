"""Training batches per second from a cache: opdcache's loader against datasets + DataLoader, in one run.

Cache: synthetic, written with opdcache's writer -- ROWS rollouts of 64-token prompts and 100-399-token
responses (``--response-tokens``; 8,48 for short rollouts such as the demo's; vocabulary 151,936), with one teacher's logprob and top-k (k=20) stores.
The padded sides deliver the same padded tensors per batch (input ids, masks, response ids, teacher log-probs,
teacher top-k ids and log-probs) for one full epoch with batch size 32 and no worker processes; the packed side the
same rows and values without padding (``pack=True``: what a padding-free trainer reads, the same information):

* opdcache: ``CacheLoader`` (flat numpy buffers per shard, sliced per row; each shard's sha256, id alignment and
  lengths checked once per process; decoded shards kept across epochs up to ``keep_decoded_bytes``, 1 GiB);
* baseline: ``datasets.load_dataset(<cache>, "rollouts")`` and ``(<cache>, "teacher-t")`` joined column-wise,
  ``.with_format("torch")``, a ``torch.utils.data.DataLoader`` and an equivalent padding collate;
* hand-written Arrow (the baseline): the 11 tensors opdcache's loader yields, from what a careful user writes with
  pyarrow alone, keeping its decoded arrays across epochs as opdcache's loader keeps its shards (:class:`HandLoader`);
  on the cold epoch a second row runs it in a process that has imported pandas already: pyarrow's ``to_numpy``
  imports pandas on first use, which opdcache's loader avoids, and that row says how much of the difference it is.

Measured with benchmarks/harness.py, cold (the loader built inside the timed epoch) and warm (after one untimed
epoch), interleaved rounds, each run its own process with glibc's mmap threshold raised as a freed large array leaves
it (``setup``; ``--loader-only-process`` leaves it as a process that only loads):

    python benchmarks/bench_loader.py [--rows 4000 --rounds 3 --batch-size 32 --response-tokens 100,400] [--no-datasets]
        [--loader-only-process]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from opdcache.format import schema as S
from opdcache.format.cache import finalize_table, run_table_job, TableJob

V, K, SHARDS = 151_936, 20, 8


def build(root: Path, rows: int, lengths: tuple[int, int] = (100, 400)) -> None:
    rng = np.random.default_rng(0)
    per = rows // SHARDS

    def rollout(i):
        out = []
        for r in range(per):
            T = int(rng.integers(*lengths))
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
            x = rng.random((T, K + 1)) * 10  # a valid top-k: K log-probs of a distribution with one more bin, descending
            lp = -np.sort(-(x - np.log(np.exp(x).sum(1, keepdims=True))), axis=1)[:, :K].astype(np.float32)
            out.append(dict(id=row["id"], logprobs=-rng.random(T).astype(np.float32), logsumexp=rng.random(T).astype(np.float32),
                            topk_ids=((rng.integers(0, V, (T, 1)) + np.arange(K) * 7919) % V).astype(np.int32),  # distinct
                            topk_logprobs=lp))
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


class HandLoader:
    """The competent baseline: what a careful user writes with pyarrow alone, keeping what it decoded. Each shard
    pair read with ``pq.read_table`` once, its list columns flattened to numpy (values + offsets) and kept for later
    epochs; rows shuffled per shard, sliced and padded with numpy per batch into the same 11 tensors as opdcache's
    loader. It checks nothing (no sha256, no id alignment, no lengths), which opdcache's loader does once per shard."""

    def __init__(self, root: Path, bs: int):
        import json

        manifest = json.loads((root / "opdcache.json").read_text())
        self.pairs = list(zip([root / s["path"] for s in manifest["tables"]["rollouts"]["shards"]],
                              [root / s["path"] for s in manifest["tables"]["teachers/t"]["shards"]]))
        self.bs, self.kept, self.rng = bs, {}, np.random.default_rng(0)

    @staticmethod
    def _flat(col, depth: int):
        arr = col.combine_chunks()
        values = arr.flatten()
        if depth == 2:
            values = values.flatten()
        return values.to_numpy(zero_copy_only=False), arr.offsets.to_numpy()

    def _shard(self, i: int) -> dict:
        import pyarrow.parquet as pq

        if i not in self.kept:
            rp, tp = self.pairs[i]
            r = pq.read_table(rp, columns=["prompt_ids", "response_ids", "sampling_logprobs", "ref_logprobs"])
            t = pq.read_table(tp, columns=["logprobs", "logsumexp", "topk_ids", "topk_logprobs"])
            self.kept[i] = {"p": self._flat(r["prompt_ids"], 1), "r": self._flat(r["response_ids"], 1),
                            "s": self._flat(r["sampling_logprobs"], 1)[0], "ref": self._flat(r["ref_logprobs"], 1)[0],
                            "l": self._flat(t["logprobs"], 1)[0], "lse": self._flat(t["logsumexp"], 1)[0],
                            "k": self._flat(t["topk_ids"], 2)[0], "kl": self._flat(t["topk_logprobs"], 2)[0], "rows": r.num_rows}
        return self.kept[i]

    def __iter__(self):
        for i in range(len(self.pairs)):
            d = self._shard(i)
            (pv, po), (rv, ro) = d["p"], d["r"]
            order = self.rng.permutation(d["rows"])
            for a0 in range(0, len(order), self.bs):
                idx = order[a0: a0 + self.bs]
                B = len(idx)
                lens_p, lens_r = po[idx + 1] - po[idx], ro[idx + 1] - ro[idx]
                T, L = int(lens_r.max()), int((lens_p + lens_r).max())
                ids, att = np.zeros((B, L), np.int64), np.zeros((B, L), np.int64)
                resp, rmask, pos = np.zeros((B, T), np.int64), np.zeros((B, T), np.float32), np.zeros((B, T), np.int64)
                samp, ref, tl, lse = (np.zeros((B, T), np.float32) for _ in range(4))
                tk, tkl = np.zeros((B, T, K), np.int64), np.zeros((B, T, K), np.float32)
                for j_, j in enumerate(idx):
                    p, a, b = pv[po[j]: po[j + 1]], ro[j], ro[j + 1]
                    n = b - a
                    ids[j_, : len(p)], ids[j_, len(p): len(p) + n], att[j_, : len(p) + n] = p, rv[a:b], 1
                    resp[j_, :n], rmask[j_, :n], pos[j_, :n] = rv[a:b], 1, len(p) - 1 + np.arange(n)
                    samp[j_, :n], ref[j_, :n], tl[j_, :n], lse[j_, :n] = d["s"][a:b], d["ref"][a:b], d["l"][a:b], d["lse"][a:b]
                    tk[j_, :n] = d["k"][a * K: b * K].reshape(n, K)
                    tkl[j_, :n] = d["kl"][a * K: b * K].reshape(n, K)
                yield {k: torch.from_numpy(v) for k, v in dict(
                    input_ids=ids, attention_mask=att, response_ids=resp, response_mask=rmask, logit_positions=pos,
                    sampling_logprobs=samp, ref_logprobs=ref, teacher_logprobs=tl, teacher_logsumexp=lse, teacher_topk_ids=tk,
                    teacher_topk_logprobs=tkl).items()}


class DatasetsLoader:
    """``datasets.load_dataset`` of the rollouts and the teacher config joined column-wise, ``.with_format("torch")``,
    a DataLoader and a padding collate."""

    def __init__(self, root: Path, bs: int):
        import datasets

        r = datasets.load_dataset(str(root), "rollouts", split="train").select_columns(["prompt_ids", "response_ids"])
        t = datasets.load_dataset(str(root), "teacher-t", split="train").select_columns(["logprobs", "topk_ids", "topk_logprobs"])
        ds = datasets.concatenate_datasets([r, t], axis=1).with_format("torch")
        self.loader = torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=True, collate_fn=pad_collate,
                                                  generator=torch.Generator().manual_seed(0))

    def __iter__(self):
        return iter(self.loader)


def make(root: str, bs: int, side: str):
    from opdcache.training.data import CacheLoader, CacheLoaderConfig

    if side in ("opdcache", "packed"):
        return CacheLoader(CacheLoaderConfig(cache=root, teacher="t", stores=("logprob", "topk"), batch_size=bs, pack=side == "packed"))
    return HandLoader(Path(root), bs) if side == "hand" else DatasetsLoader(Path(root), bs)


def setup(root: str, bs: int, side: str, warm: bool, pandas: bool = False, trained: bool = True) -> dict:
    """Cold: nothing (the loader is built inside the timed epoch, as a run starts). Warm: built, one epoch untimed.
    ``pandas``: imported before the timer (pyarrow's to_numpy imports it on first use, 0.16-0.3 s here; opdcache's
    loader never does, so this row shows how much of the cold difference that import is).

    ``trained``: glibc's mmap threshold raised, for every side alike, as a process that has freed a large array leaves
    it (training on a CPU frees activations of several MiB every step): later allocations of a few MiB (a batch's
    padded columns) then come from memory malloc keeps. A process that only loads has freed none and maps, faults in
    and unmaps every batch's arrays (3,000-6,700 page faults in an epoch of this cache), and how far the threshold had
    risen depended on whichever of the loader's own temporaries happened to be largest (BENCHMARKS.md, "DataLoader";
    ``--loader-only-process`` measures that state, which is also the one ``train --gradient-checkpointing`` fixes on a
    CPU). One 16 MiB array, allocated and freed before the timer, raises it."""
    torch.set_num_threads(2)
    if trained:
        np.ones(16 << 20, np.uint8)  # mapped, then freed at once: the threshold rises to 16 MiB
    if pandas:
        import pandas  # noqa: F401
    if side == "datasets":
        os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="bench-hf-")  # cold conversion on a cold run
    st = {"root": root, "bs": bs, "side": side}
    if warm:
        st["loader"] = make(root, bs, side)
        sum(1 for _ in st["loader"])
    return st


def run_epoch(st: dict) -> dict:
    loader = st.get("loader") or make(st["root"], st["bs"], st["side"])
    tokens = 0
    for b in loader:
        tokens += int(b["response_mask"].sum()) if "response_mask" in b else len(b["response_ids"])  # packed: no padding
    return {"tokens": tokens}


def main() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from harness import Side, compare, report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--response-tokens", default="100,400",
                        help="response lengths drawn uniformly from [LO, HI) (default 100,400; short rollouts: 8,48)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-datasets", action="store_true", help="leave out the datasets side (50 s a run here), for more rounds of the other two")
    parser.add_argument("--loader-only-process", action="store_true",
                        help="leave each side's allocator as a process that only loads leaves it (see setup's `trained`)")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "loader.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "cache"
        lengths = tuple(int(x) for x in args.response_tokens.split(","))
        build(root, args.rows, lengths)
        out = {}
        for temp in ("cold", "warm"):
            common = {"root": str(root), "bs": args.batch_size, "warm": temp == "warm", "trained": not args.loader_only_process}
            sides = [Side("opdcache CacheLoader", "run_epoch", "setup", common | {"side": "opdcache"},
                          note="checks each shard (sha256, id alignment, lengths, row rules) once, keeps decoded shards"),
                     Side("opdcache CacheLoader, packed", "run_epoch", "setup", common | {"side": "packed"},
                          note="the same rows and values as one flat sequence a batch (pack=True): no padding, one gather a column"),
                     Side("hand-written pyarrow (competent)", "run_epoch", "setup", common | {"side": "hand"}, baseline=True,
                          note="pq.read_table, numpy values + offsets kept across epochs, numpy padding; checks nothing"),
                     Side("datasets + DataLoader", "run_epoch", "setup", common | {"side": "datasets"},
                          note="load_dataset of both configs, with_format('torch'), DataLoader, padding collate")][: 3 if args.no_datasets else 4]
            if temp == "cold":
                sides.insert(3, Side("hand-written, pandas imported first", "run_epoch", "setup", common | {"side": "hand", "pandas": True},
                                     note="the baseline in a process that has imported pandas already (its to_numpy then costs no import)"))
            result = compare(f"one {temp} epoch, {args.rows} rows of {lengths[0]}-{lengths[1] - 1} response tokens, batch {args.batch_size}, top-k {K}"
                             + (" (loader built inside the timer)" if temp == "cold" else " (after one untimed epoch)"),
                             sides, __file__, rounds=args.rounds,
                             meta={"command": "python benchmarks/bench_loader.py" + (f" --rounds {args.rounds}" if args.rounds != 3 else "")
                                   + (f" --rows {args.rows}" if args.rows != 4000 else "") + (f" --batch-size {args.batch_size}" if args.batch_size != 32 else "")
                                   + (f" --response-tokens {args.response_tokens}" if lengths != (100, 400) else "")
                                   + (" --no-datasets" if args.no_datasets else "")
                                   + (" --loader-only-process" if args.loader_only_process else "")})
            report(result)
            out[temp] = result
        args.json.parent.mkdir(parents=True, exist_ok=True)
        import json

        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
