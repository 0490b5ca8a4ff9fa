"""The privacy unit: what one sample of DP-SGD is, in rows of the batch.

By default a unit is one row (one record). With ``rows`` R > 1 (user-level DP: one user's records),
the batch's rows come in consecutive groups of R, each group one unit: sampled, clipped and counted
as one. Its loss is the sum of its rows' losses and its gradient the sum of theirs; the clip factor
is computed from the norm of that sum, then applied to each of its rows. A unit with fewer records
is filled with rows whose loss is zero (all labels -100).

For layers whose per-sample math already sums over every dimension between the first (the sample)
and the last (the features) — Linear, Embedding, LayerNorm — a unit's rows are folded into those
positions ([n R, T, d] -> [n, R T, d]): the unit's gradient and its ghost norm come out exactly, cross
terms between rows included. Other layers' per-row gradients are summed per unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import BatchError


@dataclass(frozen=True)
class Units:
    rows: int = 1  # rows per privacy unit

    @property
    def single(self) -> bool:
        return self.rows == 1

    def count(self, rows: int) -> int:
        """Units in ``rows`` rows."""
        if rows % self.rows:
            raise BatchError(
                f"a batch of {rows} rows does not hold whole privacy units of {self.rows} rows each: give each "
                "unit exactly unit_rows rows (fill a unit with fewer records with rows labelled -100)"
            )
        return rows // self.rows

    def fold(self, t: torch.Tensor) -> torch.Tensor:
        """[n R, ...] -> [n, R * (positions), features]: a unit's rows become positions of one sample."""
        if self.single:
            return t
        n = t.shape[0] // self.rows
        if t.dim() == 1:  # one id per row
            return t.reshape(n, self.rows)
        if t.dim() == 2 and not t.is_floating_point():  # [rows, T] ids
            return t.reshape(n, self.rows * t.shape[1])
        return t.reshape(n, -1, t.shape[-1])

    def group_sum(self, per_row: torch.Tensor) -> torch.Tensor:
        """[n R, ...] -> [n, ...]: per-row quantities summed per unit."""
        if self.single:
            return per_row
        return per_row.reshape(per_row.shape[0] // self.rows, self.rows, *per_row.shape[1:]).sum(1)

    def expand(self, of_units: torch.Tensor) -> torch.Tensor:
        """[..., n] -> [..., n R]: a unit's value on each of its rows (clip factors, flags)."""
        if self.single:
            return of_units
        return of_units.repeat_interleave(self.rows, dim=-1)

    def mask(self, row_mask: torch.Tensor) -> torch.Tensor:
        """[n R] -> [n]: a unit is real if any of its rows is."""
        if self.single:
            return row_mask
        return row_mask.reshape(-1, self.rows).amax(1)

    def rows_of(self, unit: int) -> slice:
        return slice(unit * self.rows, (unit + 1) * self.rows)

    def row_index(self, unit_index: torch.Tensor) -> torch.Tensor:
        """The rows of the units ``unit_index`` (a batch drawn over units)."""
        if self.single:
            return unit_index
        return (unit_index[:, None] * self.rows + torch.arange(self.rows)).reshape(-1)
