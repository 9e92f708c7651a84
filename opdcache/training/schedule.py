"""Which prompts, with which sampling seeds, make up fresh-rollout batch b: one rule for the online baseline and the
async rollout workers, so a run at staleness 0 samples exactly what the synchronous trainer samples.

Prompts are drawn in the order of consecutive seeded permutations of all prompts (``numpy.random.default_rng(seed)``),
``batch_size`` at a time; sample j of batch b draws from its own stream seeded ``seed * 1_000_003 + (b + 1) * 1009 + j``.
Batch b depends only on (number of prompts, batch size, seed, b): a resumed or replayed run redraws nothing differently.
"""

from __future__ import annotations

import numpy as np


class PromptSchedule:
    def __init__(self, num_prompts: int, batch_size: int, seed: int):
        if num_prompts < 1:
            raise ValueError("the prompt schedule needs at least one prompt")
        self.num_prompts, self.batch_size, self.seed = num_prompts, batch_size, seed
        self._rng = np.random.default_rng(seed)
        self._order: list[int] = []

    def batch(self, b: int) -> tuple[list[int], list[int]]:
        """(prompt indices, per-sample seeds) of batch b (0-based)."""
        end = (b + 1) * self.batch_size
        while len(self._order) < end:  # permutations are drawn in sequence, so batch b is the same whenever it is asked for
            self._order.extend(self._rng.permutation(self.num_prompts).tolist())
        idx = self._order[b * self.batch_size: end]
        return idx, [self.seed * 1_000_003 + (b + 1) * 1009 + j for j in range(len(idx))]
