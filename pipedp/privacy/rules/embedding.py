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

from .grams import gram
from .registry import Grads, LayerRule, register


def without_padding_rows(unit: nn.Embedding, ids: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor:
    if unit.padding_idx is None:
        return backprops
    return backprops * (ids != unit.padding_idx).unsqueeze(-1).to(backprops.dtype)


def grads(unit: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor) -> Grads:
    if not unit.weight.requires_grad:
        return {}
    ids = inputs[0]
    g = without_padding_rows(unit, ids, backprops)
    n = g.shape[0]
    out = torch.zeros((n, *unit.weight.shape), dtype=g.dtype, device=g.device)
    rows = ids.reshape(n, -1)
    out.scatter_add_(1, rows.unsqueeze(-1).expand(n, rows.shape[1], g.shape[-1]), g.reshape(n, -1, g.shape[-1]))
    return {unit.weight: out}


def weight(unit: nn.Module, inputs: Sequence[torch.Tensor], scaled: torch.Tensor) -> Grads:
    if not unit.weight.requires_grad:
        return {}
    ids = inputs[0].reshape(-1)
    g = scaled.reshape(-1, unit.embedding_dim)
    total = torch.zeros_like(unit.weight, dtype=g.dtype).index_add_(0, ids, g)
    if unit.padding_idx is not None:
        total[unit.padding_idx] = 0
    return {unit.weight: total}


def norms(unit: nn.Module, inputs: Sequence[torch.Tensor], backprops: torch.Tensor, grams=None) -> Optional[Grads]:
    if not unit.weight.requires_grad:
        return {}
    ids = inputs[0]
    g = without_padding_rows(unit, ids, backprops)
    n = g.shape[0]
    g3 = g.reshape(n, -1, g.shape[-1])
    ids = ids.reshape(n, -1)
    if g3.shape[1] == 1:
        return {unit.weight: g3[:, 0].pow(2).sum(1)}
    same = (ids[:, :, None] == ids[:, None, :]).to(g.dtype)
    return {unit.weight: (gram(g3) * same).sum((1, 2))}


def _keeps_embedding_forward(unit: nn.Module) -> bool:
    return isinstance(unit, nn.Embedding) and type(unit).forward is nn.Embedding.forward


EMBEDDING = LayerRule("embedding", grads, weight, norms)
register(nn.Embedding, EMBEDDING)
register(_keeps_embedding_forward, EMBEDDING)
