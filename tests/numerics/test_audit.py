"""The one-run privacy audit: its statistics against closed forms, a correct implementation that
passes, and implementations broken on purpose that it fails."""

import math
from dataclasses import replace

import pytest

import pipedp.privacy.noise as noise_module
import pipedp.train.trainer as trainer_module
from pipedp.audit.bounds import epsilon_lower_bound, p_value
from pipedp.audit.run import AuditConfig, run_audit

ORIGINAL_NOISE = noise_module.add_noise


def test_the_bound_matches_its_closed_forms():
    # delta = 0, every one of r guesses right: P[Bin(r, p) >= r] = p^r = beta, p = e^eps / (1 + e^eps)
    for r, beta in ((10, 0.05), (200, 0.01)):
        p = beta ** (1 / r)
        assert epsilon_lower_bound(1000, r, r, beta, 0.0) == pytest.approx(math.log(p / (1 - p)), rel=1e-6)
    # the p-value is a binomial tail (delta = 0), computed here from math.comb
    r, v, eps = 30, 21, 0.7
    q = math.exp(eps) / (1 + math.exp(eps))
    tail = sum(math.comb(r, k) * q**k * (1 - q) ** (r - k) for k in range(v, r + 1))
    assert p_value(100, r, v, eps, 0.0) == pytest.approx(tail, rel=1e-9)
    assert p_value(100, r, v, eps, 1e-3) > tail  # delta only ever weakens what guesses can show
    assert epsilon_lower_bound(1000, 100, 50, 0.05, 1e-5) == 0.0  # chance-level guesses show nothing


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_correct_pipeline_passes_and_the_bound_is_not_vacuous(seed):
    result = run_audit(AuditConfig(seed=seed))
    assert result.passed, result.summary()
    assert 0.2 < result.epsilon_lower_bound < result.claimed_epsilon
    assert all(abs(c.measured_sigma - 3.0) < 0.2 for c in result.noise_checks)


def test_without_noise_the_audit_sees_the_leak():
    result = run_audit(AuditConfig(privacy=replace(AuditConfig().privacy, noise_multiplier=0.0)))
    assert result.claimed_epsilon == math.inf
    assert result.epsilon_lower_bound > 3.5, result.summary()  # near the cap 1000 guesses allow


def broken_noise(which):
    def add_noise(grads, names, std, seed, step, secure_mode=False, shards=None):
        if which == "off on stage 1":  # the audit model's stage 1 holds block 1 and the head (block 2)
            kept = [(g, n) for g, n in zip(grads, names) if n.startswith("0.")]
            grads, names, shards = [g for g, _ in kept], [n for _, n in kept], None
        if which == "same every step":
            step = 0
        if which == "sigma halved":
            std = std / 2
        return ORIGINAL_NOISE(grads, names, std, seed, step, secure_mode, shards)

    return add_noise


@pytest.mark.parametrize(
    "which, bound_exceeds",
    [
        ("off on stage 1", True),
        ("same every step", True),
        ("sigma halved", False),
    ],
)
def test_a_broken_pipeline_fails(monkeypatch, which, bound_exceeds):
    for module in (noise_module, trainer_module):  # the sums start as the noise (noise.SumNoise) or get it after
        monkeypatch.setattr(module, "add_noise", broken_noise(which))
    result = run_audit(AuditConfig())
    assert not result.passed, result.summary()
    assert (result.epsilon_lower_bound > result.claimed_epsilon) == bound_exceeds, result.summary()
    problems = " ".join(c.problem for c in result.noise_checks)
    expected = {
        "off on stage 1": "less noise than claimed: 0.000",
        "same every step": "noise repeats across steps",
        "sigma halved": "less noise than claimed",
    }[which]
    assert expected in problems, result.summary()
