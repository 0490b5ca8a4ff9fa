"""A DP zero-bubble schedule: 1F1B's forwards and input-backwards, with the clipped weight passes
placed into the bubbles (ZB-H1-like, Qi et al. ICLR 2024).

In DP-SGD the W pass of micro-batch j can only run once j's per-sample norms are summed over
every stage, and stage 0 is the last to finish I(j): the deferrable W of zero-bubble
pipelining, which needs the norm reduction as its extra dependency. The builder lists each
stage's actions by simulating the pipeline with the given costs: at every moment each stage
runs, by priority, the next input-backward when its gradient has arrived, else the next
forward when its activation has arrived and the memory limits allow, else a W whose norms
are reduced — and when nothing else can run, the stage waits. So W fills the time a stage
would spend waiting. Limits: at most ``stages - s`` micro-batches between F and I on stage
s (1F1B's), and at most ``capture_limit`` between F and W (the DP captures a stage holds):
``stages`` for "dp-zb" (1F1B's memory), ``2 * stages`` for "dp-zb-2x" (more memory, fewer
bubbles). The order found is fixed data like any other schedule; with other real costs it
stays correct (every receive follows its send), only the timing differs.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional

from .actions import Action, Kind, Schedule
from .builders import backward_actions, forward_actions, one_f_one_b
from .simulator import simulate

DEFAULT_COSTS: Dict[Kind, float] = {Kind.F: 1.0, Kind.I: 1.0, Kind.W: 1.0}


def dp_zero_bubble(
    stages: int,
    microbatches: int,
    costs: Optional[Mapping[Kind, float]] = None,
    capture_factor: int = 1,
    name: str = "dp-zb",
) -> Schedule:
    """The greedy bubble-filling order, or 1F1B's lagged W placement where that simulates faster
    (greedy filling is myopic: a W started in a short gap can delay the critical path)."""
    cost = {**DEFAULT_COSTS, **dict(costs or {})}
    greedy = _greedy_fill(stages, microbatches, cost, capture_factor, name)
    lagged = one_f_one_b(stages, microbatches)
    if simulate(lagged, cost).makespan < simulate(greedy, cost).makespan:
        return Schedule(name, lagged.stages, lagged.microbatches, lagged.actions)
    return greedy


def _greedy_fill(
    stages: int, microbatches: int, cost: Mapping[Kind, float], capture_factor: int, name: str
) -> Schedule:
    p, m = stages, microbatches
    capture_limit = capture_factor * p
    plans = {s: _one_f_one_b_order(s, p, m, warmup=min(m, p - s + (capture_factor - 1) * (p - s))) for s in range(p)}
    position = [0] * p  # next entry of plans[s]
    clock = [0.0] * p
    held = [0] * p  # micro-batches forwarded and not yet W-passed (the DP captures)
    w_next = [0] * p  # W runs in micro-batch order
    arrival: Dict[tuple, float] = {}  # (stage, kind, j) -> when its input is there
    joined: Dict[int, List[float]] = {}
    reduced: Dict[int, float] = {}
    orders: Dict[int, List[Action]] = {s: [] for s in range(p)}

    def options(s: int):
        out = []
        if position[s] < len(plans[s]):
            kind, j = plans[s][position[s]]
            needs = (s > 0) if kind is Kind.F else (s < p - 1)
            ready = arrival.get((s, kind, j)) if needs else clock[s]
            if kind is Kind.F and held[s] >= capture_limit:
                ready = None  # a W must free a capture first
            if ready is not None:
                out.append((max(clock[s], ready), 0, kind, j))
        k = w_next[s]
        if k < m and k in reduced and any(a.kind is Kind.I and a.microbatch == k for a in orders[s]):
            out.append((max(clock[s], reduced[k]), 1, Kind.W, k))
        return out

    for _ in range(3 * p * m):
        candidates = [(start, prio, s, kind, j) for s in range(p) for start, prio, kind, j in options(s)]
        if not candidates:
            raise RuntimeError(f"{name}: no stage can run (p={p}, m={m})")
        # causality: the earliest start anywhere runs first; F or I before W when both can start
        start, _, s, kind, j = min(candidates, key=lambda c: (c[0], c[1], c[2]))
        end = start + cost[kind]
        clock[s] = end
        if kind is Kind.W:
            orders[s].append(Action(s, Kind.W, j))
            w_next[s] += 1
            held[s] -= 1
            continue
        position[s] += 1
        if kind is Kind.F:
            orders[s] += forward_actions(s, p, j)
            held[s] += 1
            if s < p - 1:
                arrival[(s + 1, Kind.F, j)] = end
        else:
            orders[s] += backward_actions(s, p, j)
            if s > 0:
                arrival[(s - 1, Kind.I, j)] = end
            joined.setdefault(j, []).append(end)
            if len(joined[j]) == p:
                reduced[j] = max(joined[j])
    return Schedule(name, p, m, orders)


def _one_f_one_b_order(s: int, p: int, m: int, warmup: int) -> List[tuple]:
    """(kind, j) of stage s's forwards and input-backwards: ``warmup`` forwards, then alternate."""
    order = [(Kind.F, j) for j in range(min(warmup, m))]
    next_f = len(order)
    for j in range(m):
        order.append((Kind.I, j))
        if next_f < m:
            order.append((Kind.F, next_f))
            next_f += 1
    return order


def dp_zero_bubble_2x(stages: int, microbatches: int, costs: Optional[Mapping[Kind, float]] = None) -> Schedule:
    return dp_zero_bubble(stages, microbatches, costs, capture_factor=2, name="dp-zb-2x")
