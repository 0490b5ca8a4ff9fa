"""The layer-rule registry itself: the LayerRule type, register(), and the shared helpers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

Grads = Dict[nn.Parameter, torch.Tensor]


@dataclass(frozen=True)
class LayerRule:
    name: str
    grads: Callable[[nn.Module, Sequence[torch.Tensor], torch.Tensor], Grads]
    weight: Callable[[nn.Module, Sequence[torch.Tensor], torch.Tensor], Grads]
    norms: Optional[Callable[..., Optional[Grads]]] = None  # (layer, inputs, backprops, grams) -> {param: [n]}
    keepable: Optional[Callable[[nn.Module, Sequence[torch.Tensor], torch.Tensor], bool]] = None
    # the math sums over every dimension between the first (the sample) and the features: the rows of a
    # privacy layer may be folded into positions (privacy/units.py)
    pools_positions: bool = False


RULES: Dict[type, LayerRule] = {}
PREDICATES: List[Tuple[Callable[[nn.Module], bool], LayerRule]] = []


def register(layer: "type | Callable[[nn.Module], bool]", rule: LayerRule) -> None:
    """Register ``rule`` for a layer type (exact type match), or for every module a predicate accepts."""
    if isinstance(layer, type):
        RULES[layer] = rule
    else:
        PREDICATES.append((layer, rule))


def has_trainable_children(layer: nn.Module) -> bool:
    return any(p.requires_grad for c in layer.children() for p in c.parameters())


def trainable_direct_params(layer: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in layer.named_parameters(recurse=False) if p.requires_grad]
