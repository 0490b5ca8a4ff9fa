"""Text (and PNG) timelines of a schedule, from the simulator."""

from __future__ import annotations

from typing import Dict, Optional

import schedules
from schedules import Kind

_CELL = 4


def parse_costs(text: str) -> Dict[Kind, float]:
    costs = {Kind.F: 1.0, Kind.I: 1.0, Kind.W: 1.0}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key.strip().upper() not in ("F", "I", "W") or not value:
            raise ValueError(f"bad cost {part!r}: use e.g. F=1,I=2,W=1")
        costs[Kind(key.strip().upper())] = float(value)
    return costs


def show(name: str, stages: int, microbatches: int, costs: str = "F=1,I=1,W=1", png: Optional[str] = None) -> str:
    table = parse_costs(costs)
    schedule = schedules.build(name, stages, microbatches, table)  # dp-zb places its W passes by these costs
    schedules.validate(schedule)
    result = schedules.simulate(schedule, table)
    unit = min(v for v in table.values() if v > 0)
    width = int(round(result.makespan / unit))
    lines = [f"{schedule.name}: {stages} stages, {microbatches} micro-batches, costs {costs}"]
    for s in range(stages):
        cells = ["." * (_CELL - 1) + " "] * width
        for start, end, action in result.timeline[s]:
            first, last = int(round(start / unit)), int(round(end / unit))
            for c in range(first, last):
                label = f"{action.kind.value}{action.microbatch}"
                cells[c] = (label if c == first else "~").ljust(_CELL - 1)[: _CELL - 1] + " "
        lines.append(f"stage {s} | " + "".join(cells).rstrip())
    lines.append(
        f"makespan {result.makespan:g} | bubble {result.bubble_fraction:.1%} "
        f"(GPipe/1F1B theory without W: {(stages - 1) / (microbatches + stages - 1):.1%}) | "
        f"peak in-flight per stage {result.peak_inflight} | peak DP captures held {result.peak_captured}"
    )
    if png:
        _draw(result, schedule, png)
        lines.append(f"timeline drawn to {png}")
    return "\n".join(lines)


def _draw(result, schedule, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("--png needs matplotlib: pip install 'pipedp[plot]'") from exc
    colours = {Kind.F: "#4c72b0", Kind.I: "#dd8452", Kind.W: "#55a868"}
    fig, ax = plt.subplots(figsize=(max(6, result.makespan * 0.35), 0.6 * schedule.stages + 1.2))
    for s, items in result.timeline.items():
        for start, end, a in items:
            ax.barh(s, end - start, left=start, color=colours[a.kind], edgecolor="white")
            ax.text(
                (start + end) / 2,
                s,
                f"{a.kind.value}{a.microbatch}",
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(range(schedule.stages), [f"stage {s}" for s in range(schedule.stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time (action cost units)")
    ax.set_title(f"{schedule.name}: bubble {result.bubble_fraction:.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
