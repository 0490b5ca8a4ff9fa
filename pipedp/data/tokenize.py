"""The tokenizers rows are made with: UTF-8 bytes for the built-in model, or a local Hugging Face
tokenizer (nothing downloaded), behind one small interface.

Each gives ``encode(text, special)`` (token ids; ``special``: the tokenizer's own begin-of-text
tokens), ``pad_id``, ``eos_id``, ``vocab_size``, a ``fingerprint`` (the cache key's part), and
``render_chat(messages, add_generation_prompt)`` where the tokenizer has a chat template.
"""

from __future__ import annotations

import hashlib
import os
from typing import List

from ..errors import ConfigError
from .corpus import ByteTokenizer

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")


class Bytes(ByteTokenizer):
    """UTF-8 bytes (the built-in model's vocabulary, fixed in advance); no chat template."""

    chat_template = None

    def render_chat(self, messages, add_generation_prompt: bool = False) -> str:
        raise ConfigError(
            "chat records need a tokenizer with a chat template: the built-in model reads bytes and has none; "
            "train a Hugging Face --model whose tokenizer has one, or give text / instruction records",
            "format",
        )


class HuggingFace:
    """A local Hugging Face tokenizer."""

    def __init__(self, tokenizer, fingerprint: str):
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.vocab_size = len(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        self.chat_template = getattr(tokenizer, "chat_template", None)

    def encode(self, text: str, special: bool = True) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def decode(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids)

    def render_chat(self, messages, add_generation_prompt: bool = False) -> str:
        if not self.chat_template:
            raise ConfigError(
                "chat records need a tokenizer with a chat template, and this one has none: set "
                "tokenizer.chat_template and save it (tokenizer_config.json / chat_template.jinja), or give text / "
                "instruction records",
                "format",
            )
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def folder_fingerprint(folder: str) -> str:
    """sha256 of a model folder's files other than weights (the tokenizer's files, its config)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or name.endswith(_WEIGHTS) or name.endswith(".index.json"):
            continue
        h.update(name.encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def load_tokenizer(model: str):
    """The tokenizer of ``model``: 'tiny-gpt' reads bytes; a folder, its own Hugging Face tokenizer."""
    if model == "tiny-gpt":
        return Bytes()
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ImportError("Hugging Face models need transformers: pip install 'pipedp[hf]'") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception as exc:
        raise ConfigError(
            f"no tokenizer in {model!r} ({type(exc).__name__}: {str(exc).strip()[:200]}): save one beside the "
            "weights with tokenizer.save_pretrained",
            "model",
        ) from exc
    return HuggingFace(tokenizer, folder_fingerprint(model))
