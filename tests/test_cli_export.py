"""Exports that travel: a LoRA adapter names its base model by absolute path (loaded from another working
directory with transformers + peft), and an export folder holding files is refused without --overwrite."""

import json
import os
import subprocess
import sys

import pytest

from tests.test_cli import tiny_gpt2_folder


def test_a_lora_export_loads_from_another_directory_and_is_not_written_over(tmp_path, cli, monkeypatch):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    folder, _ = tiny_gpt2_folder(transformers, tmp_path)
    monkeypatch.chdir(tmp_path)  # --model as a user types it: relative to where the run starts
    args = ["train", "--inprocess", "--model", "tiny-gpt2", "--lora-r", "2", "--lora-targets", "c_attn", "--steps", "1",
            "--batch-size", "4", "--seq-len", "8", "--no-progress"]  # fmt: skip
    out = cli(*args, "--checkpoint-dir", "run", "--export", "adapter")
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert config["base_model_name_or_path"] == str(folder)  # absolute
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    load = (
        "import sys, torch, peft; m = peft.AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]); "
        "print(m.generate(torch.tensor([[1, 2]]), max_new_tokens=2, do_sample=False).shape)"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    loaded = subprocess.run(
        [sys.executable, "-c", load, str(tmp_path / "adapter")], cwd=elsewhere, capture_output=True, text=True, env=env
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "torch.Size([1, 4])" in loaded.stdout
    again = cli(*args, "--checkpoint-dir", "run2", "--export", "adapter")
    assert again.returncode != 0 and "--export adapter already holds files" in again.stderr
    assert cli(*args, "--checkpoint-dir", "run3", "--export", "adapter", "--overwrite").returncode == 0
