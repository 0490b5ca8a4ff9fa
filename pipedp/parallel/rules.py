"""The per-sample rules of the parallel layers: Linear's and Embedding's math on this rank's slice.

A layer's capture holds what its module was called with and gave (the whole input of a column-parallel layer,
the ids of every position of a vocabulary-parallel embedding, the gathered logits of a head), so each rule first
narrows that to its slice: the head's output-gradient to its columns, the embedding's ids to its rows (positions
whose id another rank holds get a zero output-gradient: they add nothing to this slice's gradient). Row- and
column-parallel layers without a gather see their own slices already: Linear's rule as it is. A row-parallel
layer's bias gradient is the whole bias's, the same on every rank (counted once: shards.TensorParallelPart).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..privacy.rules import LayerRule, register
from ..privacy.rules.embedding import EMBEDDING
from ..privacy.rules.linear import LINEAR
from .layers import ColumnParallelLinear, GatheredColumnLinear, RowParallelLinear, VocabParallelEmbedding

View = Callable[[nn.Module, Sequence[torch.Tensor], torch.Tensor], Tuple[Sequence[torch.Tensor], torch.Tensor]]


def narrowed(rule: LayerRule, view: View) -> LayerRule:
    """``rule`` applied to ``view``'s (inputs, output-gradients) of each call."""

    def wrap(fn: Optional[Callable]) -> Optional[Callable]:
        if fn is None:
            return None

        def on_slice(layer, inputs, backprops, *rest):
            inputs, backprops = view(layer, inputs, backprops)
            return fn(layer, inputs, backprops, *rest)

        return on_slice

    return LayerRule(
        f"{rule.name} (tensor-parallel slice)",
        wrap(rule.grads),  # type: ignore[arg-type]
        wrap(rule.weight),  # type: ignore[arg-type]
        wrap(rule.norms),
        wrap(rule.keepable),
        rule.pools_positions,
        wrap(rule.add_weight),
        wrap(rule.costs),
    )


def _head_columns(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor):
    assert isinstance(layer, GatheredColumnLinear)
    return inputs, backprops.narrow(-1, layer.start, layer.out_features)


def _embedding_rows(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor):
    assert isinstance(layer, VocabParallelEmbedding)
    local, outside = layer.local_ids(inputs[0])
    return (local, *inputs[1:]), backprops.masked_fill(outside.unsqueeze(-1), 0)


register(ColumnParallelLinear, LINEAR)
register(RowParallelLinear, LINEAR)
register(GatheredColumnLinear, narrowed(LINEAR, _head_columns))
register(VocabParallelEmbedding, narrowed(EMBEDDING, _embedding_rows))
