"""Every charge matches what ran, and the run length is declared once (FitConfig.steps / epochs).

Each epsilon is compared with Opacus's accountant called here with the charges the run should have made;
each refusal is the case that was charged wrong before (issue #35 item 5, #36 item 3)."""

import json

import pytest
import torch
from opacus.accountants.utils import get_noise_multiplier
from oracles import opacus_epsilon
from steps import class_data, class_loss

from pipedp import ConfigError, PipeDPError, PipelineDPTrainer
from pipedp.models import mlp


def data(n, seed=0):
    return class_data(n, 8, 4, seed)


def trainer(**kw):
    torch.manual_seed(3)
    args = dict(stages=2, microbatches=2, noise_multiplier=1.0, max_grad_norm=0.5, expected_batch_size=16, seed=5)
    args.update(kw)
    return PipelineDPTrainer(mlp((8, 16, 4)).double(), class_loss, **args)


# ---- step(sampling="shuffle"): the batch size, and the epochs counted by the records they hold ---------------
def test_a_shuffled_batch_larger_than_expected_is_refused():
    """Reported: four epochs of 256 records in batches of 64 with expected_batch_size=16 were charged as one
    epoch (the charge followed the step count: 16 steps = one epoch of 16 batches), epsilon 4.39 for 10.0."""
    t = trainer(sampling="shuffle", dataset_size=256)
    x, y = data(64)
    with pytest.raises(ConfigError, match="a shuffled batch of 64 units is larger than expected_batch_size=16") as e:
        t.step(x, y)
    assert e.value.field == "expected_batch_size"
    assert t.steps_taken == 0 and t.state.accountant.history == []  # nothing ran, nothing charged


def test_epochs_are_counted_by_the_records_their_batches_hold():
    """Batches smaller than expected: an epoch of 64 records in batches of 8 is 8 steps, not the 4 that
    dataset_size / expected_batch_size makes; two epochs are two charges whatever the step count."""
    t = trainer(sampling="shuffle", dataset_size=64)
    x, y = data(8)
    for _ in range(7):
        t.step(x, y)
    assert t.epsilon() == pytest.approx(opacus_epsilon([(1.0, 1.0, 1)]), rel=1e-9)  # 56 of 64 seen: one epoch
    for _ in range(2):  # the 8th batch ends the epoch, the 9th starts the next
        t.step(x, y)
    assert t.epsilon() == pytest.approx(opacus_epsilon([(1.0, 1.0, 2)]), rel=1e-9)


def test_a_batch_that_runs_past_its_epoch_is_refused():
    """10 records in batches of 4: the third batch of an epoch holds the remaining 2; a third batch of 4
    would hold two records of the next epoch, charged with this one."""
    t = trainer(sampling="shuffle", dataset_size=10, expected_batch_size=4, delta=1e-3)
    x, y = data(4)
    t.step(x, y)
    t.step(x, y)
    with pytest.raises(ConfigError, match="after 8 of this epoch's 10: .* holds the remaining 2"):
        t.step(x, y)
    t.step(x[:2], y[:2])
    t.step(x, y)  # the next epoch: charged once more
    assert t.epsilon() == pytest.approx(opacus_epsilon([(1.0, 1.0, 2)], delta=1e-3), rel=1e-9)


def test_four_shuffled_epochs_from_fit_are_four_charges():
    t = trainer(sampling="shuffle", expected_batch_size=32)
    result = t.fit(data(128), epochs=4)
    assert result.steps == 16
    assert t.state.accountant.history == [(1.0, 1.0, 4)]
    assert result.epsilon == pytest.approx(opacus_epsilon([(1.0, 1.0, 4)]), rel=1e-9)
    assert result.epsilon == pytest.approx(10.0, abs=0.1)  # what 4.39 (one charge) under-reported


# ---- mixing Poisson and shuffled steps ------------------------------------------------------------------------
def test_a_poisson_step_inside_a_shuffled_epoch_is_refused():
    """Reported: a Poisson step in a shuffled pass was charged amplified, though its records had just had an
    unamplified step. Refused by name; between epochs it is charged as Poisson."""
    t = trainer(sampling="shuffle", dataset_size=32, sample_rate=0.5)
    x, y = data(16)
    t.step(x, y)
    with pytest.raises(ConfigError, match="a Poisson step while a shuffled epoch is in progress .16 of 32") as e:
        t.step(x, y, sampling="poisson")
    assert e.value.field == "sampling"
    with pytest.raises(ConfigError, match="Poisson step while a shuffled epoch"):
        t.check_budget("poisson")
    t.step(x, y)  # the epoch ends
    t.step(x, y, sampling="poisson")
    t.step(x, y)  # a new epoch
    assert t.epsilon() == pytest.approx(opacus_epsilon([(1.0, 1.0, 1), (1.0, 0.5, 1), (1.0, 1.0, 1)]), rel=1e-9)


def test_an_undeclared_step_inside_a_shuffled_epoch_is_charged_at_rate_one():
    t = trainer(dataset_size=32)
    x, y = data(16)
    t.step(x, y, sampling="shuffle")
    with pytest.warns(UserWarning, match="not declared"):
        t.step(x, y)
    t.step(x, y, sampling="shuffle")  # ends the epoch: no charge
    assert t.epsilon() == pytest.approx(opacus_epsilon([(1.0, 1.0, 2)]), rel=1e-9)


# ---- target_epsilon: the calibration plans the charges fit() makes -------------------------------------------
def test_a_fractional_shuffled_run_is_calibrated_for_the_epochs_it_touches():
    """Reported: 10 records, batch 4, epochs=1.2 was calibrated for 3 steps and 1 charge while fit ran 4 steps
    (ceil(1.2 x 3)) and 2 charges: epsilon 4.45 for a target of 3. Now 2 charges are planned and made."""
    shuffled = dict(sampling="shuffle", dataset_size=10, expected_batch_size=4, sample_rate=0.4, delta=1e-3)
    t = trainer(target_epsilon=3.0, epochs=1.2, **shuffled)
    sigma = t.noise_multiplier
    result = t.fit(data(10))
    assert result.steps == 4
    assert t.state.accountant.history == [(sigma, 1.0, 2)]
    assert result.epsilon == pytest.approx(opacus_epsilon([(sigma, 1.0, 2)], delta=1e-3), rel=1e-9)
    assert 3.0 - 0.01 <= result.epsilon <= 3.0
    one_charge = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-3, sample_rate=1.0, steps=1)
    assert opacus_epsilon([(one_charge, 1.0, 2)], delta=1e-3) > 4.0  # the old plan: far over the target


def test_the_run_length_is_the_trainers_once_calibrated():
    t = trainer(target_epsilon=3.0, steps=20, sample_rate=0.25, accountant="rdp")
    with pytest.raises(ConfigError, match=r"fit\(steps=40, epochs=None\) makes 40 charges .* over 20 .* steps=20") as e:
        t.fit(data(64), steps=40)
    assert e.value.field == "steps"
    with pytest.raises(ConfigError, match="the run length is not given: pass steps= or epochs="):
        trainer(target_epsilon=3.0, sample_rate=0.25)
    with pytest.raises(TypeError, match="total_steps: the run length is FitConfig's: pass steps="):
        trainer(target_epsilon=3.0, sample_rate=0.25, total_steps=20)
    result = t.fit(data(64), steps=20)  # the same run, given again: fine
    assert result.epsilon == pytest.approx(opacus_epsilon([(t.noise_multiplier, 0.25, 20)], mechanism="rdp"), rel=1e-9)


def test_the_cli_derives_the_run_length_and_states_the_adjacency(tmp_path, capsys, monkeypatch):
    """pipedp train --sampling shuffle --epochs 1.2 on 10 records in batches of 4: 4 steps, calibrated for the
    2 charges made; the printed epsilon says what neighbouring datasets it is for."""
    import pipedp.runtime.process
    from pipedp.cli.main import main

    monkeypatch.setattr(pipedp.runtime.process, "settle_process", lambda: False)
    (tmp_path / "d.txt").write_text("".join(f"the cat sat on mat number {i}\n" for i in range(10)))
    threads = torch.get_num_threads()
    try:
        code = main(
            ["train", "--inprocess", "--data", str(tmp_path / "d.txt"), "--sampling", "shuffle", "--epochs", "1.2"]
            + ["--batch-size", "4", "--target-epsilon", "3", "--delta", "1e-3", "--seq-len", "16", "--no-progress"]
            + ["--no-checkpoint", "--checkpoint-dir", str(tmp_path / "run")]
        )
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4
    sigma = summary["noise_multiplier"]
    assert summary["epsilon"] == pytest.approx(opacus_epsilon([(sigma, 1.0, 2)], delta=1e-3), rel=1e-9)
    assert 3.0 - 0.01 <= summary["epsilon"] <= 3.0
    adjacency = "(add/remove adjacency, record level, shuffled epochs unamplified)"
    assert f"calibrating the noise for epsilon 3 at delta 0.001 {adjacency} over 4 steps" in out
    assert f"delta 0.001, 4 steps {adjacency}" in out  # the job's privacy line
    assert f"epsilon {summary['epsilon']:.3f} at delta 0.001 {adjacency[:-1]}; noise multiplier" in out


def test_a_shuffled_run_resumed_inside_an_epoch_is_charged_as_if_never_stopped(tmp_path):
    """Where the epoch stood travels in the checkpoint: resumed after 3 of an epoch's 4 batches, the 4th is
    not charged again (with the planted old state, a fresh epoch, it would be: two charges for one epoch)."""
    x, y = data(64)
    first = trainer(sampling="shuffle")
    first.fit((x, y), steps=3, checkpoint_dir=str(tmp_path))
    resumed = trainer(sampling="shuffle")
    resumed.fit((x, y), steps=8, checkpoint_dir=str(tmp_path), resume=True)  # epoch 1's 4th batch, then epoch 2
    assert resumed.state.accountant.history == [(1.0, 1.0, 2)]  # (a fresh epoch at step 4: charges at 1, 4, 8)
    assert resumed.epsilon() == pytest.approx(opacus_epsilon([(1.0, 1.0, 2)]), rel=1e-9)


def test_a_shuffled_fit_after_a_step_outside_it_is_refused():
    """Reported: a Poisson step, then a shuffled fit(): fit's batches follow the step count (step 1 = batch 1
    of epoch 0) while the charges began an epoch there, so batch 1 of epoch 0 and batch 0 of epoch 1 (two
    permutations: records in both) fell under one charge (epsilon 6.23 reported for 8.17)."""
    x, y = data(8)
    t = trainer(expected_batch_size=4, sample_rate=0.5, sampling="shuffle")
    t.step(x[:4], y[:4], sampling="poisson")
    with pytest.raises(PipeDPError, match="takes batch 1 of an epoch's permutation, but 0 units"):
        t.fit((x, y), steps=3)
