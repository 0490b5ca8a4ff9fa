"""Hugging Face causal LMs as pipeline blocks, and stage-by-stage loading of local checkpoints.

GPT2LMHeadModel:  [embeddings (wte + wpe)] [block 0] ... [block L-1] [ln_f + lm_head]
LlamaForCausalLM: [embed_tokens] [decoder layer 0] ... [decoder layer L-1] [norm + lm_head]

Only the hidden state travels between stages. What a layer needs besides it is recomputed
where it is used: position ids (0..T-1 for every sequence), the causal mask (an explicit
additive [1, 1, T, T] mask, valid for the eager and sdpa attention implementations), and
Llama's rotary embeddings (each decoder block holds its own small rotary module, so no
module is shared across stages). Sequences are unpadded and full length, as the CLI's
windows are.

Every block wraps the model's own submodules under their original attribute paths, so a
block's state dict keys, prefixed with its name, are the model's own keys.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from .errors import CheckpointError, UnsupportedModelError
from .partition import Block

SUPPORTED_ATTENTION = ("eager", "sdpa")


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ImportError("Hugging Face models need transformers: pip install 'pipedp[hf]'") from exc


def _causal_mask(hidden: torch.Tensor) -> torch.Tensor:
    t = hidden.shape[1]
    mask = torch.full((t, t), torch.finfo(hidden.dtype).min, device=hidden.device, dtype=hidden.dtype)
    return torch.triu(mask, diagonal=1)[None, None]


def _positions(hidden_or_ids: torch.Tensor) -> torch.Tensor:
    b, t = hidden_or_ids.shape[:2]
    return torch.arange(t, device=hidden_or_ids.device).expand(b, t).contiguous()


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def _holder(**modules) -> nn.Module:
    holder = nn.Module()
    for name, module in modules.items():
        holder.add_module(name, module)
    return holder


class GPT2Embeddings(nn.Module):
    def __init__(self, transformer):
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, ids):
        return self.drop(self.wte(ids) + self.wpe(_positions(ids)))


class GPT2Layer(nn.Module):
    """transformer.h.{i}: registered under its index, so its keys are the model's own."""

    def __init__(self, index: int, block):
        super().__init__()
        self.index = str(index)
        self.add_module(self.index, block)

    def forward(self, hidden):
        return _first(getattr(self, self.index)(hidden, attention_mask=_causal_mask(hidden)))


class GPT2Head(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.transformer = _holder(ln_f=model.transformer.ln_f)
        self.lm_head = model.lm_head

    def forward(self, hidden):
        return self.lm_head(self.transformer.ln_f(hidden))


class LlamaEmbeddings(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = _holder(embed_tokens=model.model.embed_tokens)

    def forward(self, ids):
        return self.model.embed_tokens(ids)


class LlamaLayer(nn.Module):
    """model.layers.{i}, with a private rotary module (buffers only, never shared across stages)."""

    def __init__(self, index: int, layer, rotary: nn.Module):
        super().__init__()
        self.index = str(index)
        self.add_module(self.index, layer)
        if any(b.is_meta for b in rotary.buffers()):
            self.rotary = type(rotary)(config=rotary.config)  # built on meta: recompute the frequencies
        else:
            self.rotary = copy.deepcopy(rotary)

    def reset_buffers(self, device=None) -> None:
        """Recompute the rotary frequencies (not stored in checkpoints; lost by to_empty)."""
        self.rotary = type(self.rotary)(config=self.rotary.config).to(device)

    def forward(self, hidden):
        positions = _positions(hidden)
        cos_sin = self.rotary(hidden, positions)
        return _first(getattr(self, self.index)(hidden, attention_mask=_causal_mask(hidden), position_ids=positions,
                                                position_embeddings=cos_sin))


class LlamaHead(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = _holder(norm=model.model.norm)
        self.lm_head = model.lm_head

    def forward(self, hidden):
        return self.lm_head(self.model.norm(hidden))


def _untie(model: nn.Module, head: nn.Module, embedding: nn.Module) -> None:
    if head.weight is embedding.weight:
        head.weight = nn.Parameter(embedding.weight.detach().clone(), requires_grad=embedding.weight.requires_grad)
        model.config.tie_word_embeddings = False


def _check_attention(model) -> None:
    impl = getattr(model.config, "_attn_implementation", "eager")
    if impl not in SUPPORTED_ATTENTION:
        raise UnsupportedModelError(
            f"attention implementation {impl!r} is not supported for pipelining: load the model with "
            f"attn_implementation='sdpa' or 'eager'"
        )


def gpt2_blocks(model, untie_weights: bool = False) -> List[Block]:
    _check_attention(model)
    if untie_weights:
        _untie(model, model.lm_head, model.transformer.wte)
    blocks = [Block("transformer", GPT2Embeddings(model.transformer))]
    blocks += [Block("transformer.h", GPT2Layer(i, b)) for i, b in enumerate(model.transformer.h)]
    blocks.append(Block("", GPT2Head(model)))
    return blocks


def llama_blocks(model, untie_weights: bool = False) -> List[Block]:
    _check_attention(model)
    if untie_weights:
        _untie(model, model.lm_head, model.model.embed_tokens)
    blocks = [Block("", LlamaEmbeddings(model))]
    with torch.device("cpu"):
        blocks += [Block("model.layers", LlamaLayer(i, layer, model.model.rotary_emb))
                   for i, layer in enumerate(model.model.layers)]
    blocks.append(Block("", LlamaHead(model)))
    return blocks


def hf_blocks(model: nn.Module, untie_weights: bool = False) -> Optional[List[Block]]:
    """Blocks for a known Hugging Face architecture, or None."""
    name = type(model).__name__
    if name == "GPT2LMHeadModel":
        return gpt2_blocks(model, untie_weights)
    if name == "LlamaForCausalLM":
        return llama_blocks(model, untie_weights)
    return None


# ---- loading from a local folder ---------------------------------------------------------------
def _weight_map(folder: str) -> Dict[str, str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(
        f"no safetensors weights in {folder!r} (model.safetensors or model.safetensors.index.json): "
        "save the model with save_pretrained(..., safe_serialization=True)"
    )


def read_tensors(folder: str, names: List[str], aliases: Dict[str, str]) -> Dict[str, torch.Tensor]:
    """Read only ``names`` from the checkpoint's shards (``aliases`` maps a tied name to its stored twin)."""
    from safetensors import safe_open

    weight_map = _weight_map(folder)
    by_file: Dict[str, List[str]] = {}
    for name in names:
        stored = name if name in weight_map else aliases.get(name)
        if stored not in weight_map:
            raise CheckpointError(
                f"parameter {name!r} is not in the checkpoint at {folder!r}: the folder holds another "
                "architecture or an incomplete save"
            )
        by_file.setdefault(weight_map[stored], []).append((name, stored))
    out = {}
    for path, pairs in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name, stored in pairs:
                out[name] = f.get_tensor(stored)
    return out


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


def materialize_stage(folder: str, stage_blocks: List[Block], tied: Dict[str, str], device="cpu") -> None:
    """Give this stage's blocks real memory and load their weights from the checkpoint shards."""
    for block in stage_blocks:
        own = {k: block.qualified(k) for k in block.module.state_dict().keys()}
        tensors = read_tensors(folder, list(own.values()), tied)
        block.module.to_empty(device=device)
        block.module.load_state_dict({k: tensors[q] for k, q in own.items()}, strict=True)
        for module in block.module.modules():  # non-persistent buffers (rotary frequencies) are not in files
            if hasattr(module, "reset_buffers"):
                module.reset_buffers(device)


def tied_aliases(model: nn.Module) -> Dict[str, str]:
    """Names a tied checkpoint may not store, mapped to the stored twin."""
    name = type(model).__name__
    if name == "GPT2LMHeadModel":
        return {"lm_head.weight": "transformer.wte.weight"}
    if name == "LlamaForCausalLM":
        return {"lm_head.weight": "model.embed_tokens.weight"}
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
    from .partition import model_blocks, partition

    model = build_on_meta(folder, attn_implementation)
    tied = tied_aliases(model)
    stage_blocks = partition(model_blocks(model, untie_weights), stages, balance)
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in 0..{stages - 1}, got {stage}")
    materialize_stage(folder, stage_blocks[stage], tied, device)
    return model


def resident_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters that have real memory (meta parameters count 0)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen and not p.is_meta:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
