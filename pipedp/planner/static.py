"""What a stage holds whatever the batch: its weights, the clipped sums, the optimizer's state and the update's
transients, counted from the stage's own tensors (the model built on meta and prepared as training prepares it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

from ..privacy.clipping import sum_dtype
from ..shards import owners
from ..split.blocks import Block
from ..train.narrowing import steps_without_temporaries


@dataclass(frozen=True)
class StaticBytes:
    params: int  # parameter elements of the stage
    trainable: int  # of them trainable
    frozen_bytes: int  # frozen parameters, in their dtype
    trainable_bytes: int  # trainable parameters (float32 masters under bf16-mixed)
    buffer_bytes: int  # buffers (rotary frequencies, ...)
    grads: int  # the clipped sums (p.grad), float32 (float64 for float64 parameters)
    grad_copies: int  # at the step, p.grad in the parameter's dtype where it is not the sum's (bf16-true)
    largest_copy: int  # the largest of those: it exists next to every sum (they are converted one at a time)
    stepped_grads: int  # p.grad as the optimizer steps: the copies, and the sums that need none
    optimizer: int  # the optimizer's state, created at the first step
    step_temporaries: int  # the optimizer's largest transient (Adam: one temporary of the largest tensor)


def stage_tensors(blocks: Sequence[Block]) -> Tuple[List[nn.Parameter], List[torch.Tensor]]:
    """The distinct parameters and buffers of a stage's blocks."""
    params: Dict[int, nn.Parameter] = {}
    buffers: Dict[int, torch.Tensor] = {}
    for b in blocks:
        for p in b.module.parameters():
            params.setdefault(id(p), p)
        for t in b.module.buffers():
            buffers.setdefault(id(t), t)
    return list(params.values()), list(buffers.values())


def static_bytes(
    blocks: Sequence[Block],
    optimizer: str = "adamw",
    momentum: float = 0.0,
    fused: bool = True,
    weight_decay: float = 0.0,
    shard_over: int = 1,
) -> StaticBytes:
    """``blocks`` as the trainer holds them (after LoRA and the precision's dtype changes). With Adam's fused
    kernel (``fused``, the CLI's on CPU and CUDA) or SGD without weight decay the gradients are narrowed
    inside the float32 sums' storage, so no copy exists beside the sums (train/narrowing.py's
    ``steps_without_temporaries``; SGD's weight decay is taken as applying to some trainable parameter).
    ``shard_over``: the replicas a sharded optimizer splits the stage's parameters over (pipedp.shards.owners):
    the optimizer's state and the gradients it steps are those of the replica that owns the most bytes."""
    params, buffers = stage_tensors(blocks)
    trainable = [p for p in params if p.requires_grad]
    every = trainable
    if shard_over > 1:  # the replica with the largest share
        owner = owners([p.numel() * p.element_size() for p in trainable], shard_over)
        shares = [[p for p, o in zip(trainable, owner) if o == r] for r in range(shard_over)]
        trainable = max(shares, key=lambda ps: sum(p.numel() * p.element_size() for p in ps))
    frozen = [p for p in params if not p.requires_grad]

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    grads = sum(p.numel() * sum_dtype(p).itemsize for p in every)  # every replica makes every clipped sum
    stepped = sum(p.numel() * sum_dtype(p).itemsize for p in trainable)  # the sums that become gradients here
    copies = sum(size(p) for p in trainable if p.dtype != sum_dtype(p))
    per_param = {"adam": 2, "adamw": 2}.get(optimizer, 1 if momentum else 0)
    largest = max((size(p) for p in trainable), default=0)
    largest_copy = max((size(p) for p in trainable if p.dtype != sum_dtype(p)), default=0)
    adam = optimizer in ("adam", "adamw")
    in_storage = steps_without_temporaries(_probe(optimizer, momentum, fused, weight_decay))  # the trainer's rule
    if in_storage:  # each gradient keeps its sum's storage: no copy beside the sums, the sums' bytes stepped
        largest_copy, copies = 0, 0
    return StaticBytes(
        params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in every),
        frozen_bytes=sum(size(p) for p in frozen),
        trainable_bytes=sum(size(p) for p in every),
        buffer_bytes=sum(size(t) for t in buffers),
        grads=grads,
        grad_copies=copies,
        largest_copy=largest_copy,
        stepped_grads=stepped if in_storage else sum(size(p) for p in trainable),  # else p.grad in p's dtype
        optimizer=per_param * sum(size(p) for p in trainable),
        step_temporaries=largest if per_param and not (adam and fused) else 0,
    )


def _probe(optimizer: str, momentum: float, fused: bool, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer pipedp train builds for these options, over one stand-in parameter: the trainer's own rule
    (narrowing.steps_without_temporaries) is then asked of it, not copied here."""
    params = [nn.Parameter(torch.zeros(1))]
    if optimizer in ("adam", "adamw"):
        kind = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
        return kind(params, weight_decay=weight_decay, fused=fused or None)
    return torch.optim.SGD(params, lr=0.1, momentum=momentum, weight_decay=weight_decay)
