"""Balancing by measured cost.

``measured_costs(sample_input)`` times forward + backward (with the DP capture and the
per-sample norms) + the clipped weight pass of each block on a sample micro-batch, on the block's
device (CUDA work is synchronised before each clock read), and is passed as ``balance=`` to the
trainer (or to ``partition``), which then minimises the slowest stage.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import List, Sequence

import torch

from ..split.blocks import Block
from .microbatch import Inputs, detached, rows, tensors_of
from .stage import Stage, StageOptions


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously: a clock read alone times the launches)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_block(block: Block, x, size: int, first: bool, grad_mode: str, repeats: int):
    times, out = [], None
    for r in range(repeats + 1):
        stage = Stage(0 if first else 1, 3, [block], None, StageOptions(grad_mode))  # a middle stage: no loss
        synchronize(stage.device)
        start = time.perf_counter()
        out = stage.forward(0, x, size=size)
        ones = tuple(torch.ones_like(t) for t in tensors_of(out) if t.is_floating_point())
        stage.backward_input(0, ones if isinstance(out, tuple) else ones[0] if ones else ())
        stage.weight(0, torch.ones(size, dtype=torch.float64, device=stage.device))
        synchronize(stage.device)
        elapsed = time.perf_counter() - start
        stage.close()
        if r:  # the first run warms up
            times.append(elapsed)
    return statistics.median(times), detached(out)


@dataclass
class MeasuredCosts:
    """A balance rule: blocks -> seconds per block for one micro-batch like ``sample_input``."""

    sample_input: Inputs
    grad_mode: str = "ghost"
    repeats: int = 3
    unit: str = "seconds"

    def describe(self) -> str:
        shapes = (
            {k: tuple(v.shape) for k, v in self.sample_input.items()}
            if isinstance(self.sample_input, dict)
            else tuple(self.sample_input.shape)
        )
        return f"measured_costs({shapes}, {self.grad_mode})"

    def __call__(self, blocks: Sequence[Block]) -> List[float]:
        x, out, size = self.sample_input, [], rows(self.sample_input)
        for k, block in enumerate(blocks):
            first = k == 0 or (isinstance(x, torch.Tensor) and not x.is_floating_point())
            seconds, x = _time_block(block, x, size, first, self.grad_mode, self.repeats)
            out.append(seconds)
        return out


def measured_costs(sample_input: Inputs, grad_mode: str = "ghost", repeats: int = 3) -> MeasuredCosts:
    return MeasuredCosts(sample_input, grad_mode, repeats)
