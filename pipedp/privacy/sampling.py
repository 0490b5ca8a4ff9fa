"""Poisson sampling of logical batches, one independent draw per step; and shuffled epochs.

Each step t includes every example independently with probability q, with the uniform
draws from the (step) sampling stream of streams.py: any rank computes the same batch without communication, and a
resumed run draws exactly the batches of a run that never stopped (the sampler has no
state beyond the step counter). Opacus's UniformWithReplacementSampler draws the same
distribution from one running generator; this one is keyed by step instead.
"""

from __future__ import annotations

from typing import Optional

import torch
from scipy.stats import binom

from ..config import steps_per_epoch
from .secure import secure_uniform
from .streams import Stream, stream_seed


def poisson_indices(num_examples: int, sample_rate: float, seed: int, step: int, secure: bool = False) -> torch.Tensor:
    if secure:
        draws = torch.from_numpy(secure_uniform(num_examples))
    else:
        g = torch.Generator().manual_seed(stream_seed(Stream.SAMPLING, seed, step))
        draws = torch.rand(num_examples, generator=g, dtype=torch.float64)
    return torch.nonzero(draws < sample_rate).flatten()


def shuffled_indices(num_examples: int, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """Step ``step``'s batch of shuffled fixed-size batches: epoch e = step // (steps per epoch) is a
    permutation from the (epoch) shuffle stream, cut into batches of ``batch_size``; every record is
    in exactly one batch of each epoch. Keyed by the step, so a resumed run draws the same batches."""
    per_epoch = steps_per_epoch(num_examples, batch_size)
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(stream_seed(Stream.SHUFFLE, seed, epoch))
    order = torch.randperm(num_examples, generator=g)
    return order[k * batch_size : (k + 1) * batch_size].sort().values


def truncate(indices: torch.Tensor, cap: Optional[int], seed: int, step: int) -> torch.Tensor:
    """Keep at most ``cap`` of the sampled indices (a uniformly random subset)."""
    if cap is None or len(indices) <= cap:
        return indices
    g = torch.Generator().manual_seed(stream_seed(Stream.TRUNCATION, seed, step))
    return indices[torch.randperm(len(indices), generator=g)[:cap]].sort().values


def truncation_probability(num_examples: int, sample_rate: float, cap: int) -> float:
    """P(Binomial(N, q) > cap): the chance one step's Poisson batch exceeds the cap."""
    if cap >= num_examples:
        return 0.0
    return min(1.0, float(binom.sf(cap, num_examples, sample_rate)))
