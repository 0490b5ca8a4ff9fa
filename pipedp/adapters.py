"""Adapters: turn known architectures into an ordered list of pipeline blocks."""
from __future__ import annotations

import torch.nn as nn

from .errors import UnsupportedModelError


def adapt(model: nn.Module, untie_weights: bool = False) -> list:
    from .hf import hf_blocks

    blocks = hf_blocks(model, untie_weights) if type(model).__module__.startswith("transformers.") else None
    if blocks is None:
        from .graph import captured_blocks

        blocks = captured_blocks(model)
    if blocks is None:
        raise UnsupportedModelError(
            f"don't know how to split {type(model).__name__} into pipeline stages: pass an nn.Sequential of "
            "blocks, give the model a pipeline_blocks() method returning [(name, module), ...] in forward order "
            "(each block taking the previous block's output tensor), or mark split points with "
            "torch.distributed.pipelining.pipe_split() in its forward and wrap it with pipedp.graph.SplitModel"
        )
    return blocks
