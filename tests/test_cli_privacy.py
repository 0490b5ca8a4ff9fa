"""pipedp train's privacy said plainly: --disable-dp (a non-private baseline, epsilon ∞), and the warnings when
the privacy is weak, the noise too large to learn, or the mechanism left at its defaults."""

import json
import math
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
    last = [json.loads(line) for line in open("runs/base/metrics.jsonl")][-1]
    assert last["epsilon"] == math.inf and last["clipped_fraction"] == 0.0
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
