"""A run's preparation, in one place: what is done to a model and decided about it before any runtime exists.

The trainer, the memory planner and the benches all call ``prepare``, so none of them re-derives a rule of
another (precision and float32 masters, the blocks, the partition, the name check, the clip rule, the
privacy units, the tie, the stages' options). A new parallel layer or layer rule that changes how a run is
prepared changes it here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from ..config import Balance, PipelineConfig, PrivacyConfig
from ..errors import ConfigError, UnsupportedModelError
from ..models import token_loss
from ..parallel.loss import VocabParallelTokenLoss
from ..parallel.plan import tensor_parallel_plan
from ..privacy.clipping import ClipRule
from ..privacy.units import Units
from ..privacy.validation import validate_model
from ..runtime.capture import block_layers
from ..runtime.create import stage_options
from ..runtime.stage import StageOptions
from ..runtime.tie import the_tie
from ..split.adapters import model_blocks
from ..split.balance import PartitionReport, cost_unit, report
from ..split.blocks import Block
from ..split.partition import Tie, block_costs, find_ties, partition


@dataclass
class Prepared:
    """The model as it will train (its precision applied) and everything decided about it."""

    model: nn.Module
    stage_blocks: List[List[Block]]  # the blocks of each stage
    costs: List[float]  # each block's cost under the balance rule
    clip: ClipRule
    units: Units  # rows per privacy unit
    tie: Optional[Tie]  # an embedding on the first stage tied to the head on the last
    options: StageOptions  # how every stage computes
    report: PartitionReport
    tensor_parallel_plan: Dict[str, str]  # qualified layer name -> how it is split across a stage's ranks


def prepare(
    model: nn.Module,
    pipeline: PipelineConfig,
    privacy: PrivacyConfig,
    balance: Optional[Balance] = None,
    vocab_parallel_loss: bool = False,
) -> Prepared:
    """``model`` checked, converted to its training precision (in place) and split as ``pipeline`` says;
    ``balance``: per-block costs or a rule instead of ``pipeline.balance`` (the planner's, for a model on meta);
    ``vocab_parallel_loss``: under tensor parallelism the loss takes vocabulary-split logits (the head's are not
    gathered: parallel/loss.py)."""
    validate_model(model)
    apply_precision(model, pipeline.precision)
    blocks = model_blocks(model, pipeline.untie_weights)
    rule = pipeline.balance if balance is None else balance
    costs = block_costs(blocks, rule)
    stage_blocks = partition(blocks, pipeline.stages, rule, costs)
    refuse_duplicate_names(stage_blocks)
    layers = [name for stage in stage_blocks for name in block_layers(stage)]
    # DP disabled: an infinite bound makes every clip factor 1 (a non-finite sample is still left out)
    norm = privacy.max_grad_norm if privacy.enabled else math.inf
    clip = ClipRule.make(privacy.clipping, norm, pipeline.stages, layers)
    units = Units(privacy.unit_rows)
    if pipeline.microbatch_size is not None and pipeline.microbatch_size % units.rows:
        raise ConfigError(
            f"microbatch_size {pipeline.microbatch_size} is not a multiple of unit_rows {units.rows}: a "
            "micro-batch holds whole privacy units",
            "microbatch_size",
        )
    tie = the_tie(find_ties(stage_blocks), clip.across_stages)
    options = stage_options(pipeline, clip, units)
    plan = tensor_parallel_plan(model, blocks, pipeline.tensor_parallel, gather_logits=not vocab_parallel_loss)
    return Prepared(
        model, stage_blocks, list(costs), clip, units, tie, options, report(stage_blocks, costs, cost_unit(rule)), plan
    )


def vocab_parallel(loss_fn: Callable, model: nn.Module, tensor_parallel: int) -> Optional[Callable]:
    """pipedp's own token loss on the head's vocabulary slices (parallel/loss.py), under tensor parallelism, for
    ``models.token_loss`` on a model whose head is a plain Linear; None otherwise (the logits are gathered for the
    user's loss)."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if tensor_parallel > 1 and loss_fn is token_loss and type(head) is nn.Linear:
        return VocabParallelTokenLoss(head)
    return None


def apply_precision(model: nn.Module, precision: str) -> None:
    """bf16-true: the user's model itself trains in bf16. bf16-mixed: trainable parameters held (and stepped,
    with their optimizer state) in float32 whatever dtype the model was loaded in; the forward runs under bf16
    autocast; frozen weights stay as they are."""
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    if precision == "bf16-mixed":
        for p in model.parameters():
            if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16):
                p.data = p.data.float()


def refuse_duplicate_names(stage_blocks: Sequence[Sequence[Block]]) -> None:
    """The noise of each parameter is drawn from the stream of its name: two tensors of one name would get
    the same noise (correlated, and the guarantee assumes independent noise)."""
    owner: Dict[str, int] = {}
    for blocks in stage_blocks:
        for b in blocks:
            for n, p in b.module.named_parameters():
                name = b.qualified(n)
                if owner.setdefault(name, id(p)) != id(p):
                    raise UnsupportedModelError(
                        f"two different parameters are both named {name!r} (from the model's blocks): pipedp draws "
                        "each parameter's noise from the stream of its name, so they would get the same noise; give "
                        "each block its prefix in the model's own state dict (pipeline_blocks() names)"
                    )


__all__: List[Any] = ["Prepared", "apply_precision", "prepare", "refuse_duplicate_names", "vocab_parallel"]
