"""Privacy accounting helpers on top of Opacus's accountants (prv, rdp, gdp)."""

from __future__ import annotations

import math
import warnings

from opacus.accountants import IAccountant, create_accountant
from opacus.accountants.utils import get_noise_multiplier

from ..errors import PipeDPError


def epsilon_after(steps: int, noise_multiplier: float, sample_rate: float, delta: float, accountant: str) -> float:
    if steps == 0:
        return 0.0
    acc = create_accountant(mechanism=accountant)
    acc.history = [(noise_multiplier, sample_rate, steps)]
    return float(acc.get_epsilon(delta=delta))


def steps_within_budget(
    max_epsilon: float, delta: float, noise_multiplier: float, sample_rate: float, accountant: str, limit: int = 10**8
) -> int:
    """The largest number of steps whose epsilon stays <= max_epsilon (epsilon grows with steps)."""
    if noise_multiplier == 0:
        return 0
    if epsilon_after(1, noise_multiplier, sample_rate, delta, accountant) > max_epsilon:
        return 0
    low, high = 1, 2
    while high < limit and epsilon_after(high, noise_multiplier, sample_rate, delta, accountant) <= max_epsilon:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        if epsilon_after(mid, noise_multiplier, sample_rate, delta, accountant) <= max_epsilon:
            low = mid
        else:
            high = mid
    return low


def calibrate_noise(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    """Opacus's get_noise_multiplier, with errors that say what to change."""
    try:
        with warnings.catch_warnings():  # the RDP search warns about its alpha grid at the extremes
            warnings.simplefilter("ignore")
            return float(
                get_noise_multiplier(
                    target_epsilon=target_epsilon,
                    target_delta=delta,
                    sample_rate=sample_rate,
                    steps=steps,
                    accountant=accountant,
                )
            )
    except ValueError as exc:
        raise PipeDPError(
            f"target epsilon {target_epsilon} at delta {delta} cannot be met with sample rate {sample_rate} over "
            f"{steps} steps ({exc}): raise the target epsilon, lower the sample rate, or train fewer steps"
        ) from exc


def spent_epsilon(accountant: IAccountant, delta: float) -> float:
    """The epsilon of the steps an Opacus accountant has recorded (inf once a step had no noise)."""
    if not accountant.history:
        return 0.0
    if any(sigma == 0 for sigma, _, _ in accountant.history):
        return math.inf  # a step without noise has no finite privacy guarantee
    return float(accountant.get_epsilon(delta=delta))
