"""Balancing by measured cost.

``measured_costs(sample_input)`` times forward + backward (with the DP capture and the
per-sample norms) + the clipped weight pass of each block on a sample micro-batch, and
is passed as ``balance=`` to the trainer (or to ``partition``), which then minimises the
slowest stage.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import List, Sequence

import torch

from ..split.blocks import Block
from .stage import Stage


def _time_block(block: Block, x: torch.Tensor, grad_mode: str, repeats: int):
    index = 0 if not x.is_floating_point() else 1  # a middle stage: input grads, no loss
    times, out = [], None
    for r in range(repeats + 1):
        stage = Stage(index, 3, [block], None, grad_mode)
        stage.verified = True  # time the passes, not the first-use check
        start = time.perf_counter()
        out = stage.forward(0, x)
        stage.backward(0, torch.ones_like(out))
        stage.weight(0, torch.ones(x.shape[0], dtype=torch.float64))
        elapsed = time.perf_counter() - start
        stage.close()
        if r:  # the first run warms up
            times.append(elapsed)
    return statistics.median(times), out.detach()


@dataclass
class MeasuredCosts:
    """A balance rule: blocks -> seconds per block for one micro-batch like ``sample_input``."""

    sample_input: torch.Tensor
    grad_mode: str = "ghost"
    repeats: int = 3
    unit: str = "seconds"

    def describe(self) -> str:
        return f"measured_costs({tuple(self.sample_input.shape)}, {self.grad_mode})"

    def __call__(self, blocks: Sequence[Block]) -> List[float]:
        x, out = self.sample_input, []
        for block in blocks:
            seconds, x = _time_block(block, x, self.grad_mode, self.repeats)
            out.append(seconds)
        return out


def measured_costs(sample_input: torch.Tensor, grad_mode: str = "ghost", repeats: int = 3) -> MeasuredCosts:
    return MeasuredCosts(sample_input, grad_mode, repeats)
