"""nn.Embedding, and its subclasses that keep its forward (a subclass that scales the output, as
Gemma's, changes the gradient: it falls back to torch.func).

Per sample the weight's gradient is the output-gradients scattered into the rows of the ids it read;
its squared norm is <[id_t == id_t'], g g^T> (Opacus's ghost formula, as one batched product). The
``padding_idx`` row gets no gradient in PyTorch, while Opacus 1.6's embedding samplers count it:
those output-gradients are dropped here, so the results match autograd.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from ...errors import UnsupportedModelError
from .grams import gram
from .registry import Grads, LayerRule, per_row, register


def without_padding_rows(layer: nn.Embedding, ids: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor:
    if layer.padding_idx is None:
        return backprops
    return backprops * (ids != layer.padding_idx).unsqueeze(-1).to(backprops.dtype)


def grads(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor) -> Grads:
    if not layer.weight.requires_grad:
        return {}
    ids = inputs[0]
    g = without_padding_rows(layer, ids, backprops)
    n = g.shape[0]
    out = torch.zeros((n, *layer.weight.shape), dtype=g.dtype, device=g.device)
    rows = ids.reshape(n, -1)
    out.scatter_add_(1, rows.unsqueeze(-1).expand(n, rows.shape[1], g.shape[-1]), g.reshape(n, -1, g.shape[-1]))
    return {layer.weight: out}


def weight(layer: nn.Module, inputs: Sequence[torch.Tensor], scaled: torch.Tensor) -> Grads:
    out: Grads = {}
    _scatter(layer, inputs, scaled, out)
    return out


def add_weight(
    layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor, factors: torch.Tensor, sums: Grads
) -> None:
    """The clipped sum scattered straight into the running sum (no vocabulary-sized temporary per micro-batch)."""
    if layer.weight.requires_grad:
        _scatter(layer, inputs, backprops * per_row(factors, backprops.dim()), sums)


def _scatter(layer: nn.Module, inputs: Sequence[torch.Tensor], scaled: torch.Tensor, sums: Grads) -> None:
    """The output-gradients added into the rows of the ids read. Those at ``padding_idx`` are dropped
    before the add, not the row zeroed after it: a head tied to this weight adds to that row too."""
    if not layer.weight.requires_grad:
        return
    g = without_padding_rows(layer, inputs[0], scaled).reshape(-1, layer.embedding_dim)
    total = sums.get(layer.weight)
    if total is None:
        total = sums[layer.weight] = torch.zeros_like(layer.weight, dtype=g.dtype)
    total.index_add_(0, inputs[0].reshape(-1), g.to(total.dtype))  # (a sum started as the noise: sum_dtype)


def norms(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor, grams=None) -> Optional[Grads]:
    if not layer.weight.requires_grad:
        return {}
    ids = inputs[0]
    g = without_padding_rows(layer, ids, backprops)
    n = g.shape[0]
    g3 = g.reshape(n, -1, g.shape[-1])
    ids = ids.reshape(n, -1)
    if g3.shape[1] == 1:
        return {layer.weight: g3[:, 0].pow(2).sum(1)}
    same = (ids[:, :, None] == ids[:, None, :]).to(g.dtype)
    return {layer.weight: (gram(g3) * same).sum((1, 2))}


def _keeps_embedding_forward(layer: nn.Module) -> bool:
    return isinstance(layer, nn.Embedding) and type(layer).forward is nn.Embedding.forward


EMBEDDING = LayerRule("embedding", grads, weight, norms, pools_positions=True, add_weight=add_weight)
register(nn.Embedding, EMBEDDING)
register(_keeps_embedding_forward, EMBEDDING)


# ---- nn.EmbeddingBag over [n, bag] ids (each row one bag: one sample), mode "sum" or "mean" --------------
def _bag_weights(layer: nn.EmbeddingBag, inputs: Sequence[torch.Tensor], dtype: torch.dtype):
    """(ids [n, L], w [n, L]): each id's share of its bag's output (0 for padding_idx)."""
    if len(inputs) != 1 or inputs[0].dim() != 2 or layer.mode not in ("sum", "mean"):
        raise UnsupportedModelError(
            f"nn.EmbeddingBag(mode={layer.mode!r}) called with {len(inputs)} argument(s) of shapes "
            f"{[tuple(a.shape) for a in inputs]}: pipedp's per-sample rule takes one [batch, bag] tensor of ids "
            "(each row one sample's bag) with mode 'sum' or 'mean' and no per_sample_weights; pad the bags to one "
            "length (padding_idx), or use nn.Embedding and reduce in forward"
        )
    ids = inputs[0]
    w = torch.ones(ids.shape, dtype=dtype, device=ids.device)
    if layer.padding_idx is not None:
        w = w * (ids != layer.padding_idx).to(dtype)
    if layer.mode == "mean":
        w = w / w.sum(1, keepdim=True).clamp(min=1)
    return ids, w


def bag_grads(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor) -> Grads:
    if not layer.weight.requires_grad:
        return {}
    ids, w = _bag_weights(layer, inputs, backprops.dtype)
    n, length = ids.shape
    out = torch.zeros((n, *layer.weight.shape), dtype=backprops.dtype, device=backprops.device)
    rows = w.unsqueeze(-1) * backprops.unsqueeze(1)  # [n, L, d]
    out.scatter_add_(1, ids.unsqueeze(-1).expand(n, length, backprops.shape[-1]), rows)
    return {layer.weight: out}


def bag_weight(layer: nn.Module, inputs: Sequence[torch.Tensor], scaled: torch.Tensor) -> Grads:
    if not layer.weight.requires_grad:
        return {}
    ids, w = _bag_weights(layer, inputs, scaled.dtype)
    rows = (w.unsqueeze(-1) * scaled.unsqueeze(1)).reshape(-1, scaled.shape[-1])
    return {layer.weight: torch.zeros_like(layer.weight, dtype=scaled.dtype).index_add_(0, ids.reshape(-1), rows)}


def bag_norms(layer: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor, grams=None) -> Optional[Grads]:
    """||sum_t w_t e_{x_t} g^T||^2 = ||g||^2 sum_{t, t'} w_t w_t' [x_t == x_t']."""
    if not layer.weight.requires_grad:
        return {}
    ids, w = _bag_weights(layer, inputs, backprops.dtype)
    same = (ids[:, :, None] == ids[:, None, :]).to(backprops.dtype)
    return {layer.weight: backprops.pow(2).sum(1) * torch.einsum("nt,nts,ns->n", w, same, w)}


EMBEDDING_BAG = LayerRule("embedding_bag", bag_grads, bag_weight, bag_norms)
register(nn.EmbeddingBag, EMBEDDING_BAG)
