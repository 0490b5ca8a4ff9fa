"""Which adapter turns a model into its ordered list of pipeline blocks (one registry).

A model is a pipeline of blocks when it has a ``pipeline_blocks()`` method returning
``[(name, module), ...]`` in forward order (each block taking the previous block's output
tensor), when it is an ``nn.Sequential`` (its children), a known Hugging Face causal LM
(hf.py), or a ``SplitModel`` marked for graph capture (graph.py).
"""
from __future__ import annotations

from typing import List

import torch.nn as nn

from ..errors import UnsupportedModelError
from .blocks import Block
from .graph import captured_blocks
from .hf import hf_blocks


def model_blocks(model: nn.Module, untie_weights: bool = False) -> List[Block]:
    if hasattr(model, "pipeline_blocks"):
        blocks = [Block(name, module) for name, module in model.pipeline_blocks()]
    elif isinstance(model, nn.Sequential):
        blocks = [Block(name, module) for name, module in model.named_children()]
    else:
        blocks = _adapted(model, untie_weights)
    if not blocks:
        raise UnsupportedModelError(f"{type(model).__name__} has no blocks to split")
    return blocks


def _adapted(model: nn.Module, untie_weights: bool) -> List[Block]:
    blocks = hf_blocks(model, untie_weights) if type(model).__module__.startswith("transformers.") else None
    if blocks is None:
        blocks = captured_blocks(model)
    if blocks is None:
        raise UnsupportedModelError(
            f"don't know how to split {type(model).__name__} into pipeline stages: pass an nn.Sequential of "
            "blocks, give the model a pipeline_blocks() method returning [(name, module), ...] in forward order "
            "(each block taking the previous block's output tensor), or mark split points with "
            "torch.distributed.pipelining.pipe_split() in its forward and wrap it with pipedp.SplitModel"
        )
    return blocks
