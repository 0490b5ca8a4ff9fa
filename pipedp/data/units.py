"""Rows -> privacy units, and the held-out split.

Record level (default): each row is one unit. User level: every row of one user forms one unit of
exactly ``k`` rows (``max_records_per_user``): the user's first k records in the order of the
source; a user with fewer is filled with padding rows (every target -100: no loss, no gradient).
The unit's rows are consecutive, so a batch's rows come in groups of k, one group per unit. A
held-out fraction is drawn over units (users, at user level) with a seeded permutation that depends
only on the number of units.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .rows import Tokenized


@dataclass
class UnitGroups:
    """A dataset's rows grouped into privacy units: the row indices of each unit (at user level, at most k
    each) and what grouping did. (privacy/units.py's ``Units`` is the batch-side rule: rows per unit.)"""

    rows: List[List[int]]
    unit_rows: int  # rows per unit: 1, or k at user level (PrivacyConfig.unit_rows)
    counts: Dict[str, int]

    def __len__(self) -> int:
        return len(self.rows)


def record_units(t: Tokenized) -> UnitGroups:
    return UnitGroups([[r] for r in range(t.rows)], 1, {"units": t.rows})


def user_units(t: Tokenized, per_user: int) -> UnitGroups:
    """Group rows by user (first appearance order), keep each user's first ``per_user`` rows."""
    if t.users is None:
        raise ValueError("user-level units need the rows' users (tokenise with user_field)")
    groups: Dict[str, List[int]] = {}
    for r, user in enumerate(t.users):
        groups.setdefault(user, []).append(r)
    capped = sum(1 for g in groups.values() if len(g) > per_user)
    cut = sum(max(0, len(g) - per_user) for g in groups.values())
    padded = sum(per_user - len(g) for g in groups.values() if len(g) < per_user)
    rows = [g[:per_user] for g in groups.values()]
    return UnitGroups(
        rows, per_user, {"units": len(rows), "users capped": capped, "records cut": cut, "padding rows": padded}
    )


def hold_out(count: int, fraction: Optional[float], seed: int) -> Tuple[List[int], List[int]]:
    """(training units, held-out units): round(fraction x count) units, at least one each way."""
    if not fraction:
        return list(range(count)), []
    held = min(count - 1, max(1, round(fraction * count)))
    if held < 1:
        raise ValueError(f"--eval-fraction needs at least 2 privacy units to hold one out, got {count}")
    order = list(range(count))
    random.Random(f"pipedp eval split {seed}").shuffle(order)
    return sorted(order[held:]), sorted(order[:held])


def assemble(t: Tokenized, units: UnitGroups, chosen: List[int], padded: bool = True):
    """(input_ids, labels, attention_mask) as int64 tensors: the chosen units' rows, unit after unit, each
    unit filled to ``unit_rows`` rows with padding rows (targets -100, mask 0) when ``padded``."""
    index: List[int] = []
    for u in chosen:
        members = units.rows[u]
        index.extend(members)
        if padded:
            index.extend([-1] * (units.unit_rows - len(members)))
    take = torch.tensor([max(i, 0) for i in index], dtype=torch.long)
    pad = torch.tensor([i < 0 for i in index], dtype=torch.bool)
    ids = t.input_ids[take].long()
    labels = t.labels[take].long()
    positions = torch.arange(ids.shape[1])
    mask = (positions[None, :] < t.lengths[take].long()[:, None]).long()
    if pad.any():
        labels[pad] = -100
        mask[pad] = 0
        ids[pad] = t.pad_id  # nothing learns from it: mask 0, targets -100
    return ids, labels, mask
