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

from dataclasses import dataclass

import torch

METHODS = ("naive", "importance", "prob-weighted")
BLOCK = 2048  # positions per block when evaluating distortion


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


def fit(weight_VH: torch.Tensor, bias_V: torch.Tensor | None, calib_NH: torch.Tensor, rank: int, method: str) -> SVDProjection:
    """Fit a rank-``rank`` projection of the given ``method`` on calibration hidden states [N, H]."""
    if method not in METHODS:
        raise ValueError(f"--svd-method must be one of {', '.join(METHODS)}, got {method!r}")
    W = weight_VH.double()
    H = W.shape[1]
    if not 1 <= rank <= H:
        raise ValueError(f"--svd-rank must be between 1 and the hidden size {H}, got {rank}")
    X = calib_NH.double()
    b = None if bias_V is None else bias_V.float()
    if method in ("naive", "importance"):
        _, S, Vh = torch.linalg.svd(W, full_matrices=False)  # Vh [H, H]
        if method == "naive":
            idx = torch.arange(rank)
        else:
            energy = ((X @ Vh.T) ** 2).mean(0).sqrt()  # sqrt(E[(v_i . h)^2]) per direction
            idx = torch.argsort(S * energy, descending=True)[:rank]
        basis = Vh[idx].T  # [H, r]
        return SVDProjection(method, basis.float(), (W @ basis).float(), b)
    C = X.T @ X / X.shape[0] + 1e-6 * torch.eye(H, dtype=X.dtype)
    evals, evecs = torch.linalg.eigh(C)
    C_half = evecs @ torch.diag(evals.clamp_min(1e-12).sqrt()) @ evecs.T
    C_inv_half = evecs @ torch.diag(evals.clamp_min(1e-12).rsqrt()) @ evecs.T
    logits = X @ W.T + (0 if b is None else b.double())
    p_bar = torch.softmax(logits, -1).mean(0)  # [V]
    M = p_bar.sqrt()[:, None] * W @ C_half
    _, _, Vh = torch.linalg.svd(M, full_matrices=False)
    Vr = Vh[:rank].T  # [H, r]
    return SVDProjection(method, (C_inv_half @ Vr).float(), (W @ C_half @ Vr).float(), b)


def distortion(proj: SVDProjection, weight_VH: torch.Tensor, bias_V: torch.Tensor | None, held_NH: torch.Tensor) -> dict:
    """Mean KL(true || reconstructed) in nats and top-1 agreement on held-out hidden states."""
    W = weight_VH.float()
    kl_sum, agree, n = 0.0, 0, 0
    for start in range(0, held_NH.shape[0], BLOCK):
        h = held_NH[start: start + BLOCK].float()
        true = h @ W.T + (0 if bias_V is None else bias_V.float())
        approx = proj.logits(proj.encode(h))
        lp, lq = torch.log_softmax(true, -1), torch.log_softmax(approx, -1)
        kl_sum += float((lp.exp() * (lp - lq)).sum())
        agree += int((true.argmax(-1) == approx.argmax(-1)).sum())
        n += h.shape[0]
    return {"mean_kl": kl_sum / max(n, 1), "top1_agreement": agree / max(n, 1), "positions": n}


def save(proj: SVDProjection, path, extra: dict) -> None:
    import json

    from safetensors.torch import save_file

    tensors = {"encoder": proj.encoder.contiguous(), "decoder": proj.decoder.contiguous()}
    if proj.bias is not None:
        tensors["bias"] = proj.bias.contiguous()
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "opdcache-svd-v1", "method": proj.method, "info": json.dumps(extra, sort_keys=True)})
    tmp.replace(path)


def load(path) -> SVDProjection:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        method = f.metadata()["method"]
        t = {k: f.get_tensor(k) for k in f.keys()}
    return SVDProjection(method, t["encoder"], t["decoder"], t.get("bias"))
