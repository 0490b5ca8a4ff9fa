"""The guarantee a user reads is the one they get (issue #22): delta against 1/N, epsilon never negative,
each step accounted as its batch was drawn, a failed step leaves nothing behind, bounded calibration,
and a word when a step is charged but cannot change anything."""

import pytest
import torch
from oracles import max_relative_error, opacus_epsilon
from steps import class_data, class_loss

from pipedp import ConfigError, PipeDPError, PipelineDPTrainer, PrivacyBudgetExceeded, PrivacyConfig
from pipedp.models import mlp
from pipedp.privacy.accounting import calibrate_noise, epsilon_of
from pipedp.privacy.sampling import shuffled_indices, steps_per_epoch


def data(n=256, seed=0):
    return class_data(n, 8, 4, seed)


def trainer(**kw):
    torch.manual_seed(3)
    args = dict(stages=2, microbatches=2, noise_multiplier=1.0, max_grad_norm=0.5, expected_batch_size=16)
    args.update(kw)
    return PipelineDPTrainer(mlp((8, 16, 4)).double(), class_loss, **args)


# ---- delta ---------------------------------------------------------------------------------------
def test_delta_of_at_least_one_over_n_is_refused_where_n_is_known():
    with pytest.raises(ConfigError, match=r"delta: 0.5 is not below 1/N = 1/64") as info:
        PrivacyConfig(expected_batch_size=8, delta=0.5, dataset_size=64).validate()
    assert info.value.field == "delta"
    with pytest.raises(ConfigError, match="not below 1/N = 1/64"):  # fit knows N from its data
        trainer(delta=0.1, sample_rate=0.25).fit(data(64), steps=1)
    with pytest.raises(ConfigError, match="not below 1/N"):
        t = trainer(sample_rate=0.25, dataset_size=64)
        t.epsilon(0.1)


def test_epsilon_is_never_negative():
    # at a large delta Opacus's PRV accountant reports a negative epsilon; a bound is never below 0
    raw = opacus_epsilon([(1.0, 0.5, 4)], delta=0.5)
    assert raw < 0  # the accountant's own number is negative here
    assert epsilon_of([(1.0, 0.5, 4)], 0.5, "prv") == 0.0


def test_without_n_epsilon_warns_that_delta_cannot_be_checked():
    t = trainer(sample_rate=0.1, sampling="poisson")
    t.step(*data(8))
    with pytest.warns(UserWarning, match="delta cannot be checked against 1/N"):
        t.epsilon()


# ---- sampling is declared and accounted as declared ------------------------------------------------
def test_caller_made_batches_get_no_poisson_amplification():
    """step() on the caller's own batches with nothing declared: every step as if it held every record."""
    t = trainer(sample_rate=16 / 256)
    x, y = data()
    with pytest.warns(UserWarning, match="sampling is not declared"):
        t.step(x[:16], y[:16])
    for k in range(1, 16):
        t.step(x[16 * k : 16 * (k + 1)], y[16 * k : 16 * (k + 1)])
    assert t.epsilon(1e-5) == pytest.approx(opacus_epsilon([(1.0, 1.0, 16)]), rel=1e-9)
    assert t.epsilon(1e-5) > opacus_epsilon([(1.0, 16 / 256, 16)]) * 1.5  # what Poisson would have claimed


def test_one_shuffled_epoch_is_one_gaussian_mechanism():
    """16 shuffled batches of 16 out of 256: each record is in one step, charged once without
    amplification (epsilon 4.39 at sigma 1, delta 1e-5); the next epoch is charged once more."""
    t = trainer(sampling="shuffle")
    result = t.fit(data(), steps=16)
    assert result.epsilon == pytest.approx(opacus_epsilon([(1.0, 1.0, 1)]), rel=1e-9)
    assert result.epsilon == pytest.approx(4.39, abs=0.01)
    result = t.fit(data(), steps=17)
    assert result.epsilon == pytest.approx(opacus_epsilon([(1.0, 1.0, 2)]), rel=1e-9)


def test_shuffled_batches_hold_every_record_once_per_epoch():
    n, b = 50, 8
    per_epoch = steps_per_epoch(n, b)
    for epoch in range(3):
        seen = torch.cat([shuffled_indices(n, b, 7, epoch * per_epoch + k) for k in range(per_epoch)])
        assert sorted(seen.tolist()) == list(range(n))
    first, second = (shuffled_indices(n, b, 7, k * per_epoch) for k in range(2))
    assert not torch.equal(first, second)  # a new permutation each epoch


def test_poisson_batches_from_fit_are_accounted_as_poisson():
    t = trainer(sample_rate=0.05, noise_multiplier=1.1)
    result = t.fit(data(200), steps=7)
    assert result.epsilon == pytest.approx(opacus_epsilon([(1.1, 0.05, 7)]), rel=1e-9)


def test_the_budget_guard_holds_for_undeclared_steps():
    t = trainer(max_epsilon=opacus_epsilon([(1.0, 1.0, 3)]) + 1e-6)
    x, y = data(16)
    for _ in range(3):
        t.step(x, y)
    with pytest.raises(PrivacyBudgetExceeded, match="sample rate 1"):
        t.step(x, y)


# ---- failures leave the trainer usable -------------------------------------------------------------
class FailOnce:
    """A loss that raises on the micro-batch holding a marked label, the first time it sees it."""

    def __init__(self):
        self.failed = False

    def __call__(self, out, y):
        if not self.failed and bool((y == 99).any()):
            self.failed = True
            raise ValueError("label 99 is out of range")
        return class_loss(out, y.clamp(max=3))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "dp-zb", "dp-zb-2x"])
def test_after_a_step_raises_the_next_step_is_the_one_it_would_have_been(schedule):
    """The failure comes in the last micro-batch, after W of the earlier ones ran (1F1B): their partial
    clipped sums, the messages in flight and the captures must all go."""
    x, y = data(16)
    bad = y.clone()
    bad[-1] = 99
    options = dict(stages=2, microbatches=4, schedule=schedule, noise_multiplier=1.0, expected_batch_size=16, seed=5)
    torch.manual_seed(3)
    failing = PipelineDPTrainer(mlp((8, 16, 4)).double(), FailOnce(), **options)
    torch.manual_seed(3)
    straight = PipelineDPTrainer(mlp((8, 16, 4)).double(), class_loss, **options)
    failing.step(x, y)
    straight.step(x, y)
    with pytest.raises(ValueError, match="out of range"):
        failing.step(x, bad)
    assert failing.steps_taken == 1
    failing.step(x, y)
    straight.step(x, y)
    assert max_relative_error(failing.model.state_dict(), straight.model.state_dict()) < 1e-13


# ---- bounded waits and honest warnings ---------------------------------------------------------------
def test_the_calibration_reports_progress_and_stops_at_its_limit():
    lines = []
    with pytest.raises(PipeDPError, match="did not finish within 0s.*noise_multiplier directly"):
        calibrate_noise(1.0, 1e-5, 0.01, 1000, "rdp", progress=lines.append, time_limit=0.0)
    assert lines and "calibrating noise (rdp)" in lines[0]
    sigma = calibrate_noise(1.0, 1e-5, 0.01, 1000, "rdp", progress=lines.append)
    assert 1.0 - 0.01 <= epsilon_of([(sigma, 0.01, 1000)], 1e-5, "rdp") <= 1.0


def test_an_unreachable_target_is_said_fast():
    with pytest.raises(PipeDPError, match="cannot be met"):
        calibrate_noise(0.05, 1e-9, 0.5, 10**5, "rdp")  # RDP's conversion never goes below ~200 here


def test_a_step_that_cannot_change_anything_but_is_charged_says_so():
    frozen = mlp((8, 16, 4)).double().requires_grad_(False)
    with pytest.warns(UserWarning, match="no trainable parameter"):
        PipelineDPTrainer(frozen, lambda o, y: class_loss(o, y) * 0, stages=1, expected_batch_size=4)
    with pytest.warns(UserWarning, match="learning rate is 0"):
        PipelineDPTrainer(
            mlp((8, 16, 4)).double(), class_loss, lambda p: torch.optim.SGD(p, lr=0.0), stages=1, expected_batch_size=4
        )
