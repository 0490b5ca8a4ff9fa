"""Export the trained model as a Hugging Face folder (config.json + safetensors; for a PeftModel, the
adapter folder), written by rank 0 from the gathered state: no rank holds another stage's weights."""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn as nn

from ..errors import UnsupportedModelError


def save_pretrained(model: nn.Module, state: Optional[Dict[str, torch.Tensor]], path: str) -> None:
    """``state``: the whole model's state dict (rank 0), None on the other ranks (they write nothing)."""
    if not callable(getattr(model, "save_pretrained", None)):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a Hugging Face model: save_pretrained writes a Hugging Face folder; "
            "use trainer.state_dict() (torch.save) for other models"
        )
    if state is None:
        return
    # from the gathered state, not the model's own tensors (on a rank, other stages sit on meta);
    # tied weights are written once and stay tied (transformers / peft handle the aliases)
    model.save_pretrained(path, state_dict=state, safe_serialization=True)
