"""The README's workflow run in order: a run folder per run (runs/pipedp-train-TIME, -latest), a run's own
config.toml run again, a finished run resumed, the progress in a log and on a terminal."""

import json
import os
import sys

import pytest

try:
    import tomllib  # Python 3.11+
except ImportError:  # pragma: no cover (Python 3.10)
    import tomli as tomllib

BASE = ("train", "--inprocess", "--steps", "2")


@pytest.fixture
def cli(cli, monkeypatch, tmp_path):
    """conftest's ``pipedp ...`` in this process, in a fresh working directory (the default run folders)."""
    monkeypatch.chdir(tmp_path)
    return cli


def test_each_run_gets_its_own_folder_and_resume_continues_the_latest(cli):
    refused = cli(*BASE, "--resume")
    assert refused.returncode == 2 and "there is none: give the run's --checkpoint-dir" in refused.stderr
    first, second = cli(*BASE), cli(*BASE, "--no-progress")  # before: the second was refused (folder taken)
    assert first.returncode == 0 and second.returncode == 0, second.stderr
    folders = sorted(d for d in os.listdir("runs") if d != "pipedp-train-latest")
    assert len(folders) == 2 and all(d.startswith("pipedp-train-20") for d in folders)
    assert os.readlink("runs/pipedp-train-latest") == folders[1]
    assert f"run folder: runs/{folders[1]}" in second.stdout

    done = cli(*BASE, "--resume")  # a finished run: before, "done: 2 steps ... loss nan -> nan" and an export
    assert done.returncode == 0, done.stderr
    assert "nothing to do: the run already took its 2 steps" in done.stdout and "done:" not in done.stdout
    assert len(json.load(open(f"runs/{folders[1]}/config.json"))) == 2


def _users(path, users=40):
    with open(path, "w") as f:
        for i in range(users * 2):
            f.write(json.dumps({"text": f"note {i} from someone", "sender": f"u{i % users}"}) + "\n")
    return str(path)


@pytest.mark.parametrize(
    "kind, flags",
    [
        ("target epsilon", ["--target-epsilon", "3"]),
        ("user level", ["--privacy-unit", "user", "--user-field", "sender", "--max-records-per-user", "2"]),
        ("eval", ["--eval-fraction", "0.05", "--sample-rate", "0.01"]),
    ],
)
def test_a_runs_own_config_toml_runs_again(cli, tmp_path, kind, flags):
    data = ["--data", _users(tmp_path / "mails.jsonl"), "--batch-size", "4"] if kind == "user level" else []
    first = cli(*BASE, "--no-progress", "--checkpoint-dir", "run", *flags, *data)
    assert first.returncode == 0, first.stderr
    with open("run/config.toml", "rb") as f:
        saved = {k: v for table in tomllib.load(f).values() for k, v in table.items()}
    assert not {"noise-multiplier", "target-epsilon"} <= set(saved)  # before: both (the default written anyway)
    assert not {"batch-size", "sample-rate"} <= set(saved)
    assert saved["steps"] == 2 and "checkpoint-dir" in saved
    again = cli("train", "--config", "run/config.toml", "--checkpoint-dir", "again", "--no-progress")
    assert again.returncode == 0, again.stderr
    resolved = [json.load(open(f"{run}/config.json"))["resolved"] for run in ("run", "again")]
    assert resolved[0]["privacy"] == resolved[1]["privacy"] and resolved[0]["units"] == resolved[1]["units"]


def test_progress_says_eps_unknown_on_a_terminal_and_plain_lines_in_a_log(cli, monkeypatch):
    import tqdm

    log = cli(*BASE[:-1], "4", "--epsilon-every", "2", "--checkpoint-dir", "log")  # stderr captured: not a tty
    assert log.returncode == 0, log.stderr
    lines = [line for line in log.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 2/4", "step 4/4"] and "eps 0." in lines[0]
    assert "DP training" not in log.stderr  # no progress frames in a log

    shown = []
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(tqdm.tqdm, "set_postfix", lambda self, **kw: shown.append(kw["eps"]))
    bar = cli(*BASE[:-1], "3", "--epsilon-every", "2", "--checkpoint-dir", "bar")
    assert bar.returncode == 0, bar.stderr
    assert shown[0] == "–" and shown[1].startswith("0.")  # before: eps=0.00 until the first epsilon
