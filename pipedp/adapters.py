"""Adapters: turn known architectures into an ordered list of pipeline blocks."""
from __future__ import annotations

from typing import List

import torch.nn as nn

from .errors import UnsupportedModelError


def adapt(model: nn.Module) -> list:
    raise UnsupportedModelError(
        f"don't know how to split {type(model).__name__} into pipeline stages: pass an nn.Sequential "
        "of blocks, or give the model a pipeline_blocks() method returning [(name, module), ...] in "
        "forward order, each block taking the previous block's output tensor"
    )
