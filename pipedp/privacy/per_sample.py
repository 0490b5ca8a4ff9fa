"""Per-sample squared gradient norms and clipped gradient sums of one layer, through the layer-rule
registry (pipedp.privacy.rules: one entry per layer type).

All functions are pure: (layer, inputs, output-grads) -> tensors. The per-sample gradients and ghost norms
run in full float32 precision (``full_precision``): with TF32 allowed (torch.backends.cuda.matmul), a
ghost norm's Gram products are ~1e-3 off, so a clipped gradient's norm could exceed C.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from opacus.grad_sample import GradSampleModuleFastGradientClipping

from .rules import Grads, layer_parameters, rule_for
from .rules.grams import GramCache, gram_norms, shared_storages
from .rules.registry import per_row

NORM_SAMPLERS = GradSampleModuleFastGradientClipping.NORM_SAMPLERS  # Opacus's ghost norms (benchmarked against)
KEEP_MEMORY_RATIO = 1.0  # kept per-sample gradients take at most the memory of the captures they free

__all__ = [
    "GramCache",
    "gram_norms",
    "per_sample_grads",
    "ghost_squared_norms",
    "clipped_grad_sum",
    "keeps_per_sample_grads",
    "squared_norms",
    "per_row",
    "pools_positions",
    "KEEP_MEMORY_RATIO",
    "NORM_SAMPLERS",
    "full_precision",
    "shared_storages",
]


def _precision_settings() -> List[Tuple[Callable[[], object], Callable[[object], None], object]]:
    """(read, write, full-precision value) of each setting that lets float32 products run in less precision.
    torch >= 2.9 has one ``fp32_precision`` per backend (mixing it with the older flags raises); before it,
    the global matmul precision (which sets cuBLAS's TF32 flag) and cuDNN's."""

    def attribute(owner, name):
        return (lambda: getattr(owner, name)), (lambda value: setattr(owner, name, value))

    backends = torch.backends
    if hasattr(backends.cuda.matmul, "fp32_precision"):
        owners = [backends.cuda.matmul, getattr(backends.cudnn, "conv", None)]
        owners += [getattr(getattr(backends, "mkldnn", None), kind, None) for kind in ("matmul", "conv")]
        return [(*attribute(o, "fp32_precision"), "ieee") for o in owners if hasattr(o, "fp32_precision")]
    return [
        (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision, "highest"),
        (*attribute(backends.cudnn, "allow_tf32"), False),
    ]


@contextmanager
def full_precision() -> Iterator[None]:
    """float32 matrix products and convolutions in full precision (no TF32, no bf16 passes) inside; the
    settings are restored after."""
    settings = _precision_settings()
    saved = [read() for read, _, _ in settings]
    try:
        for _, write, value in settings:
            write(value)
        yield
    finally:
        for (_, write, _), value in zip(settings, saved):
            write(value)


def per_sample_grads(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor) -> Grads:
    """{param: [n, *param.shape]} per-sample gradients of the layer's own trainable parameters."""
    with full_precision():
        return rule_for(layer).grads(layer, inputs, backprops)


def ghost_squared_norms(
    layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor, grams: Optional[GramCache] = None
) -> Optional[Grads]:
    """{param: [n]} squared norms without materializing per-sample gradients, or None where the
    layer's rule has no ghost formula or materializing is cheaper."""
    rule = rule_for(layer)
    if rule.norms is None:
        return None
    with full_precision():
        return rule.norms(layer, inputs, backprops, grams)


def clipped_grad_sum(layer: nn.Module, inputs: Sequence[torch.Tensor], scaled_backprops: torch.Tensor) -> Grads:
    """sum_i c_i grad_i for the layer's own parameters, given backprops already scaled by c_i: since a
    layer's weight gradient is linear in its output gradient, this is the layer's ordinary weight
    gradient for the scaled output gradient (no per-sample tensors, no backward through the pipeline)."""
    with full_precision():
        return rule_for(layer).weight(layer, inputs, scaled_backprops)


def add_clipped_grad_sum(
    layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor, factors: torch.Tensor, sums: Grads
) -> None:
    """``sums[p] += sum_i factors_i grad_i[p]`` for the layer's parameters (``factors``: [n], one per row
    of ``backprops``, in its dtype), in place where its rule can (no full-size temporary); a new entry is
    never a view of anything else (the kept path adds to it)."""
    rule = rule_for(layer)
    if rule.add_weight is not None:
        with full_precision():  # each sample's share of the sum stays within its clip norm
            rule.add_weight(layer, inputs, backprops, factors, sums)
        return
    scaled = backprops * per_row(factors, backprops.dim())
    with full_precision():
        summed = rule.weight(layer, inputs, scaled)
    for p, g in summed.items():
        if p in sums:
            sums[p] += g
        else:
            sums[p] = g.clone(memory_format=torch.contiguous_format)


def pools_positions(layer: nn.Module) -> bool:
    """May a privacy layer's rows be folded into positions for this layer (see privacy/units.py)?"""
    return rule_for(layer).pools_positions


def squared_norms(per_sample: torch.Tensor) -> torch.Tensor:
    """[n]: each sample's squared gradient norm, one fused reduction (no [n, ...] temporary)."""
    return torch.linalg.vector_norm(per_sample.reshape(per_sample.shape[0], -1), dim=1).pow(2)


def keeps_per_sample_grads(
    layer: nn.Module,
    inputs: Sequence[torch.Tensor],
    backprops: torch.Tensor,
    memory_ratio: float = KEEP_MEMORY_RATIO,
) -> bool:
    """Compute this layer's per-sample gradients once in I and keep them for W (the clipped sum is then
    their weighted sum, and the captured inputs and output-grads are freed at I), rather than ghost
    norms in I and the clipped weight product in W?

    Only for rules with closed-form per-sample gradients that say the call suits it (a Linear over
    T >= 2 positions: the kept products replace the [T, T] Gram matrices and W's product; LayerNorm:
    two [n, d] tensors that save W's re-normalisation), and only while the per-sample gradients take
    at most ``memory_ratio`` times the captures they free (1 by default: never more memory;
    grad_mode="keep" passes infinity)."""
    rule = rule_for(layer)
    if rule.keepable is None or not rule.keepable(layer, inputs, backprops):
        return False
    held = sum(a.numel() for a in inputs if a.is_floating_point()) + backprops.numel()
    per_sample = backprops.shape[0] * sum(p.numel() for _, p in layer_parameters(layer))
    return 0 < per_sample <= memory_ratio * held
