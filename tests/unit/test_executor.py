"""Milliseconds: the executor against a fake stage and a fake transport — which handler each action runs,
and what travels behind a gradient (the tie's message, then the self-check's probes)."""

from types import SimpleNamespace

import torch

from pipedp.privacy.clipping import ClipRule
from pipedp.privacy.units import Units
from pipedp.runtime.executor import Executor
from pipedp.runtime.microbatch import make_pass
from pipedp.runtime.self_check import Probe
from pipedp.runtime.stage import BackwardResult
from schedules import Action, Kind


class FakeCheck:
    """The stage's self-check half: plans the fake stage's probe rows, records the alone-forward."""

    conclusive = True

    def __init__(self, stage):
        self.stage = stage

    def probe_for(self, inputs, mask):
        return Probe(self.stage.probe_units) if self.stage.probe_units else None

    def refuse_mixed_samples(self, x, targets, side, size, rows):
        self.stage.calls.append("alone")


class FakeStage:
    """A middle stage: forward doubles, backward returns fixed norms; records what it was asked."""

    def __init__(self, probe_units=()):
        self.is_first, self.is_last, self.index = False, False, 1
        self.tie, self.units, self.device = None, Units(), torch.device("cpu")
        self.clip = ClipRule.make("flat", 1.0, 3).for_stage(1, [])
        self.calls, self.pending, self.probe_units = [], {}, probe_units
        self.check = FakeCheck(self)

    def watch_values(self, parameters=True):
        self.calls.append("watch")
        return {}

    def refuse_changed_values(self, before, parameters=True):
        self.calls.append("values compared")

    def forward(self, mb, x, targets, side, size, check_state=False, probe_units=()):
        self.calls.append(("F", mb, check_state))
        return 2 * x

    def backward_input(self, mb, grad, probe=None):
        self.calls.append(("I", mb, probe))
        messages = tuple(torch.full((2, 1), float(r)) for r in probe.units) if probe else ()
        return BackwardResult(grad * 3, torch.ones(2, dtype=torch.float64), messages)

    def weight(self, mb, factors):
        self.calls.append(("W", mb, factors.tolist()))

    def draw_noise(self):  # (when the real stage draws, once: tests/numerics/test_noise.py)
        pass


class FakeTransport:
    def __init__(self, inbox):
        self.inbox, self.sent, self.reduced = inbox, [], []

    def send(self, kind, mb, message):
        self.sent.append((kind, mb, message))

    def recv(self, kind, mb):
        return self.inbox[(kind, mb)].pop(0)

    def norm_reduce_start(self, mb, norms):
        self.reduced.append(mb)
        return SimpleNamespace(wait=lambda: norms * 4)  # the other stages' norms: 3 more of 1 each

    def release(self, kind, mb):
        pass

    def finish_pass(self):
        pass


def actions(mb):
    kinds = [Kind.RECV_F, Kind.F, Kind.SEND_F, Kind.RECV_B, Kind.I, Kind.SEND_B, Kind.NORM_REDUCE, Kind.W]
    return [Action(1, kind, mb) for kind in kinds]


def test_a_middle_stage_runs_its_actions_and_sends_probes_behind_the_gradient():
    stage = FakeStage(probe_units=(0, 1))
    inbox = {
        (Kind.RECV_F, 0): [torch.ones(2, 1)],
        (Kind.RECV_B, 0): [torch.ones(2, 1), torch.zeros(2, 1), torch.zeros(2, 1)],  # gradient, then 2 probes
    }
    transport = FakeTransport(inbox)
    executor = Executor(stage, transport, actions(0))
    executor.start_pass(make_pass(torch.zeros(2, 1), torch.zeros(2), microbatches=1, size=2))
    assert executor.run()
    executor.end_pass()
    # a checked pass: the state's values are compared around it
    assert [c[0] if isinstance(c, tuple) else c for c in stage.calls] == [
        "watch",
        "F",
        "alone",
        "I",
        "W",
        "values compared",
    ]
    stage.calls = [c for c in stage.calls[1:] if c != "alone"]
    assert stage.calls[0][2] is True  # every micro-batch's versions are watched
    assert stage.calls[1][2].units == (0, 1) and len(stage.calls[1][2].messages) == 2
    assert executor.totals()[3] == 0  # the fake's check was conclusive
    sent = [(kind, message) for kind, _, message in transport.sent]
    assert sent[0][0] is Kind.SEND_F and torch.equal(sent[0][1], 2 * torch.ones(2, 1))
    assert [k for k, _ in sent[1:]] == [Kind.SEND_B] * 3  # the gradient, then one probe per checked row
    assert torch.equal(sent[1][1], 3 * torch.ones(2, 1)) and float(sent[3][1][0]) == 1.0
    assert transport.reduced == [0]
    clip = 1.0 / (2.0 + 1e-6)  # norms 1 here, summed to 4 over the pipeline: clipped to C = 1
    assert stage.calls[2][2] == [clip, clip]


def test_without_a_probe_nothing_travels_behind_the_gradient():
    stage = FakeStage()
    transport = FakeTransport({(Kind.RECV_F, 0): [torch.ones(2, 1)], (Kind.RECV_B, 0): [torch.ones(2, 1)]})
    executor = Executor(stage, transport, actions(0))
    executor.start_pass(make_pass(torch.zeros(2, 1), torch.zeros(2), microbatches=1, size=2))
    assert executor.run()
    assert len([s for s in transport.sent if s[0] is Kind.SEND_B]) == 1


def test_an_observer_sees_every_action_that_runs_and_none_that_would_block():
    """Executor.observe (the memory planner's hook): entered around each action, left by WouldBlock before it ran."""
    from contextlib import contextmanager

    from pipedp.runtime.protocols import WouldBlock

    class Blocking(FakeTransport):
        def recv(self, kind, mb):
            if not self.inbox[(kind, mb)]:
                raise WouldBlock()
            return super().recv(kind, mb)

    seen = []

    @contextmanager
    def observer(executor, action):
        seen.append(("enter", action.kind))
        yield
        seen.append(("done", action.kind))

    stage = FakeStage()
    inbox = {(Kind.RECV_F, 0): [torch.ones(2, 1)], (Kind.RECV_B, 0): []}
    executor = Executor(stage, Blocking(inbox), actions(0))
    executor.observe(observer)
    executor.start_pass(make_pass(torch.zeros(2, 1), torch.zeros(2), microbatches=1, size=2))
    assert not executor.run()  # RECV_B would block: the gradient has not come
    assert seen == [(e, k) for k in (Kind.RECV_F, Kind.F, Kind.SEND_F) for e in ("enter", "done")] + [
        ("enter", Kind.RECV_B)
    ]
    inbox[(Kind.RECV_B, 0)].append(torch.ones(2, 1))
    seen.clear()
    assert executor.run()
    assert [k for e, k in seen if e == "done"] == [Kind.RECV_B, Kind.I, Kind.SEND_B, Kind.NORM_REDUCE, Kind.W]
