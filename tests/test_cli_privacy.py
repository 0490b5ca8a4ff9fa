"""pipedp train's privacy said plainly: --disable-dp (a non-private baseline, epsilon ∞), and the warnings when
the privacy is weak, the noise too large to learn, or the mechanism left at its defaults."""

import json
import os

import pytest

BASE = ("train", "--inprocess", "--steps", "2", "--no-progress")


@pytest.fixture
def cli(cli, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    return cli


def test_disable_dp_says_epsilon_is_infinite_charges_nothing_and_cannot_resume_as_private(cli):
    out = cli(*BASE, "--checkpoint-dir", "runs/base", "--disable-dp")
    assert out.returncode == 0, out.stderr
    assert "privacy: NONE (--disable-dp: no clipping, no noise, epsilon ∞" in out.stdout
    assert "epsilon ∞: not differentially private" in out.stdout
    summary = json.load(open("runs/base/summary.json"))
    assert summary["private"] is False and summary["epsilon"] is None  # inf is not JSON: written as null
    strict = dict(parse_constant=lambda c: pytest.fail(f"metrics.jsonl holds {c}, which is not JSON"))
    last = [json.loads(line, **strict) for line in open("runs/base/metrics.jsonl")][-1]
    assert last["epsilon"] is None and last["clipped_fraction"] == 0.0  # no finite guarantee: null (inf is not JSON)
    assert "disable-dp = true" in open("runs/base/config.toml").read()

    private = cli("train", "--inprocess", "--steps", "4", "--no-progress", "--checkpoint-dir", "runs/base", "--resume")
    assert (
        private.returncode == 2 and "a private run and a non-private one cannot continue each other" in private.stderr
    )
    again = cli(
        "train", "--config", "runs/base/config.toml", "--steps", "3", "--checkpoint-dir", "runs/base", "--resume"
    )
    assert again.returncode == 0, again.stderr  # its own config.toml continues it


@pytest.mark.parametrize(
    "flag", [["--noise-multiplier", "2"], ["--max-grad-norm", "0.5"], ["--target-epsilon", "3"], ["--secure-mode"]]
)
def test_disable_dp_refuses_a_privacy_option_it_would_ignore(cli, flag):
    out = cli(*BASE, "--disable-dp", *flag)
    assert out.returncode == 2 and f"--disable-dp trains without clipping or noise, so {flag[0]}" in out.stderr
    assert not os.path.exists("runs")


def opacus_epsilon(sigma, rate, steps, delta=1e-5):
    from opacus.accountants import create_accountant

    accountant = create_accountant(mechanism="prv")
    accountant.history = [(sigma, rate, steps)]
    return accountant.get_epsilon(delta=delta)


def test_weak_privacy_is_warned_before_the_run_and_in_its_summary(cli):
    weak = ("--noise-multiplier", "0.5", "--max-grad-norm", "0.8", "--sample-rate", "0.2")
    with open("records.txt", "w") as f:  # 60 records: batches of about 12 (the generated corpus's 4000: 800)
        f.write("".join(f"record number {i} of a small file\n" for i in range(60)))
    out = cli(*BASE, "--checkpoint-dir", "runs/weak", "--data", "records.txt", *weak)
    assert out.returncode == 0, out.stderr
    planned = opacus_epsilon(0.5, 0.2, 2)
    assert planned > 10  # the independent accountant agrees the run is weak: the warning below must fire
    start, end = out.stdout.split("done:")
    assert f"warning: the run will end at epsilon {planned:.3g}" in start
    summary = json.load(open("runs/weak/summary.json"))
    assert f"warning: epsilon {summary['epsilon']:.3g} is above 10" in end
    assert summary["epsilon"] == pytest.approx(planned, rel=1e-3) and len(summary["warnings"]) == 1
    assert "left at pipedp's default" not in out.stdout  # both were chosen


def test_chosen_moderate_privacy_says_nothing_and_defaults_are_named(cli):
    quiet = cli(*BASE, "--checkpoint-dir", "runs/ok", "--noise-multiplier", "1.1", "--max-grad-norm", "0.9")
    assert quiet.returncode == 0 and "warning:" not in quiet.stdout, quiet.stdout
    default = cli(*BASE, "--checkpoint-dir", "runs/default")
    assert "warning: --noise-multiplier and --max-grad-norm left at pipedp's defaults" in default.stdout
    calibrated = cli(*BASE, "--checkpoint-dir", "runs/cal", "--target-epsilon", "3")
    assert "warning: --max-grad-norm left at pipedp's default (1.0)" in calibrated.stdout


def test_noise_too_large_to_learn_is_warned_about(cli):
    # sigma / (batch x sqrt(steps)) = 100 / (32 x sqrt(2)) = 2.2: the noise outweighs any gradient on every coordinate
    out = cli(*BASE, "--checkpoint-dir", "runs/loud", "--noise-multiplier", "100", "--max-grad-norm", "0.5")
    assert "warning: noise multiplier 100 is too large to learn" in out.stdout and "2.21 x steps x C" in out.stdout
    # planted: the same noise over a batch where it no longer outweighs the signal says nothing of it
    fine = cli(*BASE, "--checkpoint-dir", "runs/fine", "--noise-multiplier", "100", "--max-grad-norm", "0.5",
               "--batch-size", "100")  # fmt: skip
    assert "too large to learn" not in fine.stdout
