"""Hugging Face decoders as pipeline blocks, taken by structure (any family of transformers).

A ``*ForCausalLM`` / ``*LMHeadModel`` / ``*ForSequenceClassification`` whose base model holds
embeddings, one list of decoder layers and a final norm is split into [embeddings] [layer 0] ...
[layer L-1] [final norm + head], every block computing through the model's own forward:
- hf_structure.py: what the parts are, and the refusals at construction (with hf_dry_run.py, the
  model's forward run once with its layers stubbed, and hf_capturable.py, one layer run alone);
- hf_runs.py, hf_drive.py: how the model's forward is driven for each block;
- hf_blocks.py: the blocks; hf_buffers.py: the buffers checkpoints do not hold (rotary frequencies).
Other transformers models are left to the other adapters.
"""

from __future__ import annotations

from typing import List, Optional

import torch.nn as nn

from .blocks import Block
from .hf_blocks import structure_blocks
from .hf_structure import find_structure, model_kind


def hf_blocks(model: nn.Module, untie_weights: bool = False) -> Optional[List[Block]]:
    """The blocks of a Hugging Face decoder (refused with UnsupportedModelError, naming why, when the
    adapter cannot drive it exactly); None for a model that is not a causal LM or a classifier."""
    kind = model_kind(model)
    if kind is None:
        return None
    if untie_weights:
        _untie(model)
    return structure_blocks(find_structure(model, kind))


def _untie(model: nn.Module) -> None:
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and getattr(head, "weight", None) is getattr(embedding, "weight", False):
        head.weight = nn.Parameter(embedding.weight.detach().clone(), requires_grad=embedding.weight.requires_grad)
        model.config.tie_word_embeddings = False
