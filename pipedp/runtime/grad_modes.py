"""How each layer gets its per-sample norms and its clipped sum: the three ways, and the choice.

- ``keep``: the per-sample gradients, computed once in I (their norms) and kept until W (a weighted
  sum); the captures are freed at I. Memory: micro-batch x the layer's parameters, between I and W.
- ``ghost``: norms from Gram matrices of the captures in I (no per-sample gradients), and W the layer's
  ordinary weight gradient of the clip-scaled output-gradients.
- ``materialize``: the per-sample gradients in I for their norms only (freed at once), W as ghost.

grad_mode "keep", "ghost" and "materialize" prefer that way where the layer's rule has it (and keep
whatever costs no more memory than the captures it frees); "auto" (the default) takes, per layer and
input shape, the way a cost model says is cheapest: multiply-adds plus memory traffic, a byte moved
counted as ``MACS_PER_BYTE`` multiply-adds (privacy/rules/registry.py).
A model, not a timing: two runs of one job choose alike, so results stay bit-identical across runs and
resumes. The layer rule owns its cost model (``LayerRule.costs``; Linear's in privacy/rules/linear.py),
so keep wins over short sequences and small layers, ghost over long sequences of wide layers (there the
n in out per-sample tensors are memory-bound). LayerNorm keeps (its per-sample gradients are two [n, d]
tensors that save W a re-normalisation); Embedding takes ghost norms; other layers materialize.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.nn as nn

from ..privacy.per_sample import keeps_per_sample_grads
from ..privacy.rules import rule_for


def allowed(
    grad_mode: str, layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor, memory_ratio: float
) -> List[str]:
    """The ways this call of ``layer`` may take, the grad mode's preferred first."""
    ways = []
    if memory_ratio > 0 and keeps_per_sample_grads(layer, inputs, backprops, memory_ratio):
        ways.append("keep")
    if grad_mode != "materialize" and rule_for(layer).norms is not None:
        ways.append("ghost")  # (its rule may still decline a call whose Gram matrices outweigh the gradients)
    ways.append("materialize")
    return ways


def cheapest(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor, ways: Sequence[str]) -> str:
    """The way the layer rule's cost model says is cheapest for this call (``ways``: those it may take); a
    rule without one (LayerNorm: keep where allowed; Embedding: ghost; others) takes the first."""
    costs = rule_for(layer).costs
    if len(ways) == 1 or costs is None:
        return ways[0]
    table = costs(layer, inputs, backprops)
    return min((w for w in ways if w in table), key=table.__getitem__)
