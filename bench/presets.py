"""Model presets for the benchmarks: the sizes the questions in bench/RESULTS.md need.

Each preset carries the batch it is measured at (``batch`` rows as ``microbatches`` micro-batches)
and, for the LoRA question, the modules its adapters go on. ``build(stages, rank)`` returns the
whole model, or, for the large presets, the model with only that rank's stage given memory (the
rest stays on the meta device, as ``pipedp.split.hf_loading.load_pipeline_stage`` leaves it):
random weights drawn per tensor name from a fixed seed, so every rank and every contender gets the
same values without any rank ever building the whole model.

    small        GPT-style, 4 blocks, d=256, T=64, 8 micro-batches of 8 rows
    realistic    GPT-style, 4 blocks, d=1024, T=128, 4 micro-batches of 4 rows (batch 16)
    llama-slice  HF LlamaForCausalLM with Llama-2-7B's widths (d=4096, 11008, 32 heads, vocab 32000), 2 layers
    mixtral-slice  HF MixtralForCausalLM: 8 experts top-2 at a quarter of Mixtral-8x7B's widths, 2 layers
    gpt, gpt-long, gpt-wide, mlp, tiny   the earlier presets (tiny: smoke tests)
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipedp.models import GPTConfig, mlp, tiny_gpt, token_loss

# how every bench contender, loader and trainer splits a model (explicit: pipedp's default has changed before)
BALANCE = "params"


def _token_mean_loss(out, y):
    out = getattr(out, "logits", out)  # (a Hugging Face model's output, called whole by the one-process contenders)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


@dataclass
class Preset:
    name: str
    build_whole: Callable[[], nn.Module]
    make_batch: Callable[[int, int], tuple]  # (batch size, seed) -> (inputs, targets)
    loss: Callable  # per-sample losses
    mean_loss: Callable  # the non-private scalar loss (mean over the batch)
    note: str
    batch: int = 32
    microbatches: int = 8
    lora_targets: List[str] = field(default_factory=list)
    lora_parameters: List[str] = field(default_factory=list)  # PEFT's target_parameters: an expert bank's weights
    build_meta: Optional[Callable[[], nn.Module]] = None  # large presets: the model on the meta device
    opacus: bool = True  # Opacus can run the whole model in one process

    def build(self, stages: int = 1, rank: int = 0) -> nn.Module:
        """The model; for a large preset only ``rank``'s stage of ``stages`` has memory (the split pipedp
        makes with balance="params")."""
        if self.build_meta is None:
            return self.build_whole()
        from pipedp import load_stage

        model = self.build_meta()
        return load_stage(model, RandomWeights(model), stages, rank, balance=BALANCE)

    @property
    def lora_config(self):
        from peft import LoraConfig

        return LoraConfig(
            r=8,
            lora_alpha=16,
            lora_dropout=0.0,
            target_modules=self.lora_targets,
            target_parameters=self.lora_parameters or None,
        )


class RandomWeights(Mapping):
    """A weight source for pipedp.load_stage: each tensor of a meta model drawn when it is read, from a
    generator seeded by its name (norm weights 1, biases 0, the rest N(0, 0.02)), in the model's dtype."""

    def __init__(self, model: nn.Module, std: float = 0.02):
        self.shapes = {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items()}
        self.std = std

    def __getitem__(self, name: str) -> torch.Tensor:
        shape, dtype = self.shapes[name]
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and leaf == "weight":
            return torch.ones(shape, dtype=dtype)
        if leaf == "bias":
            return torch.zeros(shape, dtype=dtype)
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        return (torch.randn(shape, generator=g) * self.std).to(dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def _token_batch(vocab: int, seq: int) -> Callable[[int, int], Tuple[torch.Tensor, torch.Tensor]]:
    def batch(n, seed):
        g = torch.Generator().manual_seed(seed)
        return (
            torch.randint(0, vocab, (n, seq), generator=g),
            torch.randint(0, vocab, (n, seq), generator=g),
        )

    return batch


def gpt_preset(cfg: GPTConfig, note: str, name: str, batch: int = 32, microbatches: int = 8) -> Preset:
    return Preset(
        name,
        lambda: tiny_gpt(cfg),
        _token_batch(cfg.vocab_size, cfg.seq_len),
        token_loss,
        _token_mean_loss,
        note,
        batch,
        microbatches,
        ["qkv", "proj"],  # the attention's projections (q, k, v fused in one Linear)
    )


def _mlp(sizes, name, note) -> Preset:
    def batch(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, sizes[0], generator=g), torch.randint(0, sizes[-1], (n,), generator=g)

    return Preset(
        name,
        lambda: mlp(sizes),
        batch,
        lambda o, y: F.cross_entropy(o, y, reduction="none"),
        lambda o, y: F.cross_entropy(o, y),
        note,
    )


class LogitsOnly(nn.Module):
    """A Hugging Face causal LM called as model(ids) -> logits (for single-process contenders)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def llama_config(layers: int, vocab: int = 32000, **overrides):
    """Llama-2-7B's widths with ``layers`` decoder layers."""
    from transformers import LlamaConfig

    widths = dict(
        vocab_size=vocab,
        hidden_size=4096,
        intermediate_size=11008,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    widths.update(overrides)
    return LlamaConfig(num_hidden_layers=layers, **widths)


def llama_of_width(width: int, layers: int, vocab: int, head_dim: int = 128):
    """Llama-2's shape at another width: its MLP ratio (11/4), heads of ``head_dim``, an untied head."""
    heads = width // head_dim
    return llama_config(
        layers, vocab, hidden_size=width, intermediate_size=width * 11 // 4, num_attention_heads=heads,
        num_key_value_heads=heads,
    )  # fmt: skip


def mixtral_config(layers: int, vocab: int = 32000, **overrides):
    """Mixtral-8x7B's routing (8 experts, top 2) at a quarter of its widths (d=1024, experts 3584 wide),
    ``layers`` decoder layers; transformers' default experts kernel (grouped products)."""
    from transformers import MixtralConfig

    widths = dict(
        vocab_size=vocab,
        hidden_size=1024,
        intermediate_size=3584,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    widths.update(overrides)
    return MixtralConfig(num_hidden_layers=layers, **widths)


def _llama(
    name: str, note: str, cfg_fn: Callable, seq: int, batch: int, microbatches: int, lora_parameters=()
) -> Preset:
    def meta():
        from pipedp.split.hf_loading import build_on_meta

        return build_on_meta(cfg_fn())  # rotary frequencies computed, as from_pretrained computes them

    def whole():
        from pipedp import load_stage

        model = meta()
        return load_stage(model, RandomWeights(model), 1, 0, balance=BALANCE)

    return Preset(
        name,
        whole,
        _token_batch(cfg_fn().vocab_size, seq),
        token_loss,
        _token_mean_loss,
        note,
        batch,
        microbatches,
        ["q_proj", "v_proj"],
        list(lora_parameters),
        build_meta=meta,
        opacus=False,  # Opacus has no grad sampler for LlamaRMSNorm
    )


EXPERT_WEIGHTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # LoRA on the banks too (the lora question)
PRESETS = {
    "small": gpt_preset(
        GPTConfig(vocab_size=256, seq_len=64, d_model=256, n_heads=4, n_layers=4),
        "small GPT: 4 blocks, d=256, T=64, vocab 256; batch 64 as 8 micro-batches of 8",
        "small",
        batch=64,
        microbatches=8,
    ),
    "realistic": gpt_preset(
        GPTConfig(vocab_size=256, seq_len=128, d_model=1024, n_heads=16, n_layers=4),
        "realistic GPT: 4 blocks, d=1024, T=128, vocab 256; batch 16 as 4 micro-batches of 4",
        "realistic",
        batch=16,
        microbatches=4,
    ),
    "llama-slice": _llama(
        "llama-slice",
        "Llama-2-7B widths, 2 decoder layers (667M parameters, fp32), T=32; batch 8 as 4 micro-batches of 2",
        lambda: llama_config(2),
        seq=32,
        batch=8,
        microbatches=4,
    ),
    "gpt": gpt_preset(
        GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4),
        "GPT-style, 4 layers, d=128, T=64",
        "gpt",
    ),
    # long sequences, narrow layers: materializing [n, out, in] is cheap, ghost's [n, T, T] is not
    "gpt-long": gpt_preset(
        GPTConfig(vocab_size=256, seq_len=256, d_model=32, n_heads=4, n_layers=4), "GPT-style, d=32, T=256", "gpt-long"
    ),
    # matrix work dominates: d=512, T=128, 8 layers (the per-micro-batch fixed costs weigh less)
    "gpt-wide": gpt_preset(
        GPTConfig(vocab_size=256, seq_len=128, d_model=512, n_heads=8, n_layers=8),
        "GPT-style, 8 layers, d=512, T=128",
        "gpt-wide",
    ),
    "mlp": _mlp((512, 1024, 1024, 1024, 1024, 10), "mlp", "MLP 512-1024x4-10"),
    "tiny": gpt_preset(
        GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2),
        "smoke-test size",
        "tiny",
        batch=8,
        microbatches=2,
    ),
    "mixtral-slice": _llama(
        "mixtral-slice",
        "Mixtral-shaped: 8 experts top-2, d=1024, experts 3584 wide, 2 layers, vocab 32000 (254M parameters, "
        "fp32), T=64; batch 8 as 4 micro-batches of 2",
        lambda: mixtral_config(2),
        seq=64,
        batch=8,
        microbatches=4,
        lora_parameters=EXPERT_WEIGHTS,
    ),
    "tiny-mixtral": _llama(
        "tiny-mixtral",
        "smoke-test Mixtral: d=32, 4 experts top-2, 2 layers, vocab 64, T=8",
        lambda: mixtral_config(
            2,
            vocab=64,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_local_experts=4,
        ),
        seq=8,
        batch=8,
        microbatches=2,
        lora_parameters=EXPERT_WEIGHTS,
    ),
    # smoke-test size of the Llama path (the HF adapter, stage-only materialisation, LoRA on q/v)
    "tiny-llama": _llama(
        "tiny-llama",
        "smoke-test Llama: d=32, 2 layers, vocab 64, T=8",
        lambda: llama_config(
            2, vocab=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4
        ),
        seq=8,
        batch=8,
        microbatches=2,
    ),
}
