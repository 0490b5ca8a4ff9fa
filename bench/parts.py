"""Cut a preset's model into one part per rank, where pipedp cuts it (bench.presets.BALANCE, given to pipedp too), so
that torch's pipelining, the naive split and pipedp train the same parts."""

from __future__ import annotations

import torch

from pipedp.split.adapters import model_blocks
from pipedp.split.partition import partition

from .presets import BALANCE


def rank_part(model: torch.nn.Module, stages: int, rank: int) -> torch.nn.Sequential:
    """This rank's blocks; the other ranks' blocks are freed to the meta device."""
    parts = partition(model_blocks(model), stages, BALANCE)
    for s, blocks in enumerate(parts):
        if s != rank:
            for b in blocks:
                b.module.to("meta")
    return torch.nn.Sequential(*[b.module for b in parts[rank]])
