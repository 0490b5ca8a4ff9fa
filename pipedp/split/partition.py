"""Group an ordered list of blocks into contiguous pipeline stages (uniform or balanced)."""
from __future__ import annotations

from typing import List, Optional, Sequence

from ..config import Balance
from ..errors import PartitionError
from .blocks import Block


def uniform_split(num_blocks: int, stages: int) -> List[range]:
    """Contiguous ranges of as-equal-as-possible block counts (earlier stages get the extra)."""
    _check_counts(num_blocks, stages)
    base, extra = divmod(num_blocks, stages)
    ranges, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def balanced_split(costs: Sequence[float], stages: int) -> List[range]:
    """Contiguous split of ``costs`` into ``stages`` non-empty parts minimising the largest part.

    Dynamic programming over prefix sums, O(stages * n^2): exact, and fast for the few
    hundred blocks a model has.
    """
    n = len(costs)
    _check_counts(n, stages)
    if any(c < 0 for c in costs):
        raise PartitionError(f"block costs must be >= 0, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: minimal largest part when the first i blocks form k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        bounds.append(range(j, i))
        i = j
    return list(reversed(bounds))


def _check_counts(num_blocks: int, stages: int) -> None:
    if stages < 1:
        raise PartitionError(f"stages must be >= 1, got {stages}")
    if stages > num_blocks:
        raise PartitionError(
            f"cannot split {num_blocks} blocks into {stages} stages: every stage needs at least one "
            f"block; use stages <= {num_blocks} or a model with more blocks"
        )


def parameter_costs(blocks: Sequence[Block]) -> List[float]:
    return [float(sum(p.numel() for p in b.module.parameters())) for b in blocks]


def block_costs(blocks: Sequence[Block], balance: Balance) -> List[float]:
    """The per-block costs a balance rule stands for ("uniform" counts every block as 1)."""
    if balance == "uniform":
        return [1.0] * len(blocks)
    if balance == "params":
        costs = parameter_costs(blocks)
        return costs if sum(costs) > 0 else [1.0] * len(blocks)
    if callable(balance):
        costs = list(balance(blocks))
    elif isinstance(balance, str):
        raise PartitionError(f"unknown balance {balance!r}: use 'uniform', 'params', a list of block costs, "
                             "or pipedp.measured_costs(sample_input)")
    else:
        costs = list(balance)
    if len(costs) != len(blocks):
        raise PartitionError(f"got {len(costs)} block costs for {len(blocks)} blocks")
    return costs


def partition(
    blocks: Sequence[Block], stages: int, balance: Balance = "params", costs: Optional[Sequence[float]] = None
) -> List[List[Block]]:
    """Group blocks into stages: "uniform" (block counts), "params" (parameter counts), a list of
    per-block costs, or a function of the blocks returning such a list (e.g. measured_costs)."""
    if balance == "uniform":
        ranges = uniform_split(len(blocks), stages)
    else:
        ranges = balanced_split(costs if costs is not None else block_costs(blocks, balance), stages)
    stage_blocks = [[blocks[i] for i in r] for r in ranges]
    check_no_shared_parameters(stage_blocks)
    return stage_blocks


def check_no_shared_parameters(stage_blocks: Sequence[Sequence[Block]]) -> None:
    """A parameter used on two stages (tied weights) would be clipped wrongly: refuse it."""
    owner = {}
    for s, blocks in enumerate(stage_blocks):
        for b in blocks:
            for pname, p in b.module.named_parameters():
                first = owner.setdefault(id(p), (s, b.qualified(pname)))
                if first[0] != s:
                    raise PartitionError(
                        f"parameter {first[1]} (stage {first[0]}) is the same tensor as {b.qualified(pname)} "
                        f"(stage {s}): tied weights across stages would be clipped with the wrong per-sample "
                        f"norm. Untie them (e.g. untie_weights=True for Hugging Face models, or give each "
                        f"its own copy), or choose a split that keeps both on one stage."
                    )
