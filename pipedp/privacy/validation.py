"""Refuse models DP-SGD cannot train correctly, naming the layer and the fix."""

from __future__ import annotations

from typing import List

import torch.nn as nn
from opacus.validators import ModuleValidator
from opacus.validators.errors import IllegalModuleConfigurationError

from ..errors import UnsupportedModelError

_BATCH_MIXING = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)
_INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def validate_model(model: nn.Module) -> None:
    problems: List[str] = []
    for name, module in model.named_modules():
        if isinstance(module, _BATCH_MIXING):
            problems.append(
                f"layer {name!r} is {type(module).__name__}, which mixes samples within a batch, so "
                "per-sample gradients (and DP) are undefined: replace it with nn.GroupNorm / nn.LayerNorm, "
                "or run opacus.validators.ModuleValidator.fix(model)"
            )
        checkpointing = getattr(module, "_gradient_checkpointing_func", None)  # Hugging Face layers
        if getattr(module, "gradient_checkpointing", False) is True and getattr(checkpointing, "keywords", {}).get(
            "use_reentrant", True
        ):
            problems.append(
                f"layer {name!r} uses reentrant activation checkpointing, which torch cannot combine with "
                "the per-layer gradients pipedp asks autograd for: enable it with "
                "gradient_checkpointing_kwargs={'use_reentrant': False} (exact), or disable it"
            )
        use_dora = getattr(module, "use_dora", None)  # PEFT LoRA layers: {adapter name: bool}
        if isinstance(use_dora, dict) and any(use_dora.values()):
            problems.append(
                f"layer {name!r} is a DoRA adapter (PEFT use_dora=True): its magnitude term runs lora_A on the "
                "weight matrix itself, not on the samples, which pipedp's per-sample capture cannot follow; "
                "use plain LoRA (use_dora=False)"
            )
        if (
            isinstance(module, _INSTANCE_NORMS) and module.track_running_stats
        ):  # trainable or not (Opacus: only trainable)
            problems.append(
                f"layer {name!r} is {type(module).__name__}(track_running_stats=True): its running statistics are "
                "computed from the private batch and would be released without noise (Opacus: 'we do not support "
                "tracking running stats with differential privacy'); use track_running_stats=False"
            )
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            problems.append(  # (the forward's own check would refuse it too, after the rows were changed)
                f"layer {name!r} is {type(module).__name__}(max_norm={module.max_norm}): its forward renormalizes, in "
                "place, the rows the private batch reads, un-noised; use max_norm=None"
            )
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.scale_grad_by_freq:
            problems.append(  # (the self-check catches it too, if on)
                f"layer {name!r} is {type(module).__name__}(scale_grad_by_freq=True): its gradient divides each row "
                "by the id's count in the whole batch, which couples the samples, so the clipped sum would not be a "
                "sum of per-sample gradients; use scale_grad_by_freq=False"
            )
    if not problems:
        # Opacus's own validators (LSTM -> DPLSTM, MultiheadAttention -> DPMultiheadAttention, ...); only its
        # "model in eval mode" error is dropped: evaluation mode is the user's choice, nothing leaks from it
        for err in ModuleValidator.validate(model, strict=False):
            if isinstance(err, IllegalModuleConfigurationError) and "training mode" in str(err):
                continue
            problems.append(f"{err}; opacus.validators.ModuleValidator.fix(model) replaces such layers")
    if problems:
        raise UnsupportedModelError("model not supported for DP training:\n  " + "\n  ".join(problems))
