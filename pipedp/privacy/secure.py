"""Secure mode: noise and sampling from the operating system's CSPRNG.

Opacus's secure mode needs torchcsprng, whose last release (2021) does not build for
current torch. pipedp draws the random bits from os.urandom instead (a cryptographically
secure source), turns them into Gaussians with Box-Muller in float64, and applies the
same floating-point-attack fix as Opacus (Holohan & Braghin 2021): the sum of 2n = 4
Gaussians of std sigma, divided by 2. Secure runs are, by design, not reproducible.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch


def secure_uniform(count: int) -> np.ndarray:
    """count floats uniform in (0, 1), 53 random bits each, from os.urandom."""
    bits = np.frombuffer(os.urandom(8 * count), dtype=np.uint64) >> np.uint64(11)
    return (bits.astype(np.float64) + 0.5) / float(1 << 53)


def _secure_standard_normal(count: int) -> np.ndarray:
    half = (count + 1) // 2
    u1, u2 = secure_uniform(half), secure_uniform(half)
    radius = np.sqrt(-2.0 * np.log(u1))
    z = np.concatenate([radius * np.cos(2 * math.pi * u2), radius * np.sin(2 * math.pi * u2)])
    return z[:count]


def secure_gaussian_like(reference: torch.Tensor, std: float) -> torch.Tensor:
    n = reference.numel()
    draws = sum(_secure_standard_normal(n) for _ in range(4)) / 2.0  # 2n = 4 draws, Holohan & Braghin
    return torch.from_numpy(draws * std).reshape(reference.shape).to(reference.device, reference.dtype)
