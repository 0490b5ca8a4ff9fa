"""The DP arithmetic of a step: clip factors, Gaussian noise, Opacus scaling.

Noise comes from Opacus's own generator function, drawn from a torch.Generator seeded by
(seed, step, stage) so that every stage's noise is independent, every run with the same
seed is reproducible, and a resumed run draws the same noise as one that never stopped.
In secure mode it comes from the OS CSPRNG instead (see secure.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple, Union

import numpy as np
import torch
from opacus.optimizers.optimizer import _generate_noise


CLIPPING_MODES = ("flat", "per_stage")


@dataclass(frozen=True)
class Clipping:
    """How per-sample gradients are clipped.

    flat:      one norm over the whole model (summed over stages), clipped to C.
    per_stage: each stage clips its own part to C_k, with no cross-stage sum of norms
               (He et al. 2023 group-wise clipping); the whole per-sample gradient then has
               norm at most sqrt(sum C_k^2), which is the sensitivity the noise is scaled to.
    """

    mode: str
    stage_norms: Tuple[float, ...]  # the C used on each stage

    @staticmethod
    def make(mode: str, max_grad_norm: Union[float, Sequence[float]], stages: int) -> "Clipping":
        if mode not in CLIPPING_MODES:
            raise ValueError(f"unknown clipping {mode!r}: choose one of {CLIPPING_MODES}")
        norms = [float(max_grad_norm)] * stages if isinstance(max_grad_norm, (int, float)) else [float(c) for c in max_grad_norm]
        if mode == "flat" and len(set(norms)) != 1:
            raise ValueError("flat clipping takes one max_grad_norm; per-stage norms need clipping='per_stage'")
        if mode == "per_stage" and isinstance(max_grad_norm, (int, float)):
            norms = [float(max_grad_norm) / math.sqrt(stages)] * stages  # total sensitivity stays C
        if len(norms) != stages:
            raise ValueError(f"got {len(norms)} max_grad_norm values for {stages} stages")
        if any(c <= 0 for c in norms):
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        return Clipping(mode, tuple(norms))

    @property
    def across_stages(self) -> bool:
        return self.mode == "flat"

    @property
    def sensitivity(self) -> float:
        return self.stage_norms[0] if self.mode == "flat" else math.sqrt(sum(c * c for c in self.stage_norms))


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
