"""Model presets for the benchmarks, sized for tens to hundreds of ms per step on 2 CPU cores."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipedp.models import GPTConfig, mlp, tiny_gpt, token_loss


@dataclass
class Preset:
    name: str
    build: Callable[[], nn.Sequential]
    make_batch: Callable[[int, int], tuple]  # (batch size, seed) -> (inputs, targets)
    loss: Callable  # per-sample losses
    mean_loss: Callable  # the non-private scalar loss (mean over the batch)
    note: str


def _gpt(cfg: GPTConfig, note: str, name: str) -> Preset:
    def batch(n, seed):
        g = torch.Generator().manual_seed(seed)
        return (
            torch.randint(0, cfg.vocab_size, (n, cfg.seq_len), generator=g),
            torch.randint(0, cfg.vocab_size, (n, cfg.seq_len), generator=g),
        )

    return Preset(
        name,
        lambda: tiny_gpt(cfg),
        batch,
        token_loss,
        lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)),
        note,
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


PRESETS = {
    "gpt": _gpt(
        GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4),
        "GPT-style, 4 layers, d=128, T=64",
        "gpt",
    ),
    # long sequences, narrow layers: materialising [n, out, in] is cheap, ghost's [n, T, T] is not
    "gpt-long": _gpt(
        GPTConfig(vocab_size=256, seq_len=256, d_model=32, n_heads=4, n_layers=4), "GPT-style, d=32, T=256", "gpt-long"
    ),
    # matrix work dominates: d=512, T=128, 8 layers (the per-micro-batch fixed costs weigh less)
    "gpt-wide": _gpt(
        GPTConfig(vocab_size=256, seq_len=128, d_model=512, n_heads=8, n_layers=8),
        "GPT-style, 8 layers, d=512, T=128",
        "gpt-wide",
    ),
    "mlp": _mlp((512, 1024, 1024, 1024, 1024, 10), "mlp", "MLP 512-1024x4-10"),
    "tiny": _gpt(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2), "smoke-test size", "tiny"),
}
