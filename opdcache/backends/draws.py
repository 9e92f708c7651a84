"""Counter-based uniforms for sampling: a draw is a hash of (seed, step, draw index), computed on the engine's device.

A sample's random numbers therefore depend on nothing but its seed (derived from the cache seed, its prompt and its
sample index): not on the batch it sits in, its position there, the device or any RNG state, and a CPU and a GPU draw
the same numbers. Nothing is carried from step to step, so a decode loop computes a block of steps' uniforms in one
go on the device, with no host round trip.

The hash is 32-bit integer mixing (``triple32``, C. Wellons' hash-prospector: three multiply-xorshift rounds, full
avalanche) chained over the key's 32-bit words, done in int64 tensors: every product is split so that no intermediate
exceeds 2^49, so the bits are the same on every device and never rely on overflow. Two lanes of 32 bits give one
53-bit uniform in [0, 1), the resolution of a float64. :func:`uniform_reference` is the same function in Python
integers (the plain reference the tests compare against).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
ROUNDS = ((17, 0xED5AD4BB), (11, 0xAC4C1B51), (15, 0x31848BAB))  # (xorshift, multiplier) of triple32, then a last xorshift 14
FINAL_SHIFT = 14
INIT = 0x9E3779B9  # the chain's starting state (any odd constant: the hash of an all-zero key is not 0)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for 0 <= x < 2^32, with every intermediate below 2^49 (no int64 overflow on any device)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def _mix(x: torch.Tensor) -> torch.Tensor:
    for shift, mult in ROUNDS:
        x = _mul32(x ^ (x >> shift), mult)
    return x ^ (x >> FINAL_SHIFT)


def uniforms(seeds_B: torch.Tensor, step0: int, steps: int, draws: int) -> torch.Tensor:
    """[B, steps, draws] float64 uniforms in [0, 1) on ``seeds_B``'s device: entry (b, t, d) is the hash of
    (seeds_B[b], step0 + t, d). Seeds are non-negative int64 (63 bits)."""
    device = seeds_B.device
    seed = seeds_B.to(torch.int64)[:, None, None]
    step = torch.arange(step0, step0 + steps, dtype=torch.int64, device=device)[None, :, None]
    draw = torch.arange(draws, dtype=torch.int64, device=device)[None, None, :]
    state = torch.full((), INIT, dtype=torch.int64, device=device)
    for word in (seed & MASK32, seed >> 32, step & MASK32, draw & MASK32):
        state = _mix(state ^ word)
    high = _mix(state ^ 1)  # two lanes: 21 + 32 bits
    low = _mix(state ^ 2)
    return ((high >> 11) * (1 << 32) + low).to(torch.float64) * 2.0 ** -53


def uniform_reference(seed: int, step: int, draw: int) -> float:
    """:func:`uniforms` for one (seed, step, draw), in Python integers."""

    def mix(x: int) -> int:
        for shift, mult in ROUNDS:
            x = ((x ^ (x >> shift)) * mult) & MASK32
        return x ^ (x >> FINAL_SHIFT)

    state = INIT
    for word in (seed & MASK32, seed >> 32, step & MASK32, draw & MASK32):
        state = mix(state ^ word)
    return ((mix(state ^ 1) >> 11) * (1 << 32) + mix(state ^ 2)) * 2.0 ** -53


def inverse_cdf(logprobs_BV: torch.Tensor, uniforms_BD: torch.Tensor) -> torch.Tensor:
    """[B, D] token ids drawn from exp(logprobs_BV) by inverse CDF: the first token whose cumulative mass (float64, in
    vocabulary order) exceeds u * total. The target is kept strictly below the total, so a token of zero probability
    (outside the top-p nucleus) is never drawn. Memory: one [B, V] float64 cumulative sum."""
    cdf = logprobs_BV.exp().to(torch.float64).cumsum_(-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms_BD * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)
