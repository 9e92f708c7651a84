"""Exact full-vocabulary divergences between student and teacher, computed in vocabulary chunks (papers/002).

Student logits z_s = h_s W_s^T (+ b_s) and teacher logits z_t = h_t W_t^T (+ b_t) exist only one vocabulary
slice at a time ([N, C]); neither the forward nor the backward ever holds a [tokens, vocabulary] tensor.
The teacher side is the stored hidden state with ``head.safetensors``, or the svd state z with the svd
decoder; the student side is fused the same way from the student's final hidden state and its own head.

With q = softmax(z_s) (student), p = softmax(z_t) (teacher), m = (p + q) / 2, per position:

* ``fkl``: KL(p || q) = sum_v p_v (log p_v - log q_v);     d/dz_s = q - p
* ``rkl``: KL(q || p) = sum_v q_v (log q_v - log p_v);     d/dz_s = q * (log q - log p - KL(q || p))
* ``jsd``: (KL(p || m) + KL(q || m)) / 2;                   d/dz_s = q * (g - sum_u q_u g_u), g = log(q / m) / 2

Two ways through the head, the same values and gradients (:func:`divergence_reference`, naive float64, in the
parity tests):

* **per position** (the default): the forward streams vocabulary slices of width ``chunk`` -- FKL and RKL in one
  online pass (running maxima, rescaled accumulators), JSD in two (log-partitions first, then the mixture terms) --
  and the backward recomputes each slice: 6 head matmuls for both sides, whatever weights the caller's reduction
  gives each position.
* **uniform** (``uniform=True``, the trainer's mean over tokens; on a GPU with triton through the fused kernel of
  opdcache/logits/kernels.py, :func:`_fused_row_pass`): the caller promises one weight for every position,
  so the gradient is known up to that scalar at forward time (Liger's fused-linear trick). Position blocks of
  ``rows = UNIFORM_BLOCK_BYTES // (4 V)`` hold whole vocabulary rows, so one block gives the log-partitions, the
  value and dz; grad h and grad W are accumulated then, and the backward only scales them: 4 head matmuls. A backward whose
  weights are not uniform after all still gets the exact gradient, recomputed the same way.
"""

from __future__ import annotations

import torch

from opdcache.logits import kernels
from opdcache.logits.logprobs import accumulate_, check_chunk, gpu_block_bytes, matmul_dtype, row_blocks

KINDS = ("fkl", "rkl", "jsd")
DEFAULT_CHUNK = 4096


def _logits(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, a: int, c: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits of vocabulary slice [a, a + c): the matmul in h's dtype, the result in ``dtype`` (default h's)."""
    dtype = dtype or h.dtype
    z = (h @ W[a: a + c].T.to(h.dtype)).to(dtype)
    if b is not None:
        z = z + b[a: a + c].to(dtype)
    return z


def _lse(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """[N, 2]: the running maximum m and log s of the online log-sum-exp (lse = m + log s, kept apart so that a
    log-prob is computed as (z - m) - log s and rounds at |z - m| rather than at |lse|)."""
    m = torch.full((h.shape[0],), float("-inf"), dtype=dtype, device=h.device)
    s = torch.zeros(h.shape[0], dtype=dtype, device=h.device)
    for a in range(0, W.shape[0], chunk):
        z = _logits(h, W, b, a, chunk, dtype)
        new_m = torch.maximum(m, z.amax(-1))
        s = s * torch.exp(m - new_m) + torch.exp(z - new_m[:, None]).sum(-1)
        m = new_m
    return torch.stack([m, torch.log(s)], -1)


def _log_probs(z: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """log softmax of a slice in place: (z - m) - log s, with lse2 = [m, log s] per row."""
    return z.sub_(lse2[:, :1]).sub_(lse2[:, 1:])


def _slice_terms(zs: torch.Tensor, zt: torch.Tensor, lse_s: torch.Tensor, lse_t: torch.Tensor):
    """(log q, log p, q, p) of one slice (zs and zt are overwritten)."""
    lq, lp = _log_probs(zs, lse_s), _log_probs(zt, lse_t)
    return lq, lp, lq.exp(), lp.exp()


def _mixture_log(lq: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    return torch.logaddexp(lq, lp) - torch.log(torch.tensor(2.0, dtype=lq.dtype))


def _online_kl(kind: str, hs, Ws, bs, ht, Wt, bt, chunk: int, dtype: torch.dtype):
    """One pass over the vocabulary for KL(p || q) or KL(q || p), with running maxima (papers/002's online form).

    KL(p || q) = sum_v p_v (z_t - z_s)_v - lse_t + lse_s; the expectation under p is accumulated as
    sum_v exp(z_t - m_t)(z_t - z_s) and rescaled whenever the running max m_t grows (and symmetrically for q).
    """
    N = hs.shape[0]
    ms = torch.full((N,), float("-inf"), dtype=dtype, device=hs.device)
    mt = ms.clone()
    ss, st, acc = (torch.zeros(N, dtype=dtype, device=hs.device) for _ in range(3))
    for a in range(0, Ws.shape[0], chunk):
        zs, zt = _logits(hs, Ws, bs, a, chunk, dtype), _logits(ht, Wt, bt, a, chunk, dtype)
        new_s, new_t = torch.maximum(ms, zs.amax(-1)), torch.maximum(mt, zt.amax(-1))
        es, et = torch.exp(zs - new_s[:, None]), torch.exp(zt - new_t[:, None])
        ss = ss * torch.exp(ms - new_s) + es.sum(-1)
        st = st * torch.exp(mt - new_t) + et.sum(-1)
        if kind == "fkl":
            acc = acc * torch.exp(mt - new_t) + (et * (zt - zs)).sum(-1)
        else:
            acc = acc * torch.exp(ms - new_s) + (es * (zs - zt)).sum(-1)
        ms, mt = new_s, new_t
    lse_s, lse_t = torch.stack([ms, torch.log(ss)], -1), torch.stack([mt, torch.log(st)], -1)
    # KL = E[z_a - z_b] - (m_a - m_b) - (log s_a - log s_b): the maxima and log-sums cancel separately
    if kind == "fkl":
        return lse_s, lse_t, acc / st - (mt - ms) - (lse_t[:, 1] - lse_s[:, 1])
    return lse_s, lse_t, acc / ss - (ms - mt) - (lse_s[:, 1] - lse_t[:, 1])


def _block_forward(kind: str, hs_, Ws, bs, ht_, Wt, bt, chunk: int, dtype):
    """(lse_s, lse_t, divergence, aux) [rows] of one block of positions, streamed over vocabulary slices."""
    if kind in ("fkl", "rkl"):
        lse_s, lse_t, div = _online_kl(kind, hs_, Ws, bs, ht_, Wt, bt, chunk, dtype)
        return lse_s, lse_t, div, div
    lse_s, lse_t = _lse(hs_, Ws, bs, chunk, dtype), _lse(ht_, Wt, bt, chunk, dtype)
    div = torch.zeros(hs_.shape[0], dtype=dtype, device=hs_.device)
    aux = torch.zeros_like(div)  # sum_v q_v g_v with g = log(q / m) / 2 (needed by the backward)
    for a in range(0, Ws.shape[0], chunk):
        lq, lp, q, p = _slice_terms(_logits(hs_, Ws, bs, a, chunk, dtype), _logits(ht_, Wt, bt, a, chunk, dtype), lse_s, lse_t)
        lm = _mixture_log(lq, lp)
        kl_qm = (q * (lq - lm)).sum(-1)
        div += 0.5 * ((p * (lp - lm)).sum(-1) + kl_qm)
        aux += 0.5 * kl_qm
    return lse_s, lse_t, div, aux


class _ChunkedDivergence(torch.autograd.Function):
    """All N positions in one autograd node, in blocks of opdcache.logits.logprobs.row_blocks inside: the backward
    allocates grad W [V, H] once for every block (a node per block would hand autograd one [V, H] gradient each)."""

    @staticmethod
    def forward(ctx, hs, Ws, bs, ht, Wt, bt, kind: str, chunk: int):
        # the logit matmuls in the dtype the model's own head would use (autocast's, else the inputs'); everything
        # after them in float32 at least (float64 stays float64 for gradcheck)
        dtype = torch.float64 if hs.dtype == torch.float64 else torch.float32
        mm = matmul_dtype(hs)
        N = hs.shape[0]
        lse_s, lse_t = (torch.empty(N, 2, dtype=dtype, device=hs.device) for _ in range(2))  # [m, log s] per position
        div, aux = (torch.empty(N, dtype=dtype, device=hs.device) for _ in range(2))
        for rows in row_blocks(N, chunk):
            lse_s[rows], lse_t[rows], div[rows], aux[rows] = _block_forward(kind, hs[rows].to(mm), Ws, bs, ht[rows].to(mm), Wt, bt, chunk, dtype)
        ctx.save_for_backward(hs, Ws, bs if bs is not None else torch.empty(0), ht, Wt, bt if bt is not None else torch.empty(0),
                              lse_s, lse_t, aux)
        ctx.kind, ctx.chunk, ctx.has_bs, ctx.has_bt, ctx.mm = kind, chunk, bs is not None, bt is not None, mm
        return div.to(hs.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        hs, Ws, bs, ht, Wt, bt, lse_s, lse_t, aux = ctx.saved_tensors
        bs = bs if ctx.has_bs else None
        bt = bt if ctx.has_bt else None
        dtype, mm = lse_s.dtype, ctx.mm
        g = grad_out.to(dtype)
        need_h, need_W, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.zeros(hs.shape, dtype=dtype, device=hs.device) if need_h else None
        grad_W = torch.zeros(Ws.shape, dtype=dtype, device=Ws.device) if need_W else None
        grad_b = torch.zeros(Ws.shape[0], dtype=dtype, device=Ws.device) if need_b and bs is not None else None
        for rows in row_blocks(hs.shape[0], ctx.chunk):
            hs_, ht_ = hs[rows].to(mm), ht[rows].to(mm)
            for a in range(0, Ws.shape[0], ctx.chunk):
                # in place: one [rows, C] buffer per side, so the backward holds ~3 slices at a time
                lq = _log_probs(_logits(hs_, Ws, bs, a, ctx.chunk, dtype), lse_s[rows])
                lp = _log_probs(_logits(ht_, Wt, bt, a, ctx.chunk, dtype), lse_t[rows])
                if ctx.kind == "fkl":
                    dz = lq.exp_().sub_(lp.exp_())  # q - p
                elif ctx.kind == "rkl":
                    q = lq.exp()
                    dz = lq.sub_(lp).sub_(aux[rows, None]).mul_(q)  # q (log q - log p - KL)
                else:
                    q = lq.exp()
                    dz = lq.sub_(_mixture_log(lq, lp)).mul_(0.5).sub_(aux[rows, None]).mul_(q)  # q (g - E_q g)
                dz.mul_(g[rows, None])  # [rows, C]
                dzm = dz.to(mm)  # the gradient matmuls in the forward's matmul dtype, accumulated in float32
                if grad_h is not None:
                    grad_h[rows] += dzm @ Ws[a: a + ctx.chunk].to(mm)
                if grad_W is not None:
                    grad_W[a: a + ctx.chunk] += dzm.T @ hs_
                if grad_b is not None:
                    grad_b[a: a + ctx.chunk] += dz.sum(0)
        return (None if grad_h is None else grad_h.to(hs.dtype), None if grad_W is None else grad_W.to(Ws.dtype),
                None if grad_b is None else grad_b.to(Ws.dtype), None, None, None, None, None)


UNIFORM_BLOCK_BYTES = 128 << 20  # one [rows, V] float32 block of the uniform path (two are held: student and teacher)
GPU_UNIFORM_BLOCK_BYTES = 1 << 30  # on a GPU: the same, larger (a kernel launch per piece would bound small blocks)
INNER_CHUNK = 2048  # CPU: vocabulary columns per matmul and per elementwise piece inside a block


def _uniform_layout(V: int, device: torch.device) -> tuple[int, int]:
    """(positions per whole-vocabulary block, columns per piece) of the uniform path. CPU: 128 MiB blocks (220
    positions at V = 151,936) in 2,048-column pieces. Each block streams both heads (and reads and writes grad W)
    once, so fewer, larger blocks move less memory: on 2 CPU cores at hidden 1,024 and 2,048 positions, blocks of 64
    MiB took 31-41 s where 128 MiB took 29 s (kl_div: 33-36 s). A GPU takes 1 GiB blocks (at most a quarter of its free
    memory: opdcache.logits.logprobs.gpu_block_bytes) in one piece: its matmuls need no packing, and narrower pieces cost a
    launch each (an H200 sweep, BENCHMARKS.md: 1 GiB whole rows 0.062 s, 256 MiB in 16,384-column pieces 0.094 s)."""
    if device.type == "cuda":
        return max(1, gpu_block_bytes(device, GPU_UNIFORM_BLOCK_BYTES) // (4 * V)), V
    return max(1, UNIFORM_BLOCK_BYTES // (4 * V)), INNER_CHUNK


def _logits_online_(out: torch.Tensor, h: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, piece: int,
                    scratch: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out[:, c] = h W[c]^T (+ b[c]) piece by piece, each piece's online log-sum-exp taken while it is in cache (its
    shifted logits in ``scratch``, [R, >= piece]); returns (running max m [R], log s [R]) with lse = m + log s, or
    with ``scratch`` None only (m, None). A [rows, V] matmul in one call packs all of W and ran at 58-87 GFLOP/s on 2
    CPU cores where 2,048-column pieces ran at 100-144."""
    m = torch.full((h.shape[0],), float("-inf"), dtype=out.dtype, device=out.device)
    s = torch.zeros(h.shape[0], dtype=out.dtype, device=out.device)
    for a in range(0, W.shape[0], piece):
        c = slice(a, a + piece)
        z = out[:, c]
        if out.dtype == h.dtype:
            torch.mm(h, W[c].T.to(h.dtype), out=z)
        else:
            z.copy_(h @ W[c].T.to(h.dtype))
        if b is not None:
            z += b[c].to(out.dtype)
        new = torch.maximum(m, z.amax(-1))
        if scratch is not None:
            s = s * torch.exp(m - new) + torch.sub(z, new[:, None], out=scratch[:, : z.shape[1]]).exp_().sum(-1)
        m = new
    return m, None if scratch is None else s.log()


def _fkl_block_(zs: torch.Tensor, zt: torch.Tensor, ms: torch.Tensor, mt: torch.Tensor, pieces: list[slice],
                scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(KL(p || q) [R], 1 / s_s [R, 1], 1 / s_t [R, 1]) of a block of logits whose row maxima are known, with two exps
    an element pair where the general sweeps take four: e = exp(z - m) is written over each side's logits while the
    sums s and the numerator of E_p[z_t - z_s] (sum e_t (z_t - z_s)) are taken, and KL = E_p[z_t - z_s] - (m_t - m_s)
    - (log s_t - log s_s), as :func:`_online_kl` with the final maxima. q = e_s / s_s and p = e_t / s_t, so dz = q - p
    is one multiply-add an element, no exp."""
    ss, st, acc = (torch.zeros(zs.shape[0], dtype=zs.dtype, device=zs.device) for _ in range(3))
    for c in pieces:
        d = torch.sub(zt[:, c], zs[:, c], out=scratch[:, : zs[:, c].shape[1]])  # z_t - z_s
        et = zt[:, c].sub_(mt[:, None]).exp_()
        st += et.sum(-1)
        acc += d.mul_(et).sum(-1)
        ss += zs[:, c].sub_(ms[:, None]).exp_().sum(-1)
    return acc / st - (mt - ms) - (torch.log(st) - torch.log(ss)), (1.0 / ss)[:, None], (1.0 / st)[:, None]


def _piece_totals(kind: str, lq: torch.Tensor, lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One piece's share of the row totals for rkl and jsd (fkl: :func:`_fkl_block_`): (divergence, for jsd also E_q g
    with g = log(q / m) / 2)."""
    q = lq.exp()
    if kind == "rkl":
        return (q * (lq - lp)).sum(-1), None
    lm = _mixture_log(lq, lp)
    kl_qm = (q * (lq - lm)).sum(-1)
    return 0.5 * ((lp.exp() * (lp - lm)).sum(-1) + kl_qm), 0.5 * kl_qm


def _piece_dz(kind: str, lq: torch.Tensor, lp: torch.Tensor, div: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
    """d divergence / d z_s on one piece for rkl and jsd (the module docstring's formulas), given its rows' totals."""
    q = lq.exp()
    if kind == "rkl":
        return q * (lq - lp - div[:, None])
    return q * (0.5 * (lq - _mixture_log(lq, lp)) - aux[:, None])


def _row_pass(kind: str, hs, Ws, bs, ht, Wt, bt, weights_N, needs: tuple[bool, bool, bool], fused: bool | None = None):
    """(divergence [N], grad h, grad W, grad b): :func:`_fused_row_pass` where the Triton kernel runs (``fused`` None:
    opdcache.logits.kernels.available, float32 or narrower inputs), else :func:`_torch_row_pass`, its reference."""
    if fused is None:
        fused = kernels.available(hs.device) and hs.dtype != torch.float64
    return (_fused_row_pass if fused else _torch_row_pass)(kind, hs, Ws, bs, ht, Wt, bt, weights_N, needs)


def _fused_row_pass(kind: str, hs, Ws, bs, ht, Wt, bt, weights_N, needs: tuple[bool, bool, bool]):
    """:func:`_torch_row_pass` with the logits kept in the matmul dtype and everything between the head products in
    one kernel (opdcache/logits/kernels.py: two reads of each logit, dz written over the student's): per block, two logit
    matmuls, the kernel, two gradient matmuls. Blocks of whole vocabulary rows, as many as fit
    :func:`opdcache.logits.logprobs.gpu_block_bytes` (GPU_UNIFORM_BLOCK_BYTES) in the matmul dtype (bf16: 3,533 positions a
    GiB at V = 151,936); both heads are cast to it once, not per block."""
    mm = matmul_dtype(hs)
    hs_, ht_, Ws_mm, Wt_mm = hs.to(mm), ht.to(mm), Ws.to(mm), Wt.to(mm)
    N, V = hs.shape[0], Ws.shape[0]
    per_row = V * torch.empty((), dtype=mm).element_size()
    budget = gpu_block_bytes(hs.device, GPU_UNIFORM_BLOCK_BYTES) if hs.device.type == "cuda" else UNIFORM_BLOCK_BYTES
    blocks = max(1, -(-N // max(1, budget // per_row)))  # ceil(N / rows that fit)
    R = max(1, -(-N // blocks))  # equal blocks: 4,096 positions in two of 2,048, not 3,533 and 563
    div = torch.empty(N, dtype=torch.float32, device=hs.device)
    # grad h and grad W are written by their first block (beta = 0), not zero-filled first ([V, H] float32: 2.5 GB at
    # a real shape, written once and read back once less)
    grad_h = torch.empty(hs.shape, dtype=torch.float32, device=hs.device) if needs[0] else None
    grad_W = torch.empty(Ws.shape, dtype=torch.float32, device=Ws.device) if needs[1] else None
    grad_b = torch.zeros(V, dtype=torch.float32, device=Ws.device) if needs[2] and bs is not None else None
    grad = any(t is not None for t in (grad_h, grad_W, grad_b))
    zs, zt = (torch.empty(R, V, dtype=mm, device=hs.device) for _ in range(2))
    for a in range(0, N, R):
        r = slice(a, min(a + R, N))
        n = r.stop - r.start
        torch.mm(hs_[r], Ws_mm.T, out=zs[:n])
        torch.mm(ht_[r], Wt_mm.T, out=zt[:n])
        kernels.divergence_rows_(kind, zs[:n], zt[:n], bs, bt, None if weights_N is None else weights_N[r], div[r], grad)
        dz = zs[:n]  # the kernel wrote dz over the student's logits
        if grad_b is not None:
            grad_b += dz.sum(0, dtype=torch.float32)
        if grad_h is not None:
            accumulate_(grad_h[r], dz, Ws_mm, first=True)
        if grad_W is not None:
            accumulate_(grad_W, dz.T, hs_[r], first=a == 0)
    if N == 0 and grad_W is not None:  # no block wrote it
        grad_W.zero_()
    return div, grad_h, grad_W, grad_b


def _torch_row_pass(kind: str, hs, Ws, bs, ht, Wt, bt, weights_N, needs: tuple[bool, bool, bool]):
    """(divergence [N], grad h, grad W, grad b) from whole-vocabulary position blocks, each position's dz scaled by
    ``weights_N`` (None: 1). Per block, three sweeps over pieces of columns: the logits with their online
    log-sum-exp; the log-probs (in place) with the row totals; dz with the gradient matmuls. fkl takes the logits'
    row maxima only, then :func:`_fkl_block_` (two exps an element pair, not four) and dz = q - p as a multiply-add;
    the log-probs are z - lse in one subtraction, and every temporary of a piece lives in one reused scratch piece (with
    the head gradient: 0.91x -> 0.79-0.88x kl_div's time, BENCHMARKS.md). The logit matmuls in
    the model's matmul dtype, everything after them in float32 at least; the gradient matmuls in the matmul dtype,
    accumulated in float32 (as the per-position backward does). The two [R, V] blocks are allocated once."""
    dtype = torch.float64 if hs.dtype == torch.float64 else torch.float32
    mm = matmul_dtype(hs)
    hs_, ht_ = hs.to(mm), ht.to(mm)
    N, V = hs.shape[0], Ws.shape[0]
    rows, piece = _uniform_layout(V, hs.device)
    R = min(rows, max(N, 1))
    div = torch.zeros(N, dtype=dtype, device=hs.device)
    # grad h and grad W are written by their first piece (beta = 0), not zero-filled first
    grad_h = torch.empty(hs.shape, dtype=dtype, device=hs.device) if needs[0] else None
    grad_W = torch.empty(Ws.shape, dtype=dtype, device=Ws.device) if needs[1] else None
    grad_b = torch.zeros(V, dtype=dtype, device=Ws.device) if needs[2] and bs is not None else None
    Ws_mm = Ws.to(mm) if grad_h is not None else None
    zs, zt = (torch.empty(R, V, dtype=dtype, device=hs.device) for _ in range(2))
    scratch = torch.empty(R, piece, dtype=dtype, device=hs.device)  # one piece's temporary, reused: no allocation a piece
    pieces = [slice(a, a + piece) for a in range(0, V, piece)]
    fkl = kind == "fkl"
    for a in range(0, N, R):
        r = slice(a, min(a + R, N))
        n = r.stop - r.start
        ms, ls = _logits_online_(zs[:n], hs_[r], Ws, bs, piece, None if fkl else scratch[:n])
        mt, lt = _logits_online_(zt[:n], ht_[r], Wt, bt, piece, None if fkl else scratch[:n])
        aux = torch.zeros(n, dtype=dtype, device=hs.device) if kind == "jsd" else None
        if fkl:  # exp(z - m) in zs and zt
            d, inv_s, inv_t = _fkl_block_(zs[:n], zt[:n], ms, mt, pieces, scratch[:n])
        else:
            d = torch.zeros(n, dtype=dtype, device=hs.device)
            lse_s, lse_t = (ms + ls)[:, None], (mt + lt)[:, None]
            for c in pieces:  # log q and log p in place: z - lse
                t, x = _piece_totals(kind, zs[:n, c].sub_(lse_s), zt[:n, c].sub_(lse_t))
                d += t
                if aux is not None:
                    aux += x
        div[r] = d
        if grad_h is None and grad_W is None and grad_b is None:
            continue
        w = None if weights_N is None else weights_N[r, None].to(dtype)
        for i, c in enumerate(pieces):
            if fkl:  # q - p = e_s / s_s - e_t / s_t
                dz = zs[:n, c].mul_(inv_s).addcmul_(zt[:n, c], inv_t, value=-1)
            else:
                dz = _piece_dz(kind, zs[:n, c], zt[:n, c], d, aux)  # [n, piece]
            if w is not None:
                dz.mul_(w)
            if grad_b is not None:
                grad_b[c] += dz.sum(0)
            dzm = dz.to(mm)
            if grad_h is not None:
                accumulate_(grad_h[r], dzm, Ws_mm[c], first=i == 0)
            if grad_W is not None:
                accumulate_(grad_W[c], dzm.T, hs_[r], first=a == 0)
    if N == 0:  # no block wrote them
        grad_h, grad_W = (None if t is None else t.zero_() for t in (grad_h, grad_W))
    return div, grad_h, grad_W, grad_b


class _UniformDivergence(torch.autograd.Function):
    """Per-position divergences whose gradient is computed in the forward for a uniform reduction (see the module
    docstring); the backward scales it, or recomputes it when the weights it receives are not uniform."""

    @staticmethod
    def forward(ctx, hs, Ws, bs, ht, Wt, bt, kind: str, grad_enabled: bool):
        needs = tuple(ctx.needs_input_grad[:3]) if grad_enabled else (False, False, False)
        div, grad_h, grad_W, grad_b = _row_pass(kind, hs, Ws, bs, ht, Wt, bt, None, needs)
        empty = torch.empty(0)
        ctx.save_for_backward(*(empty if t is None else t for t in (hs, Ws, bs, ht, Wt, bt, grad_h, grad_W, grad_b)))
        ctx.kind, ctx.present = kind, [t is not None for t in (hs, Ws, bs, ht, Wt, bt, grad_h, grad_W, grad_b)]
        return div.to(hs.dtype)

    @staticmethod
    def backward(ctx, g_N):
        hs, Ws, bs, ht, Wt, bt, grad_h, grad_W, grad_b = (t if ok else None for t, ok in zip(ctx.saved_tensors, ctx.present))
        if g_N.numel() and bool((g_N == g_N[0]).all()):
            scale = g_N[0]
        else:  # the reduction was not uniform after all: the exact gradient for these weights, recomputed
            scale = None
            _, grad_h, grad_W, grad_b = _row_pass(ctx.kind, hs, Ws, bs, ht, Wt, bt, g_N, tuple(ctx.needs_input_grad[:3]))

        return (*(None if g is None else scaled(g, scale, like.dtype) for g, like in ((grad_h, hs), (grad_W, Ws), (grad_b, Ws))),
                None, None, None, None, None)


def scaled(grad: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``(grad * scale).to(dtype)`` bit for bit (the product in grad's dtype, rounded once to ``dtype``), in one pass:
    in place when ``dtype`` is grad's, else written straight into the narrower tensor. For a [V, H] float32 gradient
    of bf16 weights that reads 4 bytes and writes 2 an element, where a multiply in place and a cast read 8 and
    wrote 6. ``scale`` None: the cast alone."""
    if scale is None:
        return grad.to(dtype)
    scale = scale.to(grad.dtype)
    if dtype == grad.dtype:
        return grad.mul_(scale)
    return torch.mul(grad, scale, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))


def chunked_divergence(kind: str, student_hidden_NH: torch.Tensor, student_weight_VH: torch.Tensor, teacher_hidden_NK: torch.Tensor,
                       teacher_weight_VK: torch.Tensor, student_bias_V: torch.Tensor | None = None,
                       teacher_bias_V: torch.Tensor | None = None, chunk: int = DEFAULT_CHUNK, uniform: bool = False) -> torch.Tensor:
    """Per-position divergence [N] between student and teacher distributions over the full vocabulary.

    Differentiable with respect to the student hidden states, head weight and bias; the teacher is fixed.
    ``chunk`` is the vocabulary slice width; positions go in blocks of opdcache.logits.logprobs.row_blocks, so transient
    memory is a few [rows, chunk] blocks whatever N and V.

    ``uniform=True``: the caller reduces the result with one weight for every position (a mean or a sum over
    tokens), so the gradient is computed in the forward, 4 head matmuls instead of 6 (module docstring). Memory: two
    [UNIFORM_BLOCK_BYTES // (4 V), V] float32 blocks (128 MiB each) and [rows, 2,048] pieces on a CPU; on a GPU with
    triton (opdcache/logits/kernels.py) two blocks of up to GPU_UNIFORM_BLOCK_BYTES (1 GiB each) in the matmul dtype, and both
    heads in that dtype (a copy each where they are float32 masters under autocast); and the gradients grad h [N, H]
    and grad W [V, H] (float32), which the backward would allocate anyway, held from the forward on. None of it grows
    with N but grad h. ``chunk`` is not used then.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if student_weight_VH.shape[0] != teacher_weight_VK.shape[0]:
        raise ValueError(f"student and teacher vocabularies differ: {student_weight_VH.shape[0]} vs {teacher_weight_VK.shape[0]}")
    if student_hidden_NH.shape[0] != teacher_hidden_NK.shape[0]:
        raise ValueError(f"positions differ: {student_hidden_NH.shape[0]} student vs {teacher_hidden_NK.shape[0]} teacher")
    check_chunk(chunk)
    tb = None if teacher_bias_V is None else teacher_bias_V.detach()
    if uniform:
        return _UniformDivergence.apply(student_hidden_NH, student_weight_VH, student_bias_V, teacher_hidden_NK.detach(),
                                        teacher_weight_VK.detach(), tb, kind, torch.is_grad_enabled())
    return _ChunkedDivergence.apply(student_hidden_NH, student_weight_VH, student_bias_V, teacher_hidden_NK.detach(),
                                    teacher_weight_VK.detach(), tb, kind, chunk)


def divergence_reference(kind: str, hs, Ws, ht, Wt, bs=None, bt=None) -> torch.Tensor:
    """The plain implementation: full logits, full softmax, float64. For tests and benchmarks only."""
    zs = (hs.double() @ Ws.double().T) + (0 if bs is None else bs.double())
    zt = (ht.double() @ Wt.double().T) + (0 if bt is None else bt.double())
    lq, lp = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    q, p = lq.exp(), lp.exp()
    if kind == "fkl":
        return (p * (lp - lq)).sum(-1)
    if kind == "rkl":
        return (q * (lq - lp)).sum(-1)
    lm = torch.log(0.5 * (p + q))
    return 0.5 * ((p * (lp - lm)).sum(-1) + (q * (lq - lm)).sum(-1))
