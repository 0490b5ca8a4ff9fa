"""nn.Linear and Hugging Face's Conv1D (GPT-2: a Linear whose weight is stored [in, out]).

Per sample i over positions t: grad W_i = sum_t g_t a_t^T (one batched product), grad b_i = sum_t g_t.
Ghost norm: ||sum_t g_t a_t^T||^2 = <a a^T, g g^T> over the [T, T] Gram matrices (Opacus's formula,
as batched matmuls), used while the Gram matrices are no larger than the gradients.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from .grams import GramCache, gram
from .registry import Grads, LayerRule, register


def _is_conv1d(layer: nn.Module) -> bool:
    """Hugging Face's Conv1D, recognised by its shape (no transformers import)."""
    return type(layer).__name__ == "Conv1D" and getattr(layer, "weight", None) is not None and layer.weight.dim() == 2


def _as_sequences(layer: nn.Module, a: torch.Tensor, g: torch.Tensor):
    """[n, T, in] inputs and [n, T, out] output grads (T = 1 for [n, d] calls)."""
    n = g.shape[0]
    return a.reshape(n, -1, a.shape[-1]).to(g.dtype), g.reshape(n, -1, g.shape[-1])


def grads(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor) -> Grads:
    a3, g3 = _as_sequences(layer, inputs[0], backprops)
    out = {}
    if layer.weight.requires_grad:  # one batched product in the weight's own layout (contiguous for the norms)
        conv1d = _is_conv1d(layer)
        out[layer.weight] = torch.bmm(a3.transpose(1, 2), g3) if conv1d else torch.bmm(g3.transpose(1, 2), a3)
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = g3.sum(1)
    return out


def weight(layer: nn.Module, inputs: Sequence[torch.Tensor], scaled: torch.Tensor) -> Grads:
    out: Grads = {}
    add_weight(layer, inputs, scaled, out)
    return out


def add_weight(layer: nn.Module, inputs: Sequence[torch.Tensor], scaled: torch.Tensor, sums: Grads) -> None:
    """weight() added into ``sums``: the product accumulates in the running sum (addmm_), so a 32000 x 4096
    head never has a second float32 copy of its gradient."""
    a = inputs[0].reshape(-1, inputs[0].shape[-1]).to(scaled.dtype)
    g = scaled.reshape(-1, scaled.shape[-1])
    if layer.weight.requires_grad:
        left, right = (a.t(), g) if _is_conv1d(layer) else (g.t(), a)
        if layer.weight in sums:
            sums[layer.weight].addmm_(left, right)
        else:
            sums[layer.weight] = left @ right
    if layer.bias is not None and layer.bias.requires_grad:
        if layer.bias in sums:
            sums[layer.bias] += g.sum(0)
        else:
            sums[layer.bias] = g.sum(0)


def norms(
    layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor, grams: Optional[GramCache] = None
) -> Optional[Grads]:
    a3, g3 = _as_sequences(layer, inputs[0], backprops)
    tokens = g3.shape[1]
    if tokens * tokens > layer.weight.numel():
        return None  # the [n, T, T] Gram matrices would outweigh the [n, out, in] gradients
    out = {}
    if layer.weight.requires_grad:
        if tokens == 1:
            out[layer.weight] = g3[:, 0].pow(2).sum(1) * a3[:, 0].pow(2).sum(1)
        else:
            out[layer.weight] = (gram(g3) * (grams or GramCache()).gram(inputs[0], a3)).sum((1, 2))
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = g3.sum(1).pow(2).sum(1)
    return out


def keepable(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor) -> bool:
    """Over T >= 2 positions, keeping the per-sample products replaces the Gram matrices (n T^2 (in +
    out)) and W's product; over one position ghost norms need no Gram matrix and W is small."""
    return backprops.reshape(backprops.shape[0], -1, backprops.shape[-1]).shape[1] >= 2


LINEAR = LayerRule("linear", grads, weight, norms, keepable, pools_positions=True, add_weight=add_weight)
register(nn.Linear, LINEAR)
register(_is_conv1d, LINEAR)
