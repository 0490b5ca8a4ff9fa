"""Runs one stage's action list through a dispatch table (action kind -> handler).

The executor owns the per-pass state of its stage (a ``PassState``: received tensors,
tensors waiting to be sent, norms waiting to be reduced, pending reductions); the stage
owns the model state. With the in-process transport, a handler whose input is not ready
raises WouldBlock before changing anything, and ``run`` returns so the driver can let
another stage progress.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from schedules import Action, Kind

from ..errors import UnsupportedModelError
from ..privacy.clipping import Clipping, clip_factors
from .microbatch import Activation, PassBatch, detached
from .protocols import PendingReduction, Transport, WouldBlock
from .stage import Stage


@dataclass
class PassState:
    """Everything one pass keeps between the actions of a stage, keyed by micro-batch id."""

    batch: PassBatch
    loss_sum: torch.Tensor  # float64 scalar on the batch's device
    dropped: torch.Tensor  # real rows left out for a non-finite norm (last stage), likewise
    received: Dict[int, Activation] = field(default_factory=dict)  # activations in
    outgoing: Dict[int, Activation] = field(default_factory=dict)  # activations out
    grads_in: Dict[int, Activation] = field(default_factory=dict)  # gradient messages
    grads_out: Dict[int, Activation] = field(default_factory=dict)
    norms: Dict[int, torch.Tensor] = field(default_factory=dict)  # this stage's, before the reduction
    tie_in: Dict[int, torch.Tensor] = field(default_factory=dict)  # tied head's message, travelling to stage 0
    tie_out: Dict[int, torch.Tensor] = field(default_factory=dict)
    reductions: Dict[int, PendingReduction] = field(default_factory=dict)


class LocalReduction:
    """Per-stage clipping needs no other stage's norms: the 'reduction' is the stage's own."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def wait(self) -> torch.Tensor:
        return self.value


class Executor:
    def __init__(
        self, stage: Stage, transport: Transport, actions: List[Action], clipping: Clipping, tied: bool = False
    ):
        """``tied``: the pipeline's first-stage embedding is tied to its last-stage head; the head's
        message for the cross term of the norms travels back with every gradient."""
        self.stage = stage
        self.tied = tied
        self.transport = transport
        self.actions = actions
        self.reduce_norms = clipping.across_stages
        if clipping.per_layer:  # one threshold per unit, in the stage's unit order: [units, 1]
            self.clip_norm = torch.tensor([[clipping.layer_norm(name)] for name in stage.units], dtype=torch.float64)
        else:
            self.clip_norm = torch.tensor(clipping.stage_norms[stage.index], dtype=torch.float64)
        self.handlers: Dict[Kind, Callable[[int], None]] = {
            Kind.F: self._forward,
            Kind.I: self._backward_input,
            Kind.W: self._weight,
            Kind.SEND_F: self._send_forward,
            Kind.RECV_F: self._recv_forward,
            Kind.SEND_B: self._send_backward,
            Kind.RECV_B: self._recv_backward,
            Kind.NORM_REDUCE: self._norm_reduce,
        }
        self.position = 0  # index of the next action to run
        self.state: Optional[PassState] = None  # None between passes

    def start_pass(self, batch: PassBatch) -> None:
        device = batch.masks[0].device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.state = PassState(batch, zero, zero.clone())
        self.position = 0

    @property
    def done(self) -> bool:
        return self.position >= len(self.actions)

    def totals(self) -> torch.Tensor:
        """float64 [2]: the sum of the last pass's real-row losses, and how many real rows were left
        out because their gradient norm was not finite (both counted on the last stage only)."""
        return torch.stack([self._pass.loss_sum, self._pass.dropped])

    @property
    def _pass(self) -> PassState:
        if self.state is None:
            raise RuntimeError("the executor has no pass: call start_pass first")
        return self.state

    def run(self) -> bool:
        """Run actions until the end (True) or until one would block (False)."""
        while not self.done:
            action = self.actions[self.position]
            try:
                self.handlers[action.kind](action.microbatch)
            except WouldBlock:
                return False
            self.position += 1
            if self.done:
                self.transport.finish_pass()
        return True

    # ---- handlers --------------------------------------------------------------------------
    def _forward(self, mb: int) -> None:
        state, stage = self._pass, self.stage
        inputs = state.batch.inputs[mb]
        x = inputs if stage.is_first else state.received.pop(mb)
        side = inputs if isinstance(inputs, dict) else None  # every stage sees its micro-batch's masks
        out = stage.forward(
            mb, x, state.batch.targets[mb] if stage.is_last else None, side, size=int(state.batch.masks[mb].shape[0])
        )
        if stage.is_last:
            real = state.batch.masks[mb] > 0
            state.loss_sum += torch.where(real, out.detach().to(torch.float64), 0.0).sum()
        else:
            state.outgoing[mb] = detached(out)

    def _backward_input(self, mb: int) -> None:
        state = self._pass
        grad = state.batch.masks[mb] if self.stage.is_last else state.grads_in.pop(mb)
        result = self.stage.backward(mb, grad)
        if result.input_grad is not None:
            state.grads_out[mb] = result.input_grad
        norms = result.squared_norms
        if self.tied:  # ||g_emb + g_head||^2 = ||g_emb||^2 + ||g_head||^2 + 2 <g_emb, g_head>
            if self.stage.is_last:
                state.tie_out[mb] = self.stage.tie_message(mb, _token_ids(state.batch.inputs[mb]))
            elif self.stage.is_first:
                cross = self.stage.tie_cross(mb, state.tie_in.pop(mb), _token_ids(state.batch.inputs[mb]))
                norms = norms + 2 * cross.to(norms.device)
            else:
                state.tie_out[mb] = state.tie_in.pop(mb)  # relayed towards stage 0
        state.norms[mb] = norms

    def _norm_reduce(self, mb: int) -> None:
        state = self._pass
        norms = state.norms.pop(mb)
        state.reductions[mb] = (
            self.transport.norm_reduce_start(mb, norms) if self.reduce_norms else LocalReduction(norms)
        )

    def _weight(self, mb: int) -> None:
        state = self._pass
        total = state.reductions[mb].wait()  # may raise WouldBlock: nothing changed yet
        del state.reductions[mb]
        mask = state.batch.masks[mb]
        total = total.to(mask.device)  # the stage's device (a distributed reduction comes back on the CPU)
        if self.reduce_norms and not self.stage.is_first:
            # every stage joined mb's reduction, the previous one after receiving our gradient of mb
            self.transport.release(Kind.SEND_B, mb)
        if self.stage.is_last:
            finite = torch.isfinite(total)
            finite = finite.all(0) if finite.dim() == 2 else finite  # per_layer: any layer's norm
            state.dropped += ((mask > 0) & ~finite).sum().to(torch.float64)
        self.stage.weight(mb, clip_factors(total, self.clip_norm.to(mask.device), mask))

    def _send_forward(self, mb: int) -> None:
        self.transport.send(Kind.SEND_F, mb, self._pass.outgoing.pop(mb))

    def _recv_forward(self, mb: int) -> None:
        self._pass.received[mb] = self.transport.recv(Kind.RECV_F, mb)

    def _send_backward(self, mb: int) -> None:
        self.transport.send(Kind.SEND_B, mb, self._pass.grads_out.pop(mb))
        if self.tied:
            self.transport.send(Kind.SEND_B, mb, self._pass.tie_out.pop(mb))

    def _recv_backward(self, mb: int) -> None:
        self._pass.grads_in[mb] = self.transport.recv(Kind.RECV_B, mb)
        if self.tied:  # sent right behind the gradient, so it is there too
            self._pass.tie_in[mb] = self.transport.recv(Kind.RECV_B, mb)
        # the next stage computed this gradient from our activation of mb: it has received it
        self.transport.release(Kind.SEND_F, mb)


def _token_ids(inputs) -> torch.Tensor:
    """The token ids the last stage builds the tie's message from: the micro-batch's input tensor, or
    its ``input_ids`` (the first stage checks that its tied embedding read exactly these)."""
    if not isinstance(inputs, dict):
        return inputs
    if "input_ids" not in inputs:
        raise UnsupportedModelError(
            f"an embedding tied to the head across stages needs the token ids as inputs['input_ids'] (the inputs "
            f"hold {sorted(inputs)}): name the ids input input_ids, or give the head its own weight"
        )
    return inputs["input_ids"]


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
