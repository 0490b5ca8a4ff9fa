"""Group an ordered list of blocks into contiguous pipeline stages (uniform or balanced)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Collection, Dict, List, Optional, Sequence, Set, Tuple

import torch.nn as nn

from ..config import Balance
from ..errors import PartitionError, UnsupportedModelError
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


def balanced_split(costs: Sequence[float], stages: int, uncut: Collection[int] = ()) -> List[range]:
    """Contiguous split of ``costs`` into ``stages`` non-empty parts minimising the largest part, with no
    stage starting at a block index in ``uncut`` (the caller checks that enough other cuts remain).

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
                if j in uncut:
                    continue
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


def compute_costs(blocks: Sequence[Block]) -> List[float]:
    """Multiply-adds per token, from the parameters: a Linear (a Conv1D, a convolution) costs its weight's
    size, an embedding one row (a lookup: no matrix work), any other parameter its size. The forward and
    the DP passes scale with this; parameter counts would weigh a 32000 x 4096 embedding like a head."""
    costs = []
    for b in blocks:
        total, seen = 0, set()
        for module in b.module.modules():
            for p in module.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                is_lookup = isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and p is module.weight
                total += module.embedding_dim if is_lookup else p.numel()
        costs.append(float(total))
    return costs


def block_costs(blocks: Sequence[Block], balance: Balance) -> List[float]:
    """The per-block costs a balance rule stands for ("uniform" counts every block as 1)."""
    if balance == "uniform":
        return [1.0] * len(blocks)
    if balance in ("params", "compute"):
        costs = parameter_costs(blocks) if balance == "params" else compute_costs(blocks)
        return costs if sum(costs) > 0 else [1.0] * len(blocks)
    if callable(balance):
        costs = list(balance(blocks))
    elif isinstance(balance, str):
        raise PartitionError(
            f"unknown balance {balance!r}: use 'compute', 'params', 'uniform', a list of block costs, "
            "or pipedp.measured_costs(sample_input)"
        )
    else:
        costs = list(balance)
    if len(costs) != len(blocks):
        raise PartitionError(f"got {len(costs)} block costs for {len(blocks)} blocks")
    return costs


def partition(
    blocks: Sequence[Block], stages: int, balance: Balance = "compute", costs: Optional[Sequence[float]] = None
) -> List[List[Block]]:
    """Group blocks into stages: "compute" (multiply-adds per token), "uniform" (block counts), "params"
    (parameter counts), a list of
    per-block costs, or a function of the blocks returning such a list (e.g. measured_costs)."""
    if stages > 1 and len(blocks) == 1 and blocks[0].unsplittable:
        raise UnsupportedModelError(blocks[0].unsplittable)
    uncut = _uncut(blocks, stages)
    if balance == "uniform" and not uncut:
        ranges = uniform_split(len(blocks), stages)
    else:
        given = [1.0] * len(blocks) if balance == "uniform" else costs
        ranges = balanced_split(given if given is not None else block_costs(blocks, balance), stages, uncut)
    stage_blocks = [[blocks[i] for i in r] for r in ranges]
    find_ties(stage_blocks)  # refuses every sharing across stages but an embedding / head tie
    return stage_blocks


def repeated_modules(blocks: Sequence[Block]) -> List[Tuple[str, List[int]]]:
    """(its first name, the block positions) of each module holding parameters or buffers that several blocks
    hold (a module repeated in an nn.Sequential, or shared by two blocks; of nested ones, the outermost): its
    calls must run on one stage, where its per-sample gradient is the sum over its calls (on two stages it
    would be two copies stepping apart)."""
    where: Dict[int, Tuple[nn.Module, str, List[int]]] = {}
    for i, b in enumerate(blocks):
        for name, module in b.module.named_modules(remove_duplicate=False):
            if next(itertools.chain(module.parameters(), module.buffers()), None) is not None:
                where.setdefault(id(module), (module, b.qualified(name) if name else b.name, []))[2].append(i)
    repeated = {k: (m, name, sorted(set(at))) for k, (m, name, at) in where.items() if len(set(at)) > 1}
    inner = {id(sub): at for m, _, at in repeated.values() for sub in m.modules() if sub is not m}
    return [(name, at) for k, (_, name, at) in repeated.items() if inner.get(k) != at]


def _uncut(blocks: Sequence[Block], stages: int) -> Set[int]:
    """The block indices no stage may start at: those between two positions of a repeated module."""
    repeated = repeated_modules(blocks)
    uncut = {j for _, positions in repeated for j in range(min(positions) + 1, max(positions) + 1)}
    possible = len(blocks) - len(uncut)
    if repeated and stages > possible:  # (without repeats, the split's own check names the problem)
        names = "; ".join(f"{name!r} at block positions {positions}" for name, positions in repeated)
        raise PartitionError(
            f"cannot split into {stages} stages: one module runs at several positions ({names}), and all its calls "
            f"run on one stage (its per-sample gradient sums them), which leaves at most {possible} stages. Use "
            f"stages <= {possible}, or give each position its own module (e.g. copy.deepcopy) if they are not "
            "meant to share weights"
        )
    return uncut


@dataclass(frozen=True)
class Tie:
    """A parameter used on the first stage as an nn.Embedding's weight and on the last stage as an
    nn.Linear's weight: a language model's input embedding tied to its output head. Its per-sample
    gradient is the sum of both uses; pipedp computes the cross term of their norms exactly."""

    owner: str  # the parameter's name on the first stage (the embedding's weight)
    partner: str  # its name on the last stage (the head's weight)


def _plain_or_scaled_embedding(module: nn.Module) -> bool:
    """nn.Embedding, or a subclass whose only change is a constant ``embed_scale`` (Gemma's)."""
    return type(module) is nn.Embedding or (isinstance(module, nn.Embedding) and hasattr(module, "embed_scale"))


def find_ties(stage_blocks: Sequence[Sequence[Block]]) -> List[Tie]:
    """The tied parameters across stages; refuse every sharing but the embedding / head one."""
    uses: Dict[int, List[Tuple[int, str, nn.Module]]] = {}
    for s, blocks in enumerate(stage_blocks):
        for b in blocks:
            for mname, module in b.module.named_modules():
                for pname, p in module.named_parameters(recurse=False):
                    if not p.requires_grad:  # a frozen tensor gets no gradient: sharing it is harmless
                        continue
                    name = b.qualified(f"{mname}.{pname}" if mname else pname)
                    uses.setdefault(id(p), []).append((s, name, module))
    ties = []
    last = len(stage_blocks) - 1
    for found in uses.values():
        stages = sorted({s for s, _, _ in found})
        if len(stages) < 2:
            continue
        first = [(n, m) for s, n, m in found if s == 0]
        head = [(n, m) for s, n, m in found if s == last]
        embedding_and_head = (
            stages == [0, last]
            and len(first) == 1
            and len(head) == 1
            and _plain_or_scaled_embedding(first[0][1])
            and first[0][0].endswith("weight")
            and type(head[0][1]) is nn.Linear
            and head[0][0].endswith("weight")
        )
        if embedding_and_head:
            ties.append(Tie(first[0][0], head[0][0]))
            continue
        names = ", ".join(f"{n} (stage {s})" for s, n, _ in found)
        raise PartitionError(
            f"parameters {names} are one tensor used on several stages: pipedp computes exact per-sample norms "
            "for a tie between an nn.Embedding on the first stage and an nn.Linear head on the last, not for this "
            "sharing. Untie them (e.g. untie_weights=True for Hugging Face models, or give each its own copy), "
            "or choose a split that keeps both on one stage."
        )
    return ties
