"""LoRA adapters as pipedp train adds them (PEFT, the base frozen), for the trainer's CLI and the planner alike."""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

import torch
import torch.nn as nn

from ..split.safetensors_read import stored_of


def with_lora(model: nn.Module, r: int, targets: Sequence[str], seed: int) -> nn.Module:
    """The model with PEFT LoRA adapters on ``targets`` (the base frozen). Each adapter starts as PEFT starts it
    (A Kaiming-uniform, B zero), A drawn from a stream of (``seed``, the layer's name): the same on every rank,
    under any stage split and any tensor-parallel degree."""
    from peft import LoraConfig, get_peft_model  # (here: PEFT is an optional dependency)

    torch.manual_seed(seed)  # (PEFT's own draws, replaced below: the global generator left as it always was)
    modules, parameters = _split_targets(model, targets)
    config = LoraConfig(
        r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=modules, target_parameters=parameters or None
    )
    model = get_peft_model(model, config)
    _initialise(model, seed)
    return model


def _split_targets(model: nn.Module, targets: Sequence[str]):
    """(module names, parameter names) of ``targets``: a target that names no module but ends the name of a
    parameter of three dimensions (an expert bank's weight, ``experts.down_proj``) is PEFT's target_parameters."""
    modules = {n for n, _ in model.named_modules()}
    banks = {n for n, p in model.named_parameters() if p.dim() == 3}

    def names(target: str, within: set) -> bool:
        return any(n == target or n.endswith("." + target) for n in within)

    both = [t for t in targets if names(t, modules) and names(t, banks)]
    if both:
        raise ValueError(
            f"{both} name both modules and an expert bank's weights: name the one you mean by a longer suffix "
            "(e.g. mlp.experts.down_proj for the bank's, shared_expert.down_proj for a module's)"
        )
    parameters = [t for t in targets if names(t, banks)]
    return [t for t in targets if t not in parameters], parameters


def _initialise(model: nn.Module, seed: int) -> None:
    """Draw every adapter this process holds. PEFT puts an adapter on its base layer's device: the meta device for
    another stage's layer (left so: this rank never holds it) and for a layer the loader left unread for the
    tensor-parallel split to read its slice (load_pipeline_stage(..., tensor_parallel=T)): that one gets memory
    here, on the CPU where its slice will be read."""
    for name, layer in model.named_modules():
        adapters = getattr(layer, "lora_A", None)
        if not isinstance(adapters, nn.ModuleDict):
            continue
        # (PEFT's LoRA on a parameter wraps the module holding it: that parameter is the base)
        base = layer.get_param() if hasattr(layer, "get_param") else getattr(layer.get_base_layer(), "weight", None)
        if base is not None and base.is_meta and stored_of(base) is None:
            continue
        for adapter in adapters:
            a, b = layer.lora_A[adapter], layer.lora_B[adapter]
            for factor in (a, b):
                if any(p.is_meta for p in factor.parameters()):
                    factor.to_empty(device="cpu")
            digest = hashlib.sha256(f"pipedp lora {seed} {name}.{adapter}".encode()).digest()
            stream = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
            drawn = torch.empty(a.weight.shape)  # on the CPU, in float32: the same values on any device and dtype
            nn.init.kaiming_uniform_(drawn, a=math.sqrt(5), generator=stream)
            with torch.no_grad():
                a.weight.copy_(drawn)
                for p in b.parameters():
                    p.zero_()
