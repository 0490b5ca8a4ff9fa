"""Opacus's PRV accountant in bounded memory.

Its grid has about 2 L sqrt(T ln(12 / delta_error) / 2) / eps_error points for T steps (L grows with
epsilon): 0.5 M points at 6250 steps, 10^10 and more for 10^6 steps at a large sample rate. Two things
are bounded here, the value is otherwise Opacus's own to the bit:

- the grid: past ``MAX_POINTS`` points (67 bytes each at the peak, ~280 MiB), eps_error grows in
  proportion so that the grid keeps ``MAX_POINTS``: the epsilon stays an upper bound, by at most
  eps_error above the estimate (0.018 instead of 0.01 at 10^5 steps of sigma 1, q 0.01);
- scipy's FFT plan cache: pocketfft keeps the plans of the last 16 transform lengths, and every step
  count has its own length, so epsilon() at growing step counts kept up to 16 ever larger plans
  (+600 MiB over 50 calls, up to 6250 steps). After each evaluation the cache is filled with tiny plans.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV
from opacus.accountants.prv import PRVAccountant
from scipy.fft import rfft

MAX_POINTS = 1 << 22
EPS_ERROR = 0.01  # Opacus's default
_FLUSH = range(2, 2 + 2 * 64, 2)  # 64 tiny lengths: more than pocketfft's 16 cached plans


def grid_points(accountant: PRVAccountant, eps_error: float, delta_error: float) -> int:
    """The size of the grid Opacus would build (computed from RDP bounds alone: milliseconds)."""
    prvs = [PoissonSubsampledGaussianPRV(q, sigma) for sigma, q, _ in accountant.history]
    steps = [n for _, _, n in accountant.history]
    return accountant._get_domain(prvs, steps, eps_error, delta_error).size


def prv_epsilon(history: Sequence[Tuple[float, float, int]], delta: float) -> float:
    accountant = PRVAccountant()
    accountant.history = [tuple(h) for h in history]
    delta_error = delta / 1000  # Opacus's default
    eps_error = EPS_ERROR
    points = grid_points(accountant, eps_error, delta_error)
    if points > MAX_POINTS:
        eps_error *= points / MAX_POINTS * 1.01
    try:
        return float(accountant.get_epsilon(delta, eps_error=eps_error, delta_error=delta_error))
    finally:
        flush_fft_plans()


def flush_fft_plans() -> None:
    """Replace the plans scipy's FFT cached (one per transform length) with tiny ones."""
    for n in _FLUSH:
        rfft(np.zeros(n))


__all__ = ["MAX_POINTS", "flush_fft_plans", "grid_points", "prv_epsilon"]
