"""The statistics of a one-run audit (Steinke, Nasr, Jagielski 2023, Theorem 3.1 / Algorithm 2).

m canaries, each included independently with probability 1/2; the auditor guesses in or out
for r of them (abstaining on the rest) and is right v times. If training is (eps, delta)-DP,

    P[v or more correct] <= P[Binomial(r, e^eps / (1 + e^eps)) >= v] + 2 m delta * alpha,
    alpha = max_{i = 1..v} P[v - i <= Binomial(r, e^eps / (1 + e^eps)) < v] / i,

so every eps whose p-value falls below beta is rejected: the largest such eps is a lower
bound on the true epsilon with confidence 1 - beta. Also the noise checks (z-tests on the excluded
canaries' pure noise). Binomials from scipy.stats, normal quantiles from statistics.NormalDist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import List, Optional, Sequence

import numpy as np
from scipy.stats import binom


def p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """P[>= v correct of r guesses] for an (eps, delta)-DP training run with m canaries (an upper bound)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    p = 1 / (1 + math.exp(-eps))  # e^eps / (1 + e^eps)
    pmf = binom.pmf(np.arange(r + 1), r, p).tolist()
    tail = float(binom.sf(v - 1, r, p))
    alpha, below = 0.0, 0.0
    for i in range(1, v + 1):
        below += pmf[v - i]
        alpha = max(alpha, below / i)
    return min(1.0, tail + 2 * m * delta * alpha)


def epsilon_lower_bound(m: int, r: int, v: int, beta: float, delta: float) -> float:
    """The largest eps that v correct guesses of r reject at level beta (0 when none is rejected)."""
    if r == 0 or p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(m, r, v, high, delta) < beta:
        low, high = high, 2 * high
        if high > 1e3:
            return low
    for _ in range(50):
        mid = (low + high) / 2
        if p_value(m, r, v, mid, delta) < beta:
            low = mid
        else:
            high = mid
    return low


@dataclass(frozen=True)
class Guesses:
    score: str  # which score function
    k_plus: int  # highest-scored canaries guessed "in"
    k_minus: int  # lowest-scored canaries guessed "out"
    correct: int
    epsilon: float  # the lower bound these guesses give (after the multiple-testing correction)


def best_guesses(scores: dict, included: Sequence[bool], ks: Sequence[int], beta: float, delta: float) -> Guesses:
    """Guess "in" for the k+ highest and "out" for the k- lowest scores, for every score function and
    every (k+, k-) in ``ks`` x ``ks``; return the strongest bound. Every choice is paid for with a
    Bonferroni correction (beta divided by the number of choices), so picking the best is sound."""
    m = len(included)
    tries = len(scores) * len(ks) * len(ks)
    best: Optional[Guesses] = None
    for name, values in scores.items():
        order = sorted(range(m), key=lambda i: -values[i])
        for k_plus in ks:
            for k_minus in ks:
                if k_plus + k_minus > m:
                    continue
                correct = sum(1 for i in order[:k_plus] if included[i])
                correct += sum(1 for i in order[m - k_minus :] if not included[i])
                eps = epsilon_lower_bound(m, k_plus + k_minus, correct, beta / tries, delta)
                if best is None or eps > best.epsilon:
                    best = Guesses(name, k_plus, k_minus, correct, eps)
    assert best is not None
    return best


def guess_sizes(m: int) -> List[int]:
    """The (k+, k-) grid: 2%, 10%, 25% and 50% of the canaries (few choices: each costs confidence)."""
    return sorted({max(1, int(m * f)) for f in (0.02, 0.1, 0.25, 0.5)})


@dataclass
class NoiseCheck:
    stage: int
    samples: int  # per-step noise values of excluded canaries on this stage
    measured_sigma: float
    claimed_sigma: float
    step_correlation: float  # of one step's noise with the next's (0 when fresh)
    ok: bool
    problem: str = ""


def noise_checks(
    z: np.ndarray, included: np.ndarray, stage_of: np.ndarray, stages: int, sigma: float, beta: float
) -> List[NoiseCheck]:
    """Per stage, from excluded canaries (pure noise): is it as large as claimed, and fresh every step?
    Two one-sided z-tests per stage, Bonferroni-corrected to ``beta`` overall, each with an effect
    floor (noise at least 10% below the claim, a step-to-step correlation above 0.2) so that sampling
    wiggles of a correct run never fail it, while the bugs it is for (noise off, halved, or repeated)
    are far beyond both."""
    threshold = NormalDist().inv_cdf(1 - beta / (2 * stages))
    checks = []
    for s in range(stages):
        noise = z[:, (~included) & (stage_of == s)]
        n = noise.size
        if n < 2 or z.shape[0] < 2:
            continue
        measured = float(np.sqrt((noise**2).mean()))
        problems = []
        if sigma > 0:
            significant = measured == 0 or math.log(measured**2 / sigma**2) * math.sqrt(n / 2) < -threshold
            if significant and measured < 0.9 * sigma:
                problems.append(f"less noise than claimed: {measured:.3f} < {sigma:.3f}")
        pairs = noise[:-1] * noise[1:]
        corr = float(pairs.mean() / measured**2) if measured > 0 else 0.0
        if measured > 0 and corr * math.sqrt(pairs.size) > threshold and corr > 0.2:
            problems.append(f"noise repeats across steps (correlation {corr:+.3f})")
        checks.append(NoiseCheck(s, n, measured, sigma, corr, not problems, "; ".join(problems)))
    return checks
