"""The in-process runtime: all stages in this process, wired by the in-process transport."""
from __future__ import annotations

from typing import List, Sequence

import torch

from schedules import Schedule

from .executor import Executor, run_in_process
from .microbatch import PassBatch
from .privacy import Clipping
from .stage import Stage
from .transport import InProcessHub


class InProcessRuntime:
    replicas = 1
    replica = 0
    rank = 0
    is_distributed = False

    def __init__(self, stages: Sequence[Stage], schedule: Schedule, clipping: Clipping):
        self.local_stages: List[Stage] = list(stages)
        self.hub = InProcessHub(len(stages))
        self.executors = [
            Executor(stage, self.hub.transport(stage.index), schedule.for_stage(stage.index), clipping)
            for stage in stages
        ]

    def check_same_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Only one process: nothing to compare."""

    def run_pass(self, batch: PassBatch) -> torch.Tensor:
        for e in self.executors:
            e.start_pass(batch)
        run_in_process(self.executors)
        self.hub.end_pass()
        return self.executors[-1].loss_sum

    def sum_over_replicas(self, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        return grads

    def total(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def all_gather(self, obj) -> list:
        return [obj]

    def broadcast(self, obj):
        return obj
