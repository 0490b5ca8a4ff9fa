"""A pass of micro-batches on fake tensors through pipedp's own stages and executors (torch's FakeTensorMode on the
CPU: shapes, dtypes, autocast and kernel choices as on the CPU, no memory, no arithmetic), each action's bytes
counted by a ``MemoryTracker`` through an observer on each executor (``Executor.observe``): what it leaves held
and its peak above the level before it, per stage and micro-batch.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Dict, Iterator, List, Tuple

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import schedules
from schedules import Action, Kind

from ..errors import PipeDPError
from ..runtime.executor import Executor, run_in_process
from ..runtime.inprocess_transport import InProcessHub
from ..runtime.microbatch import PassBatch, tensors_of
from ..runtime.self_check import Probe
from ..runtime.stage import Stage, StageOptions
from ..runtime.tie import TieRole
from .report import Profile
from .tracker import MemoryTracker, storage_bytes


def fake_mode(model: nn.Module) -> FakeTensorMode:
    """A fake-tensor mode with the model's parameters and meta buffers replaced by fake CPU tensors."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    converter = mode.fake_tensor_converter
    cpu = torch.device("cpu")
    done: Dict[int, Any] = {}

    def fake(t):
        meta = t if t.is_meta else t.to("meta")
        return converter.from_meta_and_device(mode, meta, cpu)

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(fake(p.data), requires_grad=p.requires_grad)
            module._parameters[name] = done[id(p)]
        for name, t in list(module._buffers.items()):
            if t is not None and t.is_meta:
                if id(t) not in done:
                    done[id(t)] = fake(t)
                module._buffers[name] = done[id(t)]
    return mode


class ActionBytes:
    """An executor observer: each action's allocations carry its stage and name, and its bytes are recorded per
    micro-batch (what it leaves held, its peak above the level before it); I's kept per-sample gradients too."""

    def __init__(self, tracker: MemoryTracker, stages: int, microbatches: int):
        self.tracker = tracker
        self.found: List[List[dict]] = [
            [{"actions": {}, "kept": 0} for _ in range(microbatches)] for _ in range(stages)
        ]

    @contextmanager
    def __call__(self, executor: Executor, action: Action) -> Iterator[None]:
        tracker, s, mb = self.tracker, executor.stage.index, action.microbatch
        tracker.stage, tracker.phase = s, action.kind.value
        before = tracker.current[s]
        tracker.peak[s] = before
        try:
            yield
        finally:  # an action that would block raised at yield, having drawn the step's noise at most (Executor._act)
            actions = self.found[s][mb]["actions"]
            delta, rise = tracker.current[s] - before, tracker.peak[s] - before
            earlier, earlier_rise = actions.get(action.kind.value, (0, 0))
            actions[action.kind.value] = (earlier + delta, max(earlier_rise, earlier + rise))
        if action.kind is Kind.I:
            state = executor.stage.pending.get(mb)
            if state is not None and state.kept:
                self.found[s][mb]["kept"] = storage_bytes(g for grads in state.kept.values() for g in grads.values())

    def profiles(self) -> List[List[Profile]]:
        out = []
        for stage in self.found:
            profiles = []
            for mb in stage:
                acts = mb["actions"]
                held = acts.get("RECV_F", (0, 0))[0] + acts.get("F", (0, 0))[0]
                profiles.append(Profile(acts, held, mb["kept"]))
            out.append(profiles)
        return out


class HeldTransport:
    """The in-process transport, with the distributed transport's memory: a sent message is held (a joined
    copy after the pass's first micro-batch) until its peer has received it (release), and a received one
    is a new buffer of the receiver's."""

    def __init__(self, inner):
        self.inner = inner
        self.held: Dict[tuple, list] = {}

    def send(self, kind, mb, message) -> None:
        tensors = [t.detach().contiguous() for t in tensors_of(message)]
        kept = tensors if mb == 0 else [t.clone() for t in tensors]
        self.held.setdefault((kind.channel, mb), []).extend(kept)
        self.inner.send(kind, mb, message)

    def recv(self, kind, mb):
        message = self.inner.recv(kind, mb)
        if isinstance(message, tuple):
            return tuple(t.clone() for t in message)
        return message.clone()

    def norm_reduce_start(self, mb, squared_norms):
        return self.inner.norm_reduce_start(mb, squared_norms)

    def send_aborted(self, kind, mb) -> None:
        self.inner.send_aborted(kind, mb)

    def release(self, kind, mb) -> None:
        self.held.pop((kind.channel, mb), None)

    def finish_pass(self) -> None:
        self.held = {}
        self.inner.finish_pass()


def simulate(
    name: str,
    stage_blocks: List[list],
    loss: Any,
    options: StageOptions,
    tie: Any,
    parts: List[Any],
    batch: PassBatch,
    probe: bool,
) -> Tuple[List[List[Profile]], List[Dict[str, int]]]:
    """[[Profile per micro-batch] per stage] of one pass of ``batch`` (all forwards, then all backwards: each action
    of a micro-batch does the same whatever the schedule), inside the model's fake mode; ``probe``: micro-batch 0
    self-checked (every unit of it). Also, per stage, how many layers took each way (keep / ghost / materialize)."""
    stages = len(stage_blocks)
    microbatches = len(batch.inputs)
    options = replace(options, self_check=False)  # the probe is set below, as StageCheck.plan would set it
    schedule = schedules.build("gpipe", stages, microbatches)
    tracker = MemoryTracker(stages)
    counted = ActionBytes(tracker, stages, microbatches)
    built: List[Stage] = []
    with tracker:
        try:
            hub = InProcessHub(stages)
            for s, blocks in enumerate(stage_blocks):
                role = TieRole.for_stage(s, stages, tie, False)
                built.append(Stage(s, stages, blocks, loss, options, role, parts[s]))
            executors = []
            for s, stage in enumerate(built):
                executor = Executor(stage, HeldTransport(hub.transport(s)), schedule.for_stage(s))
                executor.observe(counted)
                executors.append(executor)
            for stage in built:  # the sums exist from where the trainer's noise makes them (its draws cost no bytes)
                stage.set_noise(0.0, 0, 0)
            for e in executors:
                e.start_pass(batch)
                if probe:
                    assert e.state is not None
                    rows = int(batch.masks[0].shape[0])
                    e.state.probe = Probe(tuple(range(options.units.count(rows))))
            try:
                run_in_process(executors)
            except PipeDPError:
                raise
            except Exception as exc:  # an operation fake tensors cannot run: say so, not a traceback
                raise PipeDPError(
                    f"pipedp plan could not simulate {name} on fake tensors ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:300] if str(exc) else ''}); the static parts of the plan "
                    "(weights, clipped sums, optimizer state) need no simulation, but its activations do"
                ) from exc
            hub.end_pass()
            ways = [dict(Counter(stage.ways.values())) for stage in built]
        finally:
            for stage in built:
                stage.reset()
                stage.close()
    return counted.profiles(), ways
