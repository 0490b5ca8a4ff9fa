"""Balancing by measured cost, and the report of a partition's predicted per-stage cost.

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

from .partition import Block


def _time_block(block: Block, x: torch.Tensor, grad_mode: str, repeats: int):
    from .stage import Stage

    index = 0 if not x.is_floating_point() else 1  # a middle stage: input grads, no loss
    times, out = [], None
    for r in range(repeats + 1):
        stage = Stage(index, 3, [block], None, grad_mode)
        start = time.perf_counter()
        out = stage.forward(0, x)
        stage.backward(0, torch.ones_like(out))
        stage.weight(0, torch.ones(x.shape[0], dtype=torch.float64))
        elapsed = time.perf_counter() - start
        stage.capture.close()
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

    def __call__(self, blocks: Sequence[Block]) -> List[float]:
        x, out = self.sample_input, []
        for block in blocks:
            seconds, x = _time_block(block, x, self.grad_mode, self.repeats)
            out.append(seconds)
        return out


def measured_costs(sample_input: torch.Tensor, grad_mode: str = "ghost", repeats: int = 3) -> MeasuredCosts:
    return MeasuredCosts(sample_input, grad_mode, repeats)


@dataclass
class PartitionReport:
    stage_costs: List[float]
    blocks_per_stage: List[int]
    unit: str = "cost"  # what a cost counts: "parameters", "blocks", "seconds" or "cost"

    @property
    def imbalance(self) -> float:
        """slowest stage / mean stage (1.0 is perfect)."""
        mean = sum(self.stage_costs) / len(self.stage_costs)
        return max(self.stage_costs) / mean if mean > 0 else 1.0

    def __str__(self) -> str:
        parts = ", ".join(f"{c:.3g}" for c in self.stage_costs)
        return (f"blocks per stage {self.blocks_per_stage}, stage costs [{parts}] ({self.unit}), "
                f"imbalance {self.imbalance:.2f}x")


def report(stage_blocks: Sequence[Sequence[Block]], block_costs: Sequence[float], unit: str = "cost") -> PartitionReport:
    costs, i = [], 0
    for blocks in stage_blocks:
        costs.append(sum(block_costs[i : i + len(blocks)]))
        i += len(blocks)
    return PartitionReport(costs, [len(b) for b in stage_blocks], unit)


def cost_unit(balance) -> str:
    if balance == "params":
        return "parameters"
    if balance == "uniform":
        return "blocks"
    return getattr(balance, "unit", "cost")
