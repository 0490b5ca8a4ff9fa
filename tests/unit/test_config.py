"""The one configuration: validation, the steps-for-epochs rule, the CLI flags generated from it,
and the independence of the random streams."""

import argparse
import dataclasses
import math

import pytest

from pipedp import ConfigError, PipelineConfig, PrivacyConfig
from pipedp.cli.flags import add_config_flags, cli_fields, config_from_args, flag_of
from pipedp.cli.main import build_parser
from pipedp.config import FitConfig, split_options, steps_for_epochs
from pipedp.privacy.streams import Stream, stream_seed


@pytest.mark.parametrize(
    "cls, field, value, message",
    [
        (PipelineConfig, "stages", 0, "stages: must be >= 1, got 0"),
        (PipelineConfig, "microbatches", 2.5, "microbatches: must be an integer"),
        (PipelineConfig, "schedule", "pipedream", "unknown schedule 'pipedream'"),
        (PipelineConfig, "grad_mode", "fast", "unknown grad_mode 'fast'"),
        (PrivacyConfig, "max_grad_norm", math.inf, "max_grad_norm: must be > 0 and finite"),
        (PrivacyConfig, "noise_multiplier", math.nan, "noise_multiplier: must be >= 0 and finite"),
        (PrivacyConfig, "delta", 0.0, "delta: must be in (0, 1)"),
        (PrivacyConfig, "sample_rate", 1.5, "sample_rate: must be in (0, 1]"),
        (PrivacyConfig, "accountant", "moments", "unknown accountant 'moments'"),
    ],
)
def test_validate_names_the_field(cls, field, value, message):
    base = cls(expected_batch_size=8) if cls is PrivacyConfig else cls()
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")) as info:
        dataclasses.replace(base, **{field: value}).validate()
    assert info.value.field == field


def test_privacy_needs_what_its_options_need():
    with pytest.raises(ConfigError, match="expected_batch_size is required"):
        PrivacyConfig().validate()
    with pytest.raises(ConfigError, match="max_epsilon needs sample_rate"):
        PrivacyConfig(expected_batch_size=4, max_epsilon=3.0, sampling="poisson").validate()
    with pytest.raises(ConfigError, match="the run length is not given: pass steps= or epochs="):
        FitConfig().planned_steps(PrivacyConfig(expected_batch_size=4, sample_rate=0.1).validate())
    with pytest.raises(TypeError, match="total_steps: the run length is FitConfig's: pass steps="):
        split_options({"total_steps": 10})


def test_one_rule_turns_epochs_into_steps():
    assert steps_for_epochs(1, 0.003) == 334  # 333.33 -> 334, in the calibration and in fit alike
    assert steps_for_epochs(2, 0.02) == 100  # not 101 from float noise
    privacy = PrivacyConfig(expected_batch_size=3, sample_rate=0.003, target_epsilon=3.0).validate()
    assert FitConfig(epochs=1).planned_steps(privacy) == 334


def test_configs_are_frozen_and_unknown_options_are_refused():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PipelineConfig().stages = 3  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['stage'\]"):
        split_options({"stage": 2})


def test_cli_flags_are_generated_from_the_config_fields():
    train = build_parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    flags = {s for a in train._actions for s in a.option_strings}
    for cls in (PipelineConfig, PrivacyConfig):
        for f in cli_fields(cls):
            assert flag_of(f) in flags, f"config field {f.name} has no CLI flag"
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    args = parser.parse_args(["--stages", "3", "--schedule", "gpipe", "--secure-mode"])
    pipeline, privacy = config_from_args(PipelineConfig, args), config_from_args(PrivacyConfig, args)
    assert (pipeline.stages, pipeline.schedule, privacy.secure_mode) == (3, "gpipe", True)
    assert privacy.noise_multiplier == PrivacyConfig().noise_multiplier  # defaults come from the fields


def test_noise_and_sampling_streams_never_share_a_seed():
    seed = 7
    sampling = {stream_seed(Stream.SAMPLING, seed, t) for t in range(2000)}
    truncation = {stream_seed(Stream.TRUNCATION, seed, t) for t in range(2000)}
    noise = {stream_seed(Stream.NOISE, seed, t, k) for t in range(500) for k in range(4)}
    noise.add(stream_seed(Stream.NOISE, seed, 0x5A11, 3))  # the collision of the earlier scheme
    assert not (sampling & noise) and not (truncation & noise) and not (sampling & truncation)
    assert len(noise) == 2001 and len(sampling) == 2000
    assert stream_seed(Stream.NOISE, seed, 1, 2) != stream_seed(Stream.NOISE, seed, 2, 1)


def test_fit_takes_exactly_the_fields_of_fit_config():
    """trainer.fit's keywords are FitConfig's fields (a real signature, written against the config)."""
    import inspect

    from pipedp import PipelineDPTrainer

    keywords = [
        name
        for name, p in inspect.signature(PipelineDPTrainer.fit).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "callback"
    ]
    assert keywords == [f.name for f in dataclasses.fields(FitConfig)]


def test_the_trainer_and_the_cli_calibrate_in_one_place():
    from pipedp.privacy.accounting import calibrated, epsilon_of, planned_charges

    shuffled = PrivacyConfig(
        expected_batch_size=16, sample_rate=16 / 256, target_epsilon=4.0, sampling="shuffle", dataset_size=256
    ).validate()
    assert planned_charges(shuffled, FitConfig(steps=32)) == (1.0, 2)  # two epochs of 16 batches: charged once each
    sigma = calibrated(shuffled, FitConfig(steps=32)).noise_multiplier
    assert 4.0 - 0.01 <= epsilon_of([(sigma, 1.0, 2)], 1e-5, "prv") <= 4.0
