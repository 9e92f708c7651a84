"""The transformers engine: the exact reference, on any device.

Generation runs its own sampling loop over the model's KV cache, so every stored number is computed
from the logits the token was drawn from: temperature and top-p for ``sampling_logprobs``, temperature 1
for ``ref_logprobs`` and top-k. Each sample draws from its own random stream (seeded from the sample's id),
so a sample does not depend on which batch it ran in.

Scoring runs the decoder once over prompt + response (right-padded, length-sorted batches under a
token budget) and computes logits only at response positions, in blocks of positions sized so that no
[batch, length, vocabulary] float32 tensor is ever materialised. ``deterministic=True`` scores each
sequence on its own, with deterministic kernels, so its stored values are bit-identical whatever batch
or order it arrives in.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from opdcache.backends.base import GenerateRequest, Generation, SamplingConfig, ScoreRequest, Scores
from opdcache.errors import ConfigError
from opdcache.progress import advance

POSITION_BLOCK = 2048  # positions scored together: enough rows that the head matmul runs at full rate
NOISE_BLOCK_BYTES = 64 << 20  # generation: uniforms drawn ahead per batch ([rows, steps, vocabulary] float32)
LOGIT_BLOCK_BYTES = 8 << 20  # float32 logits per [positions, vocabulary slice] block (1,024 columns at 2,048 positions; measured best on CPU)
# on a GPU a 1,024-column slice is launch-bound: 1 GiB (131,072 columns at 2,048 positions) scored 8.3x faster than
# 8 MiB on an H100 at vocabulary 151,936, hidden 4,096 (256 MiB: 6.3x; benchmarks/bench_gpu.py, BENCHMARKS.md)
GPU_LOGIT_BLOCK_BYTES = 1 << 30
SCORE_BATCH_TOKENS = {"cpu": 1024, "cuda": 16384}  # default padded tokens per scoring batch (the GPU's: 8.9x faster, bench_gpu.py)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ConfigError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}") from None


def load_model(path: str | Path, dtype: str = "auto", device: str = "auto", quantize: str | None = None):
    """Load a local HF causal LM for inference. ``quantize``: a scheme of opdcache/quant.py -- ``int8`` applies
    torch's dynamic int8 linear layers (CPU); w4a16, w8a8 and fp8 are emulated (quantize, dequantize, compute)."""
    from opdcache.models import load_causal_lm
    from opdcache.quant import QuantScheme, apply_scheme
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    scheme = None if quantize is None else QuantScheme.parse(quantize)
    if scheme is not None and not scheme.emulated and dev.type != "cpu":
        raise ConfigError("--quantize int8 on the transformers backend is CPU-only (torch dynamic quantisation); use an emulated scheme "
                          "(w8a8) or --backend vllm on GPUs")
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"{path} is not a local Hugging Face model directory (no config.json); opdcache never downloads models")
    model = load_causal_lm(path, torch_dtype).to(dev).eval()
    if scheme is not None and scheme.emulated:
        apply_scheme(model, scheme, "inference")
    elif scheme is not None:
        model = model.float()
        from torch.ao.quantization import quantize_dynamic

        head = model.get_output_embeddings()
        with warnings.catch_warnings():  # torch >= 2.10 deprecates torch.ao in favour of torchao; it still works, and needs no extra package
            warnings.filterwarnings("ignore", message=".*quantiz.*deprecated", category=UserWarning)
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            model = quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        # keep the unembedding exact: quantising it too would change what every stored log-prob means
        model.set_output_embeddings(head)
    return model


def _base(model):
    return getattr(model, model.base_model_prefix)


def _head_transform(model):
    """Elementwise logit transforms some models apply after the head (scaling, then soft-capping)."""
    from opdcache.logprobs import head_transform_of

    scale, cap = head_transform_of(model)

    def transform(x: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            x = x * scale
        if cap is not None:
            x = torch.tanh(x / cap) * cap
        return x

    return transform


TOPK_GROUP = 16  # columns per group in the running top-k merge


def _merge_top_k(z: torch.Tensor, offset: int, top_vals: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
    """Merge one [P, C] logit slice (columns ``offset``..) into each row's running top-k, in place; return the
    slice's maximum per row (from the group maxima, which saves the log-sum-exp a pass).

    An element can enter a row's top-k only if it beats the row's current k-th best, so only column groups
    (TOPK_GROUP wide) whose maximum does are gathered, padded per row next to the row's current k, and reduced
    with one narrow top-k. Once a few slices have passed, most rows gather nothing: far cheaper than a top-k
    over every [P, C] slice, which costs microseconds per row whatever its width.
    """
    P, C = z.shape
    k = top_vals.shape[1]
    g = TOPK_GROUP
    kth = top_vals[:, -1]
    if offset == 0 or C % g:  # the first slice (every row takes k new values), or a ragged last one
        slice_max = z.amax(-1)
        r = (slice_max > kth).nonzero(as_tuple=True)[0]
        if len(r):
            cv, ci = z[r].topk(min(k, C), -1)
            merged, order = torch.cat([top_vals[r], cv], 1).topk(k, -1)
            top_ids[r] = torch.cat([top_ids[r], ci + offset], 1).gather(1, order)
            top_vals[r] = merged
        return slice_max
    G = C // g
    groups = z.view(P, g, G)  # group j holds columns j, j + G, j + 2G, ...: its max is an elementwise max of g contiguous rows
    group_max = groups.amax(1)  # [P, G]
    r, gi = (group_max > kth[:, None]).nonzero(as_tuple=True)  # row-major: each row's groups are adjacent
    if not len(r):
        return group_max.amax(-1)
    rows, counts = torch.unique_consecutive(r, return_counts=True)
    R, most = len(rows), int(counts.max())
    slot = torch.arange(len(r), device=z.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    owner = torch.repeat_interleave(torch.arange(R, device=z.device), counts)
    vals = torch.full((R, most, g), float("-inf"), device=z.device)
    ids = torch.zeros((R, most, g), dtype=torch.long, device=z.device)
    vals[owner, slot] = groups[r, :, gi]
    ids[owner, slot] = (offset + gi)[:, None] + G * torch.arange(g, device=z.device)
    merged, order = torch.cat([top_vals[rows], vals.view(R, most * g)], 1).topk(k, -1)
    top_ids[rows] = torch.cat([top_ids[rows], ids.view(R, most * g)], 1).gather(1, order)
    top_vals[rows] = merged
    return group_max.amax(-1)


def streamed_logit_stats(model, hidden_PH: torch.Tensor, sampled_P: torch.Tensor, top_k: int | None,
                         ref_ids_PK: torch.Tensor | None = None, mc_ids_PM: torch.Tensor | None = None,
                         uniforms_PD: torch.Tensor | None = None) -> dict:
    """Log-prob of the sampled token, logsumexp, top-k and log-probs at given ids, streaming over the vocabulary.

    Logits are computed for all P positions against one slice of the unembedding at a time
    ([P, C] float32, C chosen so a block stays under LOGIT_BLOCK_BYTES), with an online log-sum-exp
    (running max m and sum s: lse = m + log s), a running top-k merged slice by slice, and the logits at
    the requested ids picked up in the slice that holds them. Each element is the model's own logit
    (head matmul in the model's dtype, then float32 and the model's transforms), so the values equal those
    of ``model(...).logits`` at those positions, up to the order of the log-sum-exp additions.

    With ``uniforms_PD`` ([P, D] float64 in [0, 1)), also D draws per position from the temperature-1 distribution by
    inverse CDF over the vocabulary order (:func:`_draw_from_slices`): "sid" / "slp" = the drawn ids and their log-probs.
    """
    head = model.get_output_embeddings()
    W, b = head.weight, getattr(head, "bias", None)
    transform = _head_transform(model)
    P, V = hidden_PH.shape[0], W.shape[0]
    C = max(1024, (GPU_LOGIT_BLOCK_BYTES if hidden_PH.device.type == "cuda" else LOGIT_BLOCK_BYTES) // (4 * max(P, 1)))
    dev = hidden_PH.device
    m = torch.full((P,), float("-inf"), device=dev)
    s = torch.zeros(P, device=dev)
    target = torch.empty(P, device=dev)
    top_vals = torch.full((P, top_k or 0), float("-inf"), device=dev)
    top_ids = torch.zeros((P, top_k or 0), dtype=torch.long, device=dev)
    picks = {k: (ids, torch.empty(ids.shape, device=dev)) for k, ids in (("rk", ref_ids_PK), ("mc", mc_ids_PM)) if ids is not None}
    rows = torch.arange(P, device=dev)
    slice_mass = []  # draws: each slice's log-mass per position, [P] float32 each
    for a in range(0, V, C):
        z = hidden_PH @ W[a: a + C].T  # [P, C] in the model's dtype, as the model's own head computes it
        if b is not None:
            z = z + b[a: a + C]
        z = transform(z.float())
        cm = _merge_top_k(z, a, top_vals, top_ids) if top_k else z.amax(-1)
        new_m = torch.maximum(m, cm)
        hit = (sampled_P >= a) & (sampled_P < a + z.shape[1])
        target[hit] = z[rows[hit], sampled_P[hit] - a]
        for ids, out in picks.values():
            inside = (ids >= a) & (ids < a + z.shape[1])
            r, c = inside.nonzero(as_tuple=True)
            out[r, c] = z[r, ids[r, c] - a]
        # exp(z - m) in place, after every read of z. Clamping at -80 changes no float32 sum (each such term is
        # below 2e-35 while the sum is at least 1) and avoids exp's slow path for underflowing inputs.
        in_slice = z.sub_(new_m[:, None]).clamp_(min=-80.0).exp_().sum(-1)
        s = s * torch.exp(m - new_m) + in_slice
        if uniforms_PD is not None:
            slice_mass.append(new_m + torch.log(in_slice))
        m = new_m
    log_s = torch.log(s)
    # log-probs as (z - m) - log s, not z - (m + log s): the subtraction then rounds at |z - m|, not at |lse|
    out = {"lse": m + log_s, "lp": (target - m) - log_s}
    if uniforms_PD is not None:
        out["sid"], out["slp"] = _draw_from_slices(hidden_PH, W, b, transform, C, torch.stack(slice_mass, 1), out["lse"], uniforms_PD)
    if top_k:
        out["kid"], out["klp"] = top_ids, (top_vals - m[:, None]) - log_s[:, None]
    for key, (_, vals) in picks.items():
        out[key] = (vals - m[:, None]) - log_s[:, None]
    return out


def _draw_from_slices(hidden_PH, W, b, transform, C: int, slice_lm_PS: torch.Tensor, lse_P: torch.Tensor,
                      uniforms_PD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draws from softmax(logits) over the vocabulary order, in two levels: each uniform u first picks the
    vocabulary slice whose cumulative mass (from the first pass's per-slice log-masses, float64) passes u, then the
    token inside the slice from that slice's logits, recomputed for the positions that drew into it only. The token is
    min{v : F(v) > u} whatever the slice width, up to float rounding at a CDF boundary (~1e-7 of a draw), so draws do not
    depend on batching or device block sizes. Cost: the head rows of the hit (position, slice) pairs, a fraction of a
    pass when D is small. Memory: [P, slices] float64 and one [positions hitting a slice, C] block."""
    P, D = uniforms_PD.shape
    dev = hidden_PH.device
    lm = slice_lm_PS.double()
    tot = torch.logsumexp(lm, 1, keepdim=True)
    cum = torch.exp(lm - tot).cumsum(1)  # [P, S]
    u = uniforms_PD.to(dev, torch.float64)
    j = torch.searchsorted(cum, u, right=True).clamp_(max=cum.shape[1] - 1)  # [P, D]: the slice of each draw
    before = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(u))
    mass = torch.exp(lm.gather(1, j) - tot)
    frac = ((u - before) / mass).clamp_(0.0, 1.0)  # where inside the slice's own mass the draw falls
    ids = torch.empty((P, D), dtype=torch.long, device=dev)
    lps = torch.empty((P, D), dtype=torch.float32, device=dev)
    for sl in torch.unique(j).tolist():
        r, c = (j == sl).nonzero(as_tuple=True)
        rows, inverse = torch.unique(r, return_inverse=True)
        a = sl * C
        z = hidden_PH[rows] @ W[a: a + C].T
        if b is not None:
            z = z + b[a: a + C]
        z = transform(z.float())
        w = torch.exp((z - z.amax(-1, keepdim=True)).double()).cumsum(-1)
        w = w / w[:, -1:]
        col = torch.searchsorted(w[inverse], frac[r, c][:, None], right=True)[:, 0].clamp_(max=z.shape[1] - 1)
        ids[r, c] = a + col
        lps[r, c] = z[inverse, col] - lse_P[r]
    return ids, lps


def _top_p_mask(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits with tokens outside the top-p nucleus set to -inf (the most likely token always kept)."""
    if top_p >= 1.0:
        return scaled
    probs_sorted, order = torch.softmax(scaled, -1).sort(-1, descending=True)
    drop_sorted = probs_sorted.cumsum(-1) - probs_sorted >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf"))


def log_softmax_into(logits: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits, -1) written into ``out`` (which may be ``logits``): (z - m) - log sum exp(z - m), with
    ``scratch`` (same shape) for the exponentials, so no [B, V] temporary is allocated."""
    m = logits.amax(-1, keepdim=True)
    torch.sub(logits, m, out=out)
    return out.sub_(torch.exp(out, out=scratch).sum(-1, keepdim=True).log_())


class _LastPositionHead:
    """The model's head (and logit transforms) applied to the last position's hidden state, into one [B, V] buffer on
    the model's device that every decode step reuses."""

    def __init__(self, model, batch: int):
        head = model.get_output_embeddings()
        self.weight, self.bias = head.weight, getattr(head, "bias", None)
        self.transform = _head_transform(model)
        self.vocab_size = int(self.weight.shape[0])
        self.out = torch.empty((batch, self.vocab_size), dtype=self.weight.dtype, device=self.weight.device)

    def __call__(self, hidden_BLH: torch.Tensor) -> torch.Tensor:
        torch.matmul(hidden_BLH[:, -1], self.weight.T, out=self.out)
        if self.bias is not None:
            self.out += self.bias
        return self.transform(self.out)


TRIM_EVERY = 64  # decode steps between returns of freed heap memory to the OS


def release_free_heap() -> None:
    """Give freed heap pages back to the OS (glibc ``malloc_trim``). The KV cache grows by one position per step,
    each step's new, larger tensors leave the old ones' space in the heap unusable for the next, and RSS creeps
    up by MBs per step though nothing leaks; trimming every few steps keeps it at what is live. A no-op
    where glibc is absent."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log q for q = softmax(logits / T) restricted to the top-p nucleus, renormalised. [B, V] float32."""
    return torch.log_softmax(_top_p_mask(logits / temperature, top_p), -1)


@contextmanager
def _deterministic(enabled: bool):
    if not enabled:
        yield
        return
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


class TransformersBackend:
    name = "transformers"

    def __init__(self, model_path: str | Path, dtype: str = "auto", device: str = "auto", quantize: str | None = None,
                 deterministic: bool = False, max_batch_tokens: int | None = None, generate_batch_size: int = 64):
        from opdcache.quant import parse_quantize

        spec = None if quantize is None else parse_quantize(quantize).spec()  # the canonical spec is what the manifest records
        self._attach(load_model(model_path, dtype, device, spec), deterministic, max_batch_tokens, generate_batch_size,
                     Path(model_path), spec)

    def _attach(self, model, deterministic: bool, max_batch_tokens: int | None, generate_batch_size: int, path: Path | None = None,
                quantize: str | None = None) -> None:
        import transformers

        self.model, self.path, self.quantize = model, path, quantize
        self.version = transformers.__version__
        self.device = next(model.parameters()).device
        self.dtype = str(next(model.get_output_embeddings().parameters()).dtype).replace("torch.", "")
        self.max_batch_tokens = max_batch_tokens or SCORE_BATCH_TOKENS.get(self.device.type, 1024)
        self.deterministic, self.generate_batch_size = deterministic, generate_batch_size
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(getattr(model.config, "max_position_embeddings", 1 << 20))
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])

    @classmethod
    def from_model(cls, model, deterministic: bool = False) -> "TransformersBackend":
        """Wrap a model already in memory (the online baseline samples from the student being trained)."""
        self = cls.__new__(cls)
        self._attach(model, deterministic, None, 64)
        return self

    def close(self) -> None:
        """Nothing to release (the model is freed with the object); here so every engine can be closed alike."""

    def model_info(self) -> dict:
        return {"engine": self.name, "engine_version": self.version, "dtype": self.dtype, "quantization": self.quantize}

    # ------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingConfig) -> list[Generation]:
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        out: list[Generation | None] = [None] * len(requests)
        for start in range(0, len(order), self.generate_batch_size):
            idx = order[start: start + self.generate_batch_size]
            for i, gen in zip(idx, self._generate_batch([requests[i] for i in idx], sampling)):
                out[i] = gen
            advance(len(idx))
        return out  # type: ignore[return-value]

    def _generate_batch(self, requests: Sequence[GenerateRequest], s: SamplingConfig) -> list[Generation]:
        B = len(requests)
        lengths = [len(r.prompt_ids) for r in requests]
        L = max(lengths)
        input_ids = torch.zeros((B, L), dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for b, r in enumerate(requests):  # left padding: every row's next token goes at the same column
            input_ids[b, L - lengths[b]:] = torch.as_tensor(r.prompt_ids)
            mask[b, L - lengths[b]:] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        gens = [torch.Generator().manual_seed(r.seed) for r in requests]
        # the decoder, then the head at the last position only ([B, V], never [B, L, V]), into buffers reused by every
        # step: a fresh [B, V] logits tensor per step (the model's own forward) fragments the CPU heap and RSS creeps
        head = _LastPositionHead(self.model, B)
        out = _base(self.model)(input_ids=input_ids, attention_mask=mask, position_ids=position, use_cache=True)
        past = out.past_key_values
        V = head.vocab_size
        logits = torch.empty((B, V))
        ref_logp = torch.empty((B, V))
        scratch = torch.empty((B, V))
        samp_buf = torch.empty((B, V)) if s.temperature not in (0, 1) or s.top_p < 1 else None
        logits.copy_(head(out.last_hidden_state))
        next_pos = position[:, -1:] + 1
        done = torch.zeros(B, dtype=torch.bool)  # stopped at an end-of-sequence token (else cut at max_new_tokens)
        n_tokens = torch.zeros(B, dtype=torch.long)
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long)
        steps: dict[str, list[torch.Tensor]] = {k: [] for k in ("tok", "slp", "rlp", "kid", "klp", "mid", "mlp")}
        # uniforms for the Gumbel-max draw, several steps per row at a time; MC samples draw from the same streams
        # between steps, so with them the uniforms are drawn step by step to keep each stream's order
        noise, noise_at = None, 0
        noise_steps = 1 if s.mc_samples else max(1, min(s.max_new_tokens, NOISE_BLOCK_BYTES // (4 * B * self.vocab_size)))
        for t in range(s.max_new_tokens):
            log_softmax_into(logits, ref_logp, scratch)  # [B, V], temperature 1
            if s.temperature == 0:
                tok = ref_logp.argmax(-1)
                samp_logp = torch.full_like(ref_logp, float("-inf")).scatter(-1, tok[:, None], 0.0)
            else:
                if samp_buf is None:
                    samp_logp = ref_logp  # temperature 1, no nucleus: the sampling distribution is pi_ref's
                elif s.top_p < 1:
                    samp_logp = sampling_logprobs(logits, s.temperature, s.top_p)
                else:
                    samp_logp = log_softmax_into(torch.div(logits, s.temperature, out=samp_buf), samp_buf, scratch)
                if noise is None or t - noise_at == noise.shape[1]:
                    noise = None  # let the old block go before drawing the next
                    noise_at, noise = t, self._draw_noise(gens, min(noise_steps, s.max_new_tokens - t), V)
                # Gumbel-max, in place on this step's uniforms (each is used once): -log(-log u) + log q
                gumbel = noise[:, t - noise_at].clamp_min_(1e-20).log_().neg_().log_().neg_()
                tok = gumbel.add_(samp_logp).argmax(-1)
            steps["tok"].append(tok)
            steps["slp"].append(samp_logp.gather(-1, tok[:, None]).squeeze(-1))
            steps["rlp"].append(ref_logp.gather(-1, tok[:, None]).squeeze(-1))
            if s.ref_top_k:
                klp, kid = ref_logp.topk(s.ref_top_k, -1)
                steps["kid"].append(kid)
                steps["klp"].append(klp)
            if s.mc_samples:
                probs = samp_logp.exp()
                mid = torch.stack([torch.multinomial(probs[b], s.mc_samples, replacement=True, generator=gens[b]) for b in range(B)])
                steps["mid"].append(mid)
                steps["mlp"].append(samp_logp.gather(-1, mid))
            n_tokens += ~done
            done |= torch.isin(tok, eos)
            if bool(done.all()) or t == s.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=self.device)], dim=1)
            out = _base(self.model)(input_ids=tok[:, None].to(self.device), attention_mask=mask, position_ids=next_pos,
                                    past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.copy_(head(out.last_hidden_state))
            next_pos = next_pos + 1
            if t % TRIM_EVERY == TRIM_EVERY - 1:
                release_free_heap()
        stacked = {k: torch.stack(v, 1).numpy() for k, v in steps.items() if v}  # [B, steps, ...]
        gens_out = []
        for b in range(B):
            T = int(n_tokens[b])
            g = Generation(
                response_ids=stacked["tok"][b, :T].astype(np.int32), finish_reason="stop" if done[b] else "length",
                sampling_logprobs=stacked["slp"][b, :T].astype(np.float32), ref_logprobs=np.minimum(stacked["rlp"][b, :T], 0).astype(np.float32),
            )
            if s.ref_top_k:
                g.ref_topk_ids = stacked["kid"][b, :T].astype(np.int32)
                g.ref_topk_logprobs = np.minimum(stacked["klp"][b, :T], 0).astype(np.float32)
            if s.mc_samples:
                g.mc_ids = stacked["mid"][b, :T].astype(np.int32)
                g.mc_sampling_logprobs = stacked["mlp"][b, :T].astype(np.float32)
            gens_out.append(g)
        return gens_out

    @staticmethod
    def _draw_noise(gens: list[torch.Generator], steps: int, V: int) -> torch.Tensor:
        """[B, steps, V] uniforms, row b from its own stream: the same numbers as ``steps`` draws of [V] in turn."""
        return torch.stack([torch.rand(steps, V, generator=g) for g in gens])

    # ------------------------------------------------------------ scoring

    def _batches(self, requests: Sequence[ScoreRequest]) -> list[list[int]]:
        if self.deterministic:
            return [[i] for i in range(len(requests))]
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids) + len(requests[i].response_ids))
        batches, current, longest = [], [], 0
        for i in order:
            n = len(requests[i].prompt_ids) + len(requests[i].response_ids)
            if current and max(longest, n) * (len(current) + 1) > self.max_batch_tokens:  # padded tokens
                batches.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, n)
        if current:
            batches.append(current)
        return batches

    @torch.no_grad()
    def score(self, requests: Sequence[ScoreRequest], top_k: int | None = None, hidden: bool = False) -> list[Scores]:
        """Decoder forwards in small batches (bounded activation memory); their hidden rows are pooled into
        blocks of about POSITION_BLOCK positions for the streamed head pass (a large matmul runs at full rate).
        In deterministic mode every sequence is its own batch and its own block."""
        out: list[Scores | None] = [None] * len(requests)
        pending: list[tuple[int, torch.Tensor]] = []
        pooled = 0  # positions in `pending`

        def flush() -> None:
            idx = [i for i, _ in pending]
            for i, sc in zip(idx, self._score_rows([requests[i] for i in idx], torch.cat([h for _, h in pending]), top_k, hidden)):
                out[i] = sc
            pending.clear()
            advance(len(idx))

        with _deterministic(self.deterministic):
            for batch in self._batches(requests):
                hidden_NH, lengths = self.final_hidden([requests[i] for i in batch])
                pending.extend(zip(batch, torch.split(hidden_NH, lengths)))
                pooled += sum(lengths)
                if self.deterministic or pooled >= POSITION_BLOCK:
                    flush()
                    pooled = 0
            if pending:
                flush()
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def hidden_states(self, requests: Sequence[ScoreRequest]) -> torch.Tensor:
        """Final hidden states at every response position of ``requests``, in order: [sum T, H], decoded in the
        same token-budget batches as scoring (activation memory bounded by ``max_batch_tokens``)."""
        parts: list[torch.Tensor | None] = [None] * len(requests)
        for batch in self._batches(requests):
            hidden_NH, lengths = self.final_hidden([requests[i] for i in batch])
            for i, h in zip(batch, torch.split(hidden_NH, lengths)):
                parts[i] = h
        return torch.cat(parts)  # type: ignore[arg-type]

    def final_hidden(self, requests: Sequence[ScoreRequest]) -> tuple[torch.Tensor, list[int]]:
        """Final post-norm hidden states at the response positions, flattened: [sum T, H], and each row's T."""
        for r in requests:
            if len(r.prompt_ids) == 0:
                raise ConfigError("cannot score a sequence with an empty prompt")
        B = len(requests)
        seqs = [list(r.prompt_ids) + list(r.response_ids) for r in requests]
        L = max(map(len, seqs))
        input_ids = torch.zeros((B, L), dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for b, seq in enumerate(seqs):  # right padding: positions are 0..len-1, causal attention ignores the tail
            input_ids[b, : len(seq)] = torch.as_tensor(seq)
            mask[b, : len(seq)] = 1
        h = _base(self.model)(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state  # [B, L, H]
        # the value for response token t is predicted at position len(prompt) + t - 1
        rows = [h[b, len(r.prompt_ids) - 1: len(r.prompt_ids) - 1 + len(r.response_ids)] for b, r in enumerate(requests)]
        return torch.cat(rows), [len(r.response_ids) for r in requests]

    def _score_rows(self, requests: Sequence[ScoreRequest], hidden_NH: torch.Tensor, top_k: int | None, want_hidden: bool) -> list[Scores]:
        lengths = [len(r.response_ids) for r in requests]
        N = hidden_NH.shape[0]
        sampled = torch.cat([torch.as_tensor(np.asarray(r.response_ids, dtype=np.int64)) for r in requests]).to(self.device)
        ref_ids = torch.cat([torch.as_tensor(r.ref_topk_ids.astype(np.int64)) for r in requests]).to(self.device) if requests[0].ref_topk_ids is not None else None
        mc_ids = torch.cat([torch.as_tensor(r.mc_ids.astype(np.int64)) for r in requests]).to(self.device) if requests[0].mc_ids is not None else None
        uniforms = torch.cat([torch.as_tensor(r.uniforms, dtype=torch.float64) for r in requests]) if requests[0].uniforms is not None else None
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("lp", "lse", "kid", "klp", "rk", "mc", "sid", "slp")}
        blocks = max(1, round(N / POSITION_BLOCK))  # equal blocks near POSITION_BLOCK: no small tail block re-reading the whole head
        bounds = [N * i // blocks for i in range(blocks + 1)]
        for start, end in zip(bounds, bounds[1:]):
            sl = slice(start, end)
            stats = streamed_logit_stats(self.model, hidden_NH[sl], sampled[sl], top_k,
                                         None if ref_ids is None else ref_ids[sl], None if mc_ids is None else mc_ids[sl],
                                         None if uniforms is None else uniforms[sl])
            for key, value in stats.items():
                parts[key].append(value)
        cat = {k: torch.cat(v).cpu() for k, v in parts.items() if v}
        result, offset = [], 0
        hidden_cpu = hidden_NH.detach().cpu() if want_hidden else None
        for T in lengths:
            sl = slice(offset, offset + T)
            sc = Scores(logprobs=cat["lp"][sl].clamp(max=0).numpy(), logsumexp=cat["lse"][sl].numpy())
            if top_k:
                sc.topk_ids = cat["kid"][sl].numpy().astype(np.int32)
                sc.topk_logprobs = cat["klp"][sl].clamp(max=0).numpy()
            if "rk" in cat:
                sc.ref_topk_logprobs = cat["rk"][sl].clamp(max=0).numpy()
            if "mc" in cat:
                sc.mc_logprobs = cat["mc"][sl].clamp(max=0).numpy()
            if "sid" in cat:
                sc.sampled_ids, sc.sampled_logprobs = cat["sid"][sl].numpy(), cat["slp"][sl].clamp(max=0).numpy()
            if want_hidden:
                sc.hidden = hidden_cpu[sl].clone()
            result.append(sc)
            offset += T
        return result
