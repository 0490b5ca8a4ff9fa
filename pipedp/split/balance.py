"""The report of a partition: predicted per-stage cost, its unit, and the imbalance.

(Costs measured by running the blocks live in ``pipedp.runtime.measure``: measuring needs
a stage, which is the runtime's.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence

from .blocks import Block


@dataclass
class PartitionReport:
    stage_costs: List[float]
    blocks_per_stage: List[int]
    unit: str = "cost"  # what a cost counts: "parameters", "blocks", "seconds" or "cost"
    # {layer: keep / ghost / materialize}: how each layer's per-sample norms are computed (known after
    # the first step: grad_mode="auto" times the ways then); this process's stages only
    ways: Dict[str, str] = field(default_factory=dict)

    @property
    def imbalance(self) -> float:
        """slowest stage / mean stage (1.0 is perfect)."""
        mean = sum(self.stage_costs) / len(self.stage_costs)
        return max(self.stage_costs) / mean if mean > 0 else 1.0

    def __str__(self) -> str:
        parts = ", ".join(f"{c:.3g}" for c in self.stage_costs)
        text = (
            f"blocks per stage {self.blocks_per_stage}, stage costs [{parts}] ({self.unit}), "
            f"imbalance {self.imbalance:.2f}x"
        )
        if self.ways:
            counts = {w: sum(1 for v in self.ways.values() if v == w) for w in sorted(set(self.ways.values()))}
            text += ", per-sample ways " + ", ".join(f"{w} {c}" for w, c in counts.items())
        return text


def report(
    stage_blocks: Sequence[Sequence[Block]], block_costs: Sequence[float], unit: str = "cost"
) -> PartitionReport:
    costs, i = [], 0
    for blocks in stage_blocks:
        costs.append(sum(block_costs[i : i + len(blocks)]))
        i += len(blocks)
    return PartitionReport(costs, [len(b) for b in stage_blocks], unit)


def cost_unit(balance) -> str:
    if balance == "params":
        return "parameters"
    if balance == "compute":
        return "multiply-adds per token"
    if balance == "uniform":
        return "blocks"
    return getattr(balance, "unit", "cost")
