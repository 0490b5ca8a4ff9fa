"""Gaussian noise for the clipped sums.

Noise comes from Opacus's own generator function, drawn from a torch.Generator seeded by
the (step, stage) noise stream (see streams.py): every stage's noise is independent,
every run with the same seed is reproducible, and a resumed run draws the same noise as
one that never stopped. In secure mode it comes from the OS CSPRNG instead (secure.py).
"""

from __future__ import annotations

from typing import List

import torch
from opacus.optimizers.optimizer import _generate_noise

from .secure import secure_gaussian_like
from .streams import Stream, stream_seed


def add_noise(
    grads: List[torch.Tensor],
    std: float,
    seed: int,
    step: int,
    stage: int,
    secure_mode: bool = False,
) -> List[torch.Tensor]:
    """grads + N(0, std^2) elementwise, the stage's parameters in order."""
    if std == 0 or not grads:
        return grads
    if secure_mode:
        return [g + secure_gaussian_like(g, std) for g in grads]
    generator = torch.Generator(device=grads[0].device)
    generator.manual_seed(stream_seed(Stream.NOISE, seed, step, stage))
    return [g + _generate_noise(std=std, reference=g, generator=generator) for g in grads]
