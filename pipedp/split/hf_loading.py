"""Hugging Face models from a local folder: the whole model, or only one stage's tensors.

Nothing is downloaded: every function reads a local folder (config.json, safetensors
shards, tokenizer files).
"""
from __future__ import annotations

import os
from typing import Dict, List

import torch
import torch.nn as nn

from .adapters import model_blocks
from .hf import SPECS
from .partition import partition
from .stage_loading import materialize_stage, resident_parameter_bytes  # noqa: F401 (re-exported)


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
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation=attn_implementation).to(device)


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


def tied_aliases(model: nn.Module) -> Dict[str, str]:
    """Names a tied checkpoint may not store, mapped to the stored twin."""
    name = type(model).__name__
    if name == "GPT2LMHeadModel":
        return {"lm_head.weight": "transformer.wte.weight"}
    spec = SPECS.get(getattr(model.config, "model_type", None)) if name.endswith("ForCausalLM") else None
    if spec is not None:
        return {f"{spec.head}.weight": f"{spec.body}.{spec.embed}.weight"}
    return {}


def tokenize_for_model(path: str, text: str) -> List[int]:
    _require_transformers()
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise FileNotFoundError(f"no tokenizer in {path!r} ({exc}): save one with tokenizer.save_pretrained") from exc
    return tokenizer(text)["input_ids"]


def load_pipeline_stage(
    folder: str, stages: int, stage: int, balance="params", untie_weights: bool = False,
    attn_implementation: str = "sdpa", device="cpu",
) -> nn.Module:
    """The model built on the meta device with only ``stage``'s parameters materialised and loaded.

    Hand the result to PipelineDPTrainer with the same ``stages``, ``balance`` and
    ``untie_weights`` on the rank that runs that stage: each rank reads only its own
    tensors from the (possibly sharded) safetensors checkpoint, so no rank ever holds the
    whole model.
    """
    model = build_on_meta(folder, attn_implementation)
    tied = tied_aliases(model)
    stage_blocks = partition(model_blocks(model, untie_weights), stages, balance)
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in 0..{stages - 1}, got {stage}")
    materialize_stage(folder, stage_blocks[stage], tied, device)
    if not untie_weights:
        _retie(model)
    return model


def _retie(model: nn.Module) -> None:
    """Materialising a stage gives its modules new tensors, which breaks a tie between the input
    embedding and the head: point the other side at this rank's real tensor again, so every rank
    sees the tie (pipedp then trains it exactly across stages; the other side's stage stays on meta)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is None or head is None:
        return
    if not embedding.weight.is_meta:
        head.weight = embedding.weight
    elif not head.weight.is_meta:
        embedding.weight = head.weight
    else:  # a middle stage: neither is real here; keep them one (meta) tensor all the same
        head.weight = embedding.weight
