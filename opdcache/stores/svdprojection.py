"""Rank-r compression of teacher hidden states (papers/002, "SVD-Nitrobrew").

Every variant is a pair (encoder B [H, r], decoder D [V, r]) with z = h @ B stored per token and
approximate logits = z @ D.T (+ bias). With W [V, H] the unembedding, W = U S V^T its thin SVD, and
h the final post-norm hidden state:

* ``naive``: B = V_r (top-r right singular vectors), D = W V_r -- the best rank-r map of W in operator norm.
* ``importance``: directions ordered by effective logit importance s_i * sqrt(E[(v_i . h)^2]) (singular value
  times activation energy on calibration states); keep the top r: B = V_S, D = W V_S.
* ``prob-weighted``: SVD of M = diag(sqrt(p_bar)) W C^{1/2}, with p_bar the teacher's mean token probability
  and C = E[h h^T] on calibration states; with M = U' S' V'^T, B = C^{-1/2} V'_r and D = W C^{1/2} V'_r, so
  approximate logits = W P h with P = C^{1/2} V'_r V'_r^T C^{-1/2} an oblique projection (P = I at full rank).

Distortion is measured on held-out positions: mean KL(true || reconstructed) and top-1 agreement.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

METHODS = ("naive", "importance", "prob-weighted")
BLOCK = 2048  # positions per block (calibration moments, mean probabilities, distortion)
ROW_BLOCK = 16384  # vocabulary rows per block of the Gram matrices


@dataclass(frozen=True)
class SVDProjection:
    method: str
    encoder: torch.Tensor  # [H, r] float32
    decoder: torch.Tensor  # [V, r] float32
    bias: torch.Tensor | None  # [V]

    @property
    def rank(self) -> int:
        return self.encoder.shape[1]

    def encode(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        return hidden_NH.float() @ self.encoder

    def logits(self, z_NR: torch.Tensor) -> torch.Tensor:
        out = z_NR.float() @ self.decoder.T
        return out if self.bias is None else out + self.bias


def _gram(W: torch.Tensor, weights_V: torch.Tensor | None = None) -> torch.Tensor:
    """W^T diag(weights) W in float64, [H, H], from blocks of ROW_BLOCK vocabulary rows."""
    H = W.shape[1]
    G = torch.zeros(H, H, dtype=torch.float64)
    for a in range(0, W.shape[0], ROW_BLOCK):
        w = W[a: a + ROW_BLOCK].double()
        G += w.T @ (w if weights_V is None else w * weights_V[a: a + ROW_BLOCK, None])
    return G


def _second_moment(X_NH: torch.Tensor) -> torch.Tensor:
    """E[h h^T] in float64, [H, H], from blocks of BLOCK positions."""
    H = X_NH.shape[1]
    C = torch.zeros(H, H, dtype=torch.float64)
    for a in range(0, X_NH.shape[0], BLOCK):
        x = X_NH[a: a + BLOCK].double()
        C += x.T @ x
    return C / max(X_NH.shape[0], 1)


def _times(W: torch.Tensor, M_HR: torch.Tensor) -> torch.Tensor:
    """W @ M in float64 blocks of vocabulary rows, returned as float32 [V, r]."""
    return torch.cat([(W[a: a + ROW_BLOCK].double() @ M_HR).float() for a in range(0, W.shape[0], ROW_BLOCK)])


def mean_probs(weight_VH: torch.Tensor, bias_V: torch.Tensor | None, X_NH: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """p_bar = mean over positions of softmax(h W^T + b), [V] float64: log-partitions first (streamed), then each
    [BLOCK, chunk] slice's probabilities summed; memory O(BLOCK x chunk), never O(N x V)."""
    from opdcache.logits.logprobs import chunked_logprobs

    W = weight_VH.float()
    b = None if bias_V is None else bias_V.float()
    p_bar = torch.zeros(W.shape[0], dtype=torch.float64)
    for a in range(0, X_NH.shape[0], BLOCK):
        h = X_NH[a: a + BLOCK].float()
        _, lse = chunked_logprobs(h, W, torch.zeros(h.shape[0], 1, dtype=torch.long), b, chunk)
        for c in range(0, W.shape[0], chunk):
            z = h @ W[c: c + chunk].T
            if b is not None:
                z += b[c: c + chunk]
            p_bar[c: c + chunk] += z.sub_(lse[:, None]).exp_().sum(0).double()
    return p_bar / max(X_NH.shape[0], 1)


def fit(weight_VH: torch.Tensor, bias_V: torch.Tensor | None, calib_NH: torch.Tensor, rank: int, method: str) -> SVDProjection:
    """Fit a rank-``rank`` projection of the given ``method`` on calibration hidden states [N, H].

    Bounded memory: the right singular vectors come from the eigenvectors of [H, H] Gram matrices (W^T W, or
    M^T M = C^{1/2} W^T diag(p_bar) W C^{1/2}) accumulated over blocks of vocabulary rows, never from an SVD of a
    [V, H] matrix; p_bar is streamed over [positions, vocabulary slice] blocks. Grows with H^2, V x r and N x H.
    :func:`fit_reference` is the plain version the parity test compares against.
    """
    if method not in METHODS:
        raise ValueError(f"--svd-method must be one of {', '.join(METHODS)}, got {method!r}")
    H = weight_VH.shape[1]
    if not 1 <= rank <= H:
        raise ValueError(f"--svd-rank must be between 1 and the hidden size {H}, got {rank}")
    b = None if bias_V is None else bias_V.float()
    if method in ("naive", "importance"):
        evals, evecs = torch.linalg.eigh(_gram(weight_VH))  # W^T W = V S^2 V^T, ascending
        S, Vs = evals.clamp_min(0).sqrt().flip(0), evecs.flip(1)  # descending, columns are v_i
        if method == "naive":
            idx = torch.arange(rank)
        else:
            C = _second_moment(calib_NH)
            energy = ((Vs.T @ C) * Vs.T).sum(-1).clamp_min(0).sqrt()  # sqrt(E[(v_i . h)^2]) = sqrt(v_i^T C v_i)
            idx = torch.argsort(S * energy, descending=True)[:rank]
        basis = Vs[:, idx]  # [H, r]
        return SVDProjection(method, basis.float(), _times(weight_VH, basis), b)
    C = _second_moment(calib_NH) + 1e-6 * torch.eye(H, dtype=torch.float64)
    evals, evecs = torch.linalg.eigh(C)
    C_half = evecs @ torch.diag(evals.clamp_min(1e-12).sqrt()) @ evecs.T
    C_inv_half = evecs @ torch.diag(evals.clamp_min(1e-12).rsqrt()) @ evecs.T
    p_bar = mean_probs(weight_VH, bias_V, calib_NH)
    MtM = C_half @ _gram(weight_VH, p_bar) @ C_half  # M = diag(sqrt(p_bar)) W C^{1/2}
    _, evecs = torch.linalg.eigh(MtM)
    Vr = evecs.flip(1)[:, :rank]  # top-r right singular vectors of M
    return SVDProjection(method, (C_inv_half @ Vr).float(), _times(weight_VH, C_half @ Vr), b)


def fit_reference(weight_VH: torch.Tensor, bias_V: torch.Tensor | None, calib_NH: torch.Tensor, rank: int, method: str) -> SVDProjection:
    """The plain fit: full float64 SVDs of [V, H] matrices and [N, V] probabilities. For tests only."""
    W = weight_VH.double()
    H = W.shape[1]
    X = calib_NH.double()
    b = None if bias_V is None else bias_V.float()
    if method in ("naive", "importance"):
        _, S, Vh = torch.linalg.svd(W, full_matrices=False)
        if method == "naive":
            idx = torch.arange(rank)
        else:
            energy = ((X @ Vh.T) ** 2).mean(0).sqrt()
            idx = torch.argsort(S * energy, descending=True)[:rank]
        basis = Vh[idx].T
        return SVDProjection(method, basis.float(), (W @ basis).float(), b)
    C = X.T @ X / X.shape[0] + 1e-6 * torch.eye(H, dtype=X.dtype)
    evals, evecs = torch.linalg.eigh(C)
    C_half = evecs @ torch.diag(evals.clamp_min(1e-12).sqrt()) @ evecs.T
    C_inv_half = evecs @ torch.diag(evals.clamp_min(1e-12).rsqrt()) @ evecs.T
    p_bar = torch.softmax(X @ W.T + (0 if b is None else b.double()), -1).mean(0)
    _, _, Vh = torch.linalg.svd(p_bar.sqrt()[:, None] * W @ C_half, full_matrices=False)
    Vr = Vh[:rank].T
    return SVDProjection(method, (C_inv_half @ Vr).float(), (W @ C_half @ Vr).float(), b)


def _streamed_argmax(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, chunk: int) -> torch.Tensor:
    best = torch.full((h.shape[0],), float("-inf"))
    arg = torch.zeros(h.shape[0], dtype=torch.long)
    for c in range(0, W.shape[0], chunk):
        z = h @ W[c: c + chunk].T
        if b is not None:
            z += b[c: c + chunk]
        v, i = z.max(-1)
        better = v > best
        best, arg = torch.where(better, v, best), torch.where(better, i + c, arg)
    return arg


def distortion(proj: SVDProjection, weight_VH: torch.Tensor, bias_V: torch.Tensor | None, held_NH: torch.Tensor, chunk: int = 8192,
               store_dtype: str | None = None) -> dict:
    """Mean KL(true || reconstructed) in nats with its standard error over positions (``kl_stderr``: the positions'
    standard deviation over sqrt(count), as if independent; positions of one sequence are correlated, so it understates
    the spread between samples of rows), and top-1 agreement, on held-out hidden states, streamed over
    [BLOCK, chunk] blocks (opdcache/logits/divergence.py's online KL): memory never grows with positions x vocabulary.
    ``store_dtype="bfloat16"``: z is rounded to bfloat16 first, as the store keeps it."""
    from opdcache.logits.divergence import chunked_divergence

    W = weight_VH.float()
    b = None if bias_V is None else bias_V.float()
    kl_sum, kl_sq, agree, n = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, held_NH.shape[0], BLOCK):
            h = held_NH[start: start + BLOCK].float()
            z = proj.encode(h)
            if store_dtype == "bfloat16":
                z = z.to(torch.bfloat16).float()
            # "student" = the reconstruction (z, decoder), "teacher" = the true logits: fkl is KL(true || reconstructed)
            kl_N = chunked_divergence("fkl", z, proj.decoder, h, W, proj.bias, b, chunk=chunk).double()
            kl_sum, kl_sq = kl_sum + float(kl_N.sum()), kl_sq + float(kl_N.square().sum())
            agree += int((_streamed_argmax(h, W, b, chunk) == _streamed_argmax(z, proj.decoder, proj.bias, chunk)).sum())
            n += h.shape[0]
    mean = kl_sum / max(n, 1)
    stderr = math.sqrt(max(kl_sq / n - mean * mean, 0.0) / max(n - 1, 1)) if n else 0.0
    return {"mean_kl": mean, "kl_stderr": stderr, "top1_agreement": agree / max(n, 1), "positions": n}


def save(proj: SVDProjection, path, extra: dict) -> None:
    from safetensors.torch import save_file

    tensors = {"encoder": proj.encoder.contiguous(), "decoder": proj.decoder.contiguous()}
    if proj.bias is not None:
        tensors["bias"] = proj.bias.contiguous()
    from opdcache import storage

    # one metadata key: safetensors writes its metadata map in hash order, which differs between processes, so several
    # keys would make the same projection's bytes (and its manifest sha256) depend on the process that wrote it
    header = json.dumps({"format": "opdcache-svd-v1", "method": proj.method, "info": extra}, sort_keys=True)
    with storage.staged(storage.as_path(path)) as tmp:
        save_file(tensors, str(tmp), metadata={"opdcache": header})


def read_metadata(path) -> dict:
    """{format, method, info} of an svd.safetensors (also from files written with one key per field)."""
    from safetensors import safe_open

    from opdcache.storage import as_path, local_copy

    with local_copy(as_path(path)) as local, safe_open(str(local), "pt") as f:
        return _metadata(f)


def _metadata(f) -> dict:
    meta = f.metadata() or {}
    if "opdcache" in meta:
        return json.loads(meta["opdcache"])
    return {"format": meta.get("format"), "method": meta["method"], "info": json.loads(meta["info"])}


def load(path) -> SVDProjection:
    from safetensors import safe_open

    from opdcache.storage import as_path, local_copy

    with local_copy(as_path(path)) as local, safe_open(str(local), "pt") as f:  # one download for both
        method = _metadata(f)["method"]
        t = {k: f.get_tensor(k) for k in f.keys()}
    from opdcache.errors import SchemaError
    from opdcache.untrusted import tensors_problem

    problem = tensors_problem(t, {"encoder": ("H", "R"), "decoder": ("V", "R"), "bias": ("?", "V")})
    if problem is not None:
        raise SchemaError(f"{path} is not a usable svd projection: {problem}; score the teacher again, or run `opdcache validate` on the cache")
    return SVDProjection(method, t["encoder"], t["decoder"], t.get("bias"))


CALIBRATION_PER_RANK = 32  # the svd projection is fitted on at least 32 x rank positions when the table has them: on
# SmolLM2 at rank 512 the held-out KL falls from 6.7e-3 (2,048 positions) to 4.8e-3 (8,192) and then stays (BENCHMARKS.md)
CALIBRATION_MIN_POSITIONS = 2048  # ... and at least this many
HELDOUT_POSITIONS = 1024  # further positions, for measuring its distortion


def calibration_rows(cache, rank: int, seed: int) -> tuple[list[tuple[int, int]], int]:
    """(rows, target positions) for the svd fit: rows (shard, index) drawn at random (seeded) over every shard of the
    base table, in a seeded random order, enough (by the manifest's mean row length) for max(32 x rank, 2,048)
    calibration positions and then 1,024 held-out ones."""
    import numpy as np

    base = cache.table(cache.base_table)
    rows = sum(int(sh["rows"]) for sh in base["shards"])
    tokens = sum(int(sh["tokens"]) for sh in base["shards"])
    target = max(CALIBRATION_PER_RANK * rank, CALIBRATION_MIN_POSITIONS)
    want = min(rows, int(np.ceil((target + HELDOUT_POSITIONS) / max(tokens / max(rows, 1), 1.0) * 1.25)) + 2)
    picks = [(shard, i) for shard, idx in sorted(cache.sample_rows(cache.base_table, want, seed).items()) for i in idx]
    order = np.random.default_rng(seed + 1).permutation(len(picks))
    return [picks[i] for i in order], target


def fit_for_table(prep, path) -> tuple[SVDProjection, dict]:
    """The svd store's preparation (``opdcache.stores.base.Preparation``): fit (or reload) the chosen projection on
    positions drawn from all shards (:func:`calibration_rows`) and measure its distortion on further held-out positions;
    (projection, what the manifest records); it is saved at ``path``. Memory: the calibration and held-out hidden states ([positions, H],
    decoded in the engine's token-budget batches), [H, H] float64 moments and [V, rank] decoder; never
    [positions, vocabulary]."""
    from opdcache.errors import ConfigError

    job, cache, backend = prep.job, prep.cache, prep.backend
    if path.is_file():
        return load(path), read_metadata(path)["info"]
    picks, target = calibration_rows(cache, job.svd_rank, job.svd_seed)
    by_shard: dict[int, list[int]] = {}
    for shard, i in picks:
        by_shard.setdefault(shard, []).append(i)
    lengths = {}
    requests = {}
    for shard, idx in by_shard.items():
        rows = cache.read_shard(cache.base_table, shard, ["prompt_ids", "response_ids"]).take(sorted(idx))
        for i, req in zip(sorted(idx), prep.requests(rows)):
            requests[(shard, i)] = req
            lengths[(shard, i)] = len(req.response_ids)
    calib_rows, held_rows, n = [], [], 0
    for key in picks:  # in the seeded random order: calibration until the target, then the held-out rows
        if n < target or not calib_rows:
            calib_rows.append(key)
            n += lengths[key]
        elif sum(lengths[k] for k in held_rows) < HELDOUT_POSITIONS:
            held_rows.append(key)
    if n < target:
        if job.svd_min_positions and n < job.svd_min_positions:
            raise ConfigError(f"--svd-min-positions {job.svd_min_positions}: only {n:,} calibration positions are available")
        print(f"warning: the svd projection is fitted on {n:,} positions, fewer than {target:,} (32 x rank {job.svd_rank}, at "
              f"least {CALIBRATION_MIN_POSITIONS:,}): its distortion on other rollouts may be higher than measured; add "
              "rollouts or lower --svd-rank (--svd-min-positions refuses instead)")
    with torch.no_grad():
        calib = backend.hidden_states([requests[k] for k in calib_rows]).float()
        held = backend.hidden_states([requests[k] for k in (held_rows or calib_rows)]).float()
    head = backend.model.get_output_embeddings()
    W, b = head.weight.detach(), None if getattr(head, "bias", None) is None else head.bias.detach().float()
    chosen = fit(W, b, calib, job.svd_rank, job.svd_method)
    dtype = "bfloat16" if job.svd_dtype == "bfloat16" else None
    measured = {job.svd_method: distortion(chosen, W, b, held, store_dtype=dtype) | {"rank": job.svd_rank}}
    info = {"method": job.svd_method, "rank": job.svd_rank, "dtype": job.svd_dtype, "calibration_positions": int(calib.shape[0]),
            "calibration_rows": len(calib_rows), "calibration_shards": len({s for s, _ in calib_rows}), "calibration_seed": job.svd_seed,
            "calibration_target": target, "heldout_positions": int(held.shape[0]),
            "heldout": "held-out rows" if held_rows else "the calibration rows (no other rows left: in-sample)",
            "distortion": measured}
    save(chosen, path, info)
    return chosen, info
