"""Random training windows and fixed evaluation windows over a byte split.

Batches are a pure function of (seed, step), so a resumed run draws exactly the batches an uninterrupted
run would have drawn, and two swarm nodes with different seeds draw different windows.
"""

from __future__ import annotations

import numpy as np
import torch

EVAL_SEED = 0x5EED


def windows(split: np.ndarray, starts: np.ndarray, context: int) -> torch.Tensor:
    """Windows of ``context + 1`` bytes at ``starts`` as an int64 tensor (batch, context + 1)."""
    index = starts[:, None] + np.arange(context + 1)
    return torch.from_numpy(split[index].astype(np.int64))


def train_batch(split: np.ndarray, batch_size: int, context: int, seed: int, step: int) -> torch.Tensor:
    """The training batch for ``step`` of a run seeded with ``seed``."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(split) - context, size=batch_size)
    return windows(split, starts, context)


def eval_starts(split: np.ndarray, count: int, context: int) -> np.ndarray:
    """The same ``count`` window starts every time (independent of the run's seed), spread over the split."""
    rng = np.random.default_rng(EVAL_SEED)
    return np.sort(rng.integers(0, len(split) - context, size=count))
