"""Accounting in bounded memory: epsilon at growing step counts, and calibrations over very long runs."""

import pytest
from opacus.accountants.prv import PRVAccountant

from pipedp.errors import ConfigError
from pipedp.privacy import accounting, prv
from pipedp.privacy.accounting import calibrate_noise, epsilon_of


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def opacus(history, delta=1e-5):
    accountant = PRVAccountant()
    accountant.history = list(history)
    return accountant.get_epsilon(delta=delta)


@pytest.mark.parametrize(
    "history", [[(1.0, 1.0, 16)], [(1.1, 0.05, 7)], [(1.0, 0.01, 2500)], [(1.0, 0.1, 3), (2.0, 0.2, 5)]]
)
def test_prv_epsilon_is_opacus_own_value_to_the_bit(history):
    assert epsilon_of(history, 1e-5, "prv") == opacus(history)


def growth(flush: bool, monkeypatch) -> float:
    if not flush:
        monkeypatch.setattr(prv, "flush_fft_plans", lambda: None)
    prv.flush_fft_plans()
    before = rss_mib()
    for k in range(1, 21):  # epsilon() every 125 steps, as the fit loop's log does
        epsilon_of([(1.0, 0.01, 125 * k)], 1e-5, "prv")
    grown = rss_mib() - before
    monkeypatch.undo()
    prv.flush_fft_plans()
    return grown


def test_epsilon_at_growing_step_counts_does_not_grow_the_process(monkeypatch):
    assert growth(True, monkeypatch) < 20  # MiB (measured: +0)
    assert growth(False, monkeypatch) > 60  # the planted case: scipy's FFT plan cache held +160 MiB here


def test_a_grid_past_the_limit_gets_a_coarser_error_not_more_memory(monkeypatch):
    history = [(1.0, 0.01, 2500)]
    monkeypatch.setattr(prv, "MAX_POINTS", 1 << 16)  # (the real limit, 4 M points, is met at ~50 000 steps here)
    asked = []
    original = PRVAccountant.get_epsilon

    def spy(self, delta, *, eps_error=0.01, delta_error=None):
        asked.append(eps_error)
        return original(self, delta, eps_error=eps_error, delta_error=delta_error)

    monkeypatch.setattr(PRVAccountant, "get_epsilon", spy)
    coarse = epsilon_of(history, 1e-5, "prv")
    exact = opacus(history)
    assert asked[0] > 0.01
    assert exact <= coarse <= exact + asked[0]  # still an upper bound, within its (larger) error


def test_running_out_of_memory_in_a_calibration_is_refused_with_advice(monkeypatch):
    def no_memory(history, delta):
        raise MemoryError("Unable to allocate 648. GiB for an array with shape (87000000000,) and data type float64")

    monkeypatch.setattr(accounting, "prv_epsilon", no_memory)
    with pytest.raises(ConfigError, match="ran out of memory computing epsilon over 1000000 steps") as info:
        calibrate_noise(0.01, 1e-5, 0.5, 10**6, "prv")
    assert "fewer steps" in str(info.value) and "rdp" in str(info.value) and "larger epsilon" in str(info.value)
