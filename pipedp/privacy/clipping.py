"""How per-sample gradients are clipped: the clipping mode and its norms, and clip factors."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence, Tuple, Union

import torch

from ..config import CLIPPING_MODES


@dataclass(frozen=True)
class Clipping:
    """How per-sample gradients are clipped.

    flat:      one norm over the whole model (summed over stages), clipped to C.
    per_stage: each stage clips its own part to C_k, with no cross-stage sum of norms
               (He et al. 2023 group-wise clipping); the whole per-sample gradient then has
               norm at most sqrt(sum C_k^2), which is the sensitivity the noise is scaled to.
    per_layer: each layer (a module owning trainable parameters) clips its own part to C_g;
               no norm crosses a stage or a layer; sensitivity sqrt(sum C_g^2).
    """

    mode: str
    stage_norms: Tuple[float, ...]  # the C used on each stage (flat, per_stage)
    layer_norms: Tuple[Tuple[str, float], ...] = ()  # (layer name, C_g) of every layer (per_layer)

    @staticmethod
    def make(
        mode: str,
        max_grad_norm: Union[float, Sequence[float], Mapping[str, float]],
        stages: int,
        layers: Sequence[str] = (),
    ) -> "Clipping":
        """``layers``: the model's layer names (needed for per_layer)."""
        if mode not in CLIPPING_MODES:
            raise ValueError(f"unknown clipping {mode!r}: choose one of {CLIPPING_MODES}")
        if mode == "per_layer":
            return Clipping(mode, (), _layer_norms(max_grad_norm, layers))
        if isinstance(max_grad_norm, Mapping):
            raise ValueError("a {layer: C} max_grad_norm needs clipping='per_layer'")
        norms = (
            [float(max_grad_norm)] * stages
            if isinstance(max_grad_norm, (int, float))
            else [float(c) for c in max_grad_norm]
        )
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
    def per_layer(self) -> bool:
        return self.mode == "per_layer"

    def layer_norm(self, name: str) -> float:
        return dict(self.layer_norms)[name]

    @property
    def sensitivity(self) -> float:
        if self.mode == "flat":
            return self.stage_norms[0]
        norms = [c for _, c in self.layer_norms] if self.per_layer else list(self.stage_norms)
        return math.sqrt(sum(c * c for c in norms))


def _layer_norms(max_grad_norm, layers: Sequence[str]) -> Tuple[Tuple[str, float], ...]:
    if not layers:
        raise ValueError("per_layer clipping needs the model's layers (none with trainable parameters?)")
    if isinstance(max_grad_norm, Mapping):
        missing = [n for n in layers if n not in max_grad_norm]
        unknown = [n for n in max_grad_norm if n not in layers]
        if missing or unknown:
            raise ValueError(
                f"per_layer max_grad_norm must name every layer exactly: missing {missing}, "
                f"unknown {unknown} (the layers: {list(layers)})"
            )
        norms = [(n, float(max_grad_norm[n])) for n in layers]
    elif isinstance(max_grad_norm, (int, float)):
        norms = [(n, float(max_grad_norm) / math.sqrt(len(layers))) for n in layers]  # total stays C
    else:
        raise ValueError("per_layer clipping takes one max_grad_norm (split equally) or a {layer name: C} dict")
    if any(not c > 0 for _, c in norms):
        raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    return tuple(norms)


def clip_factors(
    squared_norms: torch.Tensor, max_grad_norm: Union[float, torch.Tensor], mask: torch.Tensor
) -> torch.Tensor:
    """min(1, C / (||g_i|| + 1e-6)) as Opacus computes it; 0 for padded rows, and 0 for a sample
    whose norm is not finite (NaN or inf): that sample is left out of the step, a per-sample
    decision that keeps the sensitivity at C. ``squared_norms`` [n], or [groups, n] with C of
    shape [groups, 1] (per-layer clipping)."""
    norms = squared_norms.clamp(min=0).sqrt()
    factors = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    factors = torch.where(torch.isfinite(squared_norms), factors, torch.zeros_like(factors))
    return factors * mask.to(factors.dtype)
