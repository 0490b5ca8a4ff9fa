"""The fallbacks: Opacus's per-layer grad samplers (Conv, GroupNorm, RMSNorm, InstanceNorm,
RNNLinear, ...), and torch.func for any other layer (vmap of the gradient of the layer replayed on
one sample, like Opacus's functorch fallback but keeping no state on the module). Both get W by
replaying the layer once on its captured inputs with the scaled output-gradients.

A mixture-of-experts block with no closed-form rule is replayed whole, one sample at a time (``LOOPED``).

A layer torch.func cannot differentiate per sample (e.g. one running a custom autograd.Function
without vmap support) is refused by name: see ``per_sample.unit_error``.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn as nn
from opacus.grad_sample import GradSampleModule
from torch.func import functional_call, grad, vmap

from .registry import Grads, LayerRule, layer_parameters

GRAD_SAMPLERS = GradSampleModule.GRAD_SAMPLERS


def in_unit_dtype(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor):
    """A layer replayed on its own: its float inputs and output-grads in its parameters' dtype (bf16
    weights read bf16 inputs), and the dtype its gradients are returned in (float32 at least)."""
    dtype = next((p.dtype for _, p in layer_parameters(layer)), backprops.dtype)
    inputs = tuple(a.to(dtype) if a.is_floating_point() else a for a in inputs)
    return inputs, backprops.to(dtype), torch.promote_types(backprops.dtype, torch.float32)


def first_output(output):
    """A replayed layer's output: the first element of a tuple (the capture guards the others: LayerRule.keywords)."""
    return output[0] if isinstance(output, tuple) else output


def functorch_grads(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor) -> Grads:
    inputs, backprops, wide = in_unit_dtype(layer, inputs, backprops)
    named = layer_parameters(layer)
    names = [n for n, _ in named]
    values: Tuple[torch.Tensor, ...] = tuple(p.detach() for _, p in named)

    def sample_loss(params, sample_inputs, sample_backprop):
        batched = tuple(x.unsqueeze(0) for x in sample_inputs)
        out = first_output(functional_call(layer, dict(zip(names, params)), batched))
        return (out * sample_backprop.unsqueeze(0)).sum()

    grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))(values, tuple(inputs), backprops)
    return {p: g.to(wide) for (_, p), g in zip(named, grads)}


def _alone(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor):
    """(the dtype gradients are returned in, and for each sample its gradients {param: tensor}) from the layer
    replayed on that sample's rows alone, one backward each (the loop oracle's own method)."""
    inputs, backprops, wide = in_unit_dtype(layer, inputs, backprops)
    params = [p for _, p in layer_parameters(layer)]

    def each():
        for i in range(backprops.shape[0]):
            with torch.enable_grad():
                output = first_output(layer(*(a[i : i + 1] for a in inputs)))
                grads = torch.autograd.grad(output, params, backprops[i : i + 1].to(output.dtype), allow_unused=True)
            yield {p: g if g is not None else torch.zeros_like(p) for p, g in zip(params, grads)}

    return wide, each()


def looped_grads(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor) -> Grads:
    """Each sample's gradient from the layer replayed on that sample's rows alone: for a layer vmap cannot run,
    such as a mixture of experts splitting its tokens by ``expert_size.tolist()`` (JetMoE's)."""
    wide, samples = _alone(layer, inputs, backprops)
    rows: Dict[nn.Parameter, List[torch.Tensor]] = {}
    for grads in samples:
        for p, g in grads.items():
            rows.setdefault(p, []).append(g)
    return {p: torch.stack(gs).to(wide) for p, gs in rows.items()}


def looped_weight(layer: nn.Module, inputs: Sequence[torch.Tensor], scaled: torch.Tensor) -> Grads:
    """sum_i c_i grad_i with each sample's share from its rows alone, as looped_grads took its norm: within the
    clip bound by construction, whatever the layer does across samples."""
    wide, samples = _alone(layer, inputs, scaled)
    total: Grads = {}
    for grads in samples:
        for p, g in grads.items():
            total[p] = total[p] + g if p in total else g
    return {p: g.to(wide) for p, g in total.items()}


def replayed_weight(layer: nn.Module, inputs: Sequence[torch.Tensor], scaled: torch.Tensor) -> Grads:
    """sum_i c_i grad_i as the layer's ordinary weight gradient for the scaled output-gradients."""
    params = [p for _, p in layer_parameters(layer)]
    inputs, backprops, wide = in_unit_dtype(layer, inputs, scaled)
    with torch.enable_grad():
        output = first_output(layer(*inputs))
        grads = torch.autograd.grad(output, params, backprops.to(output.dtype), allow_unused=True)
    return {p: (g.to(wide) if g is not None else torch.zeros_like(p, dtype=wide)) for p, g in zip(params, grads)}


def opacus_grads(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor) -> Grads:
    grads = GRAD_SAMPLERS[type(layer)](layer, list(inputs), backprops)
    return {p: g for p, g in grads.items() if p.requires_grad}


OPACUS = LayerRule("opacus", opacus_grads, replayed_weight)
FUNCTORCH = LayerRule("torch.func", functorch_grads, replayed_weight, keywords=True)
# a mixture-of-experts block pipedp has no closed-form rule for (split/hf_experts.py registers it per class): the
# block with everything below it, replayed one sample at a time
LOOPED = LayerRule("replayed per sample", looped_grads, looped_weight, keywords=True, holds_below=True, alone=True)
