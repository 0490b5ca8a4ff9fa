"""LoRA adapters as pipedp train adds them (PEFT, the base frozen), for the trainer's CLI and the planner alike."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn


def with_lora(model: nn.Module, r: int, targets: Sequence[str], seed: int) -> nn.Module:
    """The model with PEFT LoRA adapters on ``targets`` (the base frozen), seeded alike on every rank."""
    from peft import LoraConfig, get_peft_model  # (here: PEFT is an optional dependency)

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(targets))
    model = get_peft_model(model, config)
    _give_memory(model, config.init_lora_weights)
    return model


def _give_memory(model: nn.Module, init) -> None:
    """PEFT puts each adapter on its base layer's device: the meta device where the loader left the base weight
    unread, for the tensor-parallel split to read its slice (load_pipeline_stage(..., tensor_parallel=T)). Such
    adapters get memory here, on the CPU where that slice will be read, and PEFT's own initialisation."""
    for layer in model.modules():
        adapters = getattr(layer, "lora_A", None)
        if not isinstance(adapters, nn.ModuleDict):
            continue
        for name in adapters:
            pair = (layer.lora_A[name], layer.lora_B[name])
            if any(p.is_meta for factor in pair for p in factor.parameters()):
                for factor in pair:
                    factor.to_empty(device="cpu")
                layer.reset_lora_parameters(name, init)
