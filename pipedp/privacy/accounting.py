"""Privacy accounting on top of Opacus's accountants (prv, rdp, gdp): what each step is charged,
the epsilon spent, the budget guard and the noise calibration.

What a step is charged depends on how its batch was drawn (``PrivacyConfig.sampling``):
- ``"poisson"``: every record independently with probability q: the accountant's subsampled
  Gaussian at rate q (amplification by subsampling);
- ``"shuffle"``: each epoch a random permutation cut into batches: a record is in exactly one
  step per epoch, so each epoch is charged one Gaussian mechanism at rate 1, at its first step
  (no amplification: a valid bound whatever the permutation);
- undeclared (caller-made batches): any step may hold any record: every step is charged at rate 1.
The last two assume a record appears at most once in a batch, and that removing it leaves the
other records' batches as they were (add/remove adjacency, like the Poisson case).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Callable, List, Optional, Sequence, Tuple

from opacus.accountants import IAccountant, create_accountant

from ..config import PrivacyConfig
from ..errors import ConfigError, PipeDPError

Entry = Tuple[float, float, int]  # (noise multiplier, sample rate, steps): an Opacus history entry
MAX_SIGMA = 1e6  # as Opacus's calibration: beyond it the budget counts as unreachable
CALIBRATION_LIMIT_S = 300.0  # a calibration that takes longer is stopped with advice


def charged_rate(
    sampling: Optional[str], sample_rate: Optional[float], step: int, steps_per_epoch: int
) -> Optional[float]:
    """The sample rate the accountant records for step ``step`` (0-based), or None when the step adds
    nothing to any record's privacy loss (a later step of a shuffled epoch already charged)."""
    if sampling == "poisson":
        if sample_rate is None:
            raise PipeDPError("Poisson-sampled steps need the trainer's sample_rate to be accounted")
        return sample_rate
    if sampling == "shuffle":
        return 1.0 if step % steps_per_epoch == 0 else None
    return 1.0


def _quiet_epsilon(accountant: IAccountant, delta: float) -> float:
    with warnings.catch_warnings():  # RDP warns about its alpha grid at the extremes
        warnings.simplefilter("ignore")
        return max(0.0, float(accountant.get_epsilon(delta=delta)))  # never negative: eps >= 0 by definition


def epsilon_of(history: Sequence[Entry], delta: float, mechanism: str) -> float:
    """The epsilon of an Opacus history at ``delta`` (inf once a step had no noise; 0 for no step)."""
    history = [h for h in history if h[2] > 0]
    if not history:
        return 0.0
    if any(sigma == 0 for sigma, _, _ in history):
        return math.inf  # a step without noise has no finite privacy guarantee
    accountant = create_accountant(mechanism=mechanism)
    accountant.history = [tuple(h) for h in history]
    return _quiet_epsilon(accountant, delta)


def epsilon_after(steps: int, noise_multiplier: float, sample_rate: float, delta: float, accountant: str) -> float:
    return epsilon_of([(noise_multiplier, sample_rate, steps)], delta, accountant)


def spent_epsilon(accountant: IAccountant, delta: float) -> float:
    """The epsilon of the steps an Opacus accountant has recorded."""
    return epsilon_of(accountant.history, delta, accountant.mechanism())


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


class BudgetGuard:
    """Would one more charge push epsilon above ``max_epsilon``? A run of equal charges (the usual
    case) is answered from the number of such steps the budget allows, computed once; any other
    history is evaluated directly."""

    def __init__(self, max_epsilon: float, delta: float, mechanism: str):
        self.max_epsilon, self.delta, self.mechanism = max_epsilon, delta, mechanism
        self._allowed: dict = {}  # (sigma, q) -> steps within budget

    def allows(self, history: List[Entry], charge: Optional[Tuple[float, float]]) -> bool:
        if charge is None:  # the step adds nothing to any record's loss
            return True
        same = all((sigma, q) == charge for sigma, q, _ in history)
        if same:
            if charge not in self._allowed:
                self._allowed[charge] = steps_within_budget(
                    self.max_epsilon, self.delta, charge[0], charge[1], self.mechanism
                )
            return sum(n for _, _, n in history) + 1 <= self._allowed[charge]
        return epsilon_of(list(history) + [(charge[0], charge[1], 1)], self.delta, self.mechanism) <= self.max_epsilon


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str,
    progress: Optional[Callable[[str], None]] = None,
    time_limit: float = CALIBRATION_LIMIT_S,
) -> float:
    """The smallest noise multiplier (within 2% of the target epsilon, at most 0.01) whose epsilon after
    ``steps`` steps at ``sample_rate`` is at most ``target_epsilon``, found by bisection.

    The bracket comes from the Gaussian-DP estimate (milliseconds), so the chosen accountant is only
    asked about noise levels near the answer: asked about far larger epsilons, the prv accountant's
    grid grows until it takes minutes or exhausts memory. ``progress`` gets one line per evaluation;
    past ``time_limit`` seconds the search stops with advice rather than running on unbounded."""
    start = time.monotonic()
    tolerance = min(0.01, 0.02 * target_epsilon)
    known: dict = {}

    def eps(sigma: float) -> float:
        if sigma in known:
            return known[sigma]
        value = known[sigma] = epsilon_after(steps, sigma, sample_rate, delta, accountant)
        elapsed = time.monotonic() - start
        if progress is not None:
            progress(f"calibrating noise ({accountant}): sigma {sigma:.4g} gives epsilon {value:.4g} [{elapsed:.0f}s]")
        if elapsed > time_limit:
            raise PipeDPError(
                f"noise calibration for target epsilon {target_epsilon} at delta {delta} over {steps} steps did not "
                f"finish within {time_limit:.0f}s ({accountant} accountant): give noise_multiplier directly, or "
                "calibrate with accountant='rdp' (faster, looser)"
            )
        return value

    guess = _gaussian_dp_guess(target_epsilon, delta, sample_rate, steps)
    low, high = guess / 2, guess * 2
    while eps(high) > target_epsilon:  # widen up
        low, high = high, high * 2
        if high > MAX_SIGMA:
            raise PipeDPError(
                f"target epsilon {target_epsilon} at delta {delta} cannot be met with sample rate {sample_rate} over "
                f"{steps} steps (no noise multiplier up to {MAX_SIGMA:g} reaches it with the {accountant} accountant): "
                "raise the target epsilon or delta, lower the sample rate, or train fewer steps"
            )
    while low > 1e-3 and eps(low) <= target_epsilon:  # widen down
        high, low = low, low / 2
    eps_high = eps(high)
    while target_epsilon - eps_high > tolerance and high - low > 1e-9 * high:
        mid = (low + high) / 2
        value = eps(mid)
        if value <= target_epsilon:
            high, eps_high = mid, value
        else:
            low = mid
    return high


def planned_charges(privacy: PrivacyConfig) -> Tuple[float, int]:
    """(sample rate, number of charges) the planned steps will be accounted with, as declared: Poisson
    steps at q (fit()'s sampler when nothing is declared but a sample rate); a shuffled epoch once at
    rate 1; undeclared steps each at rate 1."""
    steps = privacy.planned_steps()
    if steps is None:
        raise PipeDPError("calibrating the noise needs total_steps or epochs")
    if privacy.sampling == "poisson" or (privacy.sampling is None and privacy.sample_rate is not None):
        assert privacy.sample_rate is not None
        return privacy.sample_rate, steps
    if privacy.sampling == "shuffle":
        if privacy.dataset_size is None or privacy.expected_batch_size is None:
            raise ConfigError(
                "target_epsilon with sampling='shuffle' needs dataset_size (an epoch is charged once)", "sampling"
            )
        return 1.0, math.ceil(steps / math.ceil(privacy.dataset_size / privacy.expected_batch_size))
    return 1.0, steps


def calibrated(privacy: PrivacyConfig, progress: Optional[Callable[[str], None]] = None) -> PrivacyConfig:
    """``privacy`` with the noise multiplier that meets its target_epsilon over its planned steps, for the
    sampling it declares (the one place both the trainer and the CLI calibrate); the target is kept."""
    assert privacy.target_epsilon is not None
    rate, charges = planned_charges(privacy)
    sigma = calibrate_noise(privacy.target_epsilon, privacy.delta, rate, charges, privacy.accountant, progress)
    return dataclasses.replace(privacy, noise_multiplier=sigma)


def _gaussian_dp_guess(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """A starting noise multiplier from the Gaussian-DP (central limit) estimate; any failure: 1."""
    try:
        from opacus.accountants.utils import get_noise_multiplier

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            guess = float(
                get_noise_multiplier(
                    target_epsilon=target_epsilon,
                    target_delta=delta,
                    sample_rate=sample_rate,
                    steps=steps,
                    accountant="gdp",
                    epsilon_tolerance=max(1e-4, 0.05 * target_epsilon),
                )
            )
    except (ValueError, ZeroDivisionError, OverflowError):
        return 1.0
    return guess if math.isfinite(guess) and guess > 0 else 1.0
