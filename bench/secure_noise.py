"""Secure mode's noise: seconds per 4 Mi-element piece (one noise draw of pipedp's) with the random bits from
ChaCha20 keyed by os.urandom (pipedp's source where ``cryptography`` is installed) and from os.urandom itself
(its fallback), and the earlier numpy Box-Muller on os.urandom (before 2026-12-04), side by side, interleaved.

    python -m bench.secure_noise              # 5 rounds; prints the medians and the ratios
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from unittest import mock

import numpy as np
import torch

from pipedp.privacy import secure
from pipedp.privacy.noise import PIECE


def _numpy_before(reference: torch.Tensor, std: float) -> torch.Tensor:
    """The earlier implementation: numpy float64 Box-Muller on os.urandom, 4 draws summed and halved."""

    def uniform(count: int) -> np.ndarray:
        bits = np.frombuffer(os.urandom(8 * count), dtype=np.uint64) >> np.uint64(11)
        return (bits.astype(np.float64) + 0.5) / float(1 << 53)

    def normal(count: int) -> np.ndarray:
        half = (count + 1) // 2
        u1, u2 = uniform(half), uniform(half)
        r = np.sqrt(-2.0 * np.log(u1))
        return np.concatenate([r * np.cos(2 * math.pi * u2), r * np.sin(2 * math.pi * u2)])[:count]

    n = reference.numel()
    return torch.from_numpy(sum(normal(n) for _ in range(4)) / 2.0 * std).reshape(reference.shape)


def _chacha(piece: torch.Tensor) -> torch.Tensor:
    return secure.secure_gaussian_like(piece, 1.0)


def _urandom(piece: torch.Tensor) -> torch.Tensor:
    with mock.patch.object(secure, "Cipher", None):
        return secure.secure_gaussian_like(piece, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    piece = torch.zeros(PIECE)
    contenders = {"chacha20": _chacha, "urandom": _urandom, "numpy before": lambda p: _numpy_before(p, 1.0)}
    times: dict = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, draw in contenders.items():
            start = time.perf_counter()
            draw(piece)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in medians.items():
        print(f"{name:>13}: {seconds:.3f} s per {PIECE} elements ({seconds * 7e9 / PIECE / 60:.1f} min per 7e9)")
    base = medians["numpy before"]
    print(f"speed-up over before: chacha20 {base / medians['chacha20']:.2f}x, urandom {base / medians['urandom']:.2f}x")


if __name__ == "__main__":
    main()
