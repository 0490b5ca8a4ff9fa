"""nn.LayerNorm with elementwise affine parameters, in closed form.

Per sample: grad weight = sum g * x_hat, grad bias = sum g, over every dimension but the first and
the normalised ones (a [n, d] input: each sample is its own sum). Cheap to keep from I to W: two
[n, d] tensors, and W then skips re-normalising the input.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from .registry import Grads, LayerRule, register


def _grads(layer: nn.LayerNorm, x: torch.Tensor, g: torch.Tensor, per_sample: bool) -> Grads:
    x_hat = torch.nn.functional.layer_norm(x.to(g.dtype), layer.normalized_shape, None, None, layer.eps)
    lead = tuple(range(1 if per_sample else 0, x.dim() - len(layer.normalized_shape)))
    out = {}  # (a sum over no dimension would sum all of them: a [n, d] input is its own per-sample sum)
    if layer.weight is not None and layer.weight.requires_grad:
        out[layer.weight] = (g * x_hat).sum(lead) if lead else g * x_hat
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = g.sum(lead) if lead else g
    return out


def grads(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor) -> Grads:
    return _grads(layer, inputs[0], backprops, per_sample=True)


def weight(layer: nn.Module, inputs: Sequence[torch.Tensor], scaled: torch.Tensor) -> Grads:
    return _grads(layer, inputs[0], scaled, per_sample=False)


def keepable(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor) -> bool:
    return True


LAYER_NORM = LayerRule("layer_norm", grads, weight, None, keepable, pools_positions=True)
register(nn.LayerNorm, LAYER_NORM)
