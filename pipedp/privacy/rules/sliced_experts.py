"""An expert bank stored as row slices of [E h, d] matrices: DBRX's ``DbrxExperts``, whose ``mlp.w1`` (gate)
and ``mlp.v1`` (up) hold expert e's [h, d] matrices in rows e h .. (e + 1) h, applied as x @ w1_e^T, and whose
``mlp.w2`` holds its down projection the same way, applied as h @ w2_e ([h, d] = [in, out]).

The rule is experts.py's (pairs recomputed per expert from the captured hidden states, routing and weights;
Gram norms masked to pairs of one expert; the clipped sum from the same pairs) with three projections instead
of two: the gate's and the up projection's pairs read the same inputs, each with its own output-gradient
(act'(x w1_e^T) (x v1_e^T) gh and act(x w1_e^T) gh for the hidden gradient gh). The bank takes the hidden
states [n, T, d] beside the routing flattened to [n T, k] (the capture holds all of them [n, T, ...]).
split/hf_experts.py checks a bank against its own forward before registering this rule for its class.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

from .experts import Projection, grads_of, norms_of, rows_by_expert, weight_of
from .registry import MACS_PER_BYTE, Grads, LayerRule

NAMES = ("w1", "v1", "w2")  # gate, up, down: DbrxExpertGLU's parameters


def is_sliced_bank(bank: nn.Module) -> bool:
    """DBRX's layout: ``num_experts``, and an ``mlp`` with w1, v1, w2 [E h, d] and an ``activation_fn``."""
    mlp = getattr(bank, "mlp", None)
    count = getattr(bank, "num_experts", None)
    return (
        isinstance(mlp, nn.Module)
        and isinstance(count, int)
        and callable(getattr(mlp, "activation_fn", None))
        and all(isinstance(getattr(mlp, n, None), nn.Parameter) and getattr(mlp, n).dim() == 2 for n in NAMES)
        and all(getattr(mlp, n).shape[0] % count == 0 for n in NAMES)
    )


def sliced_weights(bank: nn.Module) -> List[nn.Parameter]:
    """The bank's gate, up and down parameters [E h, d]."""
    return [getattr(bank.mlp, n) for n in NAMES]


def _per_expert(bank: nn.Module, dtype: torch.dtype) -> List[torch.Tensor]:
    """The three parameters as [E, h, d] (detached, in the products' dtype)."""
    count = bank.num_experts
    return [w.detach().to(dtype).reshape(count, -1, w.shape[-1]) for w in sliced_weights(bank)]


def _as_rows(count: int, transposed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient per expert [..., E, out, in] laid out as its parameter [..., E h, d] (w2's experts are [in, out])."""

    def layout(t: torch.Tensor) -> torch.Tensor:
        t = t.transpose(-1, -2) if transposed else t
        return t.reshape(*t.shape[:-3], count * t.shape[-2], t.shape[-1])

    return layout


def sliced_pairs(
    bank: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor
) -> Tuple[torch.Tensor, List[Projection]]:
    """(expert ids [n, P], [gate, up, down] projections) of the P = T k pairs per sample (experts.pairs)."""
    hidden, index, weights = inputs[0], inputs[1], inputs[2]
    n, d = hidden.shape[0], hidden.shape[-1]
    k = index.shape[-1]
    dtype = backprops.dtype
    a1 = hidden.to(dtype).reshape(n, -1, 1, d).expand(-1, -1, k, -1).reshape(-1, d)  # pair (t, j) reads a_t
    g2 = (backprops.reshape(n, -1, 1, d) * weights.to(dtype).reshape(n, -1, k, 1)).reshape(-1, d)
    experts = index.reshape(-1)
    w1, v1, w2 = _per_expert(bank, dtype)
    count, width = w1.shape[0], w1.shape[1]
    g_gate, g_up, a2 = (a1.new_zeros(a1.shape[0], width) for _ in range(3))
    act = bank.mlp.activation_fn
    for e, rows in rows_by_expert(experts, count):
        gh = g2[rows] @ w2[e].t()  # (the down projection is h @ w2_e)
        up = a1[rows] @ v1[e].t()
        with torch.enable_grad():
            gate = (a1[rows] @ w1[e].t()).requires_grad_(True)
            active = act(gate)
            (g_gate[rows],) = torch.autograd.grad(active, gate, gh * up)
        g_up[rows] = gh * active.detach()
        a2[rows] = active.detach() * up
    experts = experts.reshape(n, -1)
    gate_w, up_w, down_w = sliced_weights(bank)
    pairs = experts.shape[1]
    projections = [
        Projection(gate_w, None, a1.reshape(n, pairs, -1), g_gate.reshape(n, pairs, -1), count, _as_rows(count, False)),
        Projection(up_w, None, a1.reshape(n, pairs, -1), g_up.reshape(n, pairs, -1), count, _as_rows(count, False)),
        Projection(down_w, None, a2.reshape(n, pairs, -1), g2.reshape(n, pairs, -1), count, _as_rows(count, True)),
    ]
    return experts, projections


def recomputed_sliced_output(
    bank: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The bank's output for tokens [N, d] as this rule reads its layout, token by token (checked against the
    bank's own forward at construction: split/hf_experts.py)."""
    w1, v1, w2 = _per_expert(bank, hidden.dtype)
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            x = hidden[t : t + 1]
            h = bank.mlp.activation_fn(x @ w1[e].t()) * (x @ v1[e].t())
            out[t] += weights[t, j].to(out.dtype) * (h @ w2[e])[0]
    return out


def _positions(inputs: Sequence[torch.Tensor]) -> int:
    """Pairs per sample: T k."""
    return inputs[1].shape[1] * inputs[1].shape[-1]


def _grams_outweigh(bank: nn.Module, inputs: Sequence[torch.Tensor]) -> bool:
    """The [n, P, P] pair Gram matrices would outweigh the per-sample [n, E h, d] gradients."""
    return _positions(inputs) ** 2 > sliced_weights(bank)[0].numel()


def _norms(bank, inputs, backprops, grams=None) -> "Grads | None":
    return None if _grams_outweigh(bank, inputs) else norms_of(*sliced_pairs(bank, inputs, backprops))


def _grads(bank, inputs, backprops) -> Grads:
    return grads_of(*sliced_pairs(bank, inputs, backprops))


def _weight(bank, inputs, scaled) -> Grads:
    return weight_of(*sliced_pairs(bank, inputs, scaled))


def _costs(bank, inputs, backprops) -> Dict[str, float]:
    """experts._bank_costs for the three projections: ghost n P^2 (h + d) each, materialize n P E h d each
    (and 4 n E h d bytes written and read for the norm)."""
    n, p = backprops.shape[0], _positions(inputs)
    numels = [w.numel() for w in sliced_weights(bank)]
    table = {"materialize": sum(n * p * m + MACS_PER_BYTE * 4 * n * m for m in numels)}
    if not _grams_outweigh(bank, inputs):
        width = sliced_weights(bank)[0].shape[0] // bank.num_experts + sliced_weights(bank)[0].shape[1]
        table["ghost"] = 3 * n * p * p * width
    return table


SLICED_EXPERTS = LayerRule(
    "sliced experts",
    _grads,
    _weight,
    _norms,
    pools_positions=True,
    costs=_costs,
    flat_tokens=True,
    holds_below=True,  # (the parameters are the bank's mlp's, which the bank slices and passes in: never called alone)
)
