"""Which adapter turns a model into its ordered list of pipeline blocks (one registry).

A model is a pipeline of blocks when it has a ``pipeline_blocks()`` method returning
``[(name, module), ...]`` in forward order (each block taking the previous block's output
tensor), when it is an ``nn.Sequential`` (its children), a Hugging Face decoder (causal LM or
sequence classifier, hf.py), a PEFT ``PeftModel`` around any of these, a ``SplitModel`` marked for graph
capture (graph.py), and otherwise any module whose forward torch.fx can trace (traced.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Tuple

import torch.nn as nn

from ..errors import UnsupportedModelError
from .blocks import Block
from .graph import captured_blocks
from .hf import hf_blocks
from .traced import traced_blocks


def model_blocks(model: nn.Module, untie_weights: bool = False) -> List[Block]:
    peft = _peft_wrapped(model)
    if peft is not None:  # a PeftModel: split the model it wraps, under the PeftModel's own names
        prefix, inner = peft
        return [replace(b, name=f"{prefix}.{b.name}" if b.name else prefix) for b in model_blocks(inner, untie_weights)]
    if hasattr(model, "pipeline_blocks"):
        blocks = [Block(name, module) for name, module in model.pipeline_blocks()]
    elif isinstance(model, nn.Sequential):
        blocks = [Block(name, module) for name, module in model.named_children()]
    else:
        blocks = _adapted(model, untie_weights)
    if not blocks:
        raise UnsupportedModelError(f"{type(model).__name__} has no blocks to split")
    return blocks


def _peft_wrapped(model: nn.Module) -> Optional[Tuple[str, nn.Module]]:
    """("base_model.model", the wrapped model) for a PEFT PeftModel (its adapter layers stay inside)."""
    if type(model).__module__.startswith("peft.") and isinstance(getattr(model, "base_model", None), nn.Module):
        inner = getattr(model.base_model, "model", None)
        if isinstance(inner, nn.Module):
            return "base_model.model", inner
    return None


def _adapted(model: nn.Module, untie_weights: bool) -> List[Block]:
    blocks = hf_blocks(model, untie_weights) if type(model).__module__.startswith("transformers.") else None
    if blocks is None:
        blocks = captured_blocks(model)
    if blocks is None:
        blocks = traced_blocks(model)  # the fallback: trace the forward, cut where only tensors cross
        if blocks is None:
            raise UnsupportedModelError(unsplittable(model))
        if len(blocks) == 1:  # the whole forward: it runs on one stage; more are refused, saying why
            blocks = [replace(blocks[0], unsplittable=unsplittable(model))]
    return blocks


def unsplittable(model: nn.Module) -> str:
    """Why ``model`` cannot be split into stages, and the ways out."""
    return (
        f"don't know how to split {type(model).__name__} into pipeline stages (tried: pipeline_blocks(), "
        "nn.Sequential, the Hugging Face adapters, pipe_split() marks, and tracing its forward, which found "
        "no call of a submodule after which only tensors cross, e.g. a size read at the start and used at "
        "the end): run it on one stage, pass an nn.Sequential of blocks, give the model a "
        "pipeline_blocks() method returning [(name, module), ...] in forward order, or mark split points "
        "with torch.distributed.pipelining.pipe_split() in its forward and wrap it with pipedp.SplitModel"
    )
