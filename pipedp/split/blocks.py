"""A block: one module of a model's forward chain, under its state-dict prefix.

Layer 2 (split): may import errors, config, schedules and privacy.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Tuple

import torch.nn as nn


@dataclass(frozen=True)
class Block:
    name: str  # prefix of this block's state-dict keys in the model's state dict ("" for none)
    module: nn.Module
    # a first block whose forward takes the micro-batch's input dict entries as positional
    # arguments, in this order (a traced model whose forward has several inputs); () otherwise
    input_names: Tuple[str, ...] = ()
    # a whole model no cut could split (one traced piece): why, the error any split into 2+ stages raises
    unsplittable: str = ""

    def qualified(self, key: str) -> str:
        return f"{self.name}.{key}" if self.name else key


def model_signature(model: nn.Module) -> str:
    """A short fingerprint of the parameter names, shapes and dtypes (not values)."""
    text = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters())
    return hashlib.sha1(text.encode()).hexdigest()[:12]
