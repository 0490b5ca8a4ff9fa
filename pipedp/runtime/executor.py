"""Runs one stage's action list through a dispatch table (action kind -> handler).

The executor owns the per-pass state of its stage (a ``PassState``: received tensors,
tensors waiting to be sent, norms waiting to be reduced, pending reductions); the stage
owns the model state. With the in-process transport, a handler whose input is not ready
raises WouldBlock before changing anything, and ``run`` returns so the driver can let
another stage progress.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch

from schedules import COMMUNICATION_KINDS, Action, Kind

from ..errors import UnsupportedModelError
from .microbatch import Activation, PassBatch, detached
from .protocols import PeerAborted, PendingReduction, Transport, WouldBlock
from .self_check import Probe
from .stage import Stage

# where a stage draws the step's noise into its clipped sums (noise.SumNoise), once: before its first receive, where a
# pipeline stage waits while its neighbour computes, or its first W if that comes first (a stage that receives
# nothing; a self-checked pass, slow anyway, whose reference gradients are freed by then): before every W, so every
# clipped sum starts as the noise
RECEIVES = frozenset({Kind.RECV_F, Kind.RECV_B})


@dataclass
class BackMessage:
    """What travels back to the previous stage for one micro-batch, on the gradient channel in this order: the
    gradient of its activation, the tie's message (an embedding tied to the head: runtime/tie.py) and, for the
    self-checked micro-batch, each checked row's own gradient message (runtime/self_check.py)."""

    grad: Activation
    tie: Optional[torch.Tensor] = None
    probes: Tuple[Activation, ...] = ()

    def messages(self) -> List[Activation]:
        return [self.grad, *([self.tie] if self.tie is not None else []), *self.probes]


@dataclass
class PassState:
    """Everything one pass keeps between the actions of a stage, keyed by micro-batch id."""

    batch: PassBatch
    loss_sum: torch.Tensor  # float64 scalar on the batch's device
    dropped: torch.Tensor  # real rows left out for a non-finite norm (last stage), likewise
    clipped: torch.Tensor  # real rows whose clip factor was below 1 (last stage), likewise
    evaluating: bool = False  # forward only, no capture, no gradient (pipedp's evaluation)
    probe: Optional[Probe] = None  # the self-check of micro-batch 0 (a new input signature)
    received: Dict[int, Activation] = field(default_factory=dict)  # activations in
    outgoing: Dict[int, Activation] = field(default_factory=dict)  # activations out
    back_in: Dict[int, BackMessage] = field(default_factory=dict)  # from the next stage
    back_out: Dict[int, BackMessage] = field(default_factory=dict)  # to the previous one
    norms: Dict[int, torch.Tensor] = field(default_factory=dict)  # this stage's, before the reduction
    reductions: Dict[int, PendingReduction] = field(default_factory=dict)


class LocalReduction:
    """Per-stage and per-layer clipping need no other stage's norms: the 'reduction' is the stage's own."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def wait(self) -> torch.Tensor:
        return self.value


class Executor:
    """One stage's actions over its passes; what travels back for a micro-batch is one ``BackMessage``."""

    def __init__(self, stage: Stage, transport: Transport, actions: List[Action]):
        self.stage = stage
        self.tie = stage.tie
        self.transport = transport
        self.actions = actions
        # flat clipping sums the norms over the stages; under tensor parallelism every clip rule sums the ranks'
        # parts (the transport's norm group says over whom: runtime/distributed.py)
        self.across_stages = stage.clip.rule.across_stages
        self.reduce_norms = self.across_stages or stage.tensor_parallel.size > 1
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
        # observer(executor, action): a context manager entered around every action (observe())
        self.observers: List[Callable[["Executor", Action], ContextManager[Any]]] = []
        self.position = 0  # index of the next action to run
        self.pass_actions = actions  # this pass's list: the schedule's, or evaluation's forward-only one
        self.state: Optional[PassState] = None  # None between passes
        self._values: Optional[Dict[str, tuple]] = None  # the state's digests at the start of a watched pass
        self._watched = False  # a pass's parameters were watched (the run's first are)
        self.unstarted = False  # the current action has not started (the pass's start or the noise's draw raised)
        self._with_parameters = False  # this pass's parameters are

    def start_pass(self, batch: PassBatch, actions: Optional[List[Action]] = None) -> None:
        """``actions``: another action list for this pass only (evaluation's forward-only one)."""
        evaluating = actions is not None
        self.state = None  # until this pass's is made, a failure cannot be drained (failed_communicating)
        self.pass_actions = actions if actions is not None else self.actions  # first: drain() runs them
        self.position, self.unstarted = 0, False
        zero = torch.zeros((), dtype=torch.float64, device=self.stage.device)
        self.state = PassState(batch, zero, zero.clone(), zero.clone(), evaluating=evaluating)
        # the first action has not started until the pass has: a failure before it (out of memory moving the batch,
        # probing, watching) drains the pass from action 0, whose receive still takes the peer's message
        self.unstarted = True
        batch = batch.to(self.stage.device)  # in one process, stages may sit on several devices
        probe = None if evaluating else self.stage.check.probe_for(batch.inputs[0], batch.masks[0])
        self.state = PassState(batch, zero, zero.clone(), zero.clone(), evaluating=evaluating, probe=probe)
        # every parameter's and buffer's version and every buffer's digest around each pass; the parameters'
        # digests too at a checked pass and at the run's first (state_watch.py)
        self._with_parameters = not evaluating and (probe is not None or not self._watched)
        self._values = None if evaluating else self.stage.watch_values(self._with_parameters)
        self._watched = self._watched or self._with_parameters
        self.unstarted = False

    def end_pass(self) -> None:
        """Every stage finished the pass: refuse it if it changed the model's state (a watched pass)."""
        if self._values is not None:
            values, self._values = self._values, None
            self.stage.refuse_changed_values(values, self._with_parameters)

    @property
    def done(self) -> bool:
        return self.position >= len(self.pass_actions)

    def totals(self) -> torch.Tensor:
        """float64 [4]: the sum of the last pass's real-row losses, how many real privacy units were left
        out because their gradient norm was not finite, and how many were clipped (clip factor < 1), all
        counted on the last stage only; and 1 where this stage's self-check of the pass was inconclusive
        (the sum over every stage decides: StageCheck.conclude)."""
        state = self._pass
        inconclusive = state.probe is not None and not self.stage.check.conclusive
        flag = torch.tensor(float(inconclusive), dtype=torch.float64, device=state.loss_sum.device)
        return torch.stack([state.loss_sum, state.dropped, state.clipped, flag])

    @property
    def _pass(self) -> PassState:
        if self.state is None:
            raise RuntimeError("the executor has no pass: call start_pass first")
        return self.state

    def observe(self, observer: Callable[["Executor", Action], ContextManager[Any]]) -> None:
        """Enter ``observer(self, action)``, a context manager, around every action this executor runs from now on
        (the memory planner counts each action's bytes with it: pipedp/planner/simulate.py). An action that would
        block leaves it with WouldBlock, before it changed anything."""
        self.observers.append(observer)

    def run(self) -> bool:
        """Run actions until the end (True) or until one would block (False)."""
        while not self.done:
            action = self.pass_actions[self.position]
            try:
                if self.observers:
                    with contextlib.ExitStack() as around:
                        for observer in self.observers:
                            around.enter_context(observer(self, action))
                        self._act(action)
                else:
                    self._act(action)
            except WouldBlock:
                return False
            self.position += 1
            if self.done:
                self.transport.finish_pass()
        return True

    def _act(self, action: Action) -> None:
        state = self._pass
        if action.kind is Kind.W or (action.kind in RECEIVES and state.probe is None and not state.evaluating):
            self.unstarted = True  # (RECEIVES: why) a draw that fails (out of memory) fails before the action
            self.stage.draw_noise()
        self.unstarted = False
        self.handlers[action.kind](action.microbatch)

    @property
    def failed_communicating(self) -> bool:
        """Whether the action that raised sends or receives (part of its message may be out), or the pass failed
        before its state was made: not drainable."""
        if self.state is None:
            return True
        return not self.done and not self.unstarted and self.pass_actions[self.position].kind in COMMUNICATION_KINDS

    def drain(self, received_abort: bool = False) -> None:
        """This pass failed (here, or on a peer: ``received_abort``, the current receive got its abort
        header): run the rest of the pass's communication, with no computation, so every stage ends the
        pass in step and no message is left in flight. Each send is an abort header (PeerAborted at the
        receiver), each receive takes what the peer sends (a message, or its abort header), and each norm
        reduction is joined (NaN where this stage has no norms). The failed action itself is skipped, unless it had
        not started (``unstarted``: the pass's start or the noise's draw raised before it); after ``received_abort``
        only the rest of its receive's action is run."""
        state = self._pass
        position = self.position
        if received_abort:
            action = self.pass_actions[position]
            self._drain_action(action.kind, action.microbatch, received_abort=True)
        # the failed action itself is skipped, unless it failed before it started (start_pass, Executor._act)
        for action in self.pass_actions[position if self.unstarted else position + 1 :]:
            self._drain_action(action.kind, action.microbatch)
        self.unstarted = False
        self.position = len(self.pass_actions)
        self.transport.finish_pass()
        state.reductions.clear()

    def _drain_action(self, kind: Kind, mb: int, received_abort: bool = False) -> None:
        state, transport = self._pass, self.transport
        if kind in (Kind.SEND_F, Kind.SEND_B):
            transport.send_aborted(kind, mb)
        elif kind is Kind.RECV_F and not received_abort:
            self._receive_or_abort(Kind.RECV_F, mb, 1)
        elif kind is Kind.RECV_B:
            if not received_abort:  # the whole BackMessage (as _recv_backward)
                tied, probes = self._behind(mb)
                self._receive_or_abort(Kind.RECV_B, mb, 1 + int(tied) + probes)
            transport.release(Kind.SEND_F, mb)
        elif kind is Kind.NORM_REDUCE and self.reduce_norms:
            norms = state.norms.pop(mb, None)
            if norms is None:
                rows = int(state.batch.masks[mb].shape[0])
                norms = torch.full((rows,), math.nan, dtype=torch.float64, device=self.stage.device)
            state.reductions[mb] = transport.norm_reduce_start(mb, norms)
        elif kind is Kind.W:
            if mb in state.reductions:
                state.reductions.pop(mb).wait()
            if self.across_stages and not self.stage.is_first:  # as _weight: the previous stage joined it
                transport.release(Kind.SEND_B, mb)

    def _receive_or_abort(self, kind: Kind, mb: int, messages: int) -> None:
        """Take the ``messages`` of one receive action, or its abort header (then nothing more follows)."""
        for _ in range(messages):
            try:
                self.transport.recv(kind, mb)
            except PeerAborted:
                return

    def _behind(self, mb: int) -> Tuple[bool, int]:
        """What follows micro-batch ``mb``'s gradient: the tie's message (or not), and how many probes."""
        state = self._pass
        return self.tie is not None, len(state.probe.units) if mb == 0 and state.probe is not None else 0

    def _here(self, message: Activation) -> Activation:
        """A message from a stage on another device (one process), on this stage's device."""
        return _moved(message, self.stage.device)

    # ---- handlers --------------------------------------------------------------------------
    def _forward(self, mb: int) -> None:
        state, stage = self._pass, self.stage
        inputs = state.batch.inputs[mb]
        x = inputs if stage.is_first else state.received.pop(mb)
        side = inputs if isinstance(inputs, dict) else None  # every stage sees its micro-batch's masks
        targets, size = state.batch.targets[mb] if stage.is_last else None, int(state.batch.masks[mb].shape[0])
        if state.evaluating:
            out = stage.evaluate(x, targets, side, size)
        else:
            # every micro-batch (a dict of versions: no cost), self-checked or not
            units = state.probe.units if mb == 0 and state.probe is not None else ()
            out = stage.forward(mb, x, targets, side, size=size, check_state=True, probe_units=units)
            if units:  # the checked micro-batch: each unit alone must give its rows of the output
                stage.check.refuse_mixed_samples(x, targets, side, size, units)
        if stage.is_last:
            real = state.batch.masks[mb] > 0
            state.loss_sum += torch.where(real, out.detach().to(torch.float64), 0.0).sum()
        else:
            state.outgoing[mb] = detached(out)

    def _backward_input(self, mb: int) -> None:
        state = self._pass
        incoming = None if self.stage.is_last else state.back_in.pop(mb)
        grad = state.batch.masks[mb] if incoming is None else incoming.grad
        probe = None
        if mb == 0 and state.probe is not None:
            probe = Probe(state.probe.units, incoming.probes if incoming is not None else ())
        result = self.stage.backward_input(mb, grad, probe)
        norms, tie = result.squared_norms, None
        if self.tie is not None:  # ||g_emb + g_head||^2 = ||g_emb||^2 + ||g_head||^2 + 2 <g_emb, g_head>
            norms, tie = self.tie.after_backward(
                self.stage.pending[mb],
                _token_ids(state.batch.inputs[mb]),
                norms,
                incoming.tie if incoming is not None else None,
            )
        if result.input_grad is not None:  # (the first stage sends nothing back)
            state.back_out[mb] = BackMessage(result.input_grad, tie, result.probe_messages if probe else ())
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
        if self.across_stages and not self.stage.is_first:
            # every stage joined mb's reduction, the previous one after receiving our gradient of mb
            self.transport.release(Kind.SEND_B, mb)
        clip, units = self.stage.clip, self.stage.units
        unit_mask = units.mask(mask)
        factors = clip.factors(total, unit_mask)
        if self.stage.is_last:
            real, finite = unit_mask > 0, ~clip.rows(~torch.isfinite(total))
            state.dropped += (real & ~finite).sum().to(torch.float64)
            state.clipped += (real & finite & clip.rows(factors < 1)).sum().to(torch.float64)
        self.stage.weight(mb, factors)

    def _send_forward(self, mb: int) -> None:
        self.transport.send(Kind.SEND_F, mb, self._pass.outgoing.pop(mb))

    def _recv_forward(self, mb: int) -> None:
        self._pass.received[mb] = self._here(self.transport.recv(Kind.RECV_F, mb))

    def _send_backward(self, mb: int) -> None:
        for message in self._pass.back_out.pop(mb).messages():
            self.transport.send(Kind.SEND_B, mb, message)

    def _recv_backward(self, mb: int) -> None:
        tied, probes = self._behind(mb)
        grad = self._here(self.transport.recv(Kind.RECV_B, mb))  # may raise WouldBlock: nothing changed yet
        # what follows the gradient was sent right behind it, so it is there too
        tie = self._here(self.transport.recv(Kind.RECV_B, mb)) if tied else None
        self._pass.back_in[mb] = BackMessage(
            grad, tie, tuple(self._here(self.transport.recv(Kind.RECV_B, mb)) for _ in range(probes))
        )
        # the next stage computed this gradient from our activation of mb: it has received it
        self.transport.release(Kind.SEND_F, mb)


def _moved(value: Activation, device: torch.device) -> Activation:
    if isinstance(value, tuple):
        return tuple(t.to(device) for t in value)
    return value.to(device)


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
            stuck = [str(e.pass_actions[e.position]) for e in executors if not e.done]
            raise RuntimeError(f"in-process pipeline deadlocked at {stuck}")
