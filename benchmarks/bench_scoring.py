"""score-teacher throughput and peak memory against a plain baseline, in one run.

Work: score N sequences (prompt P + response R tokens) with a random-weight Qwen3 model whose vocabulary is
151,936 (hidden 512, 4 layers), producing the logprob store (log-prob of each response token, logsumexp)
and a top-k store (k=20).

* baseline (what a competent user writes): length-sorted left-padded batches of the same padded-token budget as the
  engine's, ``model(..., logits_to_keep=R + 1)`` so logits exist only where responses are, one float32 logsumexp, the
  sampled tokens' logits gathered, top-k taken on the logits;
* opdcache: ``TransformersBackend.score`` (the same batches through the decoder, the head streamed over vocabulary
  slices at response positions, a running top-k);
* opdcache with the sampled store's 12 draws a position on top.

Measured with benchmarks/harness.py: interleaved rounds, each run its own process, wall and CPU seconds, peak anonymous
RSS of the work. Run:

    python benchmarks/bench_scoring.py [--sequences 32 --prompt 64 --response 192 --rounds 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

V = 151_936


def build_model(path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=8, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0").save_pretrained(path)


def workload(n: int, prompt: int, response: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    lens = rng.integers(response // 2, response + 1, n)  # varied lengths, as real rollouts are
    return [(rng.integers(1, V, prompt).tolist(), rng.integers(1, V, int(r)).astype(np.int32)) for r in lens]


def setup(model: str, n: int, prompt: int, response: int, top_k: int, side: str) -> dict:
    """Untimed: the model (and for opdcache its engine), the workload, one warm-up pass."""
    import numpy as np
    import torch

    torch.set_num_threads(os.cpu_count())
    work = workload(n, prompt, response)
    st = {"work": work, "top_k": top_k, "tokens": sum(len(r) for _, r in work)}
    if side == "batched":
        from transformers import AutoModelForCausalLM

        st["model"] = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        run_batched(st | {"work": work[:2]})
        return st
    from opdcache.backends.base import ScoreRequest
    from opdcache.backends.hf import TransformersBackend

    reqs = [ScoreRequest(p, r) for p, r in work]
    if side == "sampled":  # the sampled store's 12 draws a position on top (their extra head rows)
        reqs = [ScoreRequest(r.prompt_ids, r.response_ids, uniforms=np.random.default_rng(i).random((len(r.response_ids), 12)))
                for i, r in enumerate(reqs)]
    if side == "no-moments":  # the same engine with the fidelity record's per-position moments switched off
        from opdcache.backends import hf

        original = hf.streamed_logit_stats

        def without_moments(*args, **kwargs):
            return original(*args, **(kwargs | {"moments": False}))

        hf.streamed_logit_stats = without_moments
    st["engine"], st["reqs"] = TransformersBackend(model, dtype="float32"), reqs
    st["engine"].score(reqs[:1], top_k=top_k)
    return st


def run_opdcache(st: dict) -> dict:
    """TransformersBackend.score: length-sorted batches, the head streamed over vocabulary slices at response positions."""
    import numpy as np

    out = st["engine"].score(st["reqs"], top_k=st["top_k"])
    assert all(np.isfinite(s.logprobs).all() for s in out)
    return {"tokens": st["tokens"]}


BATCH_TOKENS = 1024  # padded tokens per forward, the engine's CPU default: both sides decode the same batches' worth


def run_batched(st: dict) -> dict:
    """What a competent user writes: sequences sorted by length, left-padded batches of at most BATCH_TOKENS padded
    tokens, ``model(..., logits_to_keep=longest response + 1)`` (logits only where responses are), then one float32
    logsumexp, the sampled tokens' logits gathered, and top-k on the logits (log-probs = logit - lse)."""
    import torch

    m, work, k = st["model"], sorted(st["work"], key=lambda w: len(w[0]) + len(w[1])), st["top_k"]
    batches, cur = [], []
    for w in work:
        if cur and (len(cur) + 1) * (len(w[0]) + len(w[1])) > BATCH_TOKENS:
            batches.append(cur)
            cur = []
        cur.append(w)
    batches.append(cur)
    with torch.no_grad():
        for batch in batches:
            L = max(len(p) + len(r) for p, r in batch)
            R = max(len(r) for _, r in batch)
            ids = torch.zeros((len(batch), L), dtype=torch.long)
            mask = torch.zeros((len(batch), L), dtype=torch.long)
            for i, (p, r) in enumerate(batch):
                seq = list(p) + r.tolist()
                ids[i, L - len(seq):] = torch.tensor(seq)
                mask[i, L - len(seq):] = 1
            z = m(input_ids=ids, attention_mask=mask, logits_to_keep=R + 1).logits[:, :-1].float()  # [B, R, V]
            lse = torch.logsumexp(z, -1)
            for i, (_, r) in enumerate(batch):
                zi, li = z[i, R - len(r):], lse[i, R - len(r):]
                lp = zi.gather(1, torch.as_tensor(r, dtype=torch.long)[:, None])[:, 0] - li
                top = zi.topk(k, -1)
                _ = (lp.numpy(), li.numpy(), top.indices.numpy(), (top.values - li[:, None]).numpy())
    return {"tokens": st["tokens"]}


def main() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from harness import Side, compare, report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=192)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "scoring.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build_model(model)
        common = {"model": str(model), "n": args.sequences, "prompt": args.prompt, "response": args.response, "top_k": args.top_k}
        sides = [
            Side("opdcache score", "run_opdcache", "setup", common | {"side": "opdcache"},
                 note="logprob + top-k stores: TransformersBackend.score"),
            Side("batched forward (competent)", "run_batched", "setup", common | {"side": "batched"}, baseline=True,
                 note="left-padded length-sorted batches, logits_to_keep, one logsumexp, gather and top-k on the logits"),
            Side("opdcache + sampled m=12", "run_opdcache", "setup", common | {"side": "sampled"},
                 note="the same plus the sampled store's 12 draws a position"),
            Side("opdcache, no fidelity moments", "run_opdcache", "setup", common | {"side": "no-moments"},
                 note="opdcache score without the entropy/variance sums the fidelity record needs (their cost)"),
        ]
        result = compare(f"score-teacher, {args.sequences} sequences x (prompt {args.prompt} + response <= {args.response}), "
                         f"vocabulary {V:,}, hidden 512, 4 layers, top-k {args.top_k}", sides, __file__, rounds=args.rounds,
                         meta={"command": "python benchmarks/bench_scoring.py"})
    report(result, args.json)


if __name__ == "__main__":
    main()
