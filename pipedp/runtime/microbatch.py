"""Static-shape micro-batches: split a logical batch, pad with masked rows.

Padded rows repeat the last real row (so any loss stays finite on them) and carry mask 0:
their loss is never counted and their clip factor is 0, so they change nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch

from ..errors import BatchError


@dataclass
class PassBatch:
    """The micro-batches of one pipeline pass (all of one shape)."""

    inputs: List[torch.Tensor]
    targets: List[torch.Tensor]
    masks: List[torch.Tensor]  # float, 1 for a real row, 0 for padding

    def to(self, device) -> "PassBatch":
        move = lambda ts: [t.to(device) for t in ts]  # noqa: E731
        return PassBatch(move(self.inputs), move(self.targets), move(self.masks))


def check_batch(inputs, targets) -> int:
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise BatchError(
            f"inputs and targets must be tensors with the batch dimension first, got "
            f"{type(inputs).__name__} and {type(targets).__name__}"
        )
    if inputs.dim() == 0 or targets.dim() == 0:
        raise BatchError("inputs and targets need a batch dimension first; got a 0-d tensor")
    if inputs.shape[0] != targets.shape[0]:
        raise BatchError(
            f"inputs and targets disagree on the batch size: {inputs.shape[0]} inputs vs "
            f"{targets.shape[0]} targets (shapes {tuple(inputs.shape)} and {tuple(targets.shape)})"
        )
    return int(inputs.shape[0])


def replica_rows(n: int, replicas: int, replica: int) -> slice:
    """The contiguous rows of an n-row logical batch that data-parallel replica ``replica`` takes."""
    base, extra = divmod(n, replicas)
    start = replica * base + min(replica, extra)
    return slice(start, start + base + (1 if replica < extra else 0))


def plan_passes(n: int, microbatches: int, microbatch_size: Optional[int]) -> List[slice]:
    """Row ranges of the pipeline passes for n rows (none when n == 0)."""
    if n == 0:
        return []
    if microbatch_size is None:
        return [slice(0, n)]
    per_pass = microbatches * microbatch_size
    return [slice(start, min(n, start + per_pass)) for start in range(0, n, per_pass)]


def microbatch_size_for(rows: int, microbatches: int, microbatch_size: Optional[int]) -> int:
    return microbatch_size if microbatch_size is not None else max(1, math.ceil(rows / microbatches))


def make_pass(inputs: torch.Tensor, targets: torch.Tensor, microbatches: int, size: int) -> PassBatch:
    rows = inputs.shape[0]
    total = microbatches * size
    if rows > total:
        raise BatchError(f"{rows} rows do not fit {microbatches} micro-batches of {size}")
    pad = total - rows
    mask = torch.cat([torch.ones(rows), torch.zeros(pad)])
    if pad:
        inputs = torch.cat([inputs, inputs[-1:].expand(pad, *inputs.shape[1:])])
        targets = torch.cat([targets, targets[-1:].expand(pad, *targets.shape[1:])])
    return PassBatch(list(inputs.split(size)), list(targets.split(size)), list(mask.split(size)))
