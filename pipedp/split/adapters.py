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
from .hf_experts import refuse_experts
from .hf_structure import is_transformers_model
from .traced import traced_blocks


def model_blocks(model: nn.Module, untie_weights: bool = False) -> List[Block]:
    _refuse_peft_methods(model)
    peft = _peft_wrapped(model)
    if peft is not None:  # a PeftModel: split the model it wraps, under the PeftModel's own names
        prefix, inner = peft
        return [replace(b, name=f"{prefix}.{b.name}" if b.name else prefix) for b in model_blocks(inner, untie_weights)]
    if hasattr(model, "pipeline_blocks"):
        blocks = [Block(name, module) for name, module in model.pipeline_blocks()]
    elif isinstance(model, nn.Sequential):  # every position, as its forward runs: named_children() would
        # yield a module repeated at several positions once, and the blocks would run another network
        blocks = [Block(name, module) for name, module in model._modules.items() if module is not None]
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


_PEFT_WAY_OUT = "use LoRA, IA3, VeRA or OFT, which pipedp trains exactly"


def _refuse_peft_methods(model: nn.Module) -> None:
    """The PEFT methods pipedp cannot train exactly, by name: prompt learning, LoHa, LoKr in training mode."""
    configs = getattr(model, "peft_config", None)
    if type(model).__module__.startswith("peft.") and isinstance(configs, dict):
        learned = [c.peft_type for c in configs.values() if getattr(c, "is_prompt_learning", False)]
        prompts = sorted({str(getattr(kind, "value", kind)) for kind in learned})
        if prompts:
            raise UnsupportedModelError(
                f"PEFT {', '.join(prompts)} (prompt / prefix tuning): the PeftModel's own forward prepends learned "
                "virtual tokens to the input embeddings, or learned keys and values to every layer's attention, "
                f"outside the decoder's embeddings, layers and head that pipedp splits and captures; {_PEFT_WAY_OUT}"
            )
    for name, module in model.named_modules():
        package = type(module).__module__
        if package.startswith("peft.tuners.loha.layer"):
            raise UnsupportedModelError(
                f"layer {name!r} is a PEFT LoHa adapter: its weight (a Hadamard product of two low-rank products) is "
                "computed by a custom torch.autograd.Function without vmap support, so its per-sample gradients "
                f"cannot be computed one sample at a time; {_PEFT_WAY_OUT} (or LoKr, with its layers in eval mode)"
            )
        if package.startswith("peft.tuners.lokr.layer") and module.training:
            raise UnsupportedModelError(
                f"layer {name!r} is a PEFT LoKr adapter in training mode: its forward draws random numbers on every "
                "call (module_dropout and rank_dropout, even at 0), which pipedp's per-sample replay of the layer "
                "cannot draw again as the forward did; put its layers in eval mode (exact: module_dropout and "
                f"rank_dropout then do nothing), or {_PEFT_WAY_OUT}"
            )


def _adapted(model: nn.Module, untie_weights: bool) -> List[Block]:
    hugging_face = is_transformers_model(model)
    blocks = hf_blocks(model, untie_weights) if hugging_face else None
    if blocks is None and hugging_face:  # a base model without a head (e.g. Llama4TextModel): before tracing it
        refuse_experts(model, "a *ForCausalLM or *ForSequenceClassification")
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
