"""Training data for the CLI and the examples: a built-in generated corpus, or a local text / JSONL file.

The built-in corpus is generated from a small seeded grammar (nothing is downloaded): it
is regular enough that a tiny model's loss visibly falls within a few hundred DP steps.
Text is tokenised per character (built-in / tiny models) or with a local Hugging Face
tokenizer (when the model folder has one), then cut into fixed-length windows.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import List

import torch

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the bird", "a child", "the farmer", "our teacher"]
_VERBS = ["sees", "likes", "finds", "paints", "follows", "carries", "greets", "watches"]
_OBJECTS = ["the red ball", "a small house", "the river", "a green tree", "the moon", "an apple", "the road"]
_ENDINGS = ["today", "at night", "in the park", "with care", "again", "every morning"]


def generated_corpus(sentences: int = 4000, seed: int = 0) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        out.append(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}.")
    return " ".join(out)


def read_text(path: str) -> str:
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset {path!r} does not exist: pass a local .txt or .jsonl file")
    if not os.path.isfile(path):
        raise ValueError(f"dataset {path!r} is not a file (a folder?): pass one .txt or .jsonl file")
    if path.endswith(".jsonl"):
        texts = []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except ValueError as exc:
                        raise ValueError(f"{path}:{line_no}: not a JSON record ({exc})") from exc
                    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                        raise ValueError(f"{path}:{line_no}: a JSONL record needs a 'text' field holding a string")
                    texts.append(record["text"])
        return "\n".join(texts)
    with open(path, encoding="utf-8") as f:
        return f.read()


@dataclass
class CharTokenizer:
    chars: List[str]

    @staticmethod
    def fit(text: str) -> "CharTokenizer":
        return CharTokenizer(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> List[int]:
        index = {c: i for i, c in enumerate(self.chars)}
        return [index[c] for c in text if c in index]


def windows(ids: List[int], seq_len: int):
    """Non-overlapping (input, next-token target) windows of seq_len tokens."""
    data = torch.tensor(ids, dtype=torch.long)
    count = (len(data) - 1) // seq_len
    if count < 1:
        raise ValueError(f"the dataset has {len(data)} tokens: too few for one window of {seq_len + 1}")
    x = data[: count * seq_len].reshape(count, seq_len)
    y = data[1 : count * seq_len + 1].reshape(count, seq_len)
    return x, y
