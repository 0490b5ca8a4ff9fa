"""The command line at the edges: the run folder's lock taken before anything is written, a moved model
folder, counts of 0, config files with a BOM or a byte that is not UTF-8, blank keys caught in the preflight."""

import json
import os
import re
import shutil

import pytest
from test_cli_finetune import chats, tiny_chat_llama

import pipedp.cli.preflight as preflight
from pipedp import CheckpointError
from pipedp.train.checkpoint import FolderLock

BASE = ("train", "--inprocess", "--no-progress")


def snapshot(root):
    """Every file's bytes under ``root``, by relative path."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


# ---- 5. the lock before anything is written ---------------------------------------------------------------
@pytest.mark.parametrize("flags", [(), ("--resume",), ("--overwrite",), ("--resume", "--steps", "4")])
def test_a_job_refused_by_the_lock_leaves_the_folder_byte_for_byte(tmp_path, cli, flags):
    ck = str(tmp_path / "ck")
    assert cli(*BASE, "--steps", "2", "--checkpoint-dir", ck).returncode == 0
    holder = FolderLock(ck)  # the running job
    holder.acquire()
    try:
        before = snapshot(ck)
        second = cli(*BASE, "--steps", "3", "--checkpoint-dir", ck, "--seq-len", "20", *flags)
        after = snapshot(ck)
    finally:
        holder.release()
    assert second.returncode == 2 and "is in use by another job" in second.stderr, second.stderr[-2000:]
    assert after == before


def test_the_lock_is_held_from_before_the_first_byte_to_the_end_of_the_run(tmp_path, cli, monkeypatch):
    """The planted case: the preflight only probed the lock, so a job starting in between (here: one that tries
    while this job checks its model, before it writes the data cache and config.json) got the folder."""
    ck = str(tmp_path / "ck")
    original, seen = preflight.check_model, []

    def another_job_starts_now(*args):
        with pytest.raises(CheckpointError, match="in use by another job"):
            FolderLock(ck).acquire()
        seen.append(True)
        return original(*args)

    monkeypatch.setattr(preflight, "check_model", another_job_starts_now)
    out = cli(*BASE, "--steps", "2", "--checkpoint-dir", ck)
    assert out.returncode == 0 and seen, out.stderr[-2000:]
    assert [json.loads(line)["step"] for line in open(os.path.join(ck, "metrics.jsonl"))] == [1, 2]
    assert not os.path.exists(os.path.join(ck, "lock"))  # released at the end
    FolderLock(ck).acquire()


# ---- 1. a moved model folder, a changed base ------------------------------------------------------------------
def test_a_moved_model_folder_resumes_and_a_changed_base_is_refused_naming_the_tensor(tmp_path, cli):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    model = tiny_chat_llama(transformers, tmp_path / "model")
    data = str(chats(tmp_path / "chats.jsonl", 24))
    ck = str(tmp_path / "ck")
    job = (*BASE, "--data", data, "--lora-r", "2", "--batch-size", "4", "--checkpoint-dir", ck)
    assert cli(*job, "--model", str(model), "--steps", "1").returncode == 0
    moved = shutil.copytree(model, tmp_path / "scratch" / "model")
    shutil.rmtree(model)
    out = cli(*job, "--model", str(moved), "--steps", "2", "--resume")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "the model folder moved: its config and tokenizer files are the same" in out.stdout
    weights = load_file(moved / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name].view(-1)[1] += 0.5  # an element the sampled fingerprint never read
    save_file(weights, moved / "model.safetensors", metadata={"format": "pt"})
    changed = cli(*job, "--model", str(moved), "--steps", "3", "--resume")
    assert changed.returncode != 0
    assert re.search(rf"frozen tensor \S*{name} is not the one the checkpoint .*its bytes' sha256", changed.stderr)


# ---- 7. counts, config files, keys --------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["flag", "file"])
@pytest.mark.parametrize("key", ["steps", "epochs"])
def test_zero_steps_or_epochs_are_refused_not_replaced_by_the_default(tmp_path, cli, where, key):
    config = tmp_path / "job.toml"
    config.write_text(f"{key} = 0\n")
    given = ("--config", str(config)) if where == "file" else (f"--{key}", "0")
    out = cli(*BASE, "--checkpoint-dir", str(tmp_path / "ck"), *given)
    assert out.returncode == 2 and f"{key}" in out.stderr and "launching" not in out.stdout
    assert "300 steps" not in out.stdout  # the planted case: the default run length trained instead


def test_a_config_file_with_a_byte_order_mark_is_read(tmp_path, cli):
    config = tmp_path / "job.toml"
    config.write_bytes(b"\xef\xbb\xbfsteps = 1\n")
    out = cli(*BASE, "--checkpoint-dir", str(tmp_path / "ck"), "--config", str(config))
    assert out.returncode == 0 and "1 steps" in out.stdout, out.stderr[-2000:]


def test_a_config_file_byte_that_is_not_utf8_is_one_line_naming_the_line(tmp_path, cli):
    config = tmp_path / "job.toml"
    config.write_bytes(b"steps = 1\n# caf\xe9\n")
    out = cli(*BASE, "--checkpoint-dir", str(tmp_path / "ck"), "--config", str(config))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"--config '{config}':2: byte 0xe9 is not UTF-8: save the file as UTF-8" in out.stderr


@pytest.mark.parametrize("key", ["", " "])
def test_a_blank_key_is_refused_before_any_process_starts(tmp_path, cli, key):
    out = cli(
        "train", "--no-progress", "--steps", "1", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-key", key
    )
    assert out.returncode == 2 and "launching" not in out.stdout
    assert "signs with no secret" in out.stderr
    assert not os.path.exists(tmp_path / "ck" / "config.json")


def test_a_signed_run_resumed_without_its_key_is_refused_in_the_preflight(tmp_path, cli):
    ck = str(tmp_path / "ck")
    assert cli(*BASE, "--steps", "1", "--checkpoint-dir", ck, "--checkpoint-key", "secret").returncode == 0
    before = snapshot(ck)
    out = cli(*BASE, "--steps", "2", "--checkpoint-dir", ck, "--resume")
    assert out.returncode == 2 and "this folder's checkpoints are signed: pass the key" in out.stderr
    assert snapshot(ck) == before
