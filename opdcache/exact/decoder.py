"""The decoder forward in the exact arithmetic (opdcache/exact/arith.py): one model code for sampling, scoring and
learning, so the three give the same bits.

It reads the weights of a loaded transformers model (Llama, Mistral, Qwen2, Qwen3 families) and runs the same maths
as their forward: RMSNorm, rotary embeddings, grouped-query causal attention, SwiGLU MLP; with every reduction exact.
Keys sit at their logical positions (a row's padding is always after its tokens), so a query's attention row over a
KV cache of t + 1 keys and the same row inside a full forward over L > t keys differ only by masked zeros appended,
which the exact sums ignore: KV-cache decoding equals the full forward, whatever the batch, the padding or the
thread count. Activations are rounded to the model's dtype where transformers' own forward rounds them (float32 or
bfloat16), so an exact bfloat16 run is a bfloat16 run.

Memory: the model's activations for one forward ([B, L, hidden] per layer, and [B, heads, QUERY_BLOCK, L] attention
scores per block of queries, so nothing grows with L^2; the key/value cache is read in place, never repeated per
query head), a float64 copy of each weight (8 bytes per parameter, kept
while the weights do not change), and for decoding a KV cache of [B, kv heads, capacity, head dim] per layer.
"""

from __future__ import annotations

import math

import torch

from opdcache.errors import ConfigError
from opdcache.exact import arith as X

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
QUERY_BLOCK = 256  # queries per attention block: scores are [B, heads, QUERY_BLOCK, keys]


def check_supported(config) -> None:
    """Refuse, in one line, a model the exact forward does not implement (before any weight is read)."""
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        raise ConfigError(f"--exact supports the {', '.join(FAMILIES)} model families, got model_type {kind!r}; "
                          "run without --exact (and measure the mismatch with mismatch-report)")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ConfigError(f"--exact supports the default rotary embedding, got rope_type {rope.get('rope_type')!r}; run without --exact")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"--exact supports silu MLPs, got hidden_act {config.hidden_act!r}; run without --exact")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", kind == "mistral"):
        raise ConfigError("--exact does not implement sliding-window attention; run without --exact")
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        raise ConfigError("--exact does not implement logit scaling or soft-capping; run without --exact")


def _rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


class RotaryTable:
    """cos and sin of position x frequency, each value round32(libm(p * f)) computed by Python's math one element at
    a time, so a position's values do not depend on how long the table is. Grows by doubling."""

    def __init__(self, theta: float, head_dim: int):
        self.freqs = [1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)]
        self.cos = torch.empty(0, head_dim)
        self.sin = torch.empty(0, head_dim)

    def tables(self, positions: torch.Tensor, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 tables [n, head dim], n past every position (``end``, when the caller knows it, saves reading
        the largest position back), where ``positions`` are."""
        need = end if end is not None else int(positions.max()) + 1 if positions.numel() else 0
        if need > self.cos.shape[0]:
            n = max(need, 2 * self.cos.shape[0], 64)
            angles = [[p * f for f in self.freqs] for p in range(n)]
            cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64).float()
            sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64).float()
            self.cos, self.sin = torch.cat([cos, cos], -1).to(positions.device), torch.cat([sin, sin], -1).to(positions.device)
        if self.cos.device != positions.device:  # the table lives where the positions are (built once per device)
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        return self.cos, self.sin


class ExactDecoder:
    """The decoder of ``model`` (a transformers causal LM of a supported family) in the exact arithmetic."""

    def __init__(self, model, dtype: torch.dtype | None = None, round_activations: torch.dtype | None = None, arith=X):
        """``round_activations``: round each layer's output to this dtype (injected mismatch, opdcache/backends/exact.py).
        ``arith``: the arithmetic's primitives, opdcache/exact/arith.py (any CPU, the same bits everywhere) or
        opdcache/exact/invariant.py (batch-invariant GPU kernels)."""
        cfg = model.config
        self.arith = arith
        self.round_activations = round_activations
        check_supported(cfg)
        self.model = model
        self.base = getattr(model, model.base_model_prefix)
        self.dtype = dtype or self.base.embed_tokens.weight.dtype
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scaling = self.head_dim ** -0.5
        self.rope = RotaryTable(_rope_theta(cfg), self.head_dim)

    # ------------------------------------------------------------------ pieces
    def linear(self, module, x: torch.Tensor) -> torch.Tensor:
        """A linear layer (or an emulated low-bit one, opdcache/backends/quant.py) in the exact arithmetic, in the model's dtype."""
        w = module.weight
        scheme = getattr(module, "_opd_scheme", None)
        if scheme is not None:
            if module._opd_train:
                w = w + (scheme.weight(w) - w).detach()
            if scheme.quantizes_activations:
                x = x + (scheme.activation(x) - x).detach()
        return self.arith.linear(x.to(self.dtype), w.to(self.dtype), module.bias, out_dtype=self.dtype)

    def linears(self, modules: list, x: torch.Tensor) -> list[torch.Tensor]:
        """Several linear layers reading the same x (q, k, v; gate, up) as one exact matmul over their stacked weights:
        every output element is the same dot product, so the same bits, with one call's overhead instead of several."""
        if any(getattr(m, "_opd_train", False) for m in modules) or len({getattr(m, "_opd_scheme", None) for m in modules}) > 1:
            return [self.linear(m, x) for m in modules]
        scheme = getattr(modules[0], "_opd_scheme", None)
        if scheme is not None and scheme.quantizes_activations:
            x = x + (scheme.activation(x) - x).detach()
        weights = [m.weight for m in modules]
        if any(w.requires_grad for w in weights) and torch.is_grad_enabled():
            w = torch.cat(weights).to(self.dtype)
            b = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
        else:
            key = tuple((id(w), w._version) for w in weights) + (self.dtype,)
            hit = getattr(modules[0], "_opd_fused", None)
            if hit is None or hit[0] != key:
                w = torch.cat([w.detach() for w in weights]).to(self.dtype)
                b = None if modules[0].bias is None else torch.cat([m.bias.detach() for m in modules])
                modules[0]._opd_fused = hit = (key, w, b)
            w, b = hit[1], hit[2]
        y = self.arith.linear(x.to(self.dtype), w, b, out_dtype=self.dtype)
        return list(torch.split(y, [m.weight.shape[0] for m in modules], dim=-1))

    def norm(self, module, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm: x / sqrt(mean(x^2) + eps) in float32, then the weight in the model's dtype (the arithmetic's
        ``rms_norm``: arith.py's composite of its primitives, the GPU arithmetic's one kernel)."""
        return self.arith.rms_norm(x, module.weight, module.variance_epsilon, self.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        """Causal attention of queries q [B, h, Q, d] at positions qpos [B, Q] over keys k, v [B, kv, K, d] held at
        positions 0..K-1; key j is seen by a query at position p iff j <= p. Returns [B, h, Q, d] in the model's dtype.
        The query heads that share a key head are stacked as rows of one product with it (grouped-query attention
        without repeating the cache: every score is the same dot product, so the same bits, at 1 / rep of the copies)."""
        B, h, Q, d = q.shape
        kv = self.kv_heads
        rep = h // kv
        kT = k.transpose(-1, -2)
        out = []
        for qb, pb in zip(q.split(QUERY_BLOCK, 2), qpos.split(QUERY_BLOCK, 1)):  # split: a slice's backward would zero all Q
            Qb = qb.shape[2]
            qg = qb.reshape(B, kv, rep * Qb, d)  # head g * rep + r reads key head g: rows (r, query) of group g
            scores = self.arith.matmul(qg, kT)  # [B, kv, rep x Qb, K]
            p = self.arith.attention_probs(scores, pb, self.scaling, self.dtype)
            out.append(self.arith.matmul(p, v, out_dtype=self.dtype).reshape(B, h, Qb, d))
        return torch.cat(out, 2)

    def layer(self, layer, h: torch.Tensor, pos: torch.Tensor, cache: tuple | None = None, end: int | None = None,
              segments: tuple[int, ...] | None = None) -> torch.Tensor:
        """One decoder layer over h [B, Q, H] at positions pos [B, Q]. Without a cache the Q tokens are the whole
        sequences (positions 0..Q-1); with one, their keys and values are written into it at ``pos`` first, and
        attention reads the cache's first ``end`` positions (default: up to the largest of ``pos``, which reads it
        back from the device; a decode loop passes what it knows). ``segments``: h is [1, Q], sequences end to end
        starting at these offsets (each at positions 0, 1, ...), each attending within itself."""
        attn, B, Q = layer.self_attn, h.shape[0], h.shape[1]
        x = self.norm(layer.input_layernorm, h)
        q, k, v = self.linears([attn.q_proj, attn.k_proj, attn.v_proj], x)
        q = q.reshape(B, Q, self.heads, self.head_dim)
        k = k.reshape(B, Q, self.kv_heads, self.head_dim)
        v = v.reshape(B, Q, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
            q, k = self.norm(attn.q_norm, q), self.norm(attn.k_norm, k)
        cos, sin = self.rope.tables(pos, end)
        q, k = self.arith.rotary(q, pos, cos, sin, self.dtype), self.arith.rotary(k, pos, cos, sin, self.dtype)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, Q, d]
        if cache is not None:
            K_cache, V_cache = cache
            rows = torch.arange(B, device=h.device)[:, None]
            K_cache.transpose(1, 2)[rows, pos] = k.transpose(1, 2)
            V_cache.transpose(1, 2)[rows, pos] = v.transpose(1, 2)
            end = int(pos.max()) + 1 if end is None else end
            k, v = K_cache[:, :, :end], V_cache[:, :, :end]
        if segments is None:
            o = self.attend(q, k, v, pos)
        else:  # each sequence alone: the same products and sums as its right-padded row, without the padding (split,
            # not sliced: a slice's backward writes into a zero tensor of all Q tokens, B x Q a layer for B sequences)
            sizes = [b - a for a, b in zip(segments[:-1], segments[1:])]
            o = torch.cat([self.attend(*parts) for parts in zip(q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2),
                                                                 pos.split(sizes, 1)) if parts[0].shape[2]], 2)
        o = o.transpose(1, 2).reshape(B, Q, self.heads * self.head_dim)
        h = h + self.linear(attn.o_proj, o)
        x = self.norm(layer.post_attention_layernorm, h)
        mlp = layer.mlp
        gate, up = self.linears([mlp.gate_proj, mlp.up_proj], x)
        act = self.arith.silu(gate.float()).to(self.dtype)
        return h + self.linear(mlp.down_proj, act * up)

    # ------------------------------------------------------------------ entry points
    def forward(self, input_ids_BL: torch.Tensor) -> torch.Tensor:
        """Final post-norm hidden states [B, L, H] of right-padded rows (a row's token t at position t; what
        follows a row's end does not change its values). Differentiable."""
        B, L = input_ids_BL.shape
        pos = torch.arange(L, device=input_ids_BL.device).expand(B, L)
        h = self.base.embed_tokens(input_ids_BL).to(self.dtype)
        for layer in self.base.layers:
            h = self._rounded(self.layer(layer, h, pos, end=L))
        return self.norm(self.base.norm, h)

    def forward_packed(self, input_ids_1N: torch.Tensor, position_ids_1N: torch.Tensor, offsets: tuple[int, ...]) -> torch.Tensor:
        """Final post-norm hidden states [1, N, H] of sequences laid end to end (opdcache/training/packing.py): each
        sequence starts at ``offsets`` (host-side ints) at position 0. Every token's values are the bits
        :meth:`forward` gives it in its right-padded row (the arithmetic does not depend on the rows beside a token,
        and a row's padding adds exact zeros). Differentiable."""
        h = self.base.embed_tokens(input_ids_1N).to(self.dtype)
        end = max((b - a for a, b in zip(offsets[:-1], offsets[1:])), default=0)  # one past every position, from the host
        for layer in self.base.layers:
            h = self._rounded(self.layer(layer, h, position_ids_1N, end=end, segments=offsets))
        return self.norm(self.base.norm, h)

    def _rounded(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.round_activations is None else h.to(self.round_activations).to(h.dtype)

    def new_cache(self, batch: int, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A zeroed KV cache (zeros: masked keys then add exact zeros, never NaN) for ``capacity`` positions."""
        shape = (batch, self.kv_heads, capacity, self.head_dim)
        device = self.base.embed_tokens.weight.device
        return [(torch.zeros(shape, dtype=self.dtype, device=device), torch.zeros(shape, dtype=self.dtype, device=device))
                for _ in self.base.layers]

    def step(self, ids_BQ: torch.Tensor, pos_BQ: torch.Tensor, cache, end: int | None = None) -> torch.Tensor:
        """Tokens ids_BQ at positions pos_BQ through every layer, their keys and values written into ``cache``:
        final hidden states [B, Q, H]. A prefill is a step with Q = the longest prompt (right-padded). ``end``: one
        past the largest position, when the caller knows it (no device read then)."""
        h = self.base.embed_tokens(ids_BQ).to(self.dtype)
        end = int(pos_BQ.max()) + 1 if end is None else end
        for layer, kv in zip(self.base.layers, cache):
            h = self._rounded(self.layer(layer, h, pos_BQ, kv, end))
        return self.norm(self.base.norm, h)
