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
        ("epoch strategies", ["--eval-fraction", "0.05", "--sample-rate", "0.01", "--eval-strategy", "epoch"]),
        ("explicit defaults", ["--max-grad-norm", "1.0", "--noise-multiplier", "1.0"]),
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
    if kind == "explicit defaults":  # chosen, not left at the default: kept, and no "left at defaults" warning
        assert saved["max-grad-norm"] == 1.0 and saved["noise-multiplier"] == 1.0
        assert "left at pipedp's default" not in first.stdout + first.stderr
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


def test_epoch_strategies_evaluate_and_checkpoint_every_epoch(cli, tmp_path):
    data = tmp_path / "notes.txt"
    data.write_text("".join(f"note number {i}\n" for i in range(40)))
    args = (*BASE[:2], "--data", str(data), "--batch-size", "10", "--eval-fraction", "0.1", "--no-progress")
    out = cli(*args, "--steps", "8", "--eval-strategy", "epoch", "--save-strategy", "epoch", "--checkpoint-dir", "r")
    assert out.returncode == 0, out.stderr
    units = json.load(open("r/config.json"))["resolved"]["units"]
    epoch = -(-units // 10)  # ceil(1 / q) Poisson steps, q = B / N: each unit sampled once per epoch on average
    assert 1 < epoch < 8 and f"an epoch is {epoch} steps" in out.stdout
    with open("r/metrics.jsonl") as f:
        evaluated = [line["step"] for line in map(json.loads, f) if "eval_loss" in line]
    assert evaluated == sorted({*range(epoch, 9, epoch), 8})  # every epoch, and the end
    assert sorted(d for d in os.listdir("r") if d.startswith("step-"))[-1] == "step-00000008"
    assert f"step-{epoch:08d}" in os.listdir("r") or epoch * 4 < 8  # (keep-last 3)
    both = cli(*args, "--eval-strategy", "epoch", "--eval-every", "3")
    assert both.returncode == 2 and "--eval-strategy epoch and --eval-every both say when" in both.stderr
    lone = cli(*BASE, "--eval-strategy", "epoch")
    assert lone.returncode == 2 and "give --eval-data FILE or --eval-fraction F" in lone.stderr
    assert cli(*args, "--steps", "2", "--save-strategy", "no", "--checkpoint-dir", "n").returncode == 0
    assert not [d for d in os.listdir("n") if d.startswith("step-")]
    assert "no-checkpoint" not in open("n/config.toml").read()  # saved as the user said it, not rewritten
    again = cli(*args, "--steps", "2", "--save-strategy", "no", "--checkpoint-dir", "n", "--resume")
    assert again.returncode == 2 and "drop --save-strategy no" in again.stderr
    both = cli(*args, "--save-strategy", "epoch", "--no-checkpoint")
    assert both.returncode == 2 and "--save-strategy epoch would do nothing" in both.stderr
    # a config file's step flag gives way to the command line's strategy (flags override the file)
    with open("job.toml", "w") as f:
        f.write("eval-every = 3\ncheckpoint-every = 3\n")
    chosen = cli(*args, "--config", "job.toml", "--steps", "2", "--eval-strategy", "epoch", "--checkpoint-dir", "c")
    assert chosen.returncode == 0 and f"an epoch is {epoch} steps: evaluating every" in chosen.stdout, chosen.stderr
