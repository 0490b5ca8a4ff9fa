"""examples/finetune_chat.py on a tiny random Llama folder and a chat tokenizer written here (no internet)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_chat_llama(transformers, folder):
    """A tiny LlamaForCausalLM with random weights and a character tokenizer with a chat template."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<s>", "</s>", "<pad>"]
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789 .,?!'"))
    vocab = {t: i for i, t in enumerate(["[UNK]"] + specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=specials[:4],
    )
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def chats(path, count):
    with open(path, "w") as f:
        for i in range(count):
            messages = [
                {"role": "user", "content": f"what is {i % 5} plus one?"},
                {"role": "assistant", "content": f"it is {i % 5 + 1}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def test_finetune_chat_example_trains_evaluates_exports_and_generates(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    folder = tiny_chat_llama(transformers, tmp_path / "llama")
    data = chats(tmp_path / "chat.jsonl", 50)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "finetune_chat.py"), "--model", str(folder), "--data"]
        + [str(data), "--steps", "4", "--batch-size", "8", "--export", str(tmp_path / "adapter")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "50 conversations -> 50 rows; 0 truncated, 0 dropped" in out.stdout
    assert "trained 4 steps: epsilon" in out.stdout and "on 5 held-out conversations" in out.stdout
    assert "the exported model answers" in out.stdout
    assert os.path.exists(tmp_path / "adapter" / "adapter_config.json")
