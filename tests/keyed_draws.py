"""Sampled routing the loop oracle can reproduce: Phi-MoE's router (sparsemixer) draws its experts in
training, one Gumbel draw and one uniform per token, from torch's generator, so a token alone draws other
numbers than in the micro-batch. ``keyed(router)`` makes a router's training forward take each draw from the
values of the row it is drawn for (a token's scores), the same whether the token runs alone or in a batch,
while sparsemixer itself (its masks, its custom backward) runs unchanged. pipedp's own runs with the real
draws are tested too (tests/numerics/test_moe.py)."""

from __future__ import annotations

import types
from unittest import mock

import torch
import torch.nn as nn


def _uniform(rows: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) numbers [..., k] from each row's own values (smooth in them: a rounding difference between
    the micro-batch and the token alone moves a draw by ~1e-12, not to another expert)."""
    v = torch.nan_to_num(rows.detach().to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
    columns = torch.arange(rows.shape[-1], dtype=torch.float64, device=rows.device)
    u = torch.frac((torch.sin(v.sum(-1, keepdim=True) * 12.9898 + columns * 78.233) * 43758.5453).abs())
    return u.clamp(1e-6, 1 - 1e-6).to(rows.dtype)


class _Drawn(torch.Tensor):
    """Uniform draws standing in for an empty or random tensor: its ``exponential_`` and ``uniform_`` read them
    (a Gumbel draw is -log of an exponential one), any other operation gives a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.exponential_:
                return -torch.log(args[0])
            if func is torch.Tensor.uniform_:
                return args[0].as_subclass(cls)
            return func(*args, **(kwargs or {}))


def _empty_like(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return _uniform(t).as_subclass(_Drawn)


def _rand_like(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return _uniform(t * 7.0 + 1.0).as_subclass(_Drawn)  # (another key than the Gumbel draw's)


def keyed(router: nn.Module) -> None:
    """``router`` (this instance, and its deep copies) draws keyed numbers in training."""
    forward = type(router).forward

    def drawn(self, *args, **kwargs):
        if not self.training:
            return forward(self, *args, **kwargs)
        with mock.patch.object(torch, "empty_like", _empty_like), mock.patch.object(torch, "rand_like", _rand_like):
            return forward(self, *args, **kwargs)

    router.forward = types.MethodType(drawn, router)
