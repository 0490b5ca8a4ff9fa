"""Hugging Face causal LMs as pipeline blocks, and stage-by-stage loading of local checkpoints.

GPT2LMHeadModel:  [embeddings (wte + wpe)] [block 0] ... [block L-1] [ln_f + lm_head]
LlamaForCausalLM: [embed_tokens] [decoder layer 0] ... [decoder layer L-1] [norm + lm_head]

Only the hidden state travels between stages. What a layer needs besides it is recomputed
where it is used: position ids (0..T-1 for every sequence, as the whole model's forward
uses), the attention mask (an explicit additive mask: causal, plus the padding of the
micro-batch's ``attention_mask`` when the inputs are a dict, valid for the eager and sdpa
attention implementations), and Llama's rotary embeddings (each decoder block holds its own
small rotary module, so no module is shared across stages).

Every block wraps the model's own submodules under their original attribute paths, so a
block's state dict keys, prefixed with its name, are the model's own keys.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from ..errors import BatchError, UnsupportedModelError
from .blocks import Block

SUPPORTED_ATTENTION = ("eager", "sdpa")


def _attention_mask(hidden: torch.Tensor, side_inputs: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
    """The additive mask: causal, plus the padding of the micro-batch's ``attention_mask`` (1 keep,
    0 pad) when the inputs carry one; [1, 1, T, T] or [n, 1, T, T], with the dtype's minimum for
    "masked" (never -inf: a fully masked padding query stays finite, as in Hugging Face's own)."""
    t = hidden.shape[1]
    low = torch.finfo(hidden.dtype).min
    mask = torch.triu(torch.full((t, t), low, device=hidden.device, dtype=hidden.dtype), diagonal=1)[None, None]
    padding = (side_inputs or {}).get("attention_mask")
    if padding is None:
        return mask
    if padding.shape != hidden.shape[:2]:
        raise BatchError(
            f"attention_mask of shape {tuple(padding.shape)} does not match the sequences "
            f"{tuple(hidden.shape[:2])}: give one [batch, seq_len] mask of 1 (token) and 0 (padding)"
        )
    keys = (padding[:, None, None, :] == 0).to(hidden.device)
    return mask.masked_fill(keys, low)


def _ids(inputs) -> torch.Tensor:
    return inputs["input_ids"] if isinstance(inputs, dict) else inputs


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

    def forward(self, inputs):
        ids = _ids(inputs)
        return self.drop(self.wte(ids) + self.wpe(_positions(ids)))


class GPT2Layer(nn.Module):
    """transformer.h.{i}: registered under its index, so its keys are the model's own."""

    def __init__(self, index: int, block):
        super().__init__()
        self.index = str(index)
        self.add_module(self.index, block)

    def forward(self, hidden, side_inputs=None):
        return _first(getattr(self, self.index)(hidden, attention_mask=_attention_mask(hidden, side_inputs)))


class GPT2Head(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.transformer = _holder(ln_f=model.transformer.ln_f)
        self.lm_head = model.lm_head

    def forward(self, hidden):
        return self.lm_head(self.transformer.ln_f(hidden))


@dataclass(frozen=True)
class DecoderSpec:
    """Where a rotary decoder keeps its parts: ``model.<body>.<embed>`` (then ``<dropout>``),
    ``<body>.layers``, ``<body>.<norm>``, ``<body>.rotary_emb`` and the head ``model.<head>``."""

    body: str = "model"
    embed: str = "embed_tokens"
    dropout: Optional[str] = None
    norm: str = "norm"
    head: str = "lm_head"


LLAMA_SPEC = DecoderSpec()
NEOX_SPEC = DecoderSpec(body="gpt_neox", embed="embed_in", dropout="emb_dropout", norm="final_layer_norm")


class DecoderEmbeddings(nn.Module):
    """<body>.<embed> (and <body>.<dropout>), under the model's own names."""

    def __init__(self, model, spec: DecoderSpec):
        super().__init__()
        body = getattr(model, spec.body)
        parts = {spec.embed: getattr(body, spec.embed)}
        if spec.dropout:
            parts[spec.dropout] = getattr(body, spec.dropout)
        self.spec = spec
        self.add_module(spec.body, _holder(**parts))

    def forward(self, inputs):
        body = getattr(self, self.spec.body)
        out = getattr(body, self.spec.embed)(_ids(inputs))
        return getattr(body, self.spec.dropout)(out) if self.spec.dropout else out


class LlamaLayer(nn.Module):
    """model.layers.{i} of a Llama-like decoder, with a private rotary module (buffers only, never
    shared across stages). ``window``: the layer's sliding attention window, if it has one."""

    def __init__(self, index: int, layer, rotary: nn.Module, window: Optional[int] = None):
        super().__init__()
        self.index = str(index)
        self.window = window
        self.add_module(self.index, layer)
        if any(b.is_meta for b in rotary.buffers()):
            self.rotary = type(rotary)(config=rotary.config)  # built on meta: recompute the frequencies
        else:
            self.rotary = copy.deepcopy(rotary)

    def reset_buffers(self, device=None) -> None:
        """Recompute the rotary frequencies (not stored in checkpoints; lost by to_empty)."""
        self.rotary = type(self.rotary)(config=self.rotary.config).to(device)

    def forward(self, hidden, side_inputs=None):
        if self.window is not None and hidden.shape[1] > self.window:
            raise UnsupportedModelError(
                f"decoder layer {self.index} attends within a sliding window of {self.window} tokens, shorter than "
                f"these sequences ({hidden.shape[1]}): pipedp builds full causal masks, which would be wrong here; "
                f"use sequences of at most {self.window} tokens"
            )
        positions = _positions(hidden)  # 0..T-1, as the whole model's own forward uses (padding or not)
        cos_sin = self.rotary(hidden, positions)
        return _first(
            getattr(self, self.index)(
                hidden,
                attention_mask=_attention_mask(hidden, side_inputs),
                position_ids=positions,
                position_embeddings=cos_sin,
            )
        )


class DecoderHead(nn.Module):
    """<body>.<norm> then the head, under the model's own names."""

    def __init__(self, model, spec: DecoderSpec):
        super().__init__()
        self.spec = spec
        self.add_module(spec.body, _holder(**{spec.norm: getattr(getattr(model, spec.body), spec.norm)}))
        self.add_module(spec.head, getattr(model, spec.head))

    def forward(self, hidden):
        norm = getattr(getattr(self, self.spec.body), self.spec.norm)
        return getattr(self, self.spec.head)(norm(hidden))


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


# Llama-like decoders: model.model.{embed_tokens, layers, norm, rotary_emb} + lm_head, decoder layers
# called as layer(hidden, attention_mask=, position_ids=, position_embeddings=), nothing after the head
# (each family checked against the loop oracle in tests/numerics/test_hf.py).
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma")
SPECS = {**{t: LLAMA_SPEC for t in LLAMA_LIKE}, "gpt_neox": NEOX_SPEC}


def _sliding_window(config, index: int) -> Optional[int]:
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if types[index] == "sliding_attention" else None
    return window


def decoder_blocks(model, spec: DecoderSpec = LLAMA_SPEC, untie_weights: bool = False) -> List[Block]:
    _check_attention(model)
    body = getattr(model, spec.body)
    if untie_weights:
        _untie(model, getattr(model, spec.head), getattr(body, spec.embed))
    blocks = [Block("", DecoderEmbeddings(model, spec))]
    with torch.device("cpu"):
        blocks += [
            Block(f"{spec.body}.layers", LlamaLayer(i, layer, body.rotary_emb, _sliding_window(model.config, i)))
            for i, layer in enumerate(body.layers)
        ]
    blocks.append(Block("", DecoderHead(model, spec)))
    return blocks


def hf_blocks(model: nn.Module, untie_weights: bool = False) -> Optional[List[Block]]:
    """Blocks for a known Hugging Face causal LM; a model of transformers that is not one is refused,
    naming what is supported."""
    name = type(model).__name__
    if name == "GPT2LMHeadModel":
        return gpt2_blocks(model, untie_weights)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if name.endswith("ForCausalLM") and model_type in SPECS:
        return decoder_blocks(model, SPECS[model_type], untie_weights)
    if name.endswith("ForCausalLM") or name.endswith("LMHeadModel"):
        raise UnsupportedModelError(
            f"{name} (model_type {model_type!r}) is not one of the Hugging Face families pipedp splits exactly: "
            f"gpt2, gpt_neox and the Llama-like {list(LLAMA_LIKE)}; its layers may need masks, scalings or logit "
            "caps pipedp does not rebuild. Give the model a pipeline_blocks() method, or mark split points "
            "with pipe_split() and wrap it in pipedp.SplitModel"
        )
    return None
