"""Privacy accounting on top of Opacus's accountants (prv, rdp, gdp): what each step is charged,
the epsilon spent, the budget guard and the noise calibration.

What a step is charged depends on how its batch was drawn (``PrivacyConfig.sampling``):
- ``"poisson"``: every record independently with probability q: the accountant's subsampled
  Gaussian at rate q (amplification by subsampling);
- ``"shuffle"``: each epoch a random permutation cut into batches of at most expected_batch_size: a
  record is in exactly one step per epoch, so each epoch is charged one Gaussian mechanism at rate 1,
  at its first step (no amplification: a valid bound whatever the permutation); the epochs are counted
  by the units the batches hold (``Charges``), and a Poisson step inside an epoch is refused;
- undeclared (caller-made batches): any step may hold any record: every step is charged at rate 1.
The last two assume a record appears at most once in a batch (shuffled: at most once in an epoch,
which fit() keeps by refusing a shuffled run whose epoch the step count and the charges place apart),
and that removing it leaves the
other records' batches as they were (add/remove adjacency, like the Poisson case).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Callable, List, Optional, Sequence, Tuple

from opacus.accountants import IAccountant, RDPAccountant, create_accountant
from opacus.accountants.analysis.rdp import get_privacy_spent
from opacus.accountants.utils import get_noise_multiplier

from ..config import FitConfig, PrivacyConfig, steps_per_epoch
from ..errors import ConfigError, PipeDPError
from .prv import prv_epsilon

Entry = Tuple[float, float, int]  # (noise multiplier, sample rate, steps): an Opacus history entry
MAX_SIGMA = 1e6  # as Opacus's calibration: beyond it the budget counts as unreachable
CALIBRATION_LIMIT_S = 300.0  # a calibration that takes longer is stopped with advice


class Charges:
    """What the accountant records for each step, from how its batch was drawn (the module's rules). Shuffled
    batches are counted by the privacy units they hold: an epoch is charged once, at its first batch, and
    ends once dataset_size units have been seen, so four epochs cannot pass for one whatever the step count."""

    def __init__(self) -> None:
        self.seen = 0  # units of the shuffled epoch in progress (0: none in progress)

    def rate(self, sampling: Optional[str], privacy: PrivacyConfig, n: Optional[int] = None) -> Optional[float]:
        """The sample rate to record for a step of ``n`` units (None: any size), or None when the step adds
        nothing to any record's privacy loss (a later batch of a shuffled epoch already charged). Refuses a
        batch the charge would not cover."""
        if sampling == "poisson":
            if self.seen:
                raise ConfigError(
                    f"a Poisson step while a shuffled epoch is in progress ({self.seen} of {privacy.dataset_size} "
                    "units seen): its records just had an unamplified step, so amplification would not hold; finish "
                    "the epoch with sampling='shuffle' first, or take this step undeclared (charged at rate 1)",
                    "sampling",
                )
            if privacy.sample_rate is None:
                raise PipeDPError("Poisson-sampled steps need the trainer's sample_rate to be accounted")
            return privacy.sample_rate
        if sampling == "shuffle":
            size, batch = privacy.dataset_size, privacy.expected_batch_size
            if size is None or batch is None:
                raise ConfigError(
                    "sampling='shuffle' needs dataset_size: an epoch is charged once, and ends after dataset_size "
                    "units (fit() sets it from its data)",
                    "sampling",
                )
            if n is not None and n > batch:
                raise ConfigError(
                    f"a shuffled batch of {n} units is larger than expected_batch_size={batch}: cut each epoch's "
                    f"permutation into batches of {batch} (the last may be smaller), or set expected_batch_size to "
                    "the batch size you use",
                    "expected_batch_size",
                )
            if n is not None and self.seen + n > size:
                raise ConfigError(
                    f"a shuffled batch of {n} units after {self.seen} of this epoch's {size}: an epoch holds every "
                    f"unit once, so its last batch holds the remaining {size - self.seen}",
                    "sampling",
                )
            return 1.0 if self.seen == 0 else None
        return 1.0

    def record(self, sampling: Optional[str], privacy: PrivacyConfig, n: int) -> None:
        """A step of ``n`` units drawn by ``sampling`` ran (after ``rate`` allowed it)."""
        if sampling == "shuffle":
            assert privacy.dataset_size is not None
            self.seen = (self.seen + n) % privacy.dataset_size  # a full epoch: the next batch starts a new one


def adjacency(sampling: Optional[str], unit: str = "record") -> str:
    """The neighbouring datasets an epsilon is for, to print beside it: one privacy unit added or removed (for
    shuffled epochs the other units' batches taken as fixed, one unamplified charge per epoch)."""
    return f"add/remove adjacency, {unit} level" + (", shuffled epochs unamplified" if sampling == "shuffle" else "")


def _quiet_epsilon(history: List[Entry], delta: float, mechanism: str) -> float:
    with warnings.catch_warnings():  # RDP warns about its alpha grid at the extremes
        warnings.simplefilter("ignore")
        if mechanism == "prv":  # Opacus's value, in bounded memory (privacy/prv.py)
            return max(0.0, prv_epsilon(history, delta))
        accountant = create_accountant(mechanism=mechanism)
        accountant.history = [tuple(h) for h in history]
        return max(0.0, float(accountant.get_epsilon(delta=delta)))  # never negative: eps >= 0 by definition


def epsilon_of(history: Sequence[Entry], delta: float, mechanism: str) -> float:
    """The epsilon of an Opacus history at ``delta`` (inf once a step had no noise; 0 for no step)."""
    history = [h for h in history if h[2] > 0]
    if not history:
        return 0.0
    if any(sigma == 0 for sigma, _, _ in history):
        return math.inf  # a step without noise has no finite privacy guarantee
    try:
        return _quiet_epsilon(history, delta, mechanism)
    except MemoryError as exc:
        steps = sum(n for _, _, n in history)
        raise ConfigError(
            f"the {mechanism} accountant ran out of memory computing epsilon over {steps} steps ({exc}): train fewer "
            "steps, use the rdp accountant (--accountant rdp: closed form, looser), or aim at a larger epsilon",
            "accountant",
        ) from None


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

    unreachable = PipeDPError(
        f"target epsilon {target_epsilon} at delta {delta} cannot be met with sample rate {sample_rate} over "
        f"{steps} steps (no noise multiplier up to {MAX_SIGMA:g} reaches it with the {accountant} accountant): "
        "raise the target epsilon or delta, lower the sample rate, or train fewer steps"
    )
    if accountant == "rdp" and target_epsilon <= _rdp_floor(delta):
        raise unreachable  # said at once: the search would ask for ever slower epsilons up to MAX_SIGMA
    guess = _gaussian_dp_guess(target_epsilon, delta, sample_rate, steps)
    low, high = guess / 2, guess * 2
    while eps(high) > target_epsilon:  # widen up
        low, high = high, high * 2
        if high > MAX_SIGMA:
            raise unreachable
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


def _rdp_floor(delta: float) -> float:
    """The rdp accountant's epsilon with no privacy loss at all (every order's RDP 0): its conversion to (epsilon,
    delta) alone, which no noise multiplier goes below (Opacus's own conversion and orders)."""
    orders = RDPAccountant.DEFAULT_ALPHAS
    with warnings.catch_warnings():  # "the optimal order is the largest": it is, with no loss at all
        warnings.simplefilter("ignore")
        return max(0.0, float(get_privacy_spent(orders=orders, rdp=[0.0] * len(orders), delta=delta)[0]))


def planned_charges(privacy: PrivacyConfig, fit: FitConfig) -> Tuple[float, int]:
    """(sample rate, number of charges) fit() makes over its run (FitConfig.planned_steps): Poisson steps
    (fit()'s sampler unless sampling='shuffle') each at q; shuffled steps once per epoch they touch at rate 1
    (10 units in batches of 4 over 1.2 epochs: 4 steps, 2 charges)."""
    steps = fit.planned_steps(privacy)
    if privacy.sampling == "shuffle":
        if privacy.dataset_size is None or privacy.expected_batch_size is None:
            raise ConfigError(
                "target_epsilon with sampling='shuffle' needs dataset_size (an epoch is charged once)", "sampling"
            )
        return 1.0, math.ceil(steps / steps_per_epoch(privacy.dataset_size, privacy.expected_batch_size))
    if privacy.sample_rate is None:
        raise ConfigError("target_epsilon needs sample_rate (the Poisson rate) to calibrate the noise", "sample_rate")
    return privacy.sample_rate, steps


def calibrated(
    privacy: PrivacyConfig, fit: FitConfig, progress: Optional[Callable[[str], None]] = None
) -> PrivacyConfig:
    """``privacy`` with the noise multiplier that meets its target_epsilon over the charges fit() makes in the
    run ``fit`` declares (the one place both the trainer and the CLI calibrate); the target is kept."""
    assert privacy.target_epsilon is not None
    rate, charges = planned_charges(privacy, fit)
    sigma = calibrate_noise(privacy.target_epsilon, privacy.delta, rate, charges, privacy.accountant, progress)
    return dataclasses.replace(privacy, noise_multiplier=sigma)


def _gaussian_dp_guess(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """A starting noise multiplier from the Gaussian-DP (central limit) estimate; any failure: 1."""
    try:
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
