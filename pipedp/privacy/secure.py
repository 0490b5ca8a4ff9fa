"""Secure mode: noise and sampling from a cryptographically secure generator.

Opacus's secure mode needs torchcsprng, whose last release (2021) does not build for current torch. pipedp
takes its random bits from ChaCha20 keyed with 256 fresh bits of os.urandom per draw (the construction
Linux's own urandom runs; through the ``cryptography`` package, 4-5x faster than reading urandom for bulk
bits), or from os.urandom itself where ``cryptography`` is not installed. It turns them into Gaussians
with Box-Muller in float64 on the tensor's own device, and applies the same floating-point-attack fix as
Opacus (Holohan & Braghin 2021): the sum of 2n = 4 Gaussians of std sigma, divided by 2. Secure runs are,
by design, not reproducible.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

try:  # ChaCha20 in user space (OpenSSL); os.urandom without it
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
except ImportError:  # pragma: no cover (the dev extra installs it)
    Cipher = algorithms = None  # type: ignore[assignment,misc]

MASK_53 = (1 << 53) - 1


def secure_bytes(count: int) -> bytes:
    """``count`` random bytes: the ChaCha20 keystream of a fresh key and nonce from os.urandom, or os.urandom."""
    if Cipher is None:
        return os.urandom(count)
    encryptor = Cipher(algorithms.ChaCha20(os.urandom(32), os.urandom(16)), mode=None).encryptor()
    return encryptor.update(bytes(count))


def _uniform(count: int, device: torch.device) -> torch.Tensor:
    """``count`` float64 uniform in (0, 1), 53 random bits each, on ``device``."""
    if count == 0:  # (frombuffer refuses an empty buffer)
        return torch.zeros(0, dtype=torch.float64, device=device)
    raw = torch.frombuffer(bytearray(secure_bytes(8 * count)), dtype=torch.int64).to(device)
    return ((raw & MASK_53).to(torch.float64) + 0.5) / float(1 << 53)


def secure_uniform(count: int) -> np.ndarray:
    """``count`` floats uniform in (0, 1), 53 random bits each (the sampler's)."""
    return _uniform(count, torch.device("cpu")).numpy()


def _standard_normal(count: int, device: torch.device) -> torch.Tensor:
    half = (count + 1) // 2
    u = _uniform(2 * half, device)
    radius, angle = torch.sqrt(-2.0 * torch.log(u[:half])), (2 * math.pi) * u[half:]
    return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:count]


def secure_gaussian_like(reference: torch.Tensor, std: float) -> torch.Tensor:
    n = reference.numel()
    draws = _standard_normal(4 * n, reference.device).view(4, n).sum(0) / 2.0  # 2n = 4 draws, Holohan & Braghin
    return (draws * std).reshape(reference.shape).to(reference.dtype)
