"""The in-process runtime: all stages in this process, wired by the in-process transport."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from schedules import Schedule, forward_only

from .executor import Executor, run_in_process
from .inprocess_transport import InProcessHub
from .microbatch import Inputs, PassBatch
from .stage import Stage


class InProcessRuntime:
    rank = 0
    replica = 0
    replicas = 1

    def __init__(self, stages: Sequence[Stage], schedule: Schedule, state_keys: Sequence[str]):
        self._stages: List[Stage] = list(stages)
        self.state_keys = list(state_keys)
        self.hub = InProcessHub(len(stages))
        evaluation = forward_only(len(stages), schedule.microbatches)
        self.eval_actions = [evaluation.for_stage(stage.index) for stage in stages]
        self.executors = [
            Executor(stage, self.hub.transport(stage.index), schedule.for_stage(stage.index)) for stage in stages
        ]

    @property
    def local_stages(self) -> List[Stage]:
        return self._stages

    def check_same_batch(self, inputs: Inputs, targets: torch.Tensor) -> None:
        """Only one process: nothing to compare."""

    def run_pass(self, batch: PassBatch) -> torch.Tensor:
        for e in self.executors:
            e.start_pass(batch)
        run_in_process(self.executors)
        self.hub.end_pass()
        for e in self.executors:
            e.end_pass()
        return torch.stack([e.totals().cpu() for e in self.executors]).sum(0)  # (only the last counts losses)

    def run_eval(self, batch: PassBatch) -> torch.Tensor:
        for e, actions in zip(self.executors, self.eval_actions):
            e.start_pass(batch, actions)
        run_in_process(self.executors)
        self.hub.end_pass()
        return torch.stack([e.totals().cpu() for e in self.executors]).sum(0)

    def sum_over_replicas(self, grads: List[torch.Tensor], owners: Optional[List[int]] = None) -> List[torch.Tensor]:
        return grads  # (one replica in one process)

    def share_owned(self, parameters: List[torch.nn.Parameter], owners: List[int]) -> None:
        return None

    def gather_owned(self, states: List[Optional[Dict[str, Any]]], owners: List[int]) -> List[Optional[Dict[str, Any]]]:
        return states

    def broadcast_whole(self, stage: Stage, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        return grads  # (no tensor parallelism in one process)

    def refuse_unequal_whole(self, stage: Stage, grads: List[torch.Tensor]) -> None:
        return None

    def gather_slices(self, stage: Stage, items: List[Tuple[torch.Tensor, Any]]) -> Optional[List[torch.Tensor]]:
        return [t for t, _ in items]  # every tensor is whole here

    def combine_tied(self, stage: Stage, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """The owner adds the head's clipped part of the shared tensor (the partner does not step it)."""
        if stage.tie is None:
            return grads
        partner = self._stages[-1]
        device = stage.device
        return stage.tie.combine_in_process(grads, stage.parameters, lambda: partner.take_tied_part().to(device))

    def total(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def all_gather(self, obj: Any) -> List[Any]:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj

    def gather_state(self) -> Optional[Dict[str, torch.Tensor]]:
        merged: Dict[str, torch.Tensor] = {}
        for stage in self._stages:
            merged.update(stage.named_state())
        return {k: merged[k] for k in self.state_keys if k in merged}

    def abort_step(self, error: BaseException) -> None:
        self.hub.clear()
        for executor in self.executors:
            executor.state = None
        for stage in self._stages:
            stage.reset()

    def close(self) -> None:
        for stage in self._stages:
            stage.close()
