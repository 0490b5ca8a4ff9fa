"""Typed pipeline actions and their text form.

An action is one unit of work on one stage: ``Action(stage=1, kind=F, microbatch=3)``
prints as ``"1F3"``. A schedule is, for each stage, the ordered list of its actions.
The text form follows torch.distributed.pipelining's: F forward, I backward to the input
only, W weight gradient (here: the clipped one), SEND_F / RECV_F / SEND_B / RECV_B;
NORM_REDUCE is pipedp's own. Everything here is plain data: no torch, no processes.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Dict, List, Optional


class Kind(enum.Enum):
    F = "F"  # forward of one micro-batch, capturing what per-sample gradients need
    I = "I"  # noqa: E741 -- backward to the stage input only (torch's I), plus this stage's per-sample squared norms
    W = "W"  # clipped weight gradient, from stored (activations, clip * output-grads)
    SEND_F = "SEND_F"  # send the forward activation to the next stage
    RECV_F = "RECV_F"  # receive the forward activation from the previous stage
    SEND_B = "SEND_B"  # send the input gradient to the previous stage
    RECV_B = "RECV_B"  # receive the output gradient from the next stage
    NORM_REDUCE = "NORM_REDUCE"  # sum one micro-batch's per-sample norms over all stages

    @property
    def channel(self) -> int:
        """A communication's channel: ACTIVATIONS (forward) or GRADIENTS (backward); a compute kind has none."""
        if self not in _LINKS:
            raise ValueError(f"{self.value} is not a communication: it has no channel")
        return _LINKS[self][0]

    @property
    def peer(self) -> int:
        """A communication's peer, as an offset in stages: +1 the next stage, -1 the previous one."""
        if self not in _LINKS:
            raise ValueError(f"{self.value} is not a communication: it has no peer")
        return _LINKS[self][1]


ACTIVATIONS, GRADIENTS = 0, 1
CHANNEL_NAMES = ("activation", "gradient")
# (channel, peer) of each communication: activations go forward, gradients back
_LINKS = {
    Kind.SEND_F: (ACTIVATIONS, +1),
    Kind.RECV_F: (ACTIVATIONS, -1),
    Kind.SEND_B: (GRADIENTS, -1),
    Kind.RECV_B: (GRADIENTS, +1),
}
COMMUNICATION_KINDS = frozenset(_LINKS)

COMPUTE_KINDS = frozenset({Kind.F, Kind.I, Kind.W})

_TEXT = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|NORM_REDUCE|F|I|W)(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @staticmethod
    def parse(text: str) -> "Action":
        match = _TEXT.match(text.strip())
        if not match:
            raise ValueError(f"cannot parse action {text!r}: expected STAGE KIND MICROBATCH, e.g. '1F3' or '0SEND_B2'")
        return Action(int(match.group(1)), Kind(match.group(2)), int(match.group(3)))


@dataclass(frozen=True)
class Schedule:
    """A named per-stage list of actions for ``stages`` stages and ``microbatches`` micro-batches."""

    name: str
    stages: int
    microbatches: int
    actions: Dict[int, List[Action]]

    def for_stage(self, stage: int) -> List[Action]:
        return self.actions[stage]

    def to_text(self) -> str:
        return "\n".join(f"stage {s}: " + " ".join(str(a) for a in self.actions[s]) for s in range(self.stages))

    @staticmethod
    def from_text(name: str, text: str, microbatches: Optional[int] = None) -> "Schedule":
        actions: Dict[int, List[Action]] = {}
        for line in text.strip().splitlines():
            head, _, body = line.partition(":")
            stage = int(head.replace("stage", "").strip())
            actions[stage] = [Action.parse(tok) for tok in body.split()]
        if microbatches is None:
            microbatches = 1 + max((a.microbatch for acts in actions.values() for a in acts), default=0)
        return Schedule(name, len(actions), microbatches, actions)
