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
    return get_peft_model(model, config)
