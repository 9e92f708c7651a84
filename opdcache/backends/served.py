"""The served engine: opdcache as a client of servers users already run (vLLM's OpenAI-compatible server, SGLang's
native one), one or several replicas, tokens in and tokens out.

* **Ids, never text.** Every request sends the cache's exact ids (vLLM: ``prompt`` as a list of ids; SGLang:
  ``input_ids``), and every position that comes back is checked against what was sent: a server that re-tokenized or
  answers for other ids is refused with the row and the first differing position.
* **What the columns mean.** Teacher scoring reads prompt log-probs, which both servers compute from the raw logits at
  temperature 1 (the column's meaning) whatever their sampling settings. Generation's ``sampling_logprobs`` must be the
  log-probs of the distribution each token was drawn from (temperature and top-p applied): the server's mode is probed
  at start (a hot sample's log-probs against their temperature-1 values) and a server in raw mode is refused in one line;
  ``ref_logprobs`` and pi_ref's top-k come from a scoring pass over prompt + response. The log-partition is not returned
  by either server: a served teacher table has no ``logsumexp`` column (format v7 says so).
* **Identity.** The served model must be the named one: the local tokenizer's ids of a probe text must equal the server's
  ``/tokenize`` (vLLM), and the served name, version, ``max_model_len`` and ``max_logprobs`` are recorded as served
  provenance (never a URL or a key).
* **Throughput and faults.** Each replica runs ``concurrency`` requests at a time from one shared queue (a faster replica
  takes more); a request that fails (a 5xx, a dropped connection, a timeout, a truncated body) is retried with backoff,
  on any replica; a replica that keeps failing is dropped and its requests go to the others. Results are placed by row,
  so what is written does not depend on which replica answered or when.

Memory: at most (concurrency x replicas) requests in flight, each its sequence's ids and, for scoring, top-k entries a
position; the parsed answers of one engine call (a shard's batch).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import numpy as np

from opdcache.backends.base import Capabilities, GenerateRequest, Generation, SamplingConfig, ScoreRequest, Scores, statistics
from opdcache.backends.serverpool import Pool, ServerError, api_key, redact, split_urls
from opdcache.backends.serverprotocols import SGLangProtocol, VLLMProtocol, check_finite
from opdcache.errors import ConfigError
from opdcache.progress import advance

CAPABILITIES = Capabilities(
    summary="a running vLLM or SGLang server (--server-url, replicas comma-separated): tokens in, tokens out",
    statistics=statistics("logits", "candidates"), candidate_logprobs_vocab=8192, batch_size_changes_bits=False,
    quantization="none", monte_carlo=False)
"""candidate_logprobs_vocab: log-probs at given ids (pi_ref's top-k, the MC ids) come from the whole prompt log-prob row,
asked for up to a vocabulary of 8,192 (the server needs --max-logprobs -1); max_top_k is the server's own --max-logprobs,
checked when the engine starts, before any request is scored."""

KINDS = ("vllm", "sglang")
FULL_ROW_MAX_VOCAB = 8192
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 12 + 34 = 46; print('hello')"


# ---------------------------------------------------------------------------------------------- the engine

class ServedBackend:
    """The served engine over one or several replicas of one model (see the module docstring)."""

    name = "server"

    def __init__(self, model_path: str | Path, urls: Sequence[str], kind: str = "auto", key: str | None = None,
                 concurrency: int | None = None, timeout: float = 600.0):
        from transformers import AutoConfig

        from opdcache.inputs.models import load_tokenizer

        self.path = Path(model_path)
        self.config = AutoConfig.from_pretrained(self.path)
        self.tokenizer = load_tokenizer(self.path)
        self.vocab_size = int(getattr(self.config, "vocab_size", 0) or len(self.tokenizer))
        self.hidden_size = int(getattr(self.config, "hidden_size", 0) or 0)
        self.pool = Pool(urls, api_key(key), timeout, concurrency)
        self.kind, self.served = self._identify(kind)
        self.protocol = (VLLMProtocol if self.kind == "vllm" else SGLangProtocol)(self.served["served_name"])
        self.version = f"{self.kind}-{self.served.get('version') or 'unknown'}"
        self.max_length = int(self.served.get("max_model_len") or getattr(self.config, "max_position_embeddings", 0) or 0)
        self.dtype = str(getattr(self.config, "dtype", None) or "auto").replace("torch.", "")
        self._widths: set[int] = set()
        self.served["logprobs_mode"] = self._probe_mode()

    # -------------------------------------------------------------------------------------- identity
    def _identify(self, kind: str) -> tuple[str, dict]:
        """Which server each replica is and what it serves; all replicas must agree; the served tokenizer must be the
        local one (vLLM: /tokenize of a probe text)."""
        infos = self.pool.each("GET", "/get_model_info")  # SGLang's own endpoint (it serves /v1/models too)
        models = self.pool.each("GET", "/v1/models")
        detected = []
        for replica, info, answer in zip(self.pool.replicas, infos, models):
            if isinstance(info, dict) and "model_path" in info:
                detected.append("sglang")
            elif isinstance(answer, dict) and isinstance(answer.get("data"), list) and answer["data"]:
                detected.append("vllm")
            else:
                raise ConfigError(f"--server-url {redact(replica.url)} is neither vLLM's OpenAI-compatible server "
                                  "(/v1/models) nor SGLang's (/get_model_info); check the URL and port")
        if kind != "auto" and any(d != kind for d in detected):
            raise ConfigError(f"--server-kind {kind}, but the servers are {', '.join(sorted(set(detected)))}")
        if len(set(detected)) > 1:
            raise ConfigError(f"the replicas run different servers ({', '.join(sorted(set(detected)))}): give replicas of one")
        kind = detected[0]
        if kind == "vllm":
            cards = [m["data"][0] for m in models]
            names = {c.get("id") for c in cards}
            if len(names) > 1:
                raise ConfigError(f"the replicas serve different models ({', '.join(sorted(map(str, names)))}): give replicas of one")
            card = cards[0]
            versions = [v.get("version") if isinstance(v, dict) else None for v in self.pool.each("GET", "/version")]
            served = {"kind": "vllm", "served_name": card.get("id"), "version": versions[0],
                      "max_model_len": card.get("max_model_len"), "replicas": len(self.pool.replicas)}
            self._check_tokenizer_vllm(card.get("id"))
        else:
            info = infos
            if len({i.get("model_path") for i in info}) > 1:
                raise ConfigError("the replicas serve different models: give replicas of one")
            server = self.pool.each("GET", "/get_server_info")
            served = {"kind": "sglang", "served_name": info[0].get("model_path"),
                      "version": server[0].get("version") if isinstance(server[0], dict) else None,
                      "max_model_len": (server[0] or {}).get("context_length") if isinstance(server[0], dict) else None,
                      "replicas": len(self.pool.replicas)}
        served["max_logprobs"] = None  # learnt from a refusal (ensure_width); max_logprobs_checked: the widest answered
        return kind, served

    def _check_tokenizer_vllm(self, served_name) -> None:
        local = self.tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
        for replica, answer in zip(self.pool.replicas, self.pool.each("POST", "/tokenize", {"model": served_name, "prompt": PROBE_TEXT,
                                                                                            "add_special_tokens": False})):
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            if tokens is None:
                raise ConfigError(f"--server-url {redact(replica.url)}: /tokenize gave no tokens, so the served model cannot be "
                                  "checked against --teacher/--model; use a vLLM server with its tokenizer endpoint")
            if list(tokens) != list(local):
                first = next((j for j, (a, b) in enumerate(zip(local, tokens)) if a != b), min(len(local), len(tokens)))
                raise ConfigError(f"--server-url {redact(replica.url)} serves {served_name!r}, whose tokenizer is not "
                                  f"{self.path}'s (a probe text's ids differ from position {first}): serve the named model, "
                                  "or name the served one")

    def ensure_width(self, k: int, what: str) -> None:
        """Before the first request of a job: the server returns ``k`` entries a position (-1: the whole row), or the
        job is refused in one line naming ``what`` and the server's limit (vLLM's --max-logprobs)."""
        if k == 0 or k in self._widths:
            return
        ids = self.tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"][:3] or [0, 0]
        body = self.protocol.score_body(ids, k, 1, [])
        path = "/v1/completions" if self.kind == "vllm" else "/generate"
        answer = self.pool.each("POST", path, body)
        for replica, a in zip(self.pool.replicas, answer):
            if isinstance(a, dict) and "_error" in a:
                m = re.search(r"max allowed:? ?(-?\d+)", a["_error"])
                limit = int(m.group(1)) if m else None
                if limit is not None:
                    self.served["max_logprobs"] = limit
                need = "the whole log-prob row (--max-logprobs -1)" if k < 0 else f"--max-logprobs {k}"
                raise ConfigError(f"{what} needs {'the whole log-prob row' if k < 0 else f'{k} log-probs a position'}, more than "
                                  f"{redact(replica.url)} returns{f' (its --max-logprobs is {limit})' if limit is not None else ''}: "
                                  f"lower {what}, or restart the server with {need}")
        self._widths.add(k)
        self.served["max_logprobs_checked"] = max(self.served.get("max_logprobs_checked", 0), k if k >= 0 else self.vocab_size)

    # -------------------------------------------------------------------------------------- contract
    def load(self) -> None:
        return None

    def model_info(self) -> dict:
        return {"engine": "server", "engine_version": self.version, "dtype": None, "served": dict(self.served)}

    def close(self) -> None:
        return None

    def _row_scores(self, ids: Sequence[int], start: int, top: int, at_ids: Sequence[int], row: str):
        """A job for the pool: the positions start.. of ``ids`` scored with ``top`` entries and the log-probs at ``at_ids``."""
        body = self.protocol.score_body(ids, top, start, at_ids)
        path = "/v1/completions" if self.kind == "vllm" else "/generate"

        async def job(session, replica):
            return self.protocol.parse_scores(await self.pool.request(session, replica, "POST", path, body), ids, start, row)
        return job

    def score(self, requests: Sequence[ScoreRequest], top_k: int | None = None, hidden: bool = False,
              hidden_dtype: str | None = None) -> list[Scores]:
        if hidden:
            raise ConfigError("a served engine returns no hidden states; score the hidden and svd stores in-process")
        if top_k:
            self.ensure_width(top_k, "--top-k")
        jobs = []
        for n, r in enumerate(requests):
            ids = [int(i) for i in r.prompt_ids] + [int(i) for i in r.response_ids]
            at = sorted({int(i) for a in (r.ref_topk_ids, r.mc_ids) if a is not None for i in np.asarray(a).ravel()})
            if at and self.kind == "vllm":
                if self.vocab_size > FULL_ROW_MAX_VOCAB:
                    raise ConfigError(f"log-probs at pi_ref's top-k or MC ids need the whole prompt log-prob row, asked for up "
                                      f"to a vocabulary of {FULL_ROW_MAX_VOCAB:,} (this model's: {self.vocab_size:,}); score "
                                      "this cache in-process")
                self.ensure_width(-1, "the teacher's log-probs at pi_ref's top-k and MC ids")
            jobs.append(self._row_scores(ids, len(r.prompt_ids), top_k or 0, at, f"row {n} of this batch"))
        answers = self.pool.run(jobs, lambda i: f"scoring row {i} of this batch")
        out = []
        for r, positions in zip(requests, answers):
            T = len(r.response_ids)
            lp = np.array([p.logprob for p in positions], np.float32)
            check_finite(lp.tolist(), "a row of this batch")
            sc = Scores(logprobs=np.minimum(lp, 0))  # no log-partition: not among its statistics
            if top_k:
                ids_TK = np.full((T, top_k), -1, np.int32)
                lps_TK = np.full((T, top_k), -np.inf, np.float32)
                for t, p in enumerate(positions):
                    best = p.best(top_k)
                    if len(best) < top_k:
                        raise ServerError(f"the server returned {len(best)} top entries at a position, fewer than --top-k {top_k}")
                    ids_TK[t] = [i for i, _ in best]
                    lps_TK[t] = [v for _, v in best]
                check_finite(lps_TK.ravel().tolist(), "a row's top-k")
                lps_TK = np.minimum(lps_TK, 0)
                sc.topk_ids, sc.topk_logprobs = ids_TK, lps_TK
            for name, cand in (("ref_topk_logprobs", r.ref_topk_ids), ("mc_logprobs", r.mc_ids)):
                if cand is not None:
                    cand = np.asarray(cand)
                    vals = np.array([[positions[t].at.get(int(i), np.nan) for i in cand[t]] for t in range(T)], np.float32)
                    if not np.isfinite(vals).all():
                        raise ServerError("the server's answer lacks the log-prob of an asked-for id (pi_ref's top-k or an "
                                          "MC id); start vLLM with --max-logprobs -1")
                    setattr(sc, name, np.minimum(vals, 0))
            out.append(sc)
        advance(len(requests))
        return out

    def _probe_mode(self) -> str | None:
        """The log-prob mode of the servers' sampled tokens, seen from their answers: a hot sample (temperature 2) of a
        probe text, its returned log-probs against the same tokens' prompt log-probs (raw, temperature 1). Equal: the
        raw mode; apart: the processed one (the tempered distribution's, what sampling_logprobs means). None when the
        probe sampled nothing."""
        if self.kind != "vllm":
            return None  # SGLang's output log-probs are those of the tempered distribution (its documented behaviour)
        probe = self.tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"][:6]
        ids, values, _ = self.pool.run([self._gen_job(probe, SamplingConfig(temperature=2.0, max_new_tokens=8), 0, "the mode probe")])[0]
        if not ids:
            return None
        raw = self.pool.run([self._row_scores(probe + ids, len(probe), 0, [], "the mode probe")])[0]
        return "raw_logprobs" if max(abs(v - p.logprob) for v, p in zip(values, raw)) < 1e-3 else "processed_logprobs"

    def _gen_job(self, prompt: Sequence[int], s: SamplingConfig, seed: int, row: str):
        body = self.protocol.generate_body(prompt, s, seed)
        path = "/v1/completions" if self.kind == "vllm" else "/generate"

        async def job(session, replica):
            return self.protocol.parse_generation(await self.pool.request(session, replica, "POST", path, body), row)
        return job

    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingConfig) -> list[Generation]:
        if sampling.mc_samples:
            raise ConfigError("--mc-samples draws extra samples at every position, which a served engine would send as one "
                              "request a token; build MC rollouts in-process")
        if sampling.ref_top_k:
            self.ensure_width(sampling.ref_top_k, "--ref-top-k")
        if self.served.get("logprobs_mode") == "raw_logprobs" and sampling.temperature not in (0.0, 1.0) or \
                self.served.get("logprobs_mode") == "raw_logprobs" and sampling.top_p < 1.0:
            raise ConfigError("the server returns the raw (temperature-1) log-probs of sampled tokens, but sampling_logprobs "
                              "are those of the distribution each token was drawn from: restart vLLM with "
                              "--logprobs-mode processed_logprobs")
        seeds = [int(r.seed) % (2 ** 31) for r in requests]
        gens = self.pool.run([self._gen_job([int(i) for i in r.prompt_ids], sampling, seed, f"row {n} of this batch")
                              for n, (r, seed) in enumerate(zip(requests, seeds))], lambda i: f"generating row {i} of this batch")
        width = sampling.ref_top_k or 0
        scored = self.pool.run([self._row_scores([int(i) for i in r.prompt_ids] + ids, len(r.prompt_ids), width, [], f"row {n}'s ref_logprobs")
                                for n, (r, (ids, _, _)) in enumerate(zip(requests, gens))],
                               lambda i: f"scoring row {i}'s response under pi_ref")
        out = []
        for (ids, values, reason), positions in zip(gens, scored):
            g = Generation(response_ids=np.asarray(ids, np.int32), finish_reason=reason,
                           sampling_logprobs=np.minimum(np.asarray(values, np.float32), 0) if sampling.temperature else np.zeros(len(ids), np.float32),
                           ref_logprobs=np.minimum(np.array([p.logprob for p in positions], np.float32), 0))
            check_finite(g.ref_logprobs.tolist(), "a row's ref_logprobs")
            if width:
                best = [p.best(width) for p in positions]
                g.ref_topk_ids = np.array([[i for i, _ in b] for b in best], np.int32).reshape(len(ids), width)
                g.ref_topk_logprobs = np.minimum(np.array([[v for _, v in b] for b in best], np.float32).reshape(len(ids), width), 0)
            out.append(g)
        advance(len(requests))
        return out


def check(engine) -> dict:
    """Before anything starts: the URLs parse, and there is at least one."""
    urls = split_urls(engine.server_url)
    if not urls:
        raise ConfigError("--backend server needs --server-url http://host:port (replicas comma-separated)")
    if engine.server_kind not in ("auto",) + KINDS:
        raise ConfigError(f"--server-kind must be auto, {' or '.join(KINDS)}; got {engine.server_kind!r}")
    if engine.server_concurrency is not None and engine.server_concurrency < 1:
        raise ConfigError(f"--server-concurrency must be at least 1, got {engine.server_concurrency}")
    return {}


def build(model, engine, **extra) -> ServedBackend:
    return ServedBackend(model, split_urls(engine.server_url), engine.server_kind, engine.api_key, engine.server_concurrency,
                         engine.server_timeout)  # the widths are checked against the server as each job starts
