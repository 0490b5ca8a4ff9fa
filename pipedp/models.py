"""Small built-in models, as nn.Sequential of pipeline blocks (random weights, nothing downloaded).

The transformer is GPT-style: token + position embeddings, pre-LayerNorm blocks with
multi-head causal self-attention built from nn.Linear (so Opacus's samplers cover it),
residuals, a final LayerNorm and a Linear head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp(sizes=(8, 16, 16, 4)) -> nn.Sequential:
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


@dataclass
class GPTConfig:
    vocab_size: int = 64
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4


class Embeddings(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1).contiguous()
        return self.tok(ids) + self.pos(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class LMHead(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(x))


def tiny_gpt(cfg: GPTConfig = GPTConfig()) -> nn.Sequential:
    blocks = [Embeddings(cfg)] + [TransformerBlock(cfg) for _ in range(cfg.n_layers)] + [LMHead(cfg)]
    return nn.Sequential(*blocks)


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample loss of a token model: each sequence's mean next-token cross-entropy over its
    target tokens (targets of -100, e.g. padding, are ignored, as in Hugging Face's labels)."""
    # over [tokens, vocab] rows: a transposed [n, vocab, T] input makes the backward copy the whole
    # logits-sized gradient once more (and log-softmax run over a strided dimension)
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    losses = flat.view(targets.shape)  # 0 where the target is -100
    return losses.sum(dim=1) / (targets != -100).sum(dim=1).clamp(min=1)
