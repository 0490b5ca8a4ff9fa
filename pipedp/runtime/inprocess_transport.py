"""In-process transport: every stage in one process, messages in mailboxes.

Used for debugging and exact tests. It runs the same executor code as the multi-process
transport; an operation whose data is not there yet raises WouldBlock, and the driver
moves on to another stage and retries later.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Deque, Dict, Tuple

import torch

from schedules import CHANNEL_NAMES, Kind

from ..errors import TransportError
from .microbatch import Activation, detached
from .protocols import WouldBlock


class InProcessHub:
    def __init__(self, stages: int):
        self.stages = stages
        self.mailboxes: Dict[Tuple[int, int, int], Deque[Tuple[int, Activation]]] = defaultdict(deque)
        self.reductions: Dict[int, Dict[int, torch.Tensor]] = defaultdict(dict)

    def transport(self, stage: int) -> "InProcessTransport":
        return InProcessTransport(self, stage)

    def clear(self) -> None:
        """Forget every message and reduction (a failed pass)."""
        self.mailboxes.clear()
        self.reductions.clear()

    def end_pass(self) -> None:
        leftover = [k for k, box in self.mailboxes.items() if box]
        if leftover:
            raise TransportError(f"messages left unreceived after the pass (src, dst, channel): {leftover}")
        self.reductions.clear()


class InProcessReduction:
    def __init__(self, hub: InProcessHub, mb: int):
        self.hub, self.mb = hub, mb

    def wait(self) -> torch.Tensor:
        parts = self.hub.reductions[self.mb]
        if len(parts) < self.hub.stages:
            raise WouldBlock
        device = parts[0].device  # stages may sit on several devices
        return sum(parts[s].to(device) for s in range(self.hub.stages))


class InProcessTransport:
    def __init__(self, hub: InProcessHub, stage: int):
        self.hub, self.stage = hub, stage

    def send(self, kind: Kind, mb: int, message: Activation) -> None:
        dst = self.stage + kind.peer
        self.hub.mailboxes[(self.stage, dst, kind.channel)].append((mb, detached(message)))

    def recv(self, kind: Kind, mb: int) -> Activation:
        src = self.stage + kind.peer
        box = self.hub.mailboxes[(src, self.stage, kind.channel)]
        if not box:
            raise WouldBlock
        got_mb, message = box[0]
        if got_mb != mb:
            raise TransportError(
                f"stage {self.stage} expected the {CHANNEL_NAMES[kind.channel]} of micro-batch {mb} from stage {src}, "
                f"got micro-batch {got_mb}"
            )
        box.popleft()
        return message

    def norm_reduce_start(self, mb: int, squared_norms: torch.Tensor) -> InProcessReduction:
        parts = self.hub.reductions[mb]
        parts[self.stage] = squared_norms
        return InProcessReduction(self.hub, mb)

    def release(self, kind: Kind, mb: int) -> None:
        """Nothing is held for a send in one process."""

    def send_aborted(self, kind: Kind, mb: int) -> None:
        """Never needed: in one process a failed pass is dropped whole (InProcessRuntime.abort_step)."""
        raise TransportError("in one process a failed pass is dropped whole: there is no pass to drain")

    def finish_pass(self) -> None:
        """Nothing to wait for in one process; the hub checks and clears once all stages are done."""
