"""The registry of schedule builders: names, and one ``build`` for all of them."""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional

from .actions import Kind, Schedule
from .builders import check_sizes, gpipe, one_f_one_b
from .zero_bubble import dp_zero_bubble, dp_zero_bubble_2x

BUILDERS: Dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "dp-zb": dp_zero_bubble,
    "dp-zb-2x": dp_zero_bubble_2x,
}
COST_AWARE = {"dp-zb", "dp-zb-2x"}  # builders that place actions by simulated costs


def canonical_name(name: str) -> Optional[str]:
    """The builder's name for ``name`` ("DP_ZB" -> "dp-zb"), or None."""

    def key(text: str) -> str:
        return text.lower().replace("-", "").replace("_", "")

    return next((n for n in BUILDERS if key(n) == key(name)), None)


def build(name: str, stages: int, microbatches: int, costs: Optional[Mapping[Kind, float]] = None) -> Schedule:
    """The named schedule; ``costs`` (per action kind) guide the cost-aware builders (dp-zb)."""
    canonical = canonical_name(name)
    if canonical is None:
        raise ValueError(f"unknown schedule {name!r}: choose one of {sorted(BUILDERS)}")
    check_sizes(stages, microbatches)
    if canonical in COST_AWARE:
        return BUILDERS[canonical](stages, microbatches, costs)
    return BUILDERS[canonical](stages, microbatches)
