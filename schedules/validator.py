"""Schedule validator: the structural rules a DP pipeline schedule must obey.

Per stage and micro-batch j: one each of F, I, NORM_REDUCE and W, ordered
RECV_F < F < SEND_F, RECV_B < I < SEND_B, F < I < NORM_REDUCE < W (no clip before the
norms of every stage are summed). Across stages: every send has its receive, point-to-point
messages arrive in the order they were sent, every stage joins the norm collectives in
the same order, and the whole schedule runs to the end (checked by simulation).
"""

from __future__ import annotations

from collections import Counter
from typing import List

from .actions import Kind, Schedule
from .simulator import DeadlockError, simulate


class ScheduleError(ValueError):
    def __init__(self, name: str, problems: List[str]):
        self.problems = problems
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(f"schedule {name!r} is invalid:\n  {shown}{more}")


def _expected_kinds(stage: int, stages: int) -> List[Kind]:
    kinds = [Kind.F, Kind.I, Kind.NORM_REDUCE, Kind.W]
    if stage > 0:
        kinds += [Kind.RECV_F, Kind.SEND_B]
    if stage < stages - 1:
        kinds += [Kind.SEND_F, Kind.RECV_B]
    return kinds


_ORDER = [
    (Kind.RECV_F, Kind.F),
    (Kind.F, Kind.SEND_F),
    (Kind.RECV_B, Kind.I),
    (Kind.I, Kind.SEND_B),
    (Kind.F, Kind.I),
    (Kind.I, Kind.NORM_REDUCE),
    (Kind.NORM_REDUCE, Kind.W),
]


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError listing every broken rule; return None when the schedule is sound."""
    p, m = schedule.stages, schedule.microbatches
    problems: List[str] = []
    if sorted(schedule.actions) != list(range(p)):
        raise ScheduleError(schedule.name, [f"expected stages 0..{p - 1}, got {sorted(schedule.actions)}"])

    for s in range(p):
        acts = schedule.actions[s]
        for a in acts:
            if a.stage != s:
                problems.append(f"action {a} is listed on stage {s}")
            if not 0 <= a.microbatch < m:
                problems.append(f"action {a}: micro-batch out of range 0..{m - 1}")
        counts = Counter((a.kind, a.microbatch) for a in acts)
        expected = _expected_kinds(s, p)
        for kind in Kind:
            for j in range(m):
                want = 1 if kind in expected else 0
                if counts[(kind, j)] != want:
                    problems.append(
                        f"stage {s}: {kind.value} of micro-batch {j} appears {counts[(kind, j)]} times, expected {want}"
                    )
        index = {(a.kind, a.microbatch): i for i, a in enumerate(acts)}
        for before, after in _ORDER:
            for j in range(m):
                if (before, j) in index and (after, j) in index and index[(before, j)] > index[(after, j)]:
                    problems.append(f"stage {s}: {s}{after.value}{j} comes before {s}{before.value}{j}")

    for s in range(p - 1):
        sends = [a.microbatch for a in schedule.actions[s] if a.kind is Kind.SEND_F]
        recvs = [a.microbatch for a in schedule.actions[s + 1] if a.kind is Kind.RECV_F]
        if sends != recvs:
            problems.append(f"activations {s}->{s + 1}: sent in order {sends}, received in order {recvs}")
        sends = [a.microbatch for a in schedule.actions[s + 1] if a.kind is Kind.SEND_B]
        recvs = [a.microbatch for a in schedule.actions[s] if a.kind is Kind.RECV_B]
        if sends != recvs:
            problems.append(f"gradients {s + 1}->{s}: sent in order {sends}, received in order {recvs}")

    orders = {s: [a.microbatch for a in schedule.actions[s] if a.kind is Kind.NORM_REDUCE] for s in range(p)}
    for s in range(1, p):
        if orders[s] != orders[0]:
            problems.append(f"NORM_REDUCE order differs: stage 0 {orders[0]}, stage {s} {orders[s]}")

    if not problems:
        try:
            simulate(schedule)
        except DeadlockError as exc:
            problems.append(str(exc))
    if problems:
        raise ScheduleError(schedule.name, problems)
