"""Runs one stage's action list through a dispatch table (action kind -> handler).

The executor owns the per-pass state of its stage (received tensors, tensors waiting to
be sent, pending norm reductions); the stage owns the model state. With the in-process
transport, a handler whose input is not ready raises WouldBlock before changing anything,
and ``run`` returns so the driver can let another stage progress.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from schedules import Action, Kind

from .microbatch import PassBatch
from .privacy import Clipping, clip_factors
from .stage import Stage
from .transport import WouldBlock


class Executor:
    def __init__(self, stage: Stage, transport, actions: List[Action], clipping: Clipping):
        self.stage = stage
        self.transport = transport
        self.actions = actions
        self.clip_norm = clipping.stage_norms[stage.index]
        self.reduce_norms = clipping.across_stages
        self.handlers: Dict[Kind, Callable[[int], None]] = {
            Kind.F: self._forward,
            Kind.B: self._backward,
            Kind.W: self._weight,
            Kind.SEND_F: self._send_forward,
            Kind.RECV_F: self._recv_forward,
            Kind.SEND_B: self._send_backward,
            Kind.RECV_B: self._recv_backward,
            Kind.NORM_REDUCE: self._norm_reduce,
        }
        self._position = 0
        self._finished = True
        self._batch: Optional[PassBatch] = None

    def start_pass(self, batch: PassBatch) -> None:
        self._batch = batch
        self._position = 0
        self._finished = False
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self._received: Dict[int, torch.Tensor] = {}
        self._outgoing: Dict[int, torch.Tensor] = {}
        self._grads_in: Dict[int, torch.Tensor] = {}
        self._grads_out: Dict[int, torch.Tensor] = {}
        self._reductions: Dict[int, object] = {}

    @property
    def position(self) -> int:
        """Index of the next action to run."""
        return self._position

    @property
    def done(self) -> bool:
        return self._position >= len(self.actions)

    def run(self) -> bool:
        """Run actions until the end (True) or until one would block (False)."""
        if self._finished:
            return True
        while not self.done:
            action = self.actions[self._position]
            try:
                self.handlers[action.kind](action.microbatch)
            except WouldBlock:
                return False
            self._position += 1
        self.transport.finish_pass()
        self._finished = True
        return True

    # ---- handlers --------------------------------------------------------------------------
    def _forward(self, mb: int) -> None:
        b = self._batch
        x = b.inputs[mb] if self.stage.is_first else self._received.pop(mb)
        out = self.stage.forward(mb, x, b.targets[mb] if self.stage.is_last else None)
        if self.stage.is_last:
            self.loss_sum += (out.detach().to(torch.float64) * b.masks[mb].to(torch.float64)).sum()
        else:
            self._outgoing[mb] = out.detach()

    def _backward(self, mb: int) -> None:
        grad = self._batch.masks[mb] if self.stage.is_last else self._grads_in.pop(mb)
        input_grad = self.stage.backward(mb, grad)
        if not self.stage.is_first:
            self._grads_out[mb] = input_grad

    def _norm_reduce(self, mb: int) -> None:
        norms = self.stage.pending[mb].squared_norms
        # per-stage clipping needs no other stage's norms: the "reduction" is this stage's own
        self._reductions[mb] = self.transport.norm_reduce_start(mb, norms) if self.reduce_norms else _Local(norms)

    def _weight(self, mb: int) -> None:
        total = self._reductions[mb].wait()  # may raise WouldBlock: nothing changed yet
        del self._reductions[mb]
        self.stage.weight(mb, clip_factors(total, self.clip_norm, self._batch.masks[mb]))

    def _send_forward(self, mb: int) -> None:
        self.transport.send(Kind.SEND_F, mb, self._outgoing.pop(mb))

    def _recv_forward(self, mb: int) -> None:
        self._received[mb] = self.transport.recv(Kind.RECV_F, mb)

    def _send_backward(self, mb: int) -> None:
        self.transport.send(Kind.SEND_B, mb, self._grads_out.pop(mb))

    def _recv_backward(self, mb: int) -> None:
        self._grads_in[mb] = self.transport.recv(Kind.RECV_B, mb)


class _Local:
    def __init__(self, value: torch.Tensor):
        self.value = value

    def wait(self) -> torch.Tensor:
        return self.value


def run_in_process(executors: List[Executor]) -> None:
    """Round-robin the stages until all finish; no progress in a full round is a deadlock."""
    while True:
        before = [e.position for e in executors]
        finished = [e.run() for e in executors]
        if all(finished):
            return
        if [e.position for e in executors] == before:
            stuck = [str(e.actions[e.position]) for e in executors if not e.done]
            raise RuntimeError(f"in-process pipeline deadlocked at {stuck}")
