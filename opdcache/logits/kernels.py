"""Fused Triton kernels for the GPU's whole-vocabulary row blocks: everything between two head matmuls in one read.
This module launches them and checks their inputs; their device code is opdcache/logits/tritonkernels.py.

On a GPU the head products run at the chip's matmul rate, and what is left of a fused loss's time is the elementwise
work on the [rows, V] logit block between them: on an H200 at 4,096 positions, hidden 4,096, V 151,936, the torch ops
of opdcache/logits/divergence.py's uniform path (float32 copies of the bf16 logits, online log-sum-exp, log-probs in place,
the totals, dz, the cast back) made it 1.65-1.69x ``kl_div``'s time with the same four head matmuls (BENCHMARKS.md).
A kernel here reads each logit of a block in the matmul's own dtype twice (the online log-sum-exp and totals, then the
values that need them) and writes dz once, in that dtype, over the student's logits: the buffer the gradient matmuls
read next. Arithmetic is float32 throughout, as the torch path's.

Each kernel has its torch reference in the module that calls it (the same function with ``fused=False``) and parity
tests: on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``, the ``triton`` test group) and on CUDA
(tests/test_gpu.py). :func:`available` is the one switch: a CUDA tensor and an importable triton.
"""

from __future__ import annotations

import functools
import os

import torch

DIVERGENCE_BLOCK = 8192  # columns per tile of a row; one program per row walks the row in tiles
DIVERGENCE_WARPS = 16
STATS_BLOCK = 8192
STATS_WARPS = 16
DIVERGENCE_KINDS = {"fkl": 0, "rkl": 1, "jsd": 2}


@functools.cache
def _triton():
    """The triton module, or None where it is not installed (CPU-only torch wheels do not bring it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return triton


def _device_code():
    """opdcache/logits/tritonkernels.py, which imports triton at its top: loaded on a kernel's first launch only."""
    from opdcache.logits import tritonkernels

    return tritonkernels


def available(device: torch.device) -> bool:
    """True where the fused kernels run: a CUDA device with triton importable, or any device under Triton's CPU
    interpreter (``TRITON_INTERPRET=1``, which the parity tests use); never with ``OPDCACHE_KERNELS=0`` in the
    environment (the torch ops then, for a comparison or to rule a kernel out)."""
    if os.environ.get("OPDCACHE_KERNELS") == "0" or _triton() is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def divergence_rows_(kind: str, zs_RV: torch.Tensor, zt_RV: torch.Tensor, bs_V: torch.Tensor | None,
                     bt_V: torch.Tensor | None, weights_R: torch.Tensor | None, div_R: torch.Tensor, grad: bool) -> None:
    """One block of whole-vocabulary rows: ``div_R`` (float32) <- the divergence of softmax(zt + bt) and softmax(zs + bs)
    per row (opdcache/logits/divergence.py's formulas); with ``grad``, ``zs_RV`` <- dz = d div / d z_s times the row's weight
    (None: 1), in zs's dtype. zs and zt hold the logits in the matmul's dtype, rows contiguous."""
    R, V = zs_RV.shape
    if zt_RV.shape != (R, V) or zs_RV.stride(1) != 1 or zt_RV.stride(1) != 1:
        raise ValueError(f"logit blocks must be [rows, V] with contiguous rows, got {tuple(zs_RV.shape)} and {tuple(zt_RV.shape)}")
    if div_R.dtype != torch.float32 or not div_R.is_contiguous():
        raise ValueError("div_R must be a contiguous float32 tensor")
    if R == 0:
        return
    dummy = div_R  # an unused pointer argument (HAS_* False) still needs a tensor
    _device_code().divergence_rows[(R,)](
        zs_RV, zt_RV, dummy if bs_V is None else bs_V.contiguous(), dummy if bt_V is None else bt_V.contiguous(),
        dummy if weights_R is None else weights_R.to(torch.float32).contiguous(), div_R, V, zs_RV.stride(0), zt_RV.stride(0),
        KIND=DIVERGENCE_KINDS[kind], HAS_BS=bs_V is not None, HAS_BT=bt_V is not None, HAS_W=weights_R is not None,
        GRAD=grad, BLOCK=DIVERGENCE_BLOCK, num_warps=DIVERGENCE_WARPS)


def logit_stats_rows(z_PC: torch.Tensor, scale: float | None) -> torch.Tensor:
    """[4, P] float32 for one slice of logits [P, C] (any float dtype, rows contiguous), each multiplied by ``scale``
    (None: 1): per row the maximum m, s = sum_c exp(z_c - m), b1 = sum_c exp(z_c - m)(z_c - m) and b2 = sum_c
    exp(z_c - m)(z_c - m)^2 -- a slice's log-sum-exp (m + log s) and the moments of the full distribution's log-probs
    (opdcache/backends/streamed.py), from one read of the slice."""
    P, C = z_PC.shape
    if z_PC.stride(1) != 1:
        raise ValueError(f"a logit slice must have contiguous rows, got strides {z_PC.stride()}")
    out = torch.empty(4, P, dtype=torch.float32, device=z_PC.device)
    if P:
        _device_code().logit_stats_rows[(P,)](z_PC, out, C, z_PC.stride(0), P, 1.0 if scale is None else float(scale),
                                              BLOCK=STATS_BLOCK, num_warps=STATS_WARPS)
    return out
