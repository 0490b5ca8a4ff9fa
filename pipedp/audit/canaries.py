"""The white-box audit's model and data: every canary's gradient lives on its own coordinate.

The model is a chain of blocks over a state laid out as [features (w) | accumulator (1) |
canary one-hots (m)]. Each block maps the features through a bias-free Linear + tanh and
adds, through its *tap* (a bias-free Linear from its own share of the one-hots to the
accumulator), the one-hots of the canaries it hosts; the head outputs v . features +
accumulator. A real example has no one-hot, so it never touches a tap. Canary i has zero
features and one-hot e_i, and the per-sample loss -s * output: its gradient is exactly
-s e_i on the tap coordinate of canary i (s > C, so it is clipped to size C) and zero
everywhere else. Canaries are spread over the blocks, so every stage hosts some: a noise
bug on any stage shows.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn as nn

CANARY_LOSS_SCALE = 10.0  # s, in units of the clipping norm: every canary is clipped


class AuditBlock(nn.Module):
    def __init__(self, in_features: int, width: int, hosted: Tuple[int, int], canaries: int):
        super().__init__()
        self.in_features, self.hosted, self.canaries = in_features, hosted, canaries
        self.linear = nn.Linear(in_features, width, bias=False)
        self.tap = nn.Linear(hosted[1] - hosted[0], 1, bias=False)
        nn.init.zeros_(self.tap.weight)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        features = state[:, : self.in_features]
        accumulator = state[:, self.in_features : self.in_features + 1]
        hots = state[:, self.in_features + 1 :]
        accumulator = accumulator + self.tap(hots[:, self.hosted[0] : self.hosted[1]])
        return torch.cat([torch.tanh(self.linear(features)), accumulator, hots], dim=1)


class AuditHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.width = width
        self.linear = nn.Linear(width, 1, bias=False)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return (self.linear(state[:, : self.width]) + state[:, self.width : self.width + 1]).squeeze(1)


def audit_model(features: int, width: int, blocks: int, canaries: int, seed: int) -> nn.Sequential:
    """``blocks`` AuditBlocks (canaries split evenly among them) and a head, as an nn.Sequential."""
    torch.manual_seed(seed)
    bounds = [round(canaries * k / blocks) for k in range(blocks + 1)]
    layers: List[nn.Module] = [
        AuditBlock(features if k == 0 else width, width, (bounds[k], bounds[k + 1]), canaries) for k in range(blocks)
    ]
    layers.append(AuditHead(width))
    return nn.Sequential(*layers).double()


def tap_names(model: nn.Sequential) -> List[str]:
    return [f"{name}.tap.weight" for name, module in model.named_children() if isinstance(module, AuditBlock)]


def canary_block(model: nn.Sequential) -> List[int]:
    """For each canary, the index of the block that hosts it."""
    out: List[int] = []
    for k, module in enumerate(m for m in model.children() if isinstance(m, AuditBlock)):
        out += [k] * (module.hosted[1] - module.hosted[0])
    return out


def audit_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample losses: squared error for real rows, -s * output for canaries (targets[:, 1] = 1)."""
    is_canary = targets[:, 1] > 0
    return torch.where(is_canary, -CANARY_LOSS_SCALE * outputs, (outputs - targets[:, 0]) ** 2)


def audit_data(features: int, canaries: int, examples: int, included: torch.Tensor, seed: int):
    """(inputs, targets) of the training set: ``examples`` real rows, then the included canaries."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(examples, features, generator=g, dtype=torch.float64)
    y = torch.tanh(x.sum(1, keepdim=True) / features**0.5)
    real_in = torch.cat([x, torch.zeros(examples, 1 + canaries, dtype=torch.float64)], 1)
    real_target = torch.cat([y, torch.zeros(examples, 1, dtype=torch.float64)], 1)
    ids = torch.nonzero(included).flatten()
    hots = torch.zeros(len(ids), canaries, dtype=torch.float64)
    hots[torch.arange(len(ids)), ids] = 1.0
    canary_in = torch.cat([torch.zeros(len(ids), features + 1, dtype=torch.float64), hots], 1)
    canary_target = torch.cat([torch.zeros(len(ids), 1), torch.ones(len(ids), 1)], 1).double()
    return torch.cat([real_in, canary_in]), torch.cat([real_target, canary_target])
