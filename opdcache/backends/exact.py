"""The exact engine (``--exact``): sampling and scoring in the exact arithmetic of opdcache/exact/, so every stored
number is the one the trainer's exact forward recomputes, bit for bit, whatever the batch, the padding, KV-cache
decoding against a full forward, or the thread count (papers/003's zero-mismatch reference, on a CPU).

Each token is drawn from exactly the stored sampling log-probs: inverse CDF over exp(sampling_logprobs) in vocabulary
order, with a uniform from the sample's own stream (seeded from its id). Memory: the model and a float64 copy of its
weights (8 bytes per parameter), a KV cache of [batch, kv heads, prompt + max_new_tokens, head dim] per layer, and
per decode step [batch, vocabulary] float32 logits and float64 probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from opdcache.backends.base import (Capabilities, GenerateRequest, Generation, SamplingConfig, ScoreRequest, Scores, split_generations,
                                    split_scores, statistics)
from opdcache.backends import draws
from opdcache.backends.hf import DONE_CHECK_EVERY, UNIFORM_BLOCK_STEPS
from opdcache.backends.loading import load_model
from opdcache.errors import ConfigError
from opdcache.exact import arith, arithmetic_for_device, CPU_ARITHMETIC, head as H, invariant, primitives, require
from opdcache.exact.decoder import ExactDecoder
from opdcache.progress import advance, detail

ARITHMETIC = CPU_ARITHMETIC
INJECT_HELP = "logit-noise:SIGMA (Gaussian noise of scale SIGMA nats on every logit) or bf16-activations (each layer's output rounded to bfloat16)"


@dataclass(frozen=True)
class Injection:
    """Controlled mismatch injected into exact rollouts (papers/003 section 6), so TIS and rejection thresholds can be
    calibrated against the exact reference: the engine's log-probs (stored, and sampled from) are those of the
    perturbed model, while train --exact and mismatch-report --exact recompute the unperturbed one."""

    logit_noise: float = 0.0
    """Scale of N(0, sigma^2) noise added to every logit at every decode step (from the sample's own random stream)."""
    bf16_activations: bool = False
    """Round each decoder layer's output to bfloat16 (a bf16 engine's activations, on float32 weights)."""

    @classmethod
    def parse(cls, spec: str | None) -> "Injection | None":
        if spec is None:
            return None
        text = str(spec).strip().lower()
        if text == "bf16-activations":
            return cls(bf16_activations=True)
        if text.startswith("logit-noise:"):
            try:
                sigma = float(text.split(":", 1)[1])
            except ValueError:
                sigma = -1.0
            if not 0 < sigma <= 10 or sigma != sigma:
                raise ConfigError(f"--inject-mismatch logit-noise:SIGMA needs 0 < SIGMA <= 10, got {spec!r}")
            return cls(logit_noise=sigma)
        raise ConfigError(f"--inject-mismatch must be {INJECT_HELP}; got {spec!r}")

    def spec(self) -> str:
        return "bf16-activations" if self.bf16_activations else f"logit-noise:{self.logit_noise:g}"


def arithmetic_record(dtype: str, name: str = CPU_ARITHMETIC, device: torch.device | None = None) -> dict:
    """What fixes the arithmetic, for the manifest: its definition and the libraries whose functions it rounds (the
    CPU's: torch for the float64 kernels, the C library for math's exp/log/cos/sin on the slow path; the GPU's: its
    block constants, triton, and the device, whose tensor cores and elementwise functions give the bits)."""
    import platform

    record = {"arithmetic": name, "dtype": dtype, "vocab_block": H.VOCAB_BLOCK, "torch": torch.__version__}
    if name == CPU_ARITHMETIC:
        return record | {"libc": "-".join(platform.libc_ver()) or None, "python": platform.python_version()}
    import triton

    gpu = torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else "triton-interpreter"
    return record | invariant.constants() | {"triton": triton.__version__, "device": gpu, "draws": "counter-triple32"}


def _checked_arithmetic(name: str, device: str) -> str:
    """``name`` where this opdcache implements it and ``device`` runs it; else one line saying what is missing."""
    require(name, device, "the table", "re-compute it with the opdcache version that wrote it")
    return name


FLOAT32_ON_GPU = ("--exact --device cuda computes in bfloat16: its float32 path is not yet batch-invariant on a GPU (a row's "
                  "sampling log-probs changed with its batch on an H200); use --dtype bfloat16, or --exact on the CPU for float32")


def _refuse_float32_on_gpu(model) -> None:
    """The GPU arithmetic's float32 path failed its batch-invariance test on CUDA: refused there, in one line."""
    p = next(model.parameters())
    if p.device.type == "cuda" and p.dtype == torch.float32:
        raise ConfigError(FLOAT32_ON_GPU)


class ExactBackend:
    name = "exact"

    def __init__(self, model_path: str | Path, dtype: str = "auto", quantize: str | None = None,
                 generate_batch_size: int = 64, max_batch_tokens: int = 2048, inject: str | None = None,
                 device: str = "cpu", arithmetic: str | None = None):
        """``device``: where the model runs (``cpu``; ``cuda``/``cuda:N`` for the batch-invariant GPU arithmetic).
        ``arithmetic``: a name of :data:`ARITHMETICS` (default: the device's, :func:`arithmetic_for_device`); the
        batch-invariant one also runs on the CPU under Triton's interpreter (its tests)."""
        from opdcache.backends.quant import parse_quantize

        spec = None if quantize is None else parse_quantize(quantize).spec()
        if dtype == "float16":
            raise ConfigError("--exact supports --dtype float32 or bfloat16, got float16")
        name = _checked_arithmetic(arithmetic or arithmetic_for_device(device), device)
        on_gpu = str(device).startswith("cuda")
        if on_gpu and dtype == "float32":
            raise ConfigError(FLOAT32_ON_GPU)
        dtype = ("bfloat16" if on_gpu else "float32") if dtype == "auto" else dtype
        self.model = load_model(model_path, dtype, "cpu" if device == "auto" else device, spec)
        self.path, self.quantize = Path(model_path), spec
        self._attach(generate_batch_size, max_batch_tokens, Injection.parse(inject), name)

    @classmethod
    def from_model(cls, model, generate_batch_size: int = 64, max_batch_tokens: int = 2048, inject: str | None = None,
                   arithmetic: str | None = None) -> "ExactBackend":
        """Wrap a model in memory (an online learner's current weights), in its device's arithmetic by default."""
        self = cls.__new__(cls)
        self.model, self.path, self.quantize = model, None, None
        device = str(next(model.parameters()).device)
        _refuse_float32_on_gpu(model)
        self._attach(generate_batch_size, max_batch_tokens, Injection.parse(inject),
                     _checked_arithmetic(arithmetic or arithmetic_for_device(device), device))
        return self

    def _attach(self, generate_batch_size: int, max_batch_tokens: int, inject: Injection | None, arithmetic: str) -> None:
        import transformers

        from opdcache.inputs.models import facts_of

        self.inject = inject
        self.arithmetic = arithmetic
        self.arith = primitives(arithmetic)
        if inject is not None and inject.logit_noise and self.arith is not arith:
            raise ConfigError("--inject-mismatch logit-noise draws its noise from CPU random streams: inject it on the CPU arithmetic")
        self.decoder = ExactDecoder(self.model, round_activations=torch.bfloat16 if inject and inject.bf16_activations else None,
                                    arith=self.arith)
        self.device = self.decoder.base.embed_tokens.weight.device
        self.version = transformers.__version__
        self.dtype = str(self.decoder.dtype).replace("torch.", "")
        head = self.model.get_output_embeddings()
        self.W, self.b = head.weight, getattr(head, "bias", None)
        facts = facts_of(self.model)
        self.vocab_size, self.max_length, self.hidden_size = facts.vocab_size, facts.max_length, facts.hidden_size
        self.generate_batch_size, self.max_batch_tokens = generate_batch_size, max_batch_tokens
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = sorted(set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []))

    def close(self) -> None:
        """Nothing to release."""

    def load(self) -> None:
        """Nothing to do: the exact engine loads its weights when it starts (its arithmetic is checked on them)."""

    def model_info(self) -> dict:
        record = arithmetic_record(self.dtype, self.arithmetic, self.device)
        if self.inject is not None:
            record["inject"] = self.inject.spec()
        return {"engine": self.name, "engine_version": self.version, "dtype": self.dtype, "quantization": self.quantize, "exact": record}

    # ------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingConfig) -> list[Generation]:
        out: list[Generation] = []
        for a in range(0, len(requests), self.generate_batch_size):
            batch = requests[a: a + self.generate_batch_size]
            out.extend(self._generate_batch(batch, sampling))
            advance(len(batch))
        return out

    def _step_logprobs(self, h_BH: torch.Tensor, s: SamplingConfig, gens: list | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(temperature-1 log-probs, sampling log-probs) [B, V] of one decode step."""
        A = self.arith
        z = H.full_logits(h_BH, self.W, self.b, self.decoder.dtype, A)
        if self.inject is not None and self.inject.logit_noise:
            noise = torch.stack([torch.randn(z.shape[1], generator=g) for g in gens])  # [B, V] from each sample's stream
            z = z + noise * self.inject.logit_noise
        ref = H.log_softmax(z, A)
        if s.temperature in (0, 1) and s.top_p >= 1:
            return ref, ref
        scaled = z / s.temperature
        samp = H.log_softmax(scaled, A)
        if s.top_p < 1:
            samp = H.log_softmax(scaled.masked_fill(H.top_p_mask(samp, s.top_p, A), float("-inf")), A)
        return ref, samp

    def _uniforms(self, requests: Sequence[GenerateRequest], s: SamplingConfig):
        """Step t -> [B, 1 + m] float64 uniforms on the engine's device (draw 0 picks the token, 1..m the MC draws),
        each row's from its own seed only. The CPU arithmetic draws them from one torch.Generator per sample (its
        recorded streams); the GPU arithmetic from the counter-based hash of (seed, step, draw)
        (opdcache/backends/draws.py), a block of steps at a time, on the device. Also returns the generators (None
        on the GPU arithmetic), which the logit-noise injection draws from."""
        m = s.mc_samples or 0
        if self.arith is arith:
            gens = [torch.Generator().manual_seed(r.seed) for r in requests]

            def per_step(t: int) -> torch.Tensor:
                u = (torch.stack([torch.rand(1, dtype=torch.float64, generator=g) for g in gens]) if s.temperature > 0
                     else torch.zeros(len(gens), 1, dtype=torch.float64))  # the token's (none when greedy), then the MC draws'
                if m:
                    u = torch.cat([u, torch.stack([torch.rand(m, dtype=torch.float64, generator=g) for g in gens])], 1)
                return u

            return per_step, gens
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64, device=self.device)
        block: dict = {}

        def from_block(t: int) -> torch.Tensor:
            if "u" not in block or t - block["at"] >= block["u"].shape[1]:
                block["at"] = t
                block["u"] = draws.uniforms(seeds, t, min(UNIFORM_BLOCK_STEPS, s.max_new_tokens - t), 1 + m)
            return block["u"][:, t - block["at"]]

        return from_block, None

    def _generate_batch(self, requests: Sequence[GenerateRequest], s: SamplingConfig) -> list[Generation]:
        B, device = len(requests), self.device
        lengths = torch.tensor([len(r.prompt_ids) for r in requests])
        if int(lengths.min()) == 0:
            raise ConfigError("cannot generate from an empty prompt")
        L = int(lengths.max())
        ids = torch.zeros((B, L), dtype=torch.long)
        for b, r in enumerate(requests):  # right padding: a row's token t at position t
            ids[b, : len(r.prompt_ids)] = torch.as_tensor(r.prompt_ids)
        ids, lengths_d = ids.to(device), lengths.to(device)
        cache = self.decoder.new_cache(B, L + s.max_new_tokens)
        rows = torch.arange(B, device=device)
        h = self.decoder.step(ids, torch.arange(L, device=device).expand(B, L), cache, end=L)[rows, lengths_d - 1]  # [B, H]
        uniforms, gens = self._uniforms(requests, s)
        pos = lengths_d.clone()
        done = torch.zeros(B, dtype=torch.bool, device=device)
        n_tokens = torch.zeros(B, dtype=torch.long, device=device)
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=device)
        check_every = 1 if device.type == "cpu" else DONE_CHECK_EVERY  # the one host read of a GPU loop
        steps: dict[str, list[torch.Tensor]] = {k: [] for k in ("tok", "slp", "rlp", "kid", "klp", "mid", "mlp")}
        for t in range(s.max_new_tokens):
            detail(f"decoding {B} sequences: token {t + 1}/{s.max_new_tokens}")
            ref, samp = self._step_logprobs(h, s, gens)
            u = uniforms(t) if s.temperature > 0 or s.mc_samples else None
            if s.temperature == 0:
                tok = ref.argmax(-1)
                samp = torch.full_like(ref, float("-inf")).scatter(-1, tok[:, None], 0.0)
            else:
                tok = H.draw(samp, u[:, :1].to(device), self.arith)[:, 0]
            steps["tok"].append(tok)
            steps["slp"].append(samp.gather(-1, tok[:, None])[:, 0])
            steps["rlp"].append(ref.gather(-1, tok[:, None])[:, 0])
            if s.ref_top_k:
                klp, kid = H.canonical_top_k(ref, s.ref_top_k)
                steps["kid"].append(kid)
                steps["klp"].append(klp)
            if s.mc_samples:
                mid = H.draw(samp, u[:, 1:].to(device), self.arith)
                steps["mid"].append(mid)
                steps["mlp"].append(samp.gather(-1, mid))
            n_tokens += ~done
            done |= torch.isin(tok, eos)
            if t == s.max_new_tokens - 1 or ((t + 1) % check_every == 0 and bool(done.all())):
                break
            h = self.decoder.step(tok[:, None], pos[:, None], cache, end=L + t + 1)[:, 0]
            pos = pos + 1
        return split_generations({k: torch.stack(v, 1).cpu().numpy() for k, v in steps.items() if v}, n_tokens.cpu(), done.cpu(), s)

    # ------------------------------------------------------------ scoring
    def _batches(self, requests: Sequence[ScoreRequest]) -> list[list[int]]:
        batches, current, longest = [], [], 0
        for i, r in enumerate(requests):
            n = len(r.prompt_ids) + len(r.response_ids)
            if current and max(longest, n) * (len(current) + 1) > self.max_batch_tokens:
                batches.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, n)
        return batches + ([current] if current else [])

    def final_hidden(self, requests: Sequence[ScoreRequest]) -> tuple[torch.Tensor, list[int]]:
        """Exact final hidden states at the response positions, [sum T, H], and each row's T."""
        for r in requests:
            if len(r.prompt_ids) == 0:
                raise ConfigError("cannot score a sequence with an empty prompt")
        seqs = [list(r.prompt_ids) + list(r.response_ids) for r in requests]
        ids = torch.zeros((len(seqs), max(map(len, seqs))), dtype=torch.long)
        for b, seq in enumerate(seqs):
            ids[b, : len(seq)] = torch.as_tensor(seq)
        h = self.decoder.forward(ids.to(self.device))
        rows = [h[b, len(r.prompt_ids) - 1: len(r.prompt_ids) - 1 + len(r.response_ids)] for b, r in enumerate(requests)]
        return torch.cat(rows), [len(r.response_ids) for r in requests]

    @torch.no_grad()
    def score(self, requests: Sequence[ScoreRequest], top_k: int | None = None, hidden: bool = False,
              hidden_dtype: str | None = None) -> list[Scores]:
        if hidden and hidden_dtype is not None and getattr(torch, hidden_dtype) != self.decoder.dtype:
            raise ConfigError("--hidden-dtype with --exact: the exact engine stores hidden states in its compute dtype; "
                              "pass --dtype bfloat16 to compute (and store) in bfloat16, or drop --hidden-dtype")
        out: list[Scores | None] = [None] * len(requests)
        for batch in self._batches(requests):
            reqs = [requests[i] for i in batch]
            h_NH, lengths = self.final_hidden(reqs)
            for i, sc in zip(batch, self._score_rows(reqs, h_NH, lengths, top_k, hidden)):
                out[i] = sc
            advance(len(batch))
        return out  # type: ignore[return-value]

    def _score_rows(self, reqs, h_NH, lengths, top_k, want_hidden) -> list[Scores]:
        cols = [torch.as_tensor(np.concatenate([np.asarray(r.response_ids, np.int64) for r in reqs]))[:, None]]
        names = ["logprobs"]
        for name, attr in (("ref_topk_logprobs", "ref_topk_ids"), ("mc_logprobs", "mc_ids")):
            if getattr(reqs[0], attr) is not None:
                cols.append(torch.as_tensor(np.concatenate([getattr(r, attr).astype(np.int64) for r in reqs])))
                names.append(name)
        widths = [c.shape[1] for c in cols]
        ids = torch.cat(cols, 1).to(self.device)
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("logprobs", "logsumexp", "topk_ids", "topk_logprobs", "sampled_ids", "sampled_logprobs", "entropy", "variance")}
        uniforms = None if reqs[0].uniforms is None else torch.cat([torch.as_tensor(r.uniforms, dtype=torch.float64) for r in reqs]).to(self.device)
        for sl in H.row_blocks(h_NH.shape[0]):
            moments: list = []
            lp, lse, top = H.picks_and_stats(h_NH[sl], self.W, self.b, self.decoder.dtype, ids[sl], top_k, moments, self.arith)
            parts["entropy"].append(moments[0])
            parts["variance"].append(moments[1])
            parts["logprobs"].append(lp)
            parts["logsumexp"].append(lse)
            if top is not None:
                parts["topk_logprobs"].append(top[0])
                parts["topk_ids"].append(top[1])
            if uniforms is not None:
                full = H.log_softmax(H.full_logits(h_NH[sl], self.W, self.b, self.decoder.dtype, self.arith), self.arith)
                sid = H.draw(full, uniforms[sl], self.arith)
                parts["sampled_ids"].append(sid)
                parts["sampled_logprobs"].append(full.gather(1, sid))
        cat = {k: torch.cat(v).cpu() for k, v in parts.items() if v}
        cat.update(zip(names, torch.split(cat.pop("logprobs"), widths, 1)))
        cat["logprobs"] = cat["logprobs"][:, 0]
        if want_hidden:
            cat["hidden"] = h_NH.cpu()
        return split_scores(cat, lengths)

    @torch.no_grad()
    def hidden_states(self, requests: Sequence[ScoreRequest]) -> torch.Tensor:
        parts = []
        for batch in self._batches(requests):
            parts.append(self.final_hidden([requests[i] for i in batch])[0])
        return torch.cat(parts)


CAPABILITIES = Capabilities(
    summary="one exact arithmetic (papers/003; as --exact): the same bits whatever the batch, padding or KV cache",
    # hidden states in its compute dtype only: no rounding to another dtype, so no rounding KL
    statistics=statistics("logits", "log_partition", "candidates", "full_distribution", "hidden_states", but=("rounding_kl",)),
    batch_size_changes_bits=False,
    quantization="emulated", exact_arithmetic=True)


def check(engine) -> dict:
    """The exact engine's rules on an EngineConfig, before any model loads."""
    if engine.device not in ("auto", "cpu"):
        if not engine.device.startswith("cuda"):
            raise ConfigError(f"--exact runs on the CPU or a CUDA GPU (--device cpu, cuda or cuda:N), got --device {engine.device}")
        if engine.dtype == "float32":
            raise ConfigError(FLOAT32_ON_GPU)
        reason = invariant.unavailable_reason(engine.device)
        if reason is not None:
            raise ConfigError(f"--exact --device {engine.device} runs the batch-invariant GPU kernels: {reason}; "
                              "or run --exact on the CPU (--device cpu)")
        if engine.inject is not None and Injection.parse(engine.inject).logit_noise:
            raise ConfigError("--inject-mismatch logit-noise draws its noise from CPU random streams: use it with --exact on the CPU")
    if engine.dtype == "float16":
        raise ConfigError("--exact computes in float32 or bfloat16, got --dtype float16")
    if engine.quantize is not None and engine.quantize.split(":")[0] == "int8":
        raise ConfigError("--exact with --quantize int8 (torch's kernels) is not exact; use w8a8, its emulated equivalent")
    fixed = {} if engine.inject is None else {"inject": Injection.parse(engine.inject).spec()}
    if engine.quantize is not None:
        from opdcache.backends.quant import QuantScheme

        fixed["quantize"] = QuantScheme.parse(engine.quantize).spec()
    return fixed


def from_model(model, engine=None) -> ExactBackend:
    """The exact engine around a model already in memory, in its device's arithmetic, with ``engine``'s injection."""
    return ExactBackend.from_model(model, inject=engine.inject if engine else None)


def build(model, engine, arithmetic: str | None = None, **_extra) -> ExactBackend:
    """``arithmetic``: the recorded arithmetic a replay must use (default: the device's)."""
    return ExactBackend(model, dtype=engine.dtype, quantize=engine.quantize, generate_batch_size=engine.generate_batch_size,
                        max_batch_tokens=engine.max_batch_tokens or 2048, inject=engine.inject,
                        device="cpu" if engine.device == "auto" else engine.device, arithmetic=arithmetic)
