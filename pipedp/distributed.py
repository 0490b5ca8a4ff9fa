"""The multi-process runtime: one process per (stage, replica), over torch.distributed.

Ranks form a stages x replicas mesh: rank = replica * stages + stage. The pipeline group
of a replica holds its stages (P2P and the per-sample norm all-reduce); the data-parallel
group of a stage holds that stage on every replica (sum of clipped gradients). Groups are
explicit objects held here, never globals.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .errors import BatchError, ConfigMismatchError
from .executor import Executor
from .microbatch import PassBatch
from .stage import Stage
from .dist_transport import DistTransport, PipelineGroups


@dataclass(frozen=True)
class Mesh:
    stages: int
    replicas: int
    rank: int

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def replica(self) -> int:
        return self.rank // self.stages

    def pipeline_ranks(self, replica: int) -> List[int]:
        return [replica * self.stages + s for s in range(self.stages)]

    def data_parallel_ranks(self, stage: int) -> List[int]:
        return [r * self.stages + stage for r in range(self.replicas)]


def _checksum(stage: Stage) -> float:
    with torch.no_grad():
        return float(sum(p.double().sum() for p in stage.parameters)) if stage.parameters else 0.0


def _device_for_backend() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())  # init_from_env set it from LOCAL_RANK
    return torch.device("cpu")


def _fingerprint(t: torch.Tensor) -> float:
    """A position-weighted float64 sum: equal batches agree exactly, different ones almost never."""
    flat = t.detach().reshape(-1).to(torch.float64)
    weights = 1.0 + (torch.arange(flat.numel(), dtype=torch.float64) % 7919) / 7919
    return float((flat * weights).sum())


class DistributedRuntime:
    is_distributed = True

    def __init__(self, mesh: Mesh, stage: Stage, executor: Executor, dp_group, device, model):
        self.mesh, self.device, self.model = mesh, device, model
        self.rank = mesh.rank
        self.replicas, self.replica = mesh.replicas, mesh.replica
        self.local_stages = [stage]
        self.executor = executor
        self.dp_group = dp_group

    @classmethod
    def create(cls, trainer, stage_blocks, loss_fn, grad_mode) -> "DistributedRuntime":
        world, rank = dist.get_world_size(), dist.get_rank()
        # the static micro-batch size shapes every message, so it must agree too
        config = {"world size": world, "microbatch_size": trainer.microbatch_size, **trainer.run_config()}
        configs: List[Optional[Dict]] = [None] * world
        dist.all_gather_object(configs, config)  # before any check that could make one rank leave early
        mismatches = [
            f"rank {r} has {key}={cfg[key]!r} but rank 0 has {configs[0][key]!r}"
            for r, cfg in enumerate(configs) for key in config if cfg[key] != configs[0][key]
        ]
        if mismatches:
            raise ConfigMismatchError("ranks disagree on the configuration:\n  " + "\n  ".join(mismatches))
        if world != trainer.stages * trainer.replicas:
            raise ConfigMismatchError(
                f"world size {world} != stages {trainer.stages} x replicas {trainer.replicas}: launch "
                f"torchrun --nproc_per_node {trainer.stages * trainer.replicas} (or fix stages/replicas)"
            )
        mesh = Mesh(trainer.stages, trainer.replicas, rank)
        # every rank creates every group, in the same order (torch.distributed requires it)
        pipeline_groups = [
            PipelineGroups(*(dist.new_group(mesh.pipeline_ranks(r)) for _ in range(3))) for r in range(mesh.replicas)
        ]
        dp_groups = [dist.new_group(mesh.data_parallel_ranks(s)) for s in range(mesh.stages)]
        device = _device_for_backend()
        for s, blocks in enumerate(stage_blocks):
            for b in blocks:  # keep only this rank's stage; free the rest
                b.module.to(device if s == mesh.stage else "meta")
        stage = Stage(mesh.stage, mesh.stages, stage_blocks[mesh.stage], loss_fn, grad_mode)
        mine = _checksum(stage)
        checksums: List[Optional[float]] = [None] * world
        dist.all_gather_object(checksums, (mesh.stage, mine))
        for r, (s, value) in enumerate(checksums):
            if s == mesh.stage and value != mine:
                raise ConfigMismatchError(
                    f"ranks {rank} and {r} hold stage {s} with different weights: build the model from the "
                    "same seed (torch.manual_seed before constructing it) or load the same checkpoint on every rank"
                )
        pipeline = mesh.pipeline_ranks(mesh.replica)
        transport = DistTransport(
            mesh.stage,
            pipeline[mesh.stage - 1] if mesh.stage > 0 else None,
            pipeline[mesh.stage + 1] if mesh.stage < mesh.stages - 1 else None,
            pipeline_groups[mesh.replica],
            device,
        )
        executor = Executor(stage, transport, trainer.schedule.for_stage(mesh.stage), trainer.clipping)
        return cls(mesh, stage, executor, dp_groups[mesh.stage], device, trainer.model)

    def check_same_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Every rank must step on the same logical batch: compare its size and a fingerprint."""
        mine = torch.tensor([float(inputs.shape[0]), _fingerprint(inputs), _fingerprint(targets)], dtype=torch.float64)
        extremes = torch.cat([mine, -mine]).to(self.device)  # one MAX all-reduce gives both max and -min
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        high, low = extremes.cpu().split(3)
        if not (torch.equal(high, mine) and torch.equal(-low, mine)):
            raise BatchError(
                f"ranks got different logical batches (rank {self.mesh.rank} has {inputs.shape[0]} rows; sizes "
                f"across ranks range {int(-low[0])}..{int(high[0])}, and/or the contents differ): every rank must "
                "call step() with the same inputs and targets"
            )

    def run_pass(self, batch: PassBatch) -> torch.Tensor:
        self.executor.start_pass(batch.to(self.device))
        self.executor.run()
        return self.executor.loss_sum.cpu()

    def sum_over_replicas(self, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        if self.replicas == 1 or not grads:
            return grads
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
        return [chunk.view_as(g) for chunk, g in zip(flat.split([g.numel() for g in grads]), grads)]

    def total(self, value: torch.Tensor) -> torch.Tensor:
        value = value.to(self.device, torch.float64).clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value.cpu()

    def all_gather(self, obj) -> list:
        out: List = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_state(self) -> Optional[dict]:
        """The whole model's state dict on rank 0 (CPU tensors); None on the other ranks."""
        mine = {k: v.detach().cpu() for k, v in self.local_stages[0].named_state().items()} if self.replica == 0 else {}
        parts: List[Optional[dict]] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        if dist.get_rank() != 0:
            return None
        merged = {}
        for part in parts:
            merged.update(part)
        return {k: merged[k] for k in self.model.state_dict().keys() if k in merged}
