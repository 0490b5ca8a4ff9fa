"""The DP arithmetic of a step: clip factors, Gaussian noise, Opacus scaling.

Noise comes from Opacus's own generator function, drawn from a torch.Generator seeded by
(seed, step, stage) so that every stage's noise is independent, every run with the same
seed is reproducible, and a resumed run draws the same noise as one that never stopped.
In secure mode it comes from the OS CSPRNG instead (see secure.py).
"""
from __future__ import annotations

from typing import List

import numpy as np
import torch
from opacus.optimizers.optimizer import _generate_noise


def clip_factors(squared_norms: torch.Tensor, max_grad_norm: float, mask: torch.Tensor) -> torch.Tensor:
    """min(1, C / (||g_i|| + 1e-6)) as Opacus computes it; 0 for padded rows."""
    norms = squared_norms.clamp(min=0).sqrt()
    factors = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    return factors * mask.to(factors.dtype)


def noise_seed(seed: int, step: int, stage: int) -> int:
    return int(np.random.SeedSequence([seed, step, stage]).generate_state(1, dtype=np.uint64)[0] >> 1)


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
        from .secure import secure_gaussian_like

        return [g + secure_gaussian_like(g, std) for g in grads]
    generator = torch.Generator(device=grads[0].device)
    generator.manual_seed(noise_seed(seed, step, stage))
    return [g + _generate_noise(std=std, reference=g, generator=generator) for g in grads]
