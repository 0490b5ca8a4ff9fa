"""The clipping rule: how per-sample gradients are clipped, in one object.

A ``ClipRule`` owns what the three modes differ in: which per-sample squared norms are summed
before clipping (over every stage, over one stage, or over one layer), the thresholds C, the
shape of the clip factors, and the sensitivity the noise is scaled to. ``ClipRule.for_stage``
binds it to one stage's layers; the stage and the executor use that ``StageClip`` without
branching on the mode.

flat:      one norm over the whole model (summed over stages), clipped to C.
per_stage: each stage clips its own part to C_k, with no cross-stage sum of norms (He et al. 2023
           group-wise clipping); the whole per-sample gradient then has norm at most
           sqrt(sum C_k^2), the sensitivity.
per_layer: each layer (a module owning trainable parameters) clips its own part to C_g; no norm
           crosses a stage or a layer; sensitivity sqrt(sum C_g^2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..config import CLIPPING_MODES

MaxGradNorm = Union[float, Sequence[float], Mapping[str, float]]


def sum_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype a parameter's clipped sum accumulates in: per-sample arithmetic is float32 at least."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class ClipRule:
    mode: str
    stage_thresholds: Tuple[float, ...]  # the C of each stage (flat, per_stage)
    layer_thresholds: Tuple[Tuple[str, float], ...] = ()  # (layer name, C_g) of every layer (per_layer)

    @staticmethod
    def make(mode: str, max_grad_norm: MaxGradNorm, stages: int, layers: Sequence[str] = ()) -> "ClipRule":
        """``layers``: the model's layer names, in stage order (needed for per_layer)."""
        if mode not in CLIPPING_MODES:
            raise ValueError(f"unknown clipping {mode!r}: choose one of {CLIPPING_MODES}")
        if mode == "per_layer":
            return ClipRule(mode, (), _layer_thresholds(max_grad_norm, layers))
        if isinstance(max_grad_norm, Mapping):
            raise ValueError("a {layer: C} max_grad_norm needs clipping='per_layer'")
        if isinstance(max_grad_norm, (int, float)):
            thresholds = [float(max_grad_norm)] * stages
        else:
            thresholds = [float(c) for c in max_grad_norm]
        if mode == "flat" and len(set(thresholds)) != 1:
            raise ValueError("flat clipping takes one max_grad_norm; per-stage norms need clipping='per_stage'")
        if mode == "per_stage" and isinstance(max_grad_norm, (int, float)):
            thresholds = [float(max_grad_norm) / math.sqrt(stages)] * stages  # total sensitivity stays C
        if len(thresholds) != stages:
            raise ValueError(f"got {len(thresholds)} max_grad_norm values for {stages} stages")
        if any(c <= 0 for c in thresholds):
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        return ClipRule(mode, tuple(thresholds))

    @property
    def across_stages(self) -> bool:
        """The per-sample norms are summed over every stage before clipping (flat)."""
        return self.mode == "flat"

    @property
    def sensitivity(self) -> float:
        """The largest norm a sample's whole clipped gradient can have: the noise is scaled to it."""
        if self.mode == "flat":
            return self.stage_thresholds[0]
        if self.mode == "per_layer":
            return math.sqrt(sum(c * c for _, c in self.layer_thresholds))
        return math.sqrt(sum(c * c for c in self.stage_thresholds))

    def for_stage(self, index: int, layers: Sequence[str]) -> "StageClip":
        if self.mode == "per_layer":
            of_layer = dict(self.layer_thresholds)
            thresholds = torch.tensor([[of_layer[name]] for name in layers], dtype=torch.float64)
            return StageClip(self, tuple(layers), thresholds)
        threshold = self.stage_thresholds[index if self.mode == "per_stage" else 0]  # flat: one C for all
        return StageClip(self, tuple(layers), torch.tensor(threshold, dtype=torch.float64))


@dataclass(frozen=True)
class StageClip:
    """The clip rule as one stage applies it: its layers (in order) and thresholds."""

    rule: ClipRule
    layers: Tuple[str, ...]
    thresholds: torch.Tensor  # scalar, or [layers, 1] under per_layer

    @property
    def per_layer(self) -> bool:
        return self.rule.mode == "per_layer"

    def reduce(self, per_layer: Dict[str, torch.Tensor], n: int, device=None) -> torch.Tensor:
        """This stage's part of the norms to clip by, from each layer's per-sample squared norms
        ({layer: [n] float64}): their sum [n], or one row per layer [layers, n] (zeros for a layer this
        micro-batch did not call)."""
        zero = torch.zeros(n, dtype=torch.float64, device=device)
        if self.per_layer:
            return torch.stack([per_layer[name] if name in per_layer else zero for name in self.layers])
        if not per_layer:
            return zero
        return torch.stack(list(per_layer.values())).sum(0)

    def factors(self, reduced: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Clip factors for the reduced norms (see clip_factors): [n], or [layers, n]."""
        return clip_factors(reduced, self.thresholds.to(reduced.device), mask)

    def of_layer(self, factors: torch.Tensor, layer: str) -> torch.Tensor:
        """The [n] factors that apply to ``layer``'s gradients."""
        return factors[self.layers.index(layer)] if self.per_layer else factors

    def rows(self, flags: torch.Tensor) -> torch.Tensor:
        """[n] per-sample flags from [n] or [layers, n] ones (per_layer: any layer)."""
        return flags.any(0) if flags.dim() == 2 else flags


def _layer_thresholds(max_grad_norm: MaxGradNorm, layers: Sequence[str]) -> Tuple[Tuple[str, float], ...]:
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
        thresholds = [(n, float(max_grad_norm[n])) for n in layers]
    elif isinstance(max_grad_norm, (int, float)):
        thresholds = [(n, float(max_grad_norm) / math.sqrt(len(layers))) for n in layers]  # total stays C
    else:
        raise ValueError("per_layer clipping takes one max_grad_norm (split equally) or a {layer name: C} dict")
    if any(not c > 0 for _, c in thresholds):
        raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    return tuple(thresholds)


def clip_factors(
    squared_norms: torch.Tensor, threshold: Union[float, torch.Tensor], mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """min(1, C / (||g_i|| + 1e-6)) as Opacus computes it; 0 for padded rows (mask 0), and 0 for a
    sample whose norm is not finite (NaN or inf): that sample is left out of the step, a per-sample
    decision that keeps the sensitivity at C. ``squared_norms`` [n], or [groups, n] with C of shape
    [groups, 1] (per-layer clipping)."""
    norms = squared_norms.clamp(min=0).sqrt()
    factors = (threshold / (norms + 1e-6)).clamp(max=1.0)
    factors = torch.where(torch.isfinite(squared_norms), factors, torch.zeros_like(factors))
    return factors if mask is None else factors * mask.to(factors.dtype)
