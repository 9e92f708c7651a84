"""The student's log-probs at chosen token ids, streamed over vocabulary slices (never [tokens, vocabulary]).

Every estimator needs log pi_theta(v | position) only at a few ids per position: the sampled token
(lightning, is), the m Monte-Carlo samples (mc), a top-k support (topk-*). With logits z = h W^T (+ b),
optionally scaled and soft-capped (z <- c tanh(z / c)) as the model's own forward does, and the log-partition lse = log sum_v exp(z_v):

    forward:   logprob_{n,k} = z_{n, id_{n,k}} - lse_n
    backward:  dL/dz_{n,v} = sum_k g_{n,k} [v = id_{n,k}] + (g_lse_n - sum_k g_{n,k}) * q_{n,v},   q = softmax(z)

The forward runs one pass over vocabulary slices of width ``chunk`` with an online log-sum-exp (running
maximum m and rescaled sum s; lse = m + log s), picking up the logits at the requested ids in the slice
that holds them. The backward recomputes each slice's logits from h and W, so both passes hold one
[rows, chunk] block at a time, rows bounded by :data:`BLOCK_BYTES` (on a GPU one [rows, V] block of at most
:data:`GPU_BLOCK_BYTES`: :func:`layout`): memory grows with N * K, never with N * V. On a GPU, when every position's
probabilities fit in :data:`KEEP_BYTES` (:func:`keeps_probabilities`), the forward keeps them and the backward skips
the recompute: one head matmul less, for [N, V] float32 within that budget. This is the same online
idea as the teacher-side divergences of opdcache/logits/divergence.py (papers/002), applied to the student.

:func:`logprobs_reference` is the plain full-logits implementation the parity tests compare against.
"""

from __future__ import annotations

import torch

from opdcache.errors import ConfigError

DEFAULT_CHUNK = 8192
BLOCK_BYTES = 64 << 20  # one [rows, chunk] float32 logit block; rows = BLOCK_BYTES // (4 * chunk)
# On a GPU the block takes whole vocabulary rows, as the divergence's uniform path and scoring do there: 8,192-column
# slices in 64 MiB blocks are ~19 slices per pass, each a handful of kernel launches (the launch-bound pattern that made
# GPU scoring 7x slower before its large blocks). Capped at a quarter of the device's free memory.
GPU_BLOCK_BYTES = 1 << 30
# On a GPU the forward's softmax probabilities are kept for the backward when all of them fit in this many bytes (and a
# quarter of the free memory): the backward then needs no second logit matmul. Recomputing them costs a fourth head
# matmul against the full-logits step's three, which is what a fused Lightning step lost to it on an H200 (0.88x, with
# the head a third of the step's work); kept, the step holds [N, V] float32 probabilities, two thirds of what the
# full-logits step holds (its bf16 logits and float32 log-softmax), and still nothing of [N, V] beyond that budget.
KEEP_BYTES = 8 << 30


def _blocks(n: int, rows: int) -> list[slice]:
    return [slice(a, min(a + rows, n)) for a in range(0, n, rows)] or [slice(0, 0)]


def row_blocks(n: int, chunk: int) -> list[slice]:
    """Position blocks of at most BLOCK_BYTES // (4 * chunk) rows: each [rows, chunk] float32 block stays under
    BLOCK_BYTES, so memory does not grow with the number of positions either."""
    return _blocks(n, max(1, BLOCK_BYTES // (4 * chunk)))


def gpu_block_bytes(device: torch.device, most: int, least: int = 0) -> int:
    """A GPU's logit block: ``most`` bytes, at most a quarter of the device's free memory, at least ``least``. The one
    rule for the head pass here and for scoring (opdcache/backends/streamed.py)."""
    free, _ = torch.cuda.mem_get_info(device)
    return max(least, min(most, free // 4))


def layout(n: int, V: int, chunk: int, device: torch.device) -> tuple[list[slice], int]:
    """(position blocks, vocabulary slice width) of the head pass on ``device``. A CPU: ``chunk``-wide slices in
    :func:`row_blocks`. A GPU: the whole vocabulary in one slice, in blocks of :func:`gpu_block_bytes` (GPU_BLOCK_BYTES)
    of float32 logits, at least one row; ``chunk`` (``--chunk``) is then not used."""
    if device.type != "cuda":
        return row_blocks(n, chunk), chunk
    return _blocks(n, max(1, gpu_block_bytes(device, GPU_BLOCK_BYTES) // (4 * V))), V


def keeps_probabilities(n: int, V: int, chunk: int, device: torch.device, softcap: float | None) -> bool:
    """Whether the forward keeps every position's softmax probabilities for the backward (see KEEP_BYTES): on a GPU,
    one vocabulary slice a block (:func:`layout`'s), no soft-capping (its derivative needs the logits), and N x V
    float32 within KEEP_BYTES and a quarter of the free memory. Never on a CPU, whose passes stay in BLOCK_BYTES."""
    if device.type != "cuda" or softcap is not None or chunk < V:
        return False
    return 4 * n * V <= gpu_block_bytes(device, KEEP_BYTES)


def accumulate_(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor, first: bool = False) -> None:
    """out (+)= x @ y in place (``first``: overwrite, out may hold garbage). On CUDA a float32 ``out`` of bf16 / fp16
    products takes the sum in the GEMM itself (``out_dtype``): no product in the narrow dtype to write, read back and
    add (on an H200, [151,936, 4,096] gradients: BENCHMARKS.md). The one rule for every fused head's gradient matmuls."""
    if out.dtype == x.dtype:
        out.addmm_(x, y, beta=0 if first else 1)
    elif out.is_cuda and out.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(out, x, y, out_dtype=torch.float32, beta=0 if first else 1, out=out)
    elif first:
        out.copy_(x @ y)
    else:
        out += x @ y


def _inside(ids: torch.Tensor, a: int, C: int, V: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(column of each id in vocabulary slice [a, a + C), clamped into it; mask of the ids the slice holds, None when
    the slice is the whole vocabulary). A gather or scatter with these needs no host synchronisation, where
    ``nonzero`` would wait for the device at every slice."""
    if C == V:
        return ids, None
    local = ids - a
    return local.clamp(0, C - 1), (local >= 0) & (local < C)


def check_chunk(chunk: int) -> int:
    if not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"--chunk (vocabulary slice width) must be a positive integer, got {chunk!r}")
    return chunk


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    return torch.float64 if h.dtype == torch.float64 else torch.float32


def matmul_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype the forward's logit matmuls run in: autocast's where it is on for h's device (as the model's own head
    would run), else h's. The backward's gradient matmuls use it too (autocast is off in a backward): in float32
    they ran 3x slower than the full-logits step on an H100 (benchmarks/bench_gpu.py)."""
    if torch.is_autocast_enabled(h.device.type):
        return torch.get_autocast_dtype(h.device.type)
    return h.dtype


def _slice_logits(h, W, b, a: int, c: int, scale: float | None, softcap: float | None, dtype) -> torch.Tensor:
    """Logits of vocabulary slice [a, a + c): the matmul in the inputs' dtype (bf16 stays bf16), then ``dtype``."""
    z = (h @ W[a: a + c].T.to(h.dtype)).to(dtype)
    if b is not None:
        z += b[a: a + c].to(dtype)
    if scale is not None:
        z *= scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


class _ChunkedLogprobs(torch.autograd.Function):
    """All N positions in one autograd node, looping over row blocks inside: the backward allocates the head's
    [V, H] gradient once and accumulates every block into it (a node per block would hand autograd one [V, H]
    gradient each, two of them alive while it sums them)."""

    @staticmethod
    def forward(ctx, h, W, b, ids, chunk: int, scale, softcap):
        dtype = _compute_dtype(h)
        N, V = h.shape[0], W.shape[0]
        lse = torch.empty(N, dtype=dtype, device=h.device)
        out = torch.empty(ids.shape, dtype=dtype, device=h.device)
        blocks, chunk = layout(N, V, chunk, h.device)
        kept = [] if any(ctx.needs_input_grad[:3]) and keeps_probabilities(N, V, chunk, h.device, softcap) else None
        for rows in blocks:
            hb, ib = h[rows], ids[rows]
            m = torch.full((hb.shape[0],), float("-inf"), dtype=dtype, device=h.device)
            s = torch.zeros(hb.shape[0], dtype=dtype, device=h.device)
            picked = torch.zeros(ib.shape, dtype=dtype, device=h.device)
            for a in range(0, V, chunk):
                z = _slice_logits(hb, W, b, a, chunk, scale, softcap, dtype)  # [rows, C]
                col, held = _inside(ib, a, z.shape[1], V)
                picked = z.gather(1, col) if held is None else torch.where(held, z.gather(1, col), picked)
                new_m = torch.maximum(m, z.amax(-1))
                s = s * torch.exp(m - new_m) + z.sub_(new_m[:, None]).exp_().sum(-1)
                m = new_m
            lse[rows] = m + torch.log(s)
            # (z - m) - log s rather than z - (m + log s): the subtraction then rounds at |z - m|, not at |lse|
            out[rows] = (picked - m[:, None]) - torch.log(s)[:, None]
            if kept is not None:  # one slice (keeps_probabilities): z holds exp(z - m) of the whole vocabulary
                kept.append(z.div_(s[:, None]))
        ctx.save_for_backward(h, W, b if b is not None else torch.empty(0), ids, lse)
        ctx.blocks, ctx.chunk, ctx.scale, ctx.softcap, ctx.has_b, ctx.mm = blocks, chunk, scale, softcap, b is not None, matmul_dtype(h)
        ctx.kept = kept
        return out.to(h.dtype), lse.to(h.dtype)

    @staticmethod
    def backward(ctx, g_lp, g_lse):
        h, W, b, ids, lse = ctx.saved_tensors
        b = b if ctx.has_b else None
        dtype = lse.dtype
        g_lp = torch.zeros(ids.shape, dtype=dtype, device=h.device) if g_lp is None else g_lp.to(dtype)
        g_lse = torch.zeros_like(lse) if g_lse is None else g_lse.to(dtype)
        coef = g_lse - g_lp.sum(-1)  # [N]: weight of softmax(z) in dL/dz
        need_h, need_W, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros(h.shape, dtype=dtype, device=h.device) if need_h else None
        grad_W = torch.zeros(W.shape, dtype=dtype, device=W.device) if need_W else None
        grad_b = torch.zeros(W.shape[0], dtype=dtype, device=W.device) if need_b and b is not None else None
        mm = ctx.mm
        V = W.shape[0]
        for j, rows in enumerate(ctx.blocks):
            hm, ib, gb = h[rows].to(mm), ids[rows], g_lp[rows]
            for a in range(0, V, ctx.chunk):
                if ctx.kept is not None and ctx.kept[j] is not None:  # the forward's probabilities (one slice a block), used once
                    z, ctx.kept[j] = ctx.kept[j], None
                    C, capped = z.shape[1], None
                    dz = z.mul_(coef[rows, None])
                else:
                    z = _slice_logits(hm, W, b, a, ctx.chunk, ctx.scale, ctx.softcap, dtype)
                    C = z.shape[1]
                    capped = z.clone() if ctx.softcap is not None else None
                    dz = z.sub_(lse[rows, None]).exp_().mul_(coef[rows, None])  # (g_lse - sum g) * q
                col, held = _inside(ib, a, C, V)  # + sum_k g_k [v = id_k]; ids outside the slice add 0
                dz.scatter_add_(1, col, gb if held is None else torch.where(held, gb, 0))
                if capped is not None:  # d(c tanh(x / c))/dx = 1 - tanh(x / c)^2 = 1 - (capped / c)^2
                    t = capped.div_(ctx.softcap)
                    dz.mul_(1 - t * t)
                if ctx.scale is not None:
                    dz.mul_(ctx.scale)
                dzm = dz.to(mm)  # the gradient matmuls in the forward's matmul dtype, accumulated in float32
                if grad_h is not None:
                    accumulate_(grad_h[rows], dzm, W[a: a + C].to(mm))
                if grad_W is not None:
                    accumulate_(grad_W[a: a + C], dzm.T, hm)
                if grad_b is not None:
                    grad_b[a: a + C] += dz.sum(0)
        return (None if grad_h is None else grad_h.to(h.dtype), None if grad_W is None else grad_W.to(W.dtype),
                None if grad_b is None else grad_b.to(W.dtype), None, None, None, None)


def chunked_logprobs(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, ids_NK: torch.Tensor, bias_V: torch.Tensor | None = None,
                     chunk: int = DEFAULT_CHUNK, logit_scale: float | None = None, softcap: float | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs at ``ids_NK`` [N, K], log-partition [N]) of softmax(hidden @ weight.T + bias), both differentiable.

    Computed in float32 (float64 inputs stay float64), in blocks of positions each streamed over vocabulary slices
    (:func:`layout`): transient memory O(BLOCK_BYTES) on a CPU and O(GPU_BLOCK_BYTES) on a GPU whatever N and V, plus the
    [N, K] outputs.
    """
    check_chunk(chunk)
    if hidden_NH.dim() != 2 or weight_VH.dim() != 2 or hidden_NH.shape[1] != weight_VH.shape[1]:
        raise ValueError(f"hidden [N, H] and weight [V, H] do not match: {tuple(hidden_NH.shape)} vs {tuple(weight_VH.shape)}")
    if ids_NK.dim() != 2 or ids_NK.shape[0] != hidden_NH.shape[0]:
        raise ValueError(f"ids must be [N, K] with N = {hidden_NH.shape[0]}, got {tuple(ids_NK.shape)}")
    if ids_NK.numel() and (int(ids_NK.min()) < 0 or int(ids_NK.max()) >= weight_VH.shape[0]):
        raise ValueError(f"token ids must lie in [0, {weight_VH.shape[0]}), got {int(ids_NK.min())}..{int(ids_NK.max())}")
    return _ChunkedLogprobs.apply(hidden_NH, weight_VH, bias_V, ids_NK.long(), chunk, logit_scale, softcap)


def logprobs_reference(hidden_NH, weight_VH, ids_NK, bias_V=None, logit_scale=None, softcap=None):
    """The plain implementation: full [N, V] logits and log_softmax. For tests and benchmarks only."""
    dtype = _compute_dtype(hidden_NH)
    z = (hidden_NH @ weight_VH.T).to(dtype)
    if bias_V is not None:
        z = z + bias_V.to(dtype)
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    lp = torch.log_softmax(z, -1)
    return lp.gather(-1, ids_NK.long()).to(hidden_NH.dtype), torch.logsumexp(z, -1).to(hidden_NH.dtype)


def head_transform_of(model) -> tuple[float | None, float | None]:
    """(logit_scale, final_logit_softcapping) of a transformers causal LM's config, as its forward applies them."""
    cfg = model.config
    return getattr(cfg, "logit_scale", None), getattr(cfg, "final_logit_softcapping", None)
