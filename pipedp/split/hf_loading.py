"""Hugging Face models from a local folder: the whole model, or only one stage's tensors.

Nothing is downloaded: every function reads a local folder (config.json, safetensors
shards, tokenizer files).
"""

from __future__ import annotations

import os
from typing import List

import torch
import torch.nn as nn

from .stage_loading import load_stage, resident_parameter_bytes  # noqa: F401 (re-exported)


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ImportError("Hugging Face models need transformers: pip install 'pipedp[hf]'") from exc


def load_local_model(path: str, attn_implementation: str = "sdpa", device: str = "cpu") -> nn.Module:
    """The whole model from a local folder (nothing is downloaded)."""
    _require_transformers()
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model folder {path!r} does not exist")
    return AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, attn_implementation=attn_implementation
    ).to(device)


def build_on_meta(path_or_config, attn_implementation: str = "sdpa") -> nn.Module:
    """The model's structure with no memory behind its parameters."""
    _require_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM

    config = path_or_config
    if isinstance(path_or_config, str):
        config = AutoConfig.from_pretrained(path_or_config, local_files_only=True)
    config._attn_implementation = attn_implementation
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def tokenize_for_model(path: str, text: str) -> List[int]:
    _require_transformers()
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise FileNotFoundError(f"no tokenizer in {path!r} ({exc}): save one with tokenizer.save_pretrained") from exc
    return tokenizer(text)["input_ids"]


def load_pipeline_stage(
    folder: str,
    stages: int,
    stage: int,
    balance="params",
    untie_weights: bool = False,
    attn_implementation: str = "sdpa",
    device="cpu",
) -> nn.Module:
    """The model built on the meta device with only ``stage``'s parameters materialised and loaded.

    Hand the result to PipelineDPTrainer with the same ``stages``, ``balance`` and
    ``untie_weights`` on the rank that runs that stage: each rank reads only its own
    tensors from the (possibly sharded) safetensors checkpoint, so no rank ever holds the
    whole model.
    """
    return load_stage(build_on_meta(folder, attn_implementation), folder, stages, stage, balance, device, untie_weights)
