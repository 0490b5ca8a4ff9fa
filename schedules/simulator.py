"""Discrete-event simulator of a schedule: makespan, bubble fraction, peak in-flight.

Each stage runs its actions in order; an action starts when its stage is free and its
inputs exist: RECV_F(s, j) needs SEND_F(s-1, j), RECV_B(s, j) needs SEND_B(s+1, j), and
W(s, j) needs every stage to have issued NORM_REDUCE(j) (the collective completes when
its last member joins). The event graph is walked with a work list (p=64, m=512: about
2 s on this project's 2-core machine).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .actions import COMPUTE_KINDS, Action, Kind, Schedule

CostTable = Mapping[Kind, float]
Costs = Union[CostTable, Sequence[CostTable], Callable[[Action], float]]

DEFAULT_COSTS: Dict[Kind, float] = {Kind.F: 1.0, Kind.I: 1.0, Kind.W: 1.0}


class DeadlockError(RuntimeError):
    pass


@dataclass
class SimResult:
    makespan: float
    bubble_fraction: float
    peak_inflight: List[int]  # per stage: micro-batches forwarded and not yet backwarded (graphs held)
    peak_captured: List[int]  # per stage: micro-batches forwarded and not yet W-passed (DP captures held)
    busy: List[float]  # per stage: compute time
    timeline: Dict[int, List[Tuple[float, float, Action]]] = field(default_factory=dict)


def _cost_fn(costs: Optional[Costs]) -> Callable[[Action], float]:
    if costs is None:
        costs = DEFAULT_COSTS
    if callable(costs):
        return costs
    if isinstance(costs, Mapping):
        table = dict(costs)
        return lambda a: float(table.get(a.kind, 0.0))
    per_stage = [dict(c) for c in costs]
    return lambda a: float(per_stage[a.stage].get(a.kind, 0.0))


def _dependency(action: Action, stages: int) -> Optional[Tuple]:
    if action.kind is Kind.RECV_F:
        return ("send", Kind.SEND_F, action.stage - 1, action.microbatch)
    if action.kind is Kind.RECV_B:
        return ("send", Kind.SEND_B, action.stage + 1, action.microbatch)
    if action.kind is Kind.W:
        return ("reduce", action.microbatch)
    return None


def simulate(
    schedule: Schedule, costs: Optional[Costs] = None, comm_latency: float = 0.0, reduce_latency: float = 0.0
) -> SimResult:
    """``comm_latency``: from a send's end to its receive's earliest start; ``reduce_latency``: from
    the last stage joining a norm reduction to its result being there."""
    cost = _cost_fn(costs)
    p = schedule.stages
    position = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    event_time: Dict[Tuple, float] = {}
    reduce_joined: Dict[int, List[float]] = defaultdict(list)
    waiting: Dict[Tuple, List[int]] = defaultdict(list)
    timeline: Dict[int, List[Tuple[float, float, Action]]] = {s: [] for s in range(p)}
    inflight = [0] * p
    captured = [0] * p
    peak_inflight = [0] * p
    peak_captured = [0] * p

    ready = deque(range(p))
    queued = set(range(p))
    while ready:
        s = ready.popleft()
        queued.discard(s)
        acts = schedule.actions[s]
        while position[s] < len(acts):
            a = acts[position[s]]
            dep = _dependency(a, p)
            start = clock[s]
            if dep is not None:
                if dep not in event_time:
                    waiting[dep].append(s)
                    break
                start = max(start, event_time[dep] + (comm_latency if dep[0] == "send" else 0.0))
            duration = cost(a)
            end = start + duration
            clock[s] = end
            if a.kind in COMPUTE_KINDS:
                busy[s] += duration
                timeline[s].append((start, end, a))
            if a.kind is Kind.F:
                inflight[s] += 1
                captured[s] += 1
                peak_inflight[s] = max(peak_inflight[s], inflight[s])
                peak_captured[s] = max(peak_captured[s], captured[s])
            elif a.kind is Kind.I:
                inflight[s] -= 1
            elif a.kind is Kind.W:
                captured[s] -= 1
            fired: List[Tuple] = []
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                fired.append(("send", a.kind, s, a.microbatch))
                event_time[fired[-1]] = end
            elif a.kind is Kind.NORM_REDUCE:
                joined = reduce_joined[a.microbatch]
                joined.append(end)
                if len(joined) == p:
                    fired.append(("reduce", a.microbatch))
                    event_time[fired[-1]] = max(joined) + reduce_latency
            position[s] += 1
            for key in fired:
                for other in waiting.pop(key, []):
                    if other not in queued:
                        ready.append(other)
                        queued.add(other)

    stuck = [str(schedule.actions[s][position[s]]) for s in range(p) if position[s] < len(schedule.actions[s])]
    if stuck:
        raise DeadlockError(f"schedule {schedule.name!r} deadlocks: stages wait forever at {stuck}")
    makespan = max(clock) if p else 0.0
    total = makespan * p
    bubble = 1.0 - sum(busy) / total if total > 0 else 0.0
    return SimResult(makespan, bubble, peak_inflight, peak_captured, busy, timeline)
