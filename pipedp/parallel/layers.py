"""The tensor-parallel layers and the collectives they run inside autograd (Megatron's f and g).

- copy:    identity forward, all-reduce of the gradient backward (before a column-parallel layer: each rank's
           slice of the output sends back its part of the input's gradient);
- reduce:  all-reduce forward, identity backward (after a row-parallel layer: the partial products summed);
- gather:  all-gather along the last dimension forward, this rank's slice of the gradient backward.

Each layer is the model's own module, turned into a subclass of its torch class (nn.Linear, nn.Embedding) in place:
its parameters stay the same objects under the same names, now holding this rank's slice, so the state-dict keys,
the noise streams and everything that holds the module or its parameters stay as they were; its rule (rules.py)
reads its slice only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..shards import Shard
from ..split.safetensors_read import stored_of
from ..wire import Wire


@dataclass(frozen=True)
class Group:
    """One stage's tensor-parallel ranks as the layers see them: this rank's index, how many, the process group."""

    rank: int
    size: int
    handle: Any  # the torch.distributed group; None: the planner's simulation of rank ``rank`` (no peers)
    wire: Optional[Wire] = None  # where the collectives' tensors cross (None: where they are)

    def all_reduce(self, t: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> None:
        if self.handle is not None:  # (simulated: the sum's shape and memory, no communication)
            wired = self.wire.out(t) if self.wire is not None else t
            dist.all_reduce(wired, op=op, group=self.handle)
            Wire.into(t, wired)

    def all_gather(self, parts: list, t: torch.Tensor) -> None:
        if self.handle is None:
            for part in parts:
                part.copy_(t)
        elif self.wire is None or not self.wire.staged:
            dist.all_gather(parts, t, group=self.handle)
        else:
            wired = [self.wire.empty(p.shape, p.dtype) for p in parts]
            dist.all_gather(wired, self.wire.out(t), group=self.handle)
            for part, arrived in zip(parts, wired):
                part.copy_(arrived)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        ctx.group.all_reduce(grad)
        return grad, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        out = x.contiguous().clone()
        group.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group, ctx.width = group, x.shape[-1]
        parts = [torch.empty_like(x.contiguous()) for _ in range(group.size)]
        group.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(-1, ctx.group.rank * ctx.width, ctx.width).contiguous(), None


def copy(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _Copy.apply(x, group)


def reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _Reduce.apply(x, group)


def gather(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _Gather.apply(x, group)


def _keep(p: nn.Parameter, dim: int, start: int, width: int) -> None:
    """The parameter object stays (optimizers, weight-decay groups and hooks know it by identity); its values
    become this rank's slice [start, start + width) of ``dim``: a copy of the whole tensor's, so the whole is freed,
    or, for a parameter the loader left on the meta device, read from its file alone (split/safetensors_read.py)."""
    if p.shape[dim] == width:  # cut already: an embedding's weight tied to the head, cut by the other layer
        return
    stored = stored_of(p)
    if stored is None:
        p.data = p.detach().narrow(dim, start, width).clone().contiguous()
        return
    part = stored.read(Shard(tuple(p.shape), dim, start, start + width), p.dtype)
    torch.utils.swap_tensors(p, nn.Parameter(part, requires_grad=p.requires_grad))  # meta -> CPU, the same object


class ColumnParallelLinear(nn.Linear):
    """Output features [start, stop) of a Linear: takes the whole input, gives this rank's slice of the output
    (the next layer is row-parallel, or the attention of this rank's heads)."""

    group: Group
    start: int

    @classmethod
    def split(cls, layer: nn.Linear, group: Group) -> nn.Linear:
        """``layer`` itself, turned into this rank's slice of it."""
        width = layer.out_features // group.size
        layer.__class__ = cls
        layer.group, layer.start, layer.out_features = group, group.rank * width, width
        _keep(layer.weight, 0, layer.start, width)
        if layer.bias is not None:
            _keep(layer.bias, 0, layer.start, width)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy(x, self.group), self.weight, self.bias)


class GatheredColumnLinear(ColumnParallelLinear):
    """A column-parallel head whose slices of the logits are gathered: the loss sees the whole vocabulary, so any
    loss function (the user's own) stays exact."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather(super().forward(x), self.group)


class RowParallelLinear(nn.Linear):
    """Input features [start, stop) of a Linear: takes this rank's slice of the input, sums the partial products
    over the ranks, then adds the bias (held whole by every rank, added once)."""

    group: Group
    start: int

    @classmethod
    def split(cls, layer: nn.Linear, group: Group) -> nn.Linear:
        width = layer.in_features // group.size
        layer.__class__ = cls
        layer.group, layer.start, layer.in_features = group, group.rank * width, width
        _keep(layer.weight, 1, layer.start, width)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce(F.linear(x, self.weight), self.group)
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, stop) of an embedding: an id outside them gives zeros here, and the sum over the ranks gives
    every id its row."""

    group: Group
    start: int

    @classmethod
    def split(cls, layer: nn.Embedding, group: Group) -> nn.Embedding:
        width = layer.num_embeddings // group.size
        start, pad = group.rank * width, layer.padding_idx
        layer.__class__ = cls
        layer.group, layer.start, layer.num_embeddings = group, start, width
        layer.padding_idx = pad - start if pad is not None and start <= pad < start + width else None
        _keep(layer.weight, 0, start, width)
        return layer

    def local_ids(self, ids: torch.Tensor):
        """(the ids as rows of this slice, 0 for those outside it; where they are outside it)."""
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        return local.masked_fill(outside, 0), outside

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local, outside = self.local_ids(ids)
        out = F.embedding(local, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq)
        return reduce(out.masked_fill(outside.unsqueeze(-1), 0), self.group)
