"""Per-sample squared gradient norms and clipped gradient sums of one unit.

Reuses Opacus's per-layer functions: ``GradSampleModule.GRAD_SAMPLERS`` (materialised
per-sample gradients) and ``GradSampleModuleFastGradientClipping.NORM_SAMPLERS`` (ghost
norms). Layers without an Opacus sampler fall back to torch.func (vmap of grad), like
Opacus's functorch fallback but without storing state on the module.

All functions are pure: (unit, inputs, output-grads) -> tensors.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
from torch.func import functional_call, grad, vmap

GRAD_SAMPLERS = GradSampleModule.GRAD_SAMPLERS
NORM_SAMPLERS = GradSampleModuleFastGradientClipping.NORM_SAMPLERS


def trainable_direct_params(unit: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in unit.named_parameters(recurse=False) if p.requires_grad]


def _has_trainable_children(unit: nn.Module) -> bool:
    return any(p.requires_grad for c in unit.children() for p in c.parameters())


def _is_conv1d(unit: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): a Linear whose weight is stored [in, out]."""
    return type(unit).__name__ == "Conv1D" and getattr(unit, "weight", None) is not None and unit.weight.dim() == 2


def _conv1d_grads(unit, inputs, backprops) -> Dict[nn.Parameter, torch.Tensor]:
    a = inputs[0].to(backprops.dtype)
    out = {}
    if unit.weight.requires_grad:
        out[unit.weight] = torch.einsum("n...i,n...o->nio", a, backprops)
    if unit.bias is not None and unit.bias.requires_grad:
        out[unit.bias] = backprops.reshape(backprops.shape[0], -1, backprops.shape[-1]).sum(1)
    return out


def _without_padding_rows(unit: nn.Module, inputs, backprops: torch.Tensor) -> torch.Tensor:
    """nn.Embedding's padding_idx row gets no gradient in PyTorch, but Opacus 1.6's embedding
    samplers count it (its per-sample norms and grads include that row): drop those backprops."""
    if type(unit) is nn.Embedding and unit.padding_idx is not None:
        keep = (inputs[0] != unit.padding_idx).unsqueeze(-1).to(backprops.dtype)
        return backprops * keep
    return backprops


def per_sample_grads(
    unit: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """{param: [n, *param.shape]} per-sample gradients of the unit's own trainable parameters."""
    backprops = _without_padding_rows(unit, inputs, backprops)
    if _is_conv1d(unit):
        return _conv1d_grads(unit, inputs, backprops)
    sampler = GRAD_SAMPLERS.get(type(unit))
    if sampler is not None and not _has_trainable_children(unit):
        grads = sampler(unit, list(inputs), backprops)
        return {p: g for p, g in grads.items() if p.requires_grad}
    return _functorch_grads(unit, inputs, backprops)


def _functorch_grads(unit, inputs, backprops) -> Dict[nn.Parameter, torch.Tensor]:
    named = trainable_direct_params(unit)
    names = [n for n, _ in named]
    values = tuple(p.detach() for _, p in named)

    def sample_loss(params, sample_inputs, sample_backprop):
        batched = tuple(x.unsqueeze(0) for x in sample_inputs)
        out = functional_call(unit, dict(zip(names, params)), batched)
        return (out * sample_backprop.unsqueeze(0)).sum()

    grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))(values, tuple(inputs), backprops)
    return {p: g for (_, p), g in zip(named, grads)}


def ghost_squared_norms(
    unit: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor
) -> Optional[Dict[nn.Parameter, torch.Tensor]]:
    """{param: [n]} squared norms without materialising per-sample gradients, or None where
    Opacus has no norm sampler for the layer or where materialising is cheaper."""
    linear_like = type(unit) is nn.Linear or _is_conv1d(unit)
    # the ghost norm of a Linear depends only on (a, g), not on how its weight is stored
    sampler = NORM_SAMPLERS.get(nn.Linear if linear_like else type(unit))
    if sampler is None or _has_trainable_children(unit):
        return None
    if linear_like and backprops.dim() > 2:
        # ghost needs [n, T, T] Gram matrices; materialising needs [n, out, in]
        tokens = backprops[0].numel() // backprops.shape[-1]
        if tokens * tokens > unit.weight.numel():
            return None
        if backprops.dim() > 3:  # Opacus's ghost norm handles [n, T, d]
            backprops = backprops.reshape(backprops.shape[0], -1, backprops.shape[-1])
            inputs = [inputs[0].reshape(inputs[0].shape[0], -1, inputs[0].shape[-1])]
    backprops = _without_padding_rows(unit, inputs, backprops)
    norms = sampler(unit, [x.contiguous() for x in inputs], backprops)  # Opacus's embedding sampler views
    return {p: n.to(backprops.dtype) ** 2 for p, n in norms.items() if p.requires_grad}


def clipped_grad_sum(
    unit: nn.Module, inputs: Sequence[torch.Tensor], scaled_backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """sum_i c_i grad_i for the unit's own parameters, given backprops already scaled by c_i.

    Since a layer's weight gradient is linear in its output gradient, this is the ordinary
    weight gradient of the layer for the scaled output gradient: one local vector-Jacobian
    product, no per-sample tensors and no backward through the rest of the pipeline.
    """
    if type(unit) is nn.Linear or _is_conv1d(unit):
        a = inputs[0].reshape(-1, inputs[0].shape[-1]).to(scaled_backprops.dtype)
        g = scaled_backprops.reshape(-1, scaled_backprops.shape[-1])
        out = {}
        if unit.weight.requires_grad:
            out[unit.weight] = g.t() @ a if type(unit) is nn.Linear else a.t() @ g
        if unit.bias is not None and unit.bias.requires_grad:
            out[unit.bias] = g.sum(0)
        return out
    named = trainable_direct_params(unit)
    params = [p for _, p in named]
    with torch.enable_grad():
        output = unit(*inputs)
        grads = torch.autograd.grad(output, params, scaled_backprops, allow_unused=True)
    return {p: (g if g is not None else torch.zeros_like(p)) for p, g in zip(params, grads)}
