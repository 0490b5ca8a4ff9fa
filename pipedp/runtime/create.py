"""Choose and build the runtime: every stage in this process, or one stage per rank."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.distributed as dist

from schedules import Schedule

from ..config import PipelineConfig
from ..errors import ConfigError
from ..privacy.clipping import ClipRule
from ..privacy.units import Units
from ..split.blocks import Block
from ..split.partition import Tie
from .inprocess import InProcessRuntime
from .protocols import Runtime
from .stage import Stage, StageOptions
from .tie import TieRole


def is_distributed(transport: str) -> bool:
    """'distributed', or 'auto' with torch.distributed initialised and more than one rank."""
    return transport == "distributed" or (
        transport == "auto" and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    )


def stage_options(pipeline: PipelineConfig, clip: ClipRule, units: Units) -> StageOptions:
    """The stages' options, from the run's configuration: the one way every runtime builds a stage."""
    return StageOptions(
        grad_mode=pipeline.grad_mode,
        precision=pipeline.precision,
        clip=clip,
        self_check=pipeline.self_check,
        units=units,
        checkpointing=pipeline.activation_checkpointing,
        keep_ratio=None if pipeline.grad_mode == "keep" else pipeline.keep_memory_ratio,
    )


def create_runtime(
    pipeline: PipelineConfig,
    schedule: Schedule,
    clip: ClipRule,
    units: Units,
    stage_blocks: List[List[Block]],
    loss_fn: Callable,
    agreement: Dict[str, Any],
    state_keys: Sequence[str],
    tie: Optional[Tie] = None,
    tensor_parallel_plan: Optional[Dict[str, str]] = None,
) -> Runtime:
    """``agreement``: what every rank must agree on; ``state_keys`` the model's state-dict order;
    ``tie``: an embedding on the first stage tied to the head on the last; ``tensor_parallel_plan``: how the
    layers are split across each stage's tensor-parallel ranks (parallel/plan.py)."""
    options = stage_options(pipeline, clip, units)
    if is_distributed(pipeline.transport):
        from .distributed import DistributedRuntime  # torch.distributed's process groups only when used

        if pipeline.devices is not None:
            raise ConfigError(
                "devices places stages in one process; across processes each rank uses its backend's device "
                "(NCCL: cuda:LOCAL_RANK): drop devices",
                "devices",
            )
        return DistributedRuntime.create(
            pipeline, schedule, options, stage_blocks, loss_fn, agreement, state_keys, tie, tensor_parallel_plan or {}
        )
    if pipeline.tensor_parallel != 1:
        raise ConfigError(
            "tensor_parallel > 1 needs one process per (stage, tensor-parallel rank): launch with torchrun "
            f"--nproc_per_node {pipeline.stages * pipeline.replicas * pipeline.tensor_parallel}",
            "tensor_parallel",
        )
    if pipeline.replicas != 1:
        raise ConfigError("replicas > 1 needs one process per (stage, replica): launch with torchrun", "replicas")
    p = len(stage_blocks)
    if tie is not None and pipeline.devices is not None and len(set(pipeline.devices[:: max(1, p - 1)])) > 1:
        raise ConfigError(
            f"the input embedding is tied to the head, one tensor on stages 0 and {p - 1}, which devices puts on "
            f"{pipeline.devices[0]} and {pipeline.devices[-1]}: give the head its own copy (untie_weights=True) or "
            "put both stages on one device",
            "devices",
        )
    for device, blocks in zip(pipeline.devices or (), stage_blocks):
        for b in blocks:  # each stage's blocks on its own device (ties: the owner's stage moves the tensor)
            b.module.to(device)
    stages = [
        Stage(i, p, blocks, loss_fn, options, TieRole.for_stage(i, p, tie, own_copy=False))
        for i, blocks in enumerate(stage_blocks)
    ]
    elsewhere = [f"stage {s.index} on {s.device}" for s in stages if pipeline.device not in ("auto", s.device.type)]
    if elsewhere:
        raise ConfigError(
            f"device {pipeline.device!r} but {', '.join(elsewhere)}: move the model there first "
            f"(model.to('{pipeline.device}')), or give each stage's device (devices=)",
            "device",
        )
    return InProcessRuntime(stages, schedule, state_keys)
