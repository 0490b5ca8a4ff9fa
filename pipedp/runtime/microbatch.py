"""Static-shape micro-batches: split a logical batch, pad with masked rows.

Padded rows repeat the last real row (so any loss stays finite on them) and carry mask 0:
their loss is never counted and their clip factor is 0, so they change nothing.

Inputs are a tensor, or a dict of batch-first tensors (e.g. ``{"input_ids": ..,
"attention_mask": ..}`` as Hugging Face tokenizers return): every function here treats the
dict row-wise, and every stage sees its micro-batch's dict (the side inputs, such as masks,
never travel through the activation pipe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch

from ..errors import BatchError

Inputs = Union[torch.Tensor, Dict[str, torch.Tensor]]
# what one stage hands the next: a tensor, or a tuple of tensors (several values crossing one cut,
# e.g. a residual stream and a mask); the gradient message back holds one gradient per
# floating-point tensor of it, in order (a bare tensor for a bare tensor)
Activation = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


def detached(value: Activation) -> Activation:
    return tuple(t.detach() for t in value) if isinstance(value, tuple) else value.detach()


def gradient_message(inputs, tuple_input: bool, grads) -> Activation:
    """The gradient message to the previous stage: one gradient per floating input (zeros where autograd gave
    none), a bare tensor where the stage took one."""
    message = tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(grads, inputs))
    return message[0] if not tuple_input and len(message) == 1 else message


def rows(inputs: Inputs) -> int:
    """The batch size of a tensor or of a dict of batch-first tensors."""
    return int(next(iter(inputs.values())).shape[0]) if isinstance(inputs, dict) else int(inputs.shape[0])


def take(inputs: Inputs, index) -> Inputs:
    """``inputs[index]`` row-wise (a slice or an index tensor)."""
    return {k: v[index] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[index]


def to_device(inputs: Inputs, device) -> Inputs:
    return {k: v.to(device) for k, v in inputs.items()} if isinstance(inputs, dict) else inputs.to(device)


def tensors_of(value: Union[Inputs, Activation]) -> List[torch.Tensor]:
    """The tensors of micro-batch inputs (a tensor or a dict) or of an activation (a tensor or a tuple)."""
    if isinstance(value, dict):
        return list(value.values())
    return list(value) if isinstance(value, tuple) else [value]


@dataclass
class PassBatch:
    """The micro-batches of one pipeline pass (all of one shape)."""

    inputs: List[Inputs]
    targets: List[torch.Tensor]
    masks: List[torch.Tensor]  # float, 1 for a real row, 0 for padding

    def to(self, device) -> "PassBatch":
        return PassBatch(
            [to_device(x, device) for x in self.inputs],
            [t.to(device) for t in self.targets],
            [m.to(device) for m in self.masks],
        )


def check_batch(inputs, targets) -> int:
    if isinstance(inputs, dict):
        if not inputs or not all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in inputs.values()):
            raise BatchError("a dict of inputs must hold batch-first tensors (e.g. input_ids, attention_mask)")
        sizes = {k: int(v.shape[0]) for k, v in inputs.items()}
        if len(set(sizes.values())) > 1:
            raise BatchError(f"the input tensors disagree on the batch size: {sizes}")
        if not isinstance(targets, torch.Tensor) or targets.dim() == 0 or targets.shape[0] != rows(inputs):
            raise BatchError(f"targets must be a batch-first tensor of {rows(inputs)} rows like the inputs {sizes}")
        return rows(inputs)
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise BatchError(
            f"inputs and targets must be tensors (inputs: or a dict of tensors) with the batch dimension "
            f"first, got {type(inputs).__name__} and {type(targets).__name__}"
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


def pass_slices(n: int, microbatches: int, microbatch_size: Optional[int]) -> List[slice]:
    """Row ranges of the pipeline passes for n rows (none when n == 0)."""
    if n == 0:
        return []
    if microbatch_size is None:
        return [slice(0, n)]
    per_pass = microbatches * microbatch_size
    return [slice(start, min(n, start + per_pass)) for start in range(0, n, per_pass)]


def microbatch_size_for(rows: int, microbatches: int, microbatch_size: Optional[int]) -> int:
    return microbatch_size if microbatch_size is not None else max(1, math.ceil(rows / microbatches))


def _padded(t: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.cat([t, t[-1:].expand(pad, *t.shape[1:])]) if pad else t


def make_pass(inputs: Inputs, targets: torch.Tensor, microbatches: int, size: int) -> PassBatch:
    n = rows(inputs)
    total = microbatches * size
    if n > total:
        raise BatchError(f"{n} rows do not fit {microbatches} micro-batches of {size}")
    pad = total - n
    mask = torch.cat([torch.ones(n), torch.zeros(pad)])
    targets = _padded(targets, pad)
    if isinstance(inputs, dict):
        split = {k: _padded(v, pad).split(size) for k, v in inputs.items()}
        parts: List[Inputs] = [{k: split[k][i] for k in split} for i in range(microbatches)]
    else:
        parts = list(_padded(inputs, pad).split(size))
    return PassBatch(parts, list(targets.split(size)), list(mask.split(size)))


def padding_pass(inputs: Inputs, targets: torch.Tensor, microbatches: int, size: int) -> PassBatch:
    """A pass with no real row, made of copies of the first rows of ``inputs`` (``size`` of them, one privacy
    unit's), every one masked out: a replica whose share of the logical batch ran out while the others still run
    passes (the passes' collectives span every replica, so every replica runs as many)."""
    batch = make_pass(take(inputs, slice(0, size)), targets[:size], microbatches, size)
    return PassBatch(batch.inputs, batch.targets, [torch.zeros_like(m) for m in batch.masks])
