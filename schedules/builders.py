"""Schedule builders: GPipe and 1F1B, with DP actions (per-micro-batch norm reduce, W pass).

Each stage's list holds, per micro-batch ``j``: RECV_F, F, SEND_F (forward), RECV_B, I,
SEND_B (backward to the stage input only), NORM_REDUCE (sum of the per-sample squared
norms over the stages, a collective that every stage issues in micro-batch order) and W
(the clipped weight gradient, which needs the reduced norms).

Where W goes: stage 0 is the last to finish I(j), so the reduced norms of j are ready on
stage k at about the time it finishes I(j + k). W(j) is placed right after the backward
block (RECV_B, I, SEND_B, NORM_REDUCE) of micro-batch j + k, or at the end of the pass:
the captures stage k holds stay bounded by its in-flight micro-batches plus k, and W
rarely waits for the collective in the steady state. Any placement after NORM_REDUCE(j)
is correct; this one is fast.
"""

from __future__ import annotations

from typing import Dict, List

from .actions import Action, Kind, Schedule


def forward_actions(stage: int, stages: int, mb: int) -> List[Action]:
    acts = []
    if stage > 0:
        acts.append(Action(stage, Kind.RECV_F, mb))
    acts.append(Action(stage, Kind.F, mb))
    if stage < stages - 1:
        acts.append(Action(stage, Kind.SEND_F, mb))
    return acts


def forward_only(stages: int, microbatches: int) -> Schedule:
    """Evaluation: every micro-batch forward through every stage, nothing backward."""
    actions = {s: [a for mb in range(microbatches) for a in forward_actions(s, stages, mb)] for s in range(stages)}
    return Schedule("forward", stages, microbatches, actions)


def backward_actions(stage: int, stages: int, mb: int) -> List[Action]:
    acts = []
    if stage < stages - 1:
        acts.append(Action(stage, Kind.RECV_B, mb))
    acts.append(Action(stage, Kind.I, mb))
    if stage > 0:
        acts.append(Action(stage, Kind.SEND_B, mb))
    acts.append(Action(stage, Kind.NORM_REDUCE, mb))
    return acts


def _with_weight_passes(stage: int, microbatches: int, backward_order: List[List[Action]]) -> List[Action]:
    """Insert W(j) after the backward block of micro-batch j + stage (or at the end of the pass)."""
    lag = stage
    out: List[Action] = []
    next_w = 0
    for block in backward_order:
        out.extend(block)
        b_mb = next(a.microbatch for a in block if a.kind is Kind.I) if any(a.kind is Kind.I for a in block) else None
        if b_mb is None:
            continue
        while next_w < microbatches and next_w + lag <= b_mb:
            out.append(Action(stage, Kind.W, next_w))
            next_w += 1
    out.extend(Action(stage, Kind.W, j) for j in range(next_w, microbatches))
    return out


def check_sizes(stages: int, microbatches: int) -> None:
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (GPipe): every stage holds all m micro-batches."""
    check_sizes(stages, microbatches)
    actions: Dict[int, List[Action]] = {}
    for s in range(stages):
        blocks = [forward_actions(s, stages, j) for j in range(microbatches)]
        blocks += [backward_actions(s, stages, j) for j in range(microbatches)]
        actions[s] = _with_weight_passes(s, microbatches, blocks)
    return Schedule("gpipe", stages, microbatches, actions)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B: stage s warms up with (stages - s) forwards, then alternates B and F, then drains.

    Stage s holds at most stages - s micro-batches' autograd graphs at once.
    """
    check_sizes(stages, microbatches)
    actions: Dict[int, List[Action]] = {}
    for s in range(stages):
        warmup = min(stages - s, microbatches)
        blocks = [forward_actions(s, stages, j) for j in range(warmup)]
        next_f, next_b = warmup, 0
        while next_b < microbatches:
            blocks.append(backward_actions(s, stages, next_b))
            next_b += 1
            if next_f < microbatches:
                blocks.append(forward_actions(s, stages, next_f))
                next_f += 1
        actions[s] = _with_weight_passes(s, microbatches, blocks)
    return Schedule("1f1b", stages, microbatches, actions)
