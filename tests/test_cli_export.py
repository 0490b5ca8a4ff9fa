"""Exports that travel: a LoRA adapter names its base model by absolute path (loaded from another working
directory with transformers + peft), --export-merged writes the whole model with the adapter merged in, and an
export folder holding files is refused without --overwrite."""

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


def test_a_merged_export_computes_what_the_adapter_on_its_base_computes(tmp_path, cli, monkeypatch):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import torch

    folder, _ = tiny_gpt2_folder(transformers, tmp_path)
    monkeypatch.chdir(tmp_path)
    args = ["train", "--inprocess", "--model", "tiny-gpt2", "--lora-r", "2", "--lora-targets", "c_attn", "--steps", "2",
            "--batch-size", "4", "--seq-len", "8", "--no-progress", "--lr", "0.05"]  # fmt: skip
    assert "--export-merged merges a LoRA adapter" in cli(*args[:4], *args[8:], "--export-merged", "m").stderr
    out = cli(*args, "--checkpoint-dir", "run", "--export", "adapter", "--export-merged", "merged")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "adapter_config.json" not in os.listdir(tmp_path / "merged")  # a whole model, no peft needed
    assert "tokenizer_config.json" in os.listdir(tmp_path / "merged")
    # the oracle: peft's own adapter on the base model, loaded from the --export folder
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float64).eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        want, got, untrained = adapted(ids).logits, merged(ids).logits, plain(ids).logits
    assert (want - untrained).abs().max() > 1e-4  # the adapter was trained: the check can fail
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # (the merged weights were saved in float32)
    assert not os.path.exists(str(tmp_path / "merged") + ".adapter-partial")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    load = (  # from another working directory, without peft: transformers alone loads it and generates
        "import sys, torch, transformers; m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
        "t = transformers.AutoTokenizer.from_pretrained(sys.argv[1]); "
        "print(m.generate(torch.tensor([[1, 2]]), max_new_tokens=2, do_sample=False).shape, t.__class__.__name__)"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    loaded = subprocess.run(
        [sys.executable, "-c", load, str(tmp_path / "merged")], cwd=elsewhere, capture_output=True, text=True, env=env
    )
    assert loaded.returncode == 0 and "torch.Size([1, 4])" in loaded.stdout, loaded.stderr[-3000:]
    again = cli(*args, "--checkpoint-dir", "run2", "--export-merged", "merged")
    assert again.returncode != 0 and "--export-merged merged already holds files" in again.stderr
    alone = cli(*args, "--checkpoint-dir", "run4", "--export-merged", "merged-alone")  # no --export: the scratch
    assert alone.returncode == 0 and "config.json" in os.listdir(tmp_path / "merged-alone")
    assert not os.path.exists(str(tmp_path / "merged-alone") + ".adapter-partial")  # ... removed after the merge
    os.makedirs(str(tmp_path / "left") + ".adapter-partial")  # as an interrupted merge leaves it
    stale = cli(*args, "--checkpoint-dir", "run5", "--export-merged", "left")
    assert stale.returncode == 2 and "left from an interrupted merged export" in stale.stderr
    # a LoRA run's own config.toml runs it again (new export folders: the old ones are not written over)
    rerun = cli("train", "--config", "run/config.toml", "--checkpoint-dir", "again", "--export-merged", "merged2")
    assert rerun.returncode == 2 and "--export adapter already holds files" in rerun.stderr
    rerun = cli(
        "train", "--config", "run/config.toml", "--checkpoint-dir", "again", "--export", "a2", "--export-merged", "m2"
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resolved = [json.load(open(f"{run}/config.json"))["resolved"] for run in ("run", "again")]
    assert resolved[0]["privacy"] == resolved[1]["privacy"] and resolved[0]["model_files"] == resolved[1]["model_files"]


def test_lora_on_the_expert_weights_of_a_mixtral_folder_trains_and_exports_an_adapter_peft_loads(tmp_path, cli):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import torch

    gpt2, vocab = tiny_gpt2_folder(transformers, tmp_path)  # (its tokenizer)
    config = transformers.MixtralConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    folder = tmp_path / "tiny-mixtral"
    transformers.MixtralForCausalLM(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(gpt2).save_pretrained(folder)
    targets = "q_proj,experts.gate_up_proj,experts.down_proj"  # the bank's weights: PEFT's target_parameters
    out = cli("train", "--inprocess", "--model", str(folder), "--lora-r", "2", "--lora-targets", targets,
              "--steps", "1", "--batch-size", "4", "--seq-len", "8", "--no-progress",
              "--checkpoint-dir", str(tmp_path / "run"), "--export", str(tmp_path / "adapter"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    saved = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert saved["target_modules"] == ["q_proj"]
    assert sorted(saved["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    outer = adapted.base_model.model.model.layers[0].mlp.experts
    assert type(outer).__name__ == "ParamWrapper"
    assert float(outer.lora_B["default"].weight.abs().max()) > 0  # started at zero: one noisy step moved it
