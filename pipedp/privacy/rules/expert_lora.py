"""PEFT's LoRA on an expert bank's own parameters (``LoraConfig(target_parameters=...)``): one layer.

PEFT wraps the bank in a ``ParamWrapper`` per targeted weight (nested when both are), and each wrapper's
forward folds its factors into the bank's weight for the call (a parametrization): expert e's matrix is
W_e + s B_e A_e, with A = lora_A.weight [E r, in] read as [E, r, in] and B = lora_B.weight [out, r E] read
as [E, out, r] (PEFT's ``get_delta_factors``). The factors' own Linear modules are never called, so the
outermost wrapper is the layer: its capture has the bank's inputs, and its rule holds every trainable
parameter below it (``holds_below``).

Per pair p of expert e (rules/experts.py), with input a_p and output-gradient g_p of W_e's product, the
factors' per-sample gradients are sums over the sample's pairs, as for the bank:
    A_e: sum_p (s B_e^T g_p) a_p^T        B_e: sum_p g_p (s A_e a_p)^T
so each factor is one more projection over the same pairs (inputs a_p and output-gradients s B_e^T g_p
for A; inputs s A_e a_p and output-gradients g_p for B), and the bank rule's Gram norms, per-sample
gradients and clipped sums apply to it unchanged. The pairs themselves are recomputed with the weights
the forward used, W + s B A, applied as x W^T + s (x A^T) B^T (forming W + s B A would cost as much as the bank's
weight, per call). split/hf_experts.py checks PEFT's forward against this reading with random
factors at construction.

Llama-4's bank (rules/dense_experts.py: every token through every expert) stores its weights [E, in, out]
and multiplies ``x @ W_e``, while PEFT reads any [E, X, Y] weight as [E, out, in]: its delta s B_e A_e is
[E, X, Y] and is added as stored. The product's [out, in] matrix W_e^T then gains s A_e^T B_e^T, so B_e^T
meets the input first: its factors are the standard reading's with each pair's input and output-gradient
exchanged (A_e: sum_p (s B_e^T a_p) g_p^T; B_e: sum_p a_p (s A_e g_p)^T), and a sample's pairs of expert e
are its positions t E + e, as for the bank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .dense_experts import DENSE_EXPERTS, costs_of, dense_pairs, experts_of, grams_fit, span_norms
from .experts import (
    EXPERTS,
    LowRank,
    Projection,
    first_weights,
    grads_of,
    norms_of,
    pairs,
    rows_by_expert,
    second_weights,
    weight_names,
    weight_of,
)
from .registry import MACS_PER_BYTE, RULES, Grads, LayerRule, register


def is_lora_wrapper(module: nn.Module) -> bool:
    """PEFT's LoRA wrapper of one parameter (``peft.tuners.lora.layer.ParamWrapper``), told by name: peft is
    optional."""
    return type(module).__name__ == "ParamWrapper" and type(module).__module__.startswith("peft.tuners.lora")


def wrapped_bank(module: nn.Module) -> nn.Module:
    """The module below a chain of PEFT wrappers."""
    while is_lora_wrapper(module):
        module = module.base_layer
    return module


def wrappers(module: nn.Module) -> List[nn.Module]:
    """The chain of PEFT wrappers from ``module`` down to the bank."""
    chain = []
    while is_lora_wrapper(module):
        chain.append(module)
        module = module.base_layer
    return chain


def parametrized_per_call(module: nn.Module) -> List[Tuple[nn.Module, torch.Tensor]]:
    """(wrapper, parameter) for PEFT's wrappers below ``module``: a call that folds its adapter into the
    parameter (``folds``) registers a parametrization, which sets the tensor to itself once (torch's
    ParametrizationList: ``original.set_(original)``): its version counter moves by one, its values do not."""
    return [(w, w.get_param()) for w in module.modules() if is_lora_wrapper(w)]


def folds(wrapper: nn.Module) -> bool:
    """This call of the wrapper folds its adapter in (PEFT's ParamWrapper.forward: adapters enabled, not
    merged, and an active adapter it holds)."""
    active = wrapper.active_adapters
    return not wrapper.disable_adapters and not wrapper.merged and any(a in wrapper.lora_A for a in active)


@dataclass
class Factors:
    """One wrapper's adapter on one of the bank's weights: A [E, r, in], B [E, out, r], delta_e = s B_e A_e."""

    a_weight: nn.Parameter  # lora_A.<adapter>.weight [E r, in]
    b_weight: nn.Parameter  # lora_B.<adapter>.weight [out, r E]
    scaling: float
    experts: int

    def a(self, dtype: torch.dtype) -> torch.Tensor:
        return self.a_weight.detach().to(dtype).reshape(self.experts, -1, self.a_weight.shape[-1])

    def b(self, dtype: torch.dtype) -> torch.Tensor:
        out = self.b_weight.shape[0]
        return self.b_weight.detach().to(dtype).reshape(out, -1, self.experts).permute(2, 0, 1)


def factors(wrapper: nn.Module) -> Factors:
    """The one active adapter of a wrapper (split/hf_experts.py refuses any other state at construction)."""
    (name,) = wrapper.active_adapters
    a, b = wrapper.lora_A[name].weight, wrapper.lora_B[name].weight
    return Factors(a, b, float(wrapper.scaling[name]), int(wrapper.num_experts))


def adapted(outer: nn.Module) -> Dict[str, Factors]:
    """{bank weight name: its adapter's factors} for the chain of wrappers from ``outer``."""
    return {w.parameter_name: factors(w) for w in wrappers(outer)}


def low_rank(names: Sequence[str], adapters: Dict[str, Factors], dtype: torch.dtype) -> Tuple[Optional[LowRank], ...]:
    """The adapter term of each of the bank's weights ``names`` (the forward computes with W_e + s B_e A_e), or
    None: applied as thin products, never formed as an [E, out, in] sum (as costly to make as the weight)."""
    return tuple(
        LowRank(adapters[name].a(dtype), adapters[name].b(dtype), adapters[name].scaling) if name in adapters else None
        for name in names
    )


def _with_factors(proj: Projection, experts: torch.Tensor, f: Factors) -> List[Projection]:
    """The adapter's two factors as projections over ``proj``'s pairs (the module docstring's sums)."""
    a, g = proj.a.reshape(-1, proj.a.shape[-1]), proj.g.reshape(-1, proj.g.shape[-1])
    fa, fb = f.a(g.dtype), f.b(g.dtype)
    rank = fa.shape[1]
    u, v = g.new_zeros(g.shape[0], rank), a.new_zeros(a.shape[0], rank)
    for e, rows in rows_by_expert(experts.reshape(-1), f.experts):
        u[rows] = f.scaling * (g[rows] @ fb[e])  # s B_e^T g_p
        v[rows] = f.scaling * (a[rows] @ fa[e].t())  # s A_e a_p
    n, p = experts.shape
    count, width = f.experts, fa.shape[-1]

    def as_a(t: torch.Tensor) -> torch.Tensor:  # [..., E, r, in] -> [..., E r, in]
        return t.reshape(*t.shape[:-3], count * rank, width)

    def as_b(t: torch.Tensor) -> torch.Tensor:  # [..., E, out, r] -> [..., out, r E] (column i E + e)
        return t.movedim(-3, -1).reshape(*t.shape[:-3], t.shape[-2], rank * count)

    return [
        Projection(f.a_weight, None, proj.a, u.reshape(n, p, rank), count, as_a),
        Projection(f.b_weight, None, v.reshape(n, p, rank), proj.g, count, as_b),
    ]


def _projections(outer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor):
    bank = wrapped_bank(outer)
    adapters = adapted(outer)
    experts, projections = pairs(bank, inputs, backprops, low_rank(weight_names(bank), adapters, backprops.dtype))
    out = []
    for name, proj in zip(weight_names(bank), projections):
        out.append(proj)
        if name in adapters:
            out += _with_factors(proj, experts, adapters[name])
    return experts, out


def _trained(outer: nn.Module) -> List[int]:
    return [p.numel() for p in outer.parameters() if p.requires_grad]


def _norms(outer, inputs, backprops, grams=None) -> Optional[Grads]:
    if not _grams_fit(outer, inputs, backprops):
        return None
    return norms_of(*_projections(outer, inputs, backprops))


def _grads(outer, inputs, backprops) -> Grads:
    return grads_of(*_projections(outer, inputs, backprops))


def _weight(outer, inputs, scaled) -> Grads:
    return weight_of(*_projections(outer, inputs, scaled))


def _costs(outer, inputs, backprops) -> Dict[str, float]:
    """Multiply-adds (and bytes, MACS_PER_BYTE each) of the ways for the trained tensors, of n samples of P
    pairs: ghost n P^2 (in + out) each; materialize n E P in out each (one masked product per expert) and
    4 n E in out bytes written and read for the norm. A factor is r wide on one side: materialize is cheap."""
    n, pairs_per_sample = backprops.shape[0], _pairs_per_sample(inputs, backprops)
    table = {"materialize": 0.0, "ghost": 0.0}
    for inputs_, outputs, experts in _trained_shapes(outer):
        table["materialize"] += n * experts * pairs_per_sample * inputs_ * outputs
        table["materialize"] += MACS_PER_BYTE * 4 * n * experts * inputs_ * outputs
        table["ghost"] += n * pairs_per_sample**2 * (inputs_ + outputs)
    if not _grams_fit(outer, inputs, backprops):
        table.pop("ghost")
    return table


def _trained_shapes(outer: nn.Module) -> List[Tuple[int, int, int]]:
    """(in, out, experts) of each trained weight below the wrappers: the bank's, and each adapter's A and B."""
    bank = wrapped_bank(outer)
    shapes = []
    for weight, _ in (first_weights(bank), second_weights(bank)):
        if weight.requires_grad:
            size_in, size_out = (weight.shape[-2], weight.shape[-1]) if bank.is_transposed else weight.shape[:0:-1]
            shapes.append((int(size_in), int(size_out), int(weight.shape[0])))
    return shapes + _factor_shapes(outer)


def _factor_shapes(outer: nn.Module) -> List[Tuple[int, int, int]]:
    """(in, out, experts) of each trained adapter factor below the wrappers: A_e [r, in], B_e [out, r]."""
    shapes = []
    for f in adapted(outer).values():
        rank = f.a_weight.shape[0] // f.experts
        if f.a_weight.requires_grad:
            shapes.append((int(f.a_weight.shape[-1]), rank, f.experts))
        if f.b_weight.requires_grad:
            shapes.append((rank, int(f.b_weight.shape[0]), f.experts))
    return shapes


def _grams_fit(outer, inputs, backprops) -> bool:
    """The [n, P, P] pair Gram matrices weigh no more than the smallest trained tensor's per-sample gradients."""
    return _pairs_per_sample(inputs, backprops) ** 2 <= min(_trained(outer))


def _pairs_per_sample(inputs, backprops) -> int:
    """P: a sample's positions times the experts each token goes to (the routing's last dimension)."""
    return backprops.reshape(backprops.shape[0], -1, backprops.shape[-1]).shape[1] * inputs[1].shape[-1]


ADAPTED_EXPERTS = LayerRule(
    "experts+lora",
    _grads,
    _weight,
    _norms,
    pools_positions=True,
    costs=_costs,
    flat_tokens=True,
    holds_below=True,
)


def adapted_bank(module: nn.Module) -> bool:
    """PEFT's LoRA wrapper of a checked expert bank's weights.

    The outermost of a chain (the inner ones are part of it), over a bank whose class split/hf_experts.py
    checked and registered the bank rule for."""
    return is_lora_wrapper(module) and RULES.get(type(wrapped_bank(module))) is EXPERTS


register(adapted_bank, ADAPTED_EXPERTS)


# ---- Llama-4's bank: every token through every expert -------------------------------------------------------
DENSE_WEIGHTS = ("gate_up_proj", "down_proj")


def _exchanged(proj: Projection) -> Projection:
    """The pairs with input and output-gradient exchanged (the module docstring: Llama-4's weights)."""
    return Projection(proj.weight, proj.bias, proj.g, proj.a, proj.experts, proj.as_weight)


def _dense_projections(outer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor):
    bank = wrapped_bank(outer)
    adapters = adapted(outer)
    experts, projections = dense_pairs(bank, inputs, backprops, low_rank(DENSE_WEIGHTS, adapters, backprops.dtype))
    out = []
    for name, proj in zip(DENSE_WEIGHTS, projections):
        out.append(proj)
        if name in adapters:
            out += _with_factors(_exchanged(proj), experts, adapters[name])
    return experts, out


def _dense_trained_shapes(outer: nn.Module) -> List[Tuple[int, int]]:
    """(in, out) per expert of each trained weight below the wrappers: the bank's, and each adapter's A and B."""
    bank = wrapped_bank(outer)
    shapes = [(int(w.shape[1]), int(w.shape[2])) for w in (bank.gate_up_proj, bank.down_proj) if w.requires_grad]
    return shapes + [(size_in, size_out) for size_in, size_out, _ in _factor_shapes(outer)]


def _dense_positions(outer: nn.Module, backprops: torch.Tensor) -> Tuple[int, int]:
    """(E, T): the bank's experts and each expert's positions per sample."""
    count = experts_of(wrapped_bank(outer))
    return count, backprops.shape[1] // count


def _dense_norms(outer, inputs, backprops, grams=None) -> Optional[Grads]:
    count, positions = _dense_positions(outer, backprops)
    if not grams_fit(_dense_trained_shapes(outer), positions):
        return None
    return span_norms(_dense_projections(outer, inputs, backprops)[1], count)


def _dense_grads(outer, inputs, backprops) -> Grads:
    return grads_of(*_dense_projections(outer, inputs, backprops))


def _dense_weight(outer, inputs, scaled) -> Grads:
    return weight_of(*_dense_projections(outer, inputs, scaled))


def _dense_costs(outer, inputs, backprops) -> Dict[str, float]:
    """rules/dense_experts.py's cost model, over every trained tensor below the wrappers."""
    count, positions = _dense_positions(outer, backprops)
    return costs_of(_dense_trained_shapes(outer), backprops.shape[0], count, positions)


ADAPTED_DENSE_EXPERTS = LayerRule(
    "experts (every token)+lora",
    _dense_grads,
    _dense_weight,
    _dense_norms,
    pools_positions=True,
    costs=_dense_costs,
    flat_tokens=True,
    holds_below=True,
    experts_first=lambda outer: experts_of(wrapped_bank(outer)),
)


def adapted_dense_bank(module: nn.Module) -> bool:
    """PEFT's LoRA wrapper of a checked Llama-4 bank's weights (the outermost of a chain)."""
    return is_lora_wrapper(module) and RULES.get(type(wrapped_bank(module))) is DENSE_EXPERTS


register(adapted_dense_bank, ADAPTED_DENSE_EXPERTS)
