"""pipedp's token loss on vocabulary-split logits: no rank ever holds the whole vocabulary's logits.

Each rank holds the logits of its vocabulary slice (the head column-parallel, not gathered). Per token,
log-sum-exp over the whole vocabulary = log(sum over ranks of each slice's sum of exp(z - m)) + m, with m the
largest logit over every rank (a constant shift: it changes no value and no gradient), and the target's logit is
picked by the rank holding it. Both sums are ``reduce`` (all-reduce forward, identity backward): the loss is the
same on every rank, so each rank's gradient of a sum is its own slice's. Targets of -100 add nothing (their tokens'
losses are masked, as ``token_loss`` does: Optimum's vocabulary-parallel loss takes an ignore_index and never
applies it). The per-sample loss is each sequence's mean over its target tokens, exactly ``models.token_loss``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .layers import ColumnParallelLinear, reduce


class VocabParallelTokenLoss:
    """``token_loss`` for the logits of ``head``'s vocabulary slice (read when called: the head is split in place
    once the run's ranks exist)."""

    def __init__(self, head: nn.Module):
        self.head = head

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        head = self.head
        if not isinstance(head, ColumnParallelLinear):
            raise RuntimeError("the vocabulary-parallel loss needs its head split across the tensor-parallel ranks")
        width, group = logits.shape[-1], head.group
        z, t = logits.reshape(-1, width), targets.reshape(-1)
        with torch.no_grad():
            top = z.max(-1).values
            group.all_reduce(top, dist.ReduceOp.MAX)
        shifted = z - top.unsqueeze(-1)
        total = reduce(shifted.exp().sum(-1), group)  # sum over the whole vocabulary of exp(z - m)
        local = t - head.start
        mine = (local >= 0) & (local < width)
        picked = reduce(shifted.gather(1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1) * mine, group)
        counted = t != -100
        per_token = torch.where(counted, total.log() - picked, torch.zeros((), dtype=z.dtype, device=z.device))
        losses = per_token.view(targets.shape)
        return losses.sum(dim=1) / counted.view(targets.shape).sum(dim=1).clamp(min=1)
