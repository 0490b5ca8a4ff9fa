"""How per-sample gradients are clipped: the clipping mode and its norms, and clip factors."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple, Union

import torch

from ..config import CLIPPING_MODES


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
    """min(1, C / (||g_i|| + 1e-6)) as Opacus computes it; 0 for padded rows, and 0 for a sample
    whose norm is not finite (NaN or inf): that sample is left out of the step, a per-sample
    decision that keeps the sensitivity at C."""
    norms = squared_norms.clamp(min=0).sqrt()
    factors = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    factors = torch.where(torch.isfinite(squared_norms), factors, torch.zeros_like(factors))
    return factors * mask.to(factors.dtype)
