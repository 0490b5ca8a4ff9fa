"""Llama-4's mixture of experts: every token through every expert, its input scaled by its routing score.

Llama-4's MoE block repeats the N = n T tokens once per expert, multiplies each copy by the token's score
for that expert (zero for an expert not among its top k), and calls the bank on the [E N, d] result: expert
e's call on token t is row e N + t, two batched products ``x @ gate_up_proj[e]`` ([E, d, 2h]: gate and up
halves, ``up * act(gate)``) and ``@ down_proj[e]`` ([E, h, d]). A token's output still depends on its own
hidden state only. The capture folds the bank's inputs and output-gradient to [n, T E, ...] (sample i's
position t E + e: ``LayerRule.experts_first``; a position's expert is its index modulo E, also once a
privacy unit's rows are folded into its positions), so each sample's T E pairs are the bank rule's pairs
(rules/experts.py) with expert ids e: its masked Gram norms (taken expert by expert here, [n, T, T] at a
time), per-sample gradients and clipped sums apply unchanged. A copy whose score is zero reads a zero
input and gives zero gradients, as in the model.

The router is a Linear whose logits its own forward turns into the scores (top k, sigmoid): its rule is
the Linear rule on the gradient of the logits, taken by replaying the router's own forward with its one
``F.linear`` answered by a leaf holding the forward's own logits (kept by the capture: the same top k in
any precision; the scores' function is the model's, not a copy of it).

split/hf_experts.py checks both against the modules' own forwards on random tokens before registering them.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import linear
from .experts import LowRank, Projection, _out_in, grads_of, weight_of
from .grams import gram
from .registry import MACS_PER_BYTE, Grads, LayerRule


# ---- the bank --------------------------------------------------------------------------------------------
def is_dense_bank(bank: nn.Module) -> bool:
    """Llama-4's layout: gate_up_proj [E, d, 2h], down_proj [E, h, d], an act_fn, no fused-bank flags."""
    gate_up, down = getattr(bank, "gate_up_proj", None), getattr(bank, "down_proj", None)
    return (
        not hasattr(bank, "has_gate")
        and isinstance(gate_up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and gate_up.dim() == 3
        and down.dim() == 3
        and gate_up.shape[0] == down.shape[0]
        and gate_up.shape[-1] == 2 * down.shape[1]
        and callable(getattr(bank, "act_fn", None))
    )


def experts_of(bank: nn.Module) -> int:
    return int(bank.gate_up_proj.shape[0])


def _gated(bank: nn.Module, z: torch.Tensor) -> torch.Tensor:
    gate, up = z.chunk(2, dim=-1)
    return up * bank.act_fn(gate)


def _times(x: torch.Tensor, w: torch.Tensor, low: Optional[LowRank], e: int) -> torch.Tensor:
    """x @ (w_e + s B_e A_e), a weight stored [E, in, out] plus its adapter's term as stored (PEFT reads the
    stored [E, X, Y] as [E, out, in]: B_e [X, r], A_e [r, Y]), the term as two thin products."""
    y = x @ w[e]
    return y if low is None else y + low.scaling * ((x @ low.b[e]) @ low.a[e])


def _times_t(g: torch.Tensor, w: torch.Tensor, low: Optional[LowRank], e: int) -> torch.Tensor:
    """g @ (w_e + s B_e A_e)^T: ``_times``'s input-gradient."""
    y = g @ w[e].t()
    return y if low is None else y + low.scaling * ((g @ low.a[e].t()) @ low.b[e].t())


def dense_pairs(
    bank: nn.Module,
    inputs: Sequence[torch.Tensor],
    backprops: torch.Tensor,
    low_rank: Sequence[Optional[LowRank]] = (None, None),
):
    """(expert ids [n, T E], [gate_up projection, down projection]) from the folded inputs [n, T E, d]
    and output-gradients [n, T E, d], the gate's input-gradient by autograd through the bank's own act_fn;
    ``low_rank``: each weight's adapter term in the forward (PEFT's LoRA), or None."""
    x = inputs[0].to(backprops.dtype)
    n, p, _ = x.shape
    count = experts_of(bank)
    w1, w2 = (w.detach().to(x.dtype) for w in (bank.gate_up_proj, bank.down_proj))
    g1 = x.new_zeros(n, p, w1.shape[-1])
    a2 = x.new_zeros(n, p, w2.shape[1])
    for e in range(count):
        span = slice(e, None, count)  # (expert e's positions)
        with torch.enable_grad():
            z = _times(x[:, span], w1, low_rank[0], e).requires_grad_(True)
            h = _gated(bank, z)
            (g1[:, span],) = torch.autograd.grad(h, z, _times_t(backprops[:, span], w2, low_rank[1], e))
        a2[:, span] = h.detach()
    experts = (torch.arange(p, device=x.device) % count).expand(n, p)
    layout = _out_in(True)  # (both stored [E, in, out])
    first = Projection(bank.gate_up_proj, None, x, g1, count, layout)
    second = Projection(bank.down_proj, None, a2, backprops, count, layout)
    return experts, [first, second]


def recomputed_bank_output(
    bank: nn.Module, x: torch.Tensor, low_rank: Sequence[Optional[LowRank]] = (None, None)
) -> torch.Tensor:
    """The bank's output for its [E N, d] input as this rule reads its layout (checked at construction);
    ``low_rank``: as dense_pairs takes it."""
    count = experts_of(bank)
    w1, w2 = bank.gate_up_proj, bank.down_proj
    rows = x.reshape(count, -1, x.shape[-1])
    out = [_times(_gated(bank, _times(rows[e], w1, low_rank[0], e)), w2, low_rank[1], e) for e in range(count)]
    return torch.cat(out).reshape(-1, w2.shape[-1])


def span_norms(projections: Sequence[Projection], count: int) -> Grads:
    """{trained weight: [n]} squared norms, expert by expert: the Gram of one expert's T positions (every
    count-th) at a time, instead of a [n, T E, T E] Gram masked to pairs of one expert."""
    spans = [slice(e, None, count) for e in range(count)]
    out: Grads = {}
    for proj in projections:
        if proj.weight.requires_grad:
            out[proj.weight] = sum(((gram(proj.a[:, s]) * gram(proj.g[:, s])).sum((1, 2)) for s in spans))
    return out


def grams_fit(shapes: Sequence[Tuple[int, int]], positions: int) -> bool:
    """A [T, T] Gram per expert (T ``positions``) weighs no more than a sample's gradient of the smallest of the
    trained weights' experts, each (in, out) of ``shapes``."""
    return positions * positions <= min(size_in * size_out for size_in, size_out in shapes)


def costs_of(shapes: Sequence[Tuple[int, int]], n: int, count: int, positions: int) -> Dict[str, float]:
    """The ways' costs for trained weights of ``count`` experts, each (in, out) of ``shapes``, over n samples of
    T ``positions`` per expert: ghost n E T^2 (in + out) per weight; materialize n E^2 T in out (a masked
    product per expert) and 4 n E in out bytes for the norm."""
    table = {"materialize": 0.0, "ghost": 0.0}
    for size_in, size_out in shapes:
        table["materialize"] += n * count * count * positions * size_in * size_out
        table["materialize"] += MACS_PER_BYTE * 4 * n * count * size_in * size_out
        table["ghost"] += n * count * positions * positions * (size_in + size_out)
    if not grams_fit(shapes, positions):
        table.pop("ghost")
    return table


def _shapes(bank: nn.Module) -> List[Tuple[int, int]]:
    """(in, out) of one expert of each of the bank's two weights (stored [E, in, out])."""
    return [(int(w.shape[1]), int(w.shape[2])) for w in (bank.gate_up_proj, bank.down_proj)]


def _norms(bank, inputs, backprops, grams=None) -> Optional[Grads]:
    if not grams_fit(_shapes(bank), backprops.shape[1] // experts_of(bank)):
        return None
    return span_norms(dense_pairs(bank, inputs, backprops)[1], experts_of(bank))


def _grads(bank, inputs, backprops) -> Grads:
    return grads_of(*dense_pairs(bank, inputs, backprops))


def _weight(bank, inputs, scaled) -> Grads:
    return weight_of(*dense_pairs(bank, inputs, scaled))


def _costs(bank, inputs, backprops) -> Dict[str, float]:
    count = experts_of(bank)
    return costs_of(_shapes(bank), backprops.shape[0], count, backprops.shape[1] // count)


DENSE_EXPERTS = LayerRule(
    "experts (every token)",
    _grads,
    _weight,
    _norms,
    pools_positions=True,
    costs=_costs,
    flat_tokens=True,
    experts_first=experts_of,
)


# ---- the router --------------------------------------------------------------------------------------------
class _AnswerLinear(TorchFunctionMode):
    """``F.linear`` with ``weight`` answered by ``logits`` (its input recorded: it must be the router's)."""

    def __init__(self, weight: torch.Tensor, logits: torch.Tensor):
        super().__init__()
        self.weight, self.logits = weight, logits
        self.inputs: List[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and args[1] is self.weight:
            self.inputs.append(args[0])
            return self.logits
        return func(*args, **kwargs)


def logits_gradient(router: nn.Module, x: torch.Tensor, logits: torch.Tensor, grad_scores: torch.Tensor):
    """The gradient of the router's logits (its forward's own values, [n, T, E]: the same top k) for the
    gradient of its first output, through the router's own forward on x [n, T, d]; a router that calls
    F.linear with its weight other than once, on other than its input, is a RuntimeError."""
    flat = x.reshape(-1, x.shape[-1])
    leaf = logits.reshape(flat.shape[0], -1).detach().requires_grad_(True)
    with torch.enable_grad():
        mode = _AnswerLinear(router.weight, leaf)
        with mode:
            scores = router(flat)[0]
        if len(mode.inputs) != 1 or not torch.equal(mode.inputs[0].to(flat.dtype), flat):
            raise RuntimeError(
                f"{type(router).__name__} does not compute its logits as one F.linear of its input and its weight"
            )
        (grad,) = torch.autograd.grad(scores, leaf, grad_scores.reshape(scores.shape).to(scores.dtype))
    return grad.reshape(*x.shape[:-1], -1).to(torch.promote_types(grad_scores.dtype, grad.dtype))


def _on_logits(fn):
    """A Linear rule function on (x, the logits' gradient) for the scores' gradient; inputs (x, logits)."""
    return lambda router, inputs, backprops, *rest: fn(
        router, inputs[:1], logits_gradient(router, inputs[0], inputs[1], backprops), *rest
    )


SCORING_ROUTER = LayerRule(
    "router (scores)",
    _on_logits(linear.grads),
    _on_logits(linear.weight),
    _on_logits(linear.norms),
    pools_positions=True,
    flat_tokens=True,
    output_part=0,
    kept_part=1,
)
