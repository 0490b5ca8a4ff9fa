"""A tensor split across the tensor-parallel ranks of a stage: which slice this rank holds; and, under a sharded
optimizer, which data-parallel replica owns each whole parameter (``owners``).

One home for the idea, used by the parallel layers (which hold the slice), the noise (which draws the whole
tensor's values and keeps the slice's, so a run on T ranks is noised exactly as one on 1), the per-sample norms
(a rank adds its slices' partial norms; a tensor every rank holds whole is counted on rank 0 only) and the
state dict (the slices gathered into the whole tensor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class Shard:
    """Indices [start, stop) of dimension ``dim`` of a tensor whose whole shape is ``full_shape``."""

    full_shape: Tuple[int, ...]
    dim: int
    start: int
    stop: int

    @classmethod
    def even(cls, full_shape: Tuple[int, ...], dim: int, rank: int, size: int) -> "Shard":
        """Rank ``rank``'s equal part of ``size`` along ``dim`` (the caller refused an uneven split)."""
        width = full_shape[dim] // size
        return cls(tuple(full_shape), dim, rank * width, (rank + 1) * width)

    def of(self, whole: torch.Tensor) -> torch.Tensor:
        """This slice of the whole tensor (a view)."""
        return whole.narrow(self.dim, self.start, self.stop - self.start)

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.stop - self.start if d == self.dim else s for d, s in enumerate(self.full_shape))


@dataclass
class TensorParallelPart:
    """A stage's place in its tensor-parallel group: rank ``rank`` of ``size``, and the slices it holds
    (by parameter identity). A parameter without a slice is held whole by every rank of the group."""

    rank: int = 0
    size: int = 1
    shards: Dict[int, Shard] = field(default_factory=dict)  # id(parameter) -> its slice

    def of(self, parameter: torch.Tensor) -> Optional[Shard]:
        return self.shards.get(id(parameter))

    def counts(self, parameter: torch.Tensor) -> bool:
        """Whether this rank adds ``parameter``'s per-sample squared norms: its own slice always, a whole tensor
        on rank 0 only (counted once, never ``size`` times)."""
        return self.rank == 0 or id(parameter) in self.shards


def owners(sizes: Sequence[int], replicas: int) -> List[int]:
    """The replica that owns each parameter of a stage under a sharded optimizer (ZeRO stage 1), given their sizes
    in bytes: the largest first, each to the replica that owns the fewest bytes so far (the lowest index on a
    tie), so every rank computes the same answer and no replica owns much more than 1/replicas of the bytes.
    Whole parameters, never pieces: a parameter's optimizer step reads its own state and gradient only."""
    load = [0] * replicas
    out = [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        r = min(range(replicas), key=lambda r: (load[r], r))
        out[k] = r
        load[r] += sizes[k]
    return out
