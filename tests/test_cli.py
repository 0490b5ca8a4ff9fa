"""Drive the CLI the way a user does: as a subprocess."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pipedp(*args, timeout=240, cwd=None):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "pipedp.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or ROOT,
        env=env,
    )


@pytest.mark.dist
def test_default_train_finishes_prints_epsilon_checkpoints_and_resumes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = pipedp("train", "--steps", "4", "--checkpoint-dir", ckpt, "--no-progress")
    assert first.returncode == 0, first.stderr
    assert "launching 2 processes" in first.stdout
    assert "done: 4 steps" in first.stdout and "epsilon" in first.stdout
    assert open(os.path.join(ckpt, "latest")).read() == "step-00000004"
    again = pipedp("train", "--steps", "6", "--checkpoint-dir", ckpt, "--resume", "--no-progress")
    assert again.returncode == 0, again.stderr
    assert "resumed from step 4" in again.stdout and "done: 6 steps" in again.stdout
    assert open(os.path.join(ckpt, "latest")).read() == "step-00000006"


def test_schedule_show(tmp_path):
    png = tmp_path / "timeline.png"
    out = pipedp("schedule", "show", "1f1b", "--stages", "2", "--microbatches", "4", "--png", str(png))
    assert out.returncode == 0, out.stderr
    assert "stage 0 | F0" in out.stdout and "bubble" in out.stdout and "peak in-flight per stage [2, 1]" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
        (
            [
                "train",
                "--target-epsilon",
                "0.0000001",
                "--sample-rate",
                "1",
                "--steps",
                "1000000",
                "--accountant",
                "rdp",
            ],
            "cannot be met",
        ),
        (["schedule", "show", "zb", "--stages", "2", "--microbatches", "2"], "unknown schedule 'zb'"),
    ],
)
def test_bad_arguments_give_one_clear_line(args, message):
    out = pipedp(*args)
    assert out.returncode != 0
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("pipedp: error:") and message in lines[0], lines[0]
    assert "Traceback" not in out.stderr


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


@pytest.mark.dist
def test_train_a_local_hugging_face_model_on_a_jsonl_dataset(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder, vocab = tiny_gpt2_folder(transformers, tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join('{"text": "the cat sat on the mat, the dog sat on the log."}' for _ in range(60)))
    out = pipedp(
        "train",
        "--model",
        str(folder),
        "--data",
        str(data),
        "--steps",
        "3",
        "--seq-len",
        "16",
        "--batch-size",
        "8",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--no-progress",
        "--export",
        str(tmp_path / "out"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: 3 steps" in out.stdout and "epsilon" in out.stdout and "exported:" in out.stdout
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    original = transformers.GPT2LMHeadModel.from_pretrained(folder)
    assert trained.lm_head.weight is trained.transformer.wte.weight  # trained tied across the stages, exported tied
    assert not torch.equal(trained.transformer.h[0].mlp.c_fc.weight, original.transformer.h[0].mlp.c_fc.weight)
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))("cat")["input_ids"]


def test_non_finite_losses_are_reported_and_fail_the_run(tmp_path):
    out = pipedp(
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
    assert "non-finite gradient norm" in out.stderr and "left out of the update" in out.stderr


def test_resume_says_what_it_did_and_errors_print_whole(tmp_path):
    ck = str(tmp_path / "ck")
    fresh = pipedp("train", "--inprocess", "--steps", "1", "--no-progress", "--checkpoint-dir", ck, "--resume")
    assert fresh.returncode == 0 and "--resume: no checkpoint in" in fresh.stdout, fresh.stderr
    again = pipedp(
        "train", "--inprocess", "--steps", "2", "--no-progress", "--checkpoint-dir", ck, "--resume", "--lr", "0.01"
    )
    assert again.returncode == 0 and "--lr 0.01 replaces the checkpoint's 0.003" in again.stdout, again.stderr
    other = pipedp(
        "train",
        "--inprocess",
        "--steps",
        "3",
        "--no-progress",
        "--checkpoint-dir",
        ck,
        "--resume",
        "--microbatches",
        "2",
    )
    assert other.returncode == 2
    assert "different configuration:\n  microbatches: checkpoint 4, now 2" in other.stderr


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "is not a file (a folder?)"),
        ('{"text": {"nested": "x"}}\n', "a JSONL record needs a 'text' field holding a string"),
        ("not json\n", "not a JSON record"),
    ],
)
def test_bad_data_files_give_one_clear_line(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    out = pipedp("train", "--inprocess", "--data", str(path))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert message in out.stderr


def test_audit_prints_the_bound_and_draws_the_scores(tmp_path):
    png = tmp_path / "audit.png"
    out = pipedp("audit", "--inprocess", "--canaries", "400", "--steps", "4", "--png", str(png))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "accountant epsilon" in out.stdout and "empirical epsilon lower bound" in out.stdout
    assert "verdict: PASSED" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    leak = pipedp("audit", "--inprocess", "--canaries", "400", "--steps", "4", "--noise-multiplier", "0")
    assert leak.returncode == 0 and "accountant epsilon            inf" in leak.stdout  # no claim to break


@pytest.mark.dist
def test_lora_on_a_local_gpt2_over_two_processes_exports_an_adapter(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    folder, vocab = tiny_gpt2_folder(transformers, tmp_path)
    data = tmp_path / "data.txt"
    data.write_text("the cat sat on the mat, the dog sat on the log. " * 40)
    out = pipedp(
        "train",
        "--model",
        str(folder),
        "--data",
        str(data),
        "--steps",
        "3",
        "--seq-len",
        "16",
        "--batch-size",
        "8",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--no-progress",
        "--lora-r",
        "4",
        "--lora-targets",
        "c_attn",
        "--export",
        str(tmp_path / "adapter"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    base = transformers.GPT2LMHeadModel.from_pretrained(folder)
    adapted = peft.PeftModel.from_pretrained(
        transformers.GPT2LMHeadModel.from_pretrained(folder), str(tmp_path / "adapter")
    )
    x = torch.randint(0, vocab, (2, 16))
    assert not torch.allclose(adapted(x).logits, base(x).logits)  # the trained adapter changes the model


@pytest.mark.parametrize(
    "command", [["--help"], ["train", "--help"], ["audit", "--help"], ["schedule", "show", "--help"]]
)
def test_help_prints_every_flag(command):
    out = pipedp(*command)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]
    if command[0] == "train":
        for flag in ("--stages", "--noise-multiplier", "--target-epsilon", "--precision", "--lora-r", "--export"):
            assert flag in out.stdout
