"""The svd store on a real model: held-out distortion against rank and calibration size, and the bytes it costs.

Data: SmolLM2-135M-Instruct's post-norm hidden states (the head's input) on its own temperature-1 responses to
``--prompts`` chat-template math word problems (opdcache/demo/real.py, seed 7, the math tutor system prompt, up to
128 new tokens; a response's positions up to and including its first EOS). Generated once, 32 prompts a batch, and
kept under ``~/.cache/opdcache/bench/svd-math`` (``--data``).

Held out: every position of the last 32 prompts: other prompts than any calibration position, as a table's rows
are to the sample its projection was fitted on. Calibration: N positions drawn at random (seed 0) over the other
prompts, as score-teacher draws its rows over every shard; and, as an earlier frontier fitted it, all positions of
32 prompts only. Distortion: mean KL(true || reconstructed) per held-out position with z rounded to bfloat16 as the
store keeps it, with its standard error over the held-out positions, and top-1 agreement (opdcache/stores/svdprojection.py). Bytes: the svd column as opdcache's writer stores it
(BYTE_STREAM_SPLIT + zstd), per token. A measurement of error and bytes: nothing is timed, so no harness rounds.

    python benchmarks/bench_svd.py [--prompts 288] [--ranks 256,512] [--sizes 2048,4096,8192,16384,24576]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from opdcache.format import schema as S, shards
from opdcache.stores import svdprojection as svd

HELD_PROMPTS = 32
BATCH = 32
DEFAULT_DATA = Path.home() / ".cache" / "opdcache" / "bench" / "svd-math"


def generate(data: Path, model_dir: Path, prompts: int) -> None:
    """Hidden states of the model's own responses, one .npy pair (states, prompt index) per batch of 32 prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opdcache.demo import real

    data.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in real.write_math_prompts(data / "prompts.jsonl", prompts, seed=7).read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    for i in range(0, prompts, BATCH):
        if (data / f"h{i:05d}.npy").is_file():
            continue
        chats = [tok.apply_chat_template([{"role": "system", "content": real.MATH_SYSTEM}] + r["messages"], tokenize=False,
                                         add_generation_prompt=True) for r in rows[i: i + BATCH]]
        enc = tok(chats, return_tensors="pt", padding=True, padding_side="left")
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=128, pad_token_id=tok.eos_token_id)
            P = enc["input_ids"].shape[1]
            eos = (out[:, P:] == tok.eos_token_id).int()
            keep = (eos.cumsum(1) - eos) == 0  # up to and including the first EOS
            mask = torch.cat([enc["attention_mask"], keep.long()], 1)
            h = model.model(input_ids=out, attention_mask=mask).last_hidden_state[:, P - 1: -1]  # post-norm: the head's input
        states = [h[b][keep[b]].numpy() for b in range(h.shape[0])]
        np.save(data / f"s{i:05d}.npy", np.concatenate([np.full(len(x), i + b) for b, x in enumerate(states)]))
        np.save(data / f"h{i:05d}.npy", np.concatenate(states))  # last: its presence means the batch is complete
        print(f"prompts {i}-{i + len(states) - 1}: {sum(len(x) for x in states)} positions", flush=True)


def column_bytes_per_token(z: np.ndarray, rank: int, dtype: str | None) -> float:
    params = S.StoreParams(stores=("logprob", "svd"), svd_rank=rank, svd_dtype=dtype)
    values = shards.hidden_to_numpy(torch.from_numpy(z).to(torch.bfloat16)) if dtype else z
    T = 512
    records = [{"id": f"r{i}", "logprobs": np.zeros(len(values[i: i + T]), np.float32), "logsumexp": np.zeros(len(values[i: i + T]), np.float32),
                "svd": values[i: i + T]} for i in range(0, len(values), T)]
    with tempfile.TemporaryDirectory() as tmp:
        info = shards.write_table_atomic(shards.build_table("teacher", params, records), Path(tmp) / "s.parquet", tmp)
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(Path(tmp) / info.path).metadata
        size = sum(meta.row_group(g).column(c).total_compressed_size for g in range(meta.num_row_groups)
                   for c in range(meta.num_columns) if meta.row_group(g).column(c).path_in_schema.startswith("svd"))
    return size / len(values)


def main() -> None:
    from transformers import AutoModelForCausalLM

    from opdcache.demo import real

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--prompts", type=int, default=288)
    parser.add_argument("--ranks", default="256,512")
    parser.add_argument("--sizes", default="2048,4096,8192,16384,24576")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "svd_calibration.json")
    args = parser.parse_args()
    model_dir = real.smollm2()
    generate(args.data, model_dir, args.prompts)
    files = sorted(args.data.glob("h*.npy"))[: -(-args.prompts // BATCH)]
    H = np.concatenate([np.load(f) for f in files])
    prompt_of = np.concatenate([np.load(f.with_name("s" + f.name[1:])) for f in files])
    W = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).get_output_embeddings().weight.detach()
    prompts = np.unique(prompt_of)
    held_mask = np.isin(prompt_of, prompts[-HELD_PROMPTS:])
    held, pool, pool_prompt = torch.from_numpy(H[held_mask]), H[~held_mask], prompt_of[~held_mask]
    print(f"{len(prompts)} prompts, {len(H):,} positions; held out: {HELD_PROMPTS} prompts, {len(held):,} positions; "
          f"calibration pool: {len(pool):,} positions of {len(prompts) - HELD_PROMPTS} prompts; hidden {W.shape[1]}, vocabulary {W.shape[0]:,}\n")
    few = np.isin(pool_prompt, prompts[:HELD_PROMPTS])  # the first 32 prompts alone: a sample's first half
    rng = np.random.default_rng(0)
    rows = []
    header = (f"{'rank':>5} {'calibration':<34} {'positions':>9} {'held-out KL':>12} {'± s.e.':>8} {'top-1':>7} {'in-sample KL':>13} "
              f"{'B/token':>8}")
    print(header + "\n" + "-" * len(header))
    for rank in (int(r) for r in args.ranks.split(",")):
        draws = [(f"random over {len(prompts) - HELD_PROMPTS} prompts", rng.choice(len(pool), n, replace=False))
                 for n in (int(s) for s in args.sizes.split(",")) if n <= len(pool)]
        draws.append((f"all of {HELD_PROMPTS} prompts", np.flatnonzero(few)))
        bytes_per_token = None
        for label, idx in draws:
            calib = torch.from_numpy(pool[idx])
            proj = svd.fit(W, None, calib, rank, "prob-weighted")
            out = svd.distortion(proj, W, None, held, store_dtype="bfloat16")
            inside = svd.distortion(proj, W, None, calib[:4096], store_dtype="bfloat16")
            if bytes_per_token is None:
                bytes_per_token = column_bytes_per_token(proj.encode(held).numpy(), rank, "bfloat16")
            rows.append({"rank": rank, "calibration": label, "positions": len(idx), "heldout_kl": out["mean_kl"], "heldout_kl_stderr": out["kl_stderr"],
                         "top1": out["top1_agreement"], "in_sample_kl": inside["mean_kl"], "bytes_per_token": bytes_per_token})
            print(f"{rank:>5} {label:<34} {len(idx):>9,} {out['mean_kl']:>12.3e} {out['kl_stderr']:>8.1e} {out['top1_agreement']:>7.2%} {inside['mean_kl']:>13.3e} "
                  f"{bytes_per_token:>8.1f}", flush=True)
    args.json.write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "prompts": int(len(prompts)), "positions": int(len(H)),
                                     "heldout_positions": int(len(held)), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
