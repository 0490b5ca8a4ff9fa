"""Per-sample squared gradient norms and clipped gradient sums of one unit.

Materialised per-sample gradients come from Opacus's per-layer functions
(``GradSampleModule.GRAD_SAMPLERS``); layers without one fall back to torch.func (vmap of
grad), like Opacus's functorch fallback but without storing state on the module. Ghost
norms of Linear / Conv1D / Embedding use the same formulas as Opacus's NORM_SAMPLERS with
batched matmuls (faster); other layers use Opacus's NORM_SAMPLERS where it has one.

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


def _linear_grads(unit: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """One batched product per weight ([n, out, T] @ [n, T, in]), contiguous for the norms after."""
    n = g.shape[0]
    g3 = g.reshape(n, -1, g.shape[-1])
    out = {}
    if unit.weight.requires_grad:
        out[unit.weight] = torch.bmm(g3.transpose(1, 2), a.reshape(n, -1, a.shape[-1]).to(g.dtype))
    if unit.bias is not None and unit.bias.requires_grad:
        out[unit.bias] = g3.sum(1)
    return out


def squared_norms(per_sample: torch.Tensor) -> torch.Tensor:
    """[n]: each sample's squared gradient norm, one fused reduction (no [n, ...] temporary)."""
    return torch.linalg.vector_norm(per_sample.reshape(per_sample.shape[0], -1), dim=1).pow(2)


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
    if type(unit) is nn.Linear:
        return _linear_grads(unit, inputs[0], backprops)
    if type(unit) is nn.LayerNorm and unit.elementwise_affine:
        return _layer_norm_grads(unit, inputs[0], backprops, per_sample=True)
    sampler = GRAD_SAMPLERS.get(type(unit))
    if sampler is not None and not _has_trainable_children(unit):
        grads = sampler(unit, list(inputs), backprops)
        return {p: g for p, g in grads.items() if p.requires_grad}
    return _functorch_grads(unit, inputs, backprops)


def _functorch_grads(unit, inputs, backprops) -> Dict[nn.Parameter, torch.Tensor]:
    inputs, backprops, wide = _in_unit_dtype(unit, inputs, backprops)
    named = trainable_direct_params(unit)
    names = [n for n, _ in named]
    values = tuple(p.detach() for _, p in named)

    def sample_loss(params, sample_inputs, sample_backprop):
        batched = tuple(x.unsqueeze(0) for x in sample_inputs)
        out = functional_call(unit, dict(zip(names, params)), batched)
        return (out * sample_backprop.unsqueeze(0)).sum()

    grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))(values, tuple(inputs), backprops)
    return {p: g.to(wide) for (_, p), g in zip(named, grads)}


KEEP_MEMORY_RATIO = 1.0  # kept per-sample gradients take at most the memory of the captures they free


def keeps_per_sample_grads(
    unit: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor, memory_ratio: float = KEEP_MEMORY_RATIO
) -> bool:
    """Compute this unit's per-sample gradients once in I and keep them for W (the clipped sum is
    then their weighted sum, and the captured inputs and output-grads are freed at I), rather than
    ghost norms in I and the clipped weight product in W?

    For a Linear over T > 1 positions the kept path replaces the [T, T] Gram matrices
    (n T^2 (in + out) multiply-adds) by a weighted sum (n in out), and computes the per-sample
    products (n T in out) in place of W's one product of the same size: cheaper whenever
    T^2 (in + out) > in out, which the memory rule below implies for T >= 2. LayerNorm's per-sample
    gradients are two [n, d] tensors: keeping them saves W's re-normalisation. The rule: keep when
    the per-sample gradients take at most ``memory_ratio`` times the captures they free (the default 1:
    never more memory; grad_mode="keep" passes infinity: every Linear and LayerNorm over T >= 2)."""
    linear = type(unit) is nn.Linear or _is_conv1d(unit)
    if not (linear or type(unit) is nn.LayerNorm) or _has_trainable_children(unit):
        return False
    if linear and backprops.reshape(backprops.shape[0], -1, backprops.shape[-1]).shape[1] < 2:
        return False  # one position: ghost norms need no Gram matrix, W one small product
    held = sum(a.numel() for a in inputs if a.is_floating_point()) + backprops.numel()
    per_sample = backprops.shape[0] * sum(p.numel() for _, p in trainable_direct_params(unit))
    return 0 < per_sample <= memory_ratio * held


class GramCache:
    """Input Gram matrices a a^T, each computed once: projections that read the same hidden state
    (q/k/v, gate/up) share it. Keyed by the tensor's storage and layout; live for one micro-batch's
    norms, while every captured input is still held (so no address can be reused)."""

    def __init__(self) -> None:
        self._grams: Dict[tuple, torch.Tensor] = {}

    def gram(self, a3: torch.Tensor) -> torch.Tensor:
        key = (a3.data_ptr(), tuple(a3.shape), tuple(a3.stride()), a3.dtype)
        if key not in self._grams:
            self._grams[key] = _gram(a3)
        return self._grams[key]


def ghost_squared_norms(
    unit: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor, grams: Optional[GramCache] = None
) -> Optional[Dict[nn.Parameter, torch.Tensor]]:
    """{param: [n]} squared norms without materialising per-sample gradients, or None where no
    ghost formula applies or where materialising is cheaper.

    Linear (and HF Conv1D) weight: ||sum_t g_t a_t^T||^2 = <a a^T, g g^T> over the [T, T] Gram
    matrices; bias: ||sum_t g_t||^2. Embedding: <[id_t == id_t'], g g^T>. These are the
    formulas of Opacus's norm samplers (ghost clipping), computed with one batched matmul per
    Gram matrix instead of einsum / torch.unique, which cost 2-5x more at small micro-batches.
    Other layers use Opacus's NORM_SAMPLERS where it has one.
    """
    if _has_trainable_children(unit):
        return None
    if type(unit) is nn.Linear or _is_conv1d(unit):
        return _linear_ghost(unit, inputs[0], backprops, grams or GramCache())
    if type(unit) is nn.Embedding:
        return _embedding_ghost(unit, inputs[0], backprops)
    sampler = NORM_SAMPLERS.get(type(unit))
    if sampler is None:
        return None
    norms = sampler(unit, [x.contiguous() for x in inputs], backprops)
    return {p: n.to(backprops.dtype) ** 2 for p, n in norms.items() if p.requires_grad}


def _gram(x: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x, x.transpose(1, 2))


def gram_norms(a3: torch.Tensor, g3: torch.Tensor) -> torch.Tensor:
    """Per-sample ||sum_t g_t a_t^T||^2 for [n, T, in] inputs and [n, T, out] output grads."""
    return (_gram(g3) * _gram(a3)).sum((1, 2))


def _linear_ghost(unit, a, g, grams: GramCache) -> Optional[Dict[nn.Parameter, torch.Tensor]]:
    n = g.shape[0]
    g3 = g.reshape(n, -1, g.shape[-1])
    a3 = a.reshape(n, -1, a.shape[-1]).to(g.dtype)
    tokens = g3.shape[1]
    if tokens * tokens > unit.weight.numel():
        return None  # the [n, T, T] Gram matrices would outweigh the [n, out, in] gradients
    out = {}
    if unit.weight.requires_grad:
        if tokens == 1:
            out[unit.weight] = g3[:, 0].pow(2).sum(1) * a3[:, 0].pow(2).sum(1)
        else:
            out[unit.weight] = (_gram(g3) * grams.gram(a3)).sum((1, 2))
    if unit.bias is not None and unit.bias.requires_grad:
        out[unit.bias] = g3.sum(1).pow(2).sum(1)
    return out


def _embedding_ghost(unit, ids, g) -> Dict[nn.Parameter, torch.Tensor]:
    if not unit.weight.requires_grad:
        return {}
    g = _without_padding_rows(unit, [ids], g)
    n = g.shape[0]
    g3 = g.reshape(n, -1, g.shape[-1])
    ids = ids.reshape(n, -1)
    if g3.shape[1] == 1:
        return {unit.weight: g3[:, 0].pow(2).sum(1)}
    same = (ids[:, :, None] == ids[:, None, :]).to(g.dtype)
    return {unit.weight: (_gram(g3) * same).sum((1, 2))}


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
    if type(unit) is nn.Embedding and not unit.sparse:
        ids = inputs[0].reshape(-1)
        g = scaled_backprops.reshape(-1, unit.embedding_dim)
        grad = torch.zeros_like(unit.weight, dtype=g.dtype).index_add_(0, ids, g)
        if unit.padding_idx is not None:
            grad[unit.padding_idx] = 0
        return {unit.weight: grad} if unit.weight.requires_grad else {}
    if type(unit) is nn.LayerNorm and unit.elementwise_affine:
        return _layer_norm_grads(unit, inputs[0], scaled_backprops)
    named = trainable_direct_params(unit)
    params = [p for _, p in named]
    inputs, backprops, wide = _in_unit_dtype(unit, inputs, scaled_backprops)
    with torch.enable_grad():
        output = unit(*inputs)
        grads = torch.autograd.grad(output, params, backprops.to(output.dtype), allow_unused=True)
    return {p: (g.to(wide) if g is not None else torch.zeros_like(p, dtype=wide)) for p, g in zip(params, grads)}


def _in_unit_dtype(unit: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor):
    """A layer re-run on its own: its float inputs and output-grads in its parameters' dtype (bf16
    weights read bf16 inputs), and the dtype its gradients are returned in (float32 at least)."""
    dtype = next((p.dtype for p in unit.parameters(recurse=False)), backprops.dtype)
    inputs = tuple(a.to(dtype) if a.is_floating_point() else a for a in inputs)
    return inputs, backprops.to(dtype), torch.promote_types(backprops.dtype, torch.float32)


def _layer_norm_grads(
    unit: nn.LayerNorm, x: torch.Tensor, g: torch.Tensor, per_sample: bool = False
) -> Dict[nn.Parameter, torch.Tensor]:
    """LayerNorm's weight/bias gradients in closed form: sum g * x_hat, sum g (per sample: over
    every dimension but the first and the normalised ones)."""
    x_hat = torch.nn.functional.layer_norm(x.to(g.dtype), unit.normalized_shape, None, None, unit.eps)
    lead = tuple(range(1 if per_sample else 0, x.dim() - len(unit.normalized_shape)))
    out = {}  # (sum over no dimension would be a sum over all of them: a [n, d] input is its own sum)
    if unit.weight is not None and unit.weight.requires_grad:
        out[unit.weight] = (g * x_hat).sum(lead) if lead else g * x_hat
    if unit.bias is not None and unit.bias.requires_grad:
        out[unit.bias] = g.sum(lead) if lead else g
    return out
