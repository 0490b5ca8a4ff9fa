"""A mixture of experts' two layers: the router (a Linear over the tokens) and the expert bank.

Both are called on the micro-batch's tokens flattened to [n T, ...] (Hugging Face's MoE blocks); the
capture folds every input and the output-gradient back to [n, T, ...] (``LayerRule.flat_tokens``), so
token t of sample i is row i of the rules' tensors, as for any other layer.

With dropless top-k routing a token's output depends on its own hidden state only, so per-sample
gradients are sums over the sample's tokens. Token t goes to k experts: pair (t, j) reads the hidden
state a_t through expert e = index[t, j], and its gradient is w_tj times the token's output-gradient.
Over a sample's T k pairs, expert e's per-sample gradient is sum over its pairs of g_p a_p^T, so the
ghost norm is a Gram product masked to pairs of the same expert:
    ||grad_i||^2 = sum_{p, p' of sample i, e_p = e_p'} (a_p . a_p') (g_p . g_p')
(an expert no pair of the sample reaches contributes zero; one no pair of the micro-batch reaches
still gets its noise, like every parameter). The pairs' activations and gradients are recomputed from
the captured hidden states with the bank's own weights and its own gate (``_apply_gate``), one matrix
product per expert; the clipped sum is taken from the same pairs (so a sample's share of it has the norm
its clip factor came from, in low precision too).

The expert bank is the layout transformers' ``use_experts_implementation`` describes (fused
``gate_up_proj`` / ``up_proj`` and ``down_proj`` of shape [E, out, in], or [E, in, out] when
``is_transposed``; optional biases [E, out]); split/hf_experts.py checks a bank against its own
forward before registering this rule for its class.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from . import linear
from .grams import gram
from .registry import MACS_PER_BYTE, Grads, LayerRule


# ---- the router --------------------------------------------------------------------------------------
def _as_linear(router: nn.Module) -> SimpleNamespace:
    """The router's weight [E, d] (and bias) as the Linear its logits are: logits = F.linear(x, weight, bias)."""
    return SimpleNamespace(weight=router.weight, bias=getattr(router, "bias", None))


def _on_linear(fn):
    """One of the Linear rule's functions, called on the router's weight and bias."""
    return lambda router, *args: fn(_as_linear(router), *args)


def _router_costs(router, inputs, backprops) -> Dict[str, float]:
    table = linear.costs(_as_linear(router), inputs, backprops)
    table.pop("keep", None)  # (the router's capture is freed at W like any other's)
    return table


# the router's logits (output[0] of its (logits, scores, indices)) carry every gradient its weight gets
ROUTER = LayerRule(
    "router",
    _on_linear(linear.grads),
    _on_linear(linear.weight),
    _on_linear(linear.norms),
    pools_positions=True,
    add_weight=_on_linear(linear.add_weight),
    costs=_router_costs,
    flat_tokens=True,
    reads_inputs=1,  # the hidden states (MiniMax-M2's router is also passed its experts' score-correction bias)
    output_part=0,
)


# ---- the expert bank ---------------------------------------------------------------------------------
@dataclass
class Projection:
    """One trained tensor's pairs over a micro-batch: [n, P, in] inputs and [n, P, out] output-gradients of
    each pair's product with its expert's [out, in] matrix; the tensor (``weight``, its ``bias`` or None),
    and how a gradient per expert [..., E, out, in] is laid out as ``weight`` (``as_weight``)."""

    weight: nn.Parameter
    bias: Optional[nn.Parameter]
    a: torch.Tensor
    g: torch.Tensor
    experts: int
    as_weight: Callable[[torch.Tensor], torch.Tensor]


def first_weights(bank: nn.Module) -> Tuple[nn.Parameter, Optional[nn.Parameter]]:
    if bank.has_gate:
        return bank.gate_up_proj, getattr(bank, "gate_up_proj_bias", None) if bank.has_bias else None
    return bank.up_proj, getattr(bank, "up_proj_bias", None) if bank.has_bias else None


def second_weights(bank: nn.Module) -> Tuple[nn.Parameter, Optional[nn.Parameter]]:
    return bank.down_proj, getattr(bank, "down_proj_bias", None) if bank.has_bias else None


def weight_names(bank: nn.Module) -> Tuple[str, str]:
    """The names of the bank's two weights, first projection first."""
    return ("gate_up_proj" if bank.has_gate else "up_proj"), "down_proj"


@dataclass(frozen=True)
class LowRank:
    """An adapter's term s B_e A_e added to a bank weight's expert matrices [out, in] (PEFT's LoRA on the
    bank), applied as two thin products instead of the [E, out, in] sum: x (W_e + s B_e A_e)^T =
    x W_e^T + s (x A_e^T) B_e^T, in either storage layout of W. (Llama-4's dense bank, whose weights PEFT
    reads as stored [E, X, Y] with X the product's input, uses it with A [E, r, Y] and B [E, X, r]:
    rules/dense_experts.py ``_times``.)"""

    a: torch.Tensor  # [E, r, in]
    b: torch.Tensor  # [E, out, r]
    scaling: float


def _apply(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    transposed: bool,
    low: Optional[Tuple[torch.Tensor, torch.Tensor, float]] = None,
) -> torch.Tensor:
    """x's product with one expert's matrix (plus ``low``: that expert's A_e, B_e and s, the adapter's term)."""
    y = x @ weight if transposed else x @ weight.t()
    if low is not None:
        y = y + low[2] * ((x @ low[0].t()) @ low[1].t())
    return y + bias if bias is not None else y


def _back(
    g: torch.Tensor,
    weight: torch.Tensor,
    transposed: bool,
    low: Optional[Tuple[torch.Tensor, torch.Tensor, float]] = None,
) -> torch.Tensor:
    """The input-gradient of ``_apply`` for output-gradient ``g``."""
    back = g @ weight.t() if transposed else g @ weight
    return back + low[2] * ((g @ low[1]) @ low[0]) if low is not None else back


def _expert_term(low: Optional[LowRank], e: int):
    """Expert e's (A_e, B_e, s) of an adapter term (made in the products' dtype: expert_lora.low_rank), or None."""
    return None if low is None else (low.a[e], low.b[e], low.scaling)


def _out_in(transposed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """A bank weight's layout of a gradient per expert [..., E, out, in]: itself, or [..., E, in, out]."""
    return (lambda t: t.transpose(-1, -2)) if transposed else (lambda t: t)


def pairs(
    bank: nn.Module,
    inputs: Sequence[torch.Tensor],
    backprops: torch.Tensor,
    low_rank: Sequence[Optional[LowRank]] = (None, None),
) -> Tuple[torch.Tensor, List[Projection]]:
    """(expert ids [n, P], [first projection, second projection]) of the micro-batch's P = T k pairs per
    sample, recomputed from the captured hidden states [n, T, d], routing [n, T, k] and weights [n, T, k]
    with the bank's own weights and gate (one product per expert the micro-batch reaches); ``low_rank``:
    an adapter's term added to each weight in the forward (PEFT's LoRA on the bank), or None."""
    hidden, index, weights = inputs[0], inputs[1], inputs[2]
    n, t, d = hidden.shape
    k = index.shape[-1]
    dtype = backprops.dtype
    a1 = hidden.to(dtype).unsqueeze(2).expand(n, t, k, d).reshape(n * t * k, d)  # pair (t, j) reads a_t
    g2 = (backprops.unsqueeze(2) * weights.to(dtype).unsqueeze(-1)).reshape(n * t * k, -1)  # w_tj * token's grad
    experts = index.reshape(-1)
    (w1, b1), w2 = first_weights(bank), second_weights(bank)[0]
    low1, low2 = low_rank
    transposed = bool(bank.is_transposed)
    width = w1.shape[-1] if transposed else w1.shape[-2]  # the first projection's output, the second's input
    g1 = a1.new_zeros(n * t * k, width)
    a2 = a1.new_zeros(n * t * k, w2.shape[-2] if transposed else w2.shape[-1])
    for e, rows in rows_by_expert(experts, w1.shape[0]):
        with torch.enable_grad():
            bias = b1[e].detach().to(dtype) if b1 is not None else None
            z = _apply(a1[rows], w1[e].detach().to(dtype), bias, transposed, _expert_term(low1, e))
            z = z.detach().requires_grad_(True)
            h = bank._apply_gate(z) if bank.has_gate else bank.act_fn(z)
            gh = _back(g2[rows], w2[e].detach().to(dtype), transposed, _expert_term(low2, e))
            (g1[rows],) = torch.autograd.grad(h, z, gh)
        a2[rows] = h.detach()
    experts = experts.reshape(n, t * k)
    count, layout = w1.shape[0], _out_in(transposed)
    (p1, q1), (p2, q2) = first_weights(bank), second_weights(bank)
    first = Projection(p1, q1, a1.reshape(n, t * k, -1), g1.reshape(n, t * k, -1), count, layout)
    second = Projection(p2, q2, a2.reshape(n, t * k, -1), g2.reshape(n, t * k, -1), count, layout)
    return experts, [first, second]


def rows_by_expert(experts: torch.Tensor, count: int):
    """(expert, the indices of the pairs routed to it) for each expert some pair reaches (an id outside
    [0, count), an expert-parallel sentinel refused at construction, is passed over)."""
    for e in torch.unique(experts).tolist():
        if 0 <= e < count:
            yield e, (experts == e).nonzero().squeeze(1)


def recomputed_output(
    bank: nn.Module,
    hidden: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    low_rank: Sequence[Optional[LowRank]] = (None, None),
) -> torch.Tensor:
    """The bank's output for tokens [N, d] as this rule reads its layout (checked against the bank's own
    forward at construction: split/hf_experts.py); ``low_rank``: as ``pairs`` takes it."""
    (w1, b1), (w2, b2) = first_weights(bank), second_weights(bank)
    transposed = bool(bank.is_transposed)
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            term1, term2 = _expert_term(low_rank[0], e), _expert_term(low_rank[1], e)
            z = _apply(hidden[t : t + 1], w1[e], b1[e] if b1 is not None else None, transposed, term1)
            h = bank._apply_gate(z) if bank.has_gate else bank.act_fn(z)
            y = _apply(h, w2[e], b2[e] if b2 is not None else None, transposed, term2)
            out[t] += weights[t, j].to(out.dtype) * y[0]
    return out


def _same_expert(experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, P, P]: 1 where two pairs of a sample go to the same expert."""
    return (experts.unsqueeze(2) == experts.unsqueeze(1)).to(dtype)


def _grams_outweigh(bank: nn.Module, backprops: torch.Tensor, k: int) -> bool:
    """The [n, P, P] pair Gram matrices would outweigh the per-sample [n, E, out, in] gradients."""
    positions = backprops.reshape(backprops.shape[0], -1, backprops.shape[-1]).shape[1]
    return (positions * k) ** 2 > min(first_weights(bank)[0].numel(), second_weights(bank)[0].numel())


def _bank_norms(bank, inputs, backprops, grams=None) -> Optional[Grads]:
    if _grams_outweigh(bank, backprops, inputs[1].shape[-1]):
        return None
    return norms_of(*pairs(bank, inputs, backprops))


def norms_of(experts: torch.Tensor, projections: Sequence[Projection]) -> Grads:
    """{param: [n]} per-sample squared norms from the pairs: Gram products masked to pairs of one expert."""
    out: Grads = {}
    for proj in projections:
        kg = gram(proj.g)
        mask = _same_expert(experts, kg.dtype)
        if proj.weight.requires_grad:
            out[proj.weight] = (kg * gram(proj.a) * mask).sum((1, 2))
        if proj.bias is not None and proj.bias.requires_grad:
            out[proj.bias] = (kg * mask).sum((1, 2))
    return out


def _bank_grads(bank, inputs, backprops) -> Grads:
    return grads_of(*pairs(bank, inputs, backprops))


def grads_of(experts: torch.Tensor, projections: Sequence[Projection]) -> Grads:
    """{param: [n, ...]} per-sample gradients, each sample's pairs summed per expert (one masked product per
    expert the micro-batch reaches: no [n, P, E out] spread of the gradients)."""
    n, p = experts.shape
    out: Grads = {}
    for proj in projections:
        if proj.weight.requires_grad:
            grads = proj.g.new_zeros(n, proj.experts, proj.g.shape[-1], proj.a.shape[-1])
            for e in torch.unique(experts).tolist():
                if 0 <= e < proj.experts:
                    mine = (experts == e).to(proj.g.dtype).unsqueeze(-1)  # [n, P, 1]: this expert's pairs
                    grads[:, e] = torch.bmm((proj.g * mine).transpose(1, 2), proj.a)
            out[proj.weight] = proj.as_weight(grads)
        if proj.bias is not None and proj.bias.requires_grad:
            onehot = torch.nn.functional.one_hot(experts, proj.experts).to(proj.g.dtype)  # [n, P, E]
            out[proj.bias] = torch.bmm(onehot.transpose(1, 2), proj.g)
    return out


def _bank_weight(bank, inputs, scaled) -> Grads:
    return weight_of(*pairs(bank, inputs, scaled))


def weight_of(experts: torch.Tensor, projections: Sequence[Projection]) -> Grads:
    """sum_i c_i grad_i from the pairs of the clip-scaled output-gradients (linear in them): per expert, the
    product of its pairs' gradients and inputs. The same pairs as the norms, so in low precision too each
    sample's share of the sum has exactly the norm its clip factor was computed from."""
    flat = experts.reshape(-1)
    out: Grads = {}
    for proj in projections:
        a, g = proj.a.reshape(flat.shape[0], -1), proj.g.reshape(flat.shape[0], -1)
        wide = torch.promote_types(g.dtype, torch.float32)
        # (written expert by expert, and only the experts no pair reaches zeroed: zeroing the whole [E, out, in]
        # first, then copying each product in, cost more than the products on the Mixtral slice)
        full = g.new_empty(proj.experts, g.shape[-1], a.shape[-1], dtype=wide) if proj.weight.requires_grad else None
        bias = g.new_zeros(proj.experts, g.shape[-1], dtype=wide) if proj.bias is not None else None
        reached = set()
        for e, rows in rows_by_expert(flat, proj.experts):
            reached.add(e)
            if full is not None and g.dtype == wide:
                torch.mm(g[rows].t(), a[rows], out=full[e])
            elif full is not None:
                full[e] = g[rows].t() @ a[rows]
            if bias is not None:
                bias[e] = g[rows].sum(0)
        if full is not None:
            for e in set(range(proj.experts)) - reached:
                full[e].zero_()
            out[proj.weight] = proj.as_weight(full)
        if bias is not None and proj.bias is not None and proj.bias.requires_grad:
            out[proj.bias] = bias
    return out


def _bank_costs(bank, inputs, backprops) -> Dict[str, float]:
    """Multiply-adds (and memory traffic, MACS_PER_BYTE a byte) of the ways, for n samples of P pairs:
    ghost: n P^2 (in + out) per projection's Gram matrices; materialize: n P E in out per projection (the
    one-hot spread) and 4 n E in out bytes written and read for the norm."""
    n = backprops.shape[0]
    p = backprops.reshape(n, -1, backprops.shape[-1]).shape[1] * inputs[1].shape[-1]
    sizes = [sum(s) for s in ((w.shape[-1], w.shape[-2]) for w in (first_weights(bank)[0], second_weights(bank)[0]))]
    numels = [first_weights(bank)[0].numel(), second_weights(bank)[0].numel()]
    table = {"materialize": sum(n * p * m + MACS_PER_BYTE * 4 * n * m for m in numels)}
    if not _grams_outweigh(bank, backprops, inputs[1].shape[-1]):
        table["ghost"] = sum(n * p * p * s for s in sizes)
    return table


EXPERTS = LayerRule(
    "experts",
    _bank_grads,
    _bank_weight,
    _bank_norms,
    pools_positions=True,
    costs=_bank_costs,
    flat_tokens=True,
)
