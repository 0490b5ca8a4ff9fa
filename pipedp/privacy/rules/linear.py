"""nn.Linear and Hugging Face's Conv1D (GPT-2: a Linear whose weight is stored [in, out]).

Per sample i over positions t: grad W_i = sum_t g_t a_t^T (one batched product), grad b_i = sum_t g_t.
Ghost norm: ||sum_t g_t a_t^T||^2 = <a a^T, g g^T> over the [T, T] Gram matrices (Opacus's formula,
as batched matmuls), used while the Gram matrices are no larger than the gradients.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
import torch.nn as nn

from .grams import GramCache
from .registry import MACS_PER_BYTE, Grads, LayerRule, per_row, register


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
    a3, g3 = _as_sequences(layer, inputs[0], scaled)
    _accumulate(layer, a3, g3, out)
    return out


def add_weight(
    layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor, factors: torch.Tensor, sums: Grads
) -> None:
    """sum_i factors_i grad_i added into ``sums``. The gradient is bilinear in the input and the
    output-gradient, so the factors scale the narrower one (fc1 of a d -> 4d MLP: a quarter of the
    elements); the bias then weights each sample's output-gradient sum."""
    n = backprops.shape[0]
    a3, g3 = inputs[0].reshape(n, -1, inputs[0].shape[-1]), backprops.reshape(n, -1, backprops.shape[-1])
    if a3.shape[-1] >= g3.shape[-1] and layer.weight.requires_grad:
        _accumulate(layer, a3.to(g3.dtype), g3 * per_row(factors, 3), sums)
        return
    bias = None  # the output-gradient stays unscaled: the bias weights its per-sample sums
    if layer.bias is not None and layer.bias.requires_grad:
        bias = g3.sum(1).t() @ factors
    if layer.weight.requires_grad:  # (one pass: a bf16 capture promotes against the float32 factors)
        a3 = (a3 * per_row(factors, 3)).to(g3.dtype)
    _accumulate(layer, a3, g3, sums, bias)


def _accumulate(
    layer: nn.Module, a3: torch.Tensor, g3: torch.Tensor, sums: Grads, bias: Optional[torch.Tensor] = None
) -> None:
    """``sums`` += the weight's product of [n, T, in] inputs and [n, T, out] output-gradients and the bias's
    part (``bias``, or the output-gradients' sum). The product accumulates in the running sum (addmm_),
    so a 32000 x 4096 head never has a second float32 copy of its gradient."""
    if layer.weight.requires_grad:
        a, g = a3.reshape(-1, a3.shape[-1]), g3.reshape(-1, g3.shape[-1])
        left, right = (a.t(), g) if _is_conv1d(layer) else (g.t(), a)
        if layer.weight in sums:  # (a sum started as the noise has the parameter's sum_dtype: float32 products
            total = sums[layer.weight]  # of a float64 layer then accumulate in float64)
            total.addmm_(left.to(total.dtype), right.to(total.dtype))
        else:
            sums[layer.weight] = left @ right
    if layer.bias is not None and layer.bias.requires_grad:
        part = bias if bias is not None else g3.sum((0, 1))
        if layer.bias in sums:
            sums[layer.bias] += part
        else:
            sums[layer.bias] = part


def norms(
    layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor, grams: Optional[GramCache] = None
) -> Optional[Grads]:
    if _grams_outweigh(layer, backprops):
        return None
    a3, g3 = _as_sequences(layer, inputs[0], backprops)
    tokens = g3.shape[1]
    out = {}
    if layer.weight.requires_grad:
        if tokens == 1:
            out[layer.weight] = g3[:, 0].pow(2).sum(1) * a3[:, 0].pow(2).sum(1)
        else:
            grams = grams or GramCache()
            out[layer.weight] = (grams.gram(backprops, g3) * grams.gram(inputs[0], a3)).sum((1, 2))
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = g3.sum(1).pow(2).sum(1)
    return out


def _positions(backprops: torch.Tensor) -> int:
    return backprops.reshape(backprops.shape[0], -1, backprops.shape[-1]).shape[1]


def _grams_outweigh(layer: nn.Module, backprops: torch.Tensor) -> bool:
    """The [n, T, T] Gram matrices would outweigh the [n, out, in] gradients: no ghost norms."""
    return _positions(backprops) ** 2 > layer.weight.numel()


def costs(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor) -> Dict[str, float]:
    """The cost of each way (runtime/grad_modes.py: multiply-adds plus memory traffic, a byte counted as
    MACS_PER_BYTE multiply-adds), for n samples over T positions, in -> out features:
      ghost:       n T^2 (in + out) for the Gram matrices + n T in out for W's product
      keep:        n T in out for the per-sample products + 12 n in out bytes (written, read for the norm and
                   for W's weighted sum)
      materialize: keep's products and norm traffic + W's product."""
    n, t = backprops.shape[0], _positions(backprops)
    out, features_in = backprops.shape[-1], inputs[0].shape[-1]
    product = n * t * features_in * out
    traffic = MACS_PER_BYTE * 12 * n * features_in * out
    table = {"keep": product + traffic, "materialize": 2 * product + traffic}
    if not _grams_outweigh(layer, backprops):
        table["ghost"] = n * t * t * (features_in + out) + product
    return table


def keepable(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor) -> bool:
    """Over T >= 2 positions, keeping the per-sample products replaces the Gram matrices (n T^2 (in +
    out)) and W's product; over one position ghost norms need no Gram matrix and W is small."""
    return _positions(backprops) >= 2


LINEAR = LayerRule("linear", grads, weight, norms, keepable, pools_positions=True, add_weight=add_weight, costs=costs)
register(nn.Linear, LINEAR)
register(_is_conv1d, LINEAR)
