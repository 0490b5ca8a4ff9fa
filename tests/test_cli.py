"""Drive the CLI the way a user does: as a subprocess."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def pipedp(*args, timeout=240, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "pipedp.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or ROOT,
        env=ENV,
    )


def metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def opacus_epsilon(noise_multiplier, sample_rate, steps, delta=1e-5):
    from opacus.accountants import create_accountant

    accountant = create_accountant(mechanism="prv")
    accountant.history = [(noise_multiplier, sample_rate, steps)]
    return accountant.get_epsilon(delta=delta)


def wait_for(predicate, timeout, proc):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.mark.dist
def test_default_job_over_two_processes_stops_on_sigterm_and_resumes_from_its_config(tmp_path, cli):
    ck = str(tmp_path / "ck")
    run = subprocess.Popen(
        [sys.executable, "-m", "pipedp.cli", "train", "--steps", "100000", "--checkpoint-dir", ck, "--checkpoint-every"]
        + ["2", "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=ENV,
    )
    try:
        done = lambda: os.path.exists(os.path.join(ck, "metrics.jsonl")) and len(metrics(ck)) >= 5  # noqa: E731
        wait_for(done, 200, run)
        ranks = subprocess.run(["ps", "-o", "pid=", "--ppid", str(run.pid)], capture_output=True, text=True).stdout
        run.send_signal(signal.SIGTERM)  # to the launcher only: it forwards it to the ranks
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 143, err[-3000:]
    assert "launching 2 processes" in out and "pipedp: stopped (SIGTERM)" in err
    assert not any(
        os.path.exists(f"/proc/{pid}") and "spawn" in open(f"/proc/{pid}/cmdline").read() for pid in ranks.split()
    )
    from pipedp.train.checkpoint import FolderLock, exists

    assert exists(ck)
    lock = FolderLock(ck)
    lock.acquire()  # released by the ranks' finally paths (no job holds the folder)
    lock.release()
    lines = metrics(ck)
    q = 32 / 4000
    for line in lines:
        if "epsilon" in line:  # exactly the accountant's epsilon after that many Poisson steps
            assert line["epsilon"] == pytest.approx(opacus_epsilon(1.0, q, line["step"]), rel=1e-9)
    assert {"loss", "lr", "batch_size", "clipped_fraction", "samples_per_s"} <= set(lines[0])
    assert 0 <= lines[0]["clipped_fraction"] <= 1 and lines[0]["samples_per_s"] > 0

    again = cli("train", "--checkpoint-dir", ck, "--steps", "3", "--inprocess")
    assert again.returncode == 2 and "already holds the checkpoint of a run: pass --resume" in again.stderr

    # the saved config.toml runs the job again; flags override it; what does not change the update is accepted
    steps = max(line["step"] for line in lines) + 2
    resumed = cli(
        "train", "--config", os.path.join(ck, "config.toml"), "--resume", "--steps", str(steps), "--inprocess"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume: --inprocess: False -> True (does not change the update)" in resumed.stdout
    assert "resumed from step" in resumed.stdout and f"done: {steps} steps" in resumed.stdout
    after = metrics(ck)
    assert [line["step"] for line in after] == list(range(1, steps + 1))  # no step twice, none missing
    assert after[-1]["epsilon"] == pytest.approx(opacus_epsilon(1.0, q, steps), rel=1e-9)
    assert open(os.path.join(ck, "training.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert json.load(open(os.path.join(ck, "summary.json")))["steps"] == steps


def test_schedule_show(tmp_path):
    png = tmp_path / "timeline.png"
    out = pipedp("schedule", "show", "1f1b", "--stages", "2", "--microbatches", "4", "--png", str(png))
    assert out.returncode == 0, out.stderr
    assert "stage 0 | F0" in out.stdout and "bubble" in out.stdout and "peak in-flight per stage [2, 1]" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _one_clear_line(out, message):
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("pipedp: error:") and message in lines[0], lines[0]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--stages", "0"], "--stages: must be >= 1, got 0"),
        (["train", "--delta", "1"], "--delta: must be in (0, 1), got 1.0"),
        (["train", "--export", "out"], "--export writes a Hugging Face folder"),
        (["train", "--target-epsilon", "1e9"], "--target-epsilon: 1e+09 is above 100"),
        (["train", "--timeout", "0"], "--timeout: must be > 0 and finite"),
        (["train", "--lr", "inf"], "--lr: must be > 0 and finite"),
        (["train", "--model", "/no/such/model"], "'/no/such/model' is neither 'tiny-gpt' nor a local folder"),
        (["train", "--data", "/no/such/file.txt"], "dataset '/no/such/file.txt' does not exist"),
        (["train", "--resume", "--overwrite"], "--resume continues the run in --checkpoint-dir and --overwrite"),
        (["train", "--eval-every", "10"], "--eval-every: give evaluation data"),
        (["train", "--privacy-unit", "user"], "--privacy-unit: 'user' needs user_field"),
        (["train", "--checkpoint-dir", ""], "--checkpoint-dir: give a folder"),
        (["schedule", "show", "zb", "--stages", "2", "--microbatches", "2"], "unknown schedule 'zb'"),
    ],
)
def test_bad_arguments_give_one_clear_line_at_once(args, message):
    _one_clear_line(pipedp(*args), message)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--stages", "7"], "--stages: 7 stages for a model of 6 blocks (0, 1, 2, 3, 4, 5): use --stages 6 or fewer"),
        (["--delta", "0.001"], "--delta: 0.001 is not below 1/N = 1/4000"),
        (["--batch-size", "5000"], "--batch-size 5000 is larger than the data (4000 privacy units)"),
        (
            ["--target-epsilon", "0.0000001", "--sample-rate", "1", "--steps", "1000000", "--accountant", "rdp"],
            "cannot be met",
        ),
    ],
)
def test_checks_that_read_the_model_or_the_data_come_before_any_process(tmp_path, cli, args, message):
    out = cli("train", "--checkpoint-dir", str(tmp_path / "ck"), "--no-progress", *args)
    _one_clear_line(out, message)
    assert "launching" not in out.stdout


def tiny_gpt2_folder(transformers, tmp_path):
    """A local Hugging Face folder: a tiny GPT-2 (random weights) and a character tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz .,"))
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(["[UNK]"] + chars)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    cfg = transformers.GPT2Config(
        vocab_size=len(chars) + 1, n_positions=32, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    folder = tmp_path / "tiny-gpt2"
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder, len(chars) + 1


def test_a_local_gpt2_on_jsonl_records_evaluates_calibrates_and_exports_tied(tmp_path, cli):
    transformers = pytest.importorskip("transformers")
    folder, vocab = tiny_gpt2_folder(transformers, tmp_path)
    data, held = tmp_path / "data.jsonl", tmp_path / "eval.jsonl"
    data.write_text("\n".join(json.dumps({"body": f"the cat sat on the mat {'a' * (i % 30)}."}) for i in range(60)))
    held.write_text("\n".join(json.dumps({"body": "the dog sat on the log."}) for _ in range(5)))
    out = cli(
        "train",
        "--inprocess",
        "--model",
        str(folder),
        "--data",
        str(data),
        "--text-field",
        "body",
        "--eval-data",
        str(held),
        "--target-epsilon",
        "8",
        "--steps",
        "3",
        "--seq-len",
        "24",
        "--batch-size",
        "8",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--no-checkpoint",
        "--no-progress",
        "--export",
        str(tmp_path / "out"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "calibrating noise (prv): sigma" in out.stdout
    # one record, one row: the long records are cut at 24 + 1 tokens, and the run says how many
    long = sum(len(f"the cat sat on the mat {'a' * (i % 30)}.") > 25 for i in range(60))
    assert f"60 text records -> 60 rows of 24 tokens; {long} truncated" in out.stdout
    assert "done: 3 steps" in out.stdout and "exported:" in out.stdout and "eval: loss" in out.stdout
    assert not any(n.startswith("step-") for n in os.listdir(tmp_path / "ck"))  # --no-checkpoint
    evals = [line for line in metrics(tmp_path / "ck") if "eval_loss" in line]
    assert len(evals) == 1 and evals[0]["eval_perplexity"] == pytest.approx(2.718281828459045 ** evals[0]["eval_loss"])
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    original = transformers.GPT2LMHeadModel.from_pretrained(folder)
    assert trained.lm_head.weight is trained.transformer.wte.weight  # trained tied across the stages, exported tied
    assert not torch.equal(trained.transformer.h[0].mlp.c_fc.weight, original.transformer.h[0].mlp.c_fc.weight)
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))("cat")["input_ids"]


def test_lora_on_a_local_llama_on_chat_records_with_a_schedule(tmp_path, cli):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from test_cli_finetune import chats, tiny_chat_llama

    folder = tiny_chat_llama(transformers, tmp_path / "llama")
    data = chats(tmp_path / "chat.jsonl", 40)
    out = cli(
        "train",
        "--inprocess",
        "--model",
        str(folder),
        "--data",
        str(data),
        "--eval-fraction",
        "0.2",
        "--steps",
        "3",
        "--seq-len",
        "40",
        "--batch-size",
        "8",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "1",
        "--weight-decay",
        "0.01",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--no-progress",
        "--lora-r",
        "4",
        "--lora-targets",
        "q_proj,v_proj",
        "--export",
        str(tmp_path / "adapter"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "40 chat records -> 40 rows of 40 tokens" in out.stdout and "8 of 40 privacy units held out" in out.stdout
    assert "stage 0: loading the whole model" in out.stdout and "stage 0: loaded in" in out.stdout
    from pipedp.cli.options import OptimizerConfig

    schedule = OptimizerConfig(lr_schedule="cosine", warmup_steps=1)
    assert [line["lr"] for line in metrics(tmp_path / "ck") if "lr" in line] == [
        pytest.approx(3e-3 * schedule.lr_factor(s, 3)) for s in range(3)
    ]
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    adapted = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(folder), tmp_path / "adapter"
    )
    x = torch.randint(0, base.config.vocab_size, (2, 12))
    assert not torch.allclose(adapted(x).logits, base(x).logits)  # the trained adapter changes the model


@pytest.mark.dist
def test_lora_under_tensor_parallelism_reads_each_ranks_slices_and_exports_the_whole_adapter(tmp_path, cli):
    """--tensor-parallel 2 --lora-r: each rank reads its slices of the split projections, its adapters split with
    them (exactness: tests/multiprocess/test_tensor_parallel.py); the export joins them into one whole adapter."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from test_cli_finetune import chats, tiny_chat_llama

    folder = tiny_chat_llama(transformers, tmp_path / "llama")
    out = cli(
        "train",
        "--model",
        str(folder),
        "--data",
        str(chats(tmp_path / "chat.jsonl", 40)),
        "--tensor-parallel",
        "2",
        "--steps",
        "2",
        "--seq-len",
        "40",
        "--batch-size",
        "8",
        "--lora-r",
        "4",
        "--lora-targets",
        "q_proj,o_proj",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--no-progress",
        "--export",
        str(tmp_path / "adapter"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 replica(s) x 2 tensor-parallel" in out.stdout
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    adapted = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(folder), tmp_path / "adapter"
    )
    attention = adapted.base_model.model.model.layers[0].self_attn
    assert attention.q_proj.lora_B["default"].weight.shape == (32, 4)  # whole: both ranks' rows
    assert attention.o_proj.lora_A["default"].weight.shape == (4, 32)  # whole: both ranks' columns
    x = torch.randint(0, base.config.vocab_size, (2, 12))
    assert not torch.allclose(adapted(x).logits, base(x).logits)  # trained


def test_non_finite_losses_are_reported_and_fail_the_run(tmp_path, cli):
    with pytest.warns(UserWarning) as warned:
        out = cli(
            "train",
            "--inprocess",
            "--steps",
            "4",
            "--no-progress",
            "--noise-multiplier",
            "0",
            "--lr",
            "1e30",
            "--checkpoint-dir",
            str(tmp_path / "ck"),
        )
    assert out.returncode == 3, out.stderr[-2000:]
    assert "-> nan" in out.stdout and "non-finite losses from step" in out.stdout
    text = " ".join(str(w.message) for w in warned)
    assert "non-finite gradient norm" in text and "left out of the update" in text


def test_resume_says_what_changed_refuses_what_the_update_cannot_take_and_overwrite_moves_aside(tmp_path, cli):
    ck = str(tmp_path / "ck")
    base = ("train", "--inprocess", "--no-progress", "--checkpoint-dir", ck)
    fresh = cli(*base, "--steps", "1", "--resume")
    assert fresh.returncode == 0 and "--resume: no checkpoint in" in fresh.stdout, fresh.stderr
    again = cli(*base, "--steps", "2", "--resume", "--lr", "0.01", "--microbatches", "2")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resume: --lr: 0.003 -> 0.01 (applies from the resumed step on" in again.stdout
    assert "resume: --microbatches: 4 -> 2 (does not change the update)" in again.stdout
    assert "--lr 0.01 replaces the checkpoint's 0.003" in again.stdout
    other = cli(*base, "--steps", "3", "--resume", "--seq-len", "20", "--max-grad-norm", "2")
    assert other.returncode == 2 and "launching" not in other.stdout
    assert f"cannot resume the run in {ck}: it was started with other options:\n  " in other.stderr
    assert "--seq-len: (default) -> 20 (the resumed run must train the same model on the same records)" in other.stderr
    assert "max grad norm: checkpoint 1.0, now 2.0 (it shapes the update)" in other.stderr
    over = cli(*base, "--steps", "1", "--overwrite")
    assert over.returncode == 0 and "--overwrite: the previous run in" in over.stdout, over.stderr[-2000:]
    aside = [n for n in os.listdir(tmp_path) if n.startswith("ck.previous-")]
    assert len(aside) == 1 and [m["step"] for m in metrics(tmp_path / aside[0])] == [1, 2]
    assert [m["step"] for m in metrics(ck)] == [1]


def test_bad_data_gives_one_clear_line(tmp_path, cli):
    folder = tmp_path / "data.jsonl"
    folder.mkdir()
    _one_clear_line(pipedp("train", "--inprocess", "--data", str(folder)), "is not a file (a folder?)")
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": {"nested": "x"}}\n')
    out = cli("train", "--inprocess", "--data", str(path), "--checkpoint-dir", str(tmp_path / "ck"))
    _one_clear_line(out, f"{path}:2: a text record needs a 'text' field holding a string")


def test_audit_prints_the_bound_and_draws_the_scores(tmp_path, cli):
    png = tmp_path / "audit.png"
    out = cli("audit", "--inprocess", "--canaries", "400", "--steps", "4", "--png", str(png))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "accountant epsilon" in out.stdout and "empirical epsilon lower bound" in out.stdout
    assert "verdict: PASSED" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    leak = cli("audit", "--inprocess", "--canaries", "400", "--steps", "4", "--noise-multiplier", "0")
    assert leak.returncode == 0 and "accountant epsilon            inf" in leak.stdout  # no claim to break


@pytest.mark.parametrize(
    "command", [["--help"], ["train", "--help"], ["audit", "--help"], ["schedule", "show", "--help"]]
)
def test_help_prints_every_flag(command):
    out = pipedp(*command)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]
    if command[0] == "train":
        for flag in (
            "--stages",
            "--noise-multiplier",
            "--target-epsilon",
            "--precision",
            "--lora-r",
            "--export",
            "--config",
            "--eval-fraction",
            "--lr-schedule",
            "--weight-decay",
            "--privacy-unit",
            "--no-checkpoint",
            "--overwrite",
            "--report-to",
            "--max-logical-batch",
        ):
            assert flag in out.stdout


def test_tensorboard_is_optional(tmp_path, cli):
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        _one_clear_line(
            pipedp("train", "--report-to", "tensorboard"), "--report-to tensorboard needs the tensorboard package"
        )
        return
    args = ("train", "--inprocess", "--steps", "2", "--no-progress", "--report-to", "tensorboard", "--checkpoint-dir")
    out = cli(*args, str(tmp_path / "ck"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert any(n.startswith("events.") for n in os.listdir(tmp_path / "ck" / "tensorboard"))


def test_report_to_names_are_checked_before_the_run(monkeypatch):
    import importlib.util

    from pipedp.cli import trackers
    from pipedp.errors import ConfigError

    assert trackers.parse("none") == () and trackers.parse("") == ()
    assert trackers.parse("wandb, MLflow,wandb") == ("wandb", "mlflow")
    with pytest.raises(ConfigError, match="comet is not a tracker pipedp reports to"):
        trackers.parse("wandb,comet")
    real = importlib.util.find_spec
    gone = {"wandb", "sqlalchemy"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name in gone else real(name))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert "wandb" not in trackers.parse("all") and "mlflow" not in trackers.parse("all")  # (no sqlite store)
    with pytest.raises(ImportError, match="pip install wandb"):
        trackers.check_installed(("wandb",))
    with pytest.raises(ImportError, match="needs sqlalchemy"):
        trackers.check_installed(("mlflow",))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")  # a server: no local store needed
    trackers.check_installed(("mlflow",))
    # the metrics.jsonl line as tracker names; no step, no null or infinite epsilon (--disable-dp)
    line = {"step": 3, "loss": 1.5, "epsilon": float("inf"), "eval_loss": 2.0, "clipped_fraction": None}
    assert trackers.tags(line) == {"train/loss": 1.5, "eval/loss": 2.0}


def test_a_failing_tracker_is_said_and_dropped_and_the_run_ends_as_without_it(tmp_path, cli, monkeypatch):
    """A tracker that fails at a step or at close (a server gone) must not end the run: the summary, the export and
    the other trackers still happen (before: the run ended after training with no summary.json)."""
    pytest.importorskip("tensorboard")
    from pipedp.cli import trackers

    def broken(*args, **kwargs):
        raise ConnectionError("the tracking server went away")

    monkeypatch.setattr(trackers._TensorBoard, "log", broken)
    monkeypatch.setattr(trackers._TensorBoard, "close", broken)
    args = ("train", "--inprocess", "--steps", "2", "--no-progress", "--report-to", "tensorboard", "--checkpoint-dir")
    out = cli(*args, str(tmp_path / "ck"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.count("--report-to tensorboard failed at step 1 (ConnectionError") == 1  # said once, dropped
    assert "tensorboard failed to close" not in out.stderr  # (dropped at step 1: nothing left to close)
    assert (tmp_path / "ck" / "summary.json").exists() and len(metrics(tmp_path / "ck")) == 2
    monkeypatch.setattr(trackers._TensorBoard, "log", lambda self, metrics, step: None)
    out = cli(*args, str(tmp_path / "ck2"))
    assert out.returncode == 0 and "--report-to tensorboard failed to close (ConnectionError" in out.stderr
    assert (tmp_path / "ck2" / "summary.json").exists()


def test_wandb_and_mlflow_offline_get_every_step_and_resume_continues_their_runs(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    ck = tmp_path / "ck"
    base = ("train", "--inprocess", "--no-progress", "--report-to", "wandb,mlflow", "--checkpoint-dir", str(ck))
    env = dict(ENV, WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path))
    env.pop("MLFLOW_TRACKING_URI", None)
    for extra in (("--steps", "2", "--seed", "7"), ("--steps", "3", "--resume", "--seed", "7")):
        out = subprocess.run(
            [sys.executable, "-m", "pipedp.cli", *base, *extra], capture_output=True, text=True, env=env, timeout=240
        )
        assert out.returncode == 0, out.stderr[-3000:]
    ids = json.loads((ck / "trackers.json").read_text())
    assert "report to mlflow: run " + ids["mlflow"] in out.stdout
    runs = [n for n in os.listdir(ck / "wandb") if n.startswith("offline-run-")]
    assert len(runs) == 2 and all(n.endswith("-" + ids["wandb"]) for n in runs)  # the resumed run: the same id
    client = MlflowClient("sqlite:///" + str(ck / "mlflow.db"))
    (run,) = client.search_runs([client.get_experiment_by_name("pipedp").experiment_id])
    assert run.info.run_id == ids["mlflow"]
    history = client.get_metric_history(run.info.run_id, "train/loss")
    losses = {line["step"]: line["loss"] for line in metrics(ck) if "loss" in line}
    assert sorted((m.step, m.value) for m in history) == sorted(losses.items()) and len(history) == 3
    assert run.data.params["report_to"] == "wandb,mlflow"
    assert "seed" not in run.data.params  # a known seed regenerates the noise: never sent to a tracker
    assert not any("--seed" in str(v) for v in run.data.tags.values())
    for folder, _, names in os.walk(ck / "wandb"):  # nor in wandb's record of the command line
        for name in names:
            assert b"--seed" not in (Path(folder) / name).read_bytes(), name


def test_user_level_units_are_sampled_and_accounted_per_user(tmp_path, cli):
    data = tmp_path / "users.jsonl"
    users = [f"u{i % 7}" for i in range(40)] + ["solo"]  # 7 users with 5-6 records each, one with a single record
    data.write_text("\n".join(json.dumps({"who": u, "text": f"note {i} of {u}."}) for i, u in enumerate(users)))
    args = ("train", "--inprocess", "--no-progress", "--data", str(data), "--privacy-unit", "user", "--user-field")
    out = cli(
        *args,
        "who",
        "--max-records-per-user",
        "4",
        "--batch-size",
        "2",
        "--steps",
        "3",
        "--eval-fraction",
        "0.25",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "8 users of 4 rows each; 7 users had more records (12 cut), 3 padding rows" in out.stdout
    assert "2 of 8 privacy units held out" in out.stdout and "unit user (who, 4 rows each), N = 6" in out.stdout
    lines = [line for line in metrics(tmp_path / "ck") if "epsilon" in line]
    assert lines and all(line["epsilon"] == pytest.approx(opacus_epsilon(1.0, 2 / 6, line["step"])) for line in lines)
