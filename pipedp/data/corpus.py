"""The built-in generated corpus, the tokenizers that need no files, and fixed-length windows.

The corpus is generated from a small seeded grammar (nothing is downloaded): regular enough
that a tiny model's loss visibly falls within a few hundred DP steps. ``generated_records``
gives short sentences of it as records, the unit the CLI trains on; ``generated_corpus`` its
sentences as one text, which the audit and the examples cut into windows.

``ByteTokenizer`` (UTF-8 bytes, vocabulary 256) is what the built-in model reads: its
vocabulary is fixed in advance, so it reveals nothing of the data. ``CharTokenizer`` fits its
vocabulary to a text: only for public text (a vocabulary fitted to private data is a
statistic of it, published with the model without noise).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List

import torch

from .sources import check_source, read_records

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the bird", "a child", "the farmer", "our teacher"]
_VERBS = ["sees", "likes", "finds", "paints", "follows", "carries", "greets", "watches"]
_OBJECTS = ["the red ball", "a small house", "the river", "a green tree", "the moon", "an apple", "the road"]
_ENDINGS = ["today", "at night", "in the park", "with care", "again", "every morning"]


def _sentences(count: int, seed: int) -> List[str]:
    rng = random.Random(seed)
    return [
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}."
        for _ in range(count)
    ]


def generated_corpus(sentences: int = 4000, seed: int = 0) -> str:
    """The generated sentences as one text."""
    return " ".join(_sentences(sentences, seed))


def generated_records(records: int = 4000, seed: int = 0) -> List[dict]:
    """The generated grammar as text records, one short sentence each ("the cat sees the moon.": subject,
    verb, object; 20 to 34 characters: a row of 36 tokens, the CLI's default, holds any of them whole)."""
    rng = random.Random(seed)
    return [{"text": f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."} for _ in range(records)]


def read_text(path: str) -> str:
    """A local .txt file, or the 'text' fields of a .jsonl file joined by newlines."""
    if path.endswith(".jsonl"):
        return "\n".join(r["text"] for r in read_records(path, text_field="text", require_text=True).records)
    check_source(path)
    with open(path, encoding="utf-8") as f:
        return f.read()


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256, fixed: it depends on no data)."""

    vocab_size = 256
    pad_id = 0
    eos_id = None
    fingerprint = "utf-8 bytes"

    def encode(self, text: str, special: bool = True) -> List[int]:
        """The text's UTF-8 bytes (``special``: begin-of-text tokens, of which bytes have none)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: List[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


@dataclass
class CharTokenizer:
    """One token per distinct character of the text it was fitted to (public text only: see above)."""

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
    """Non-overlapping (input, next-token target) windows of seq_len tokens.

    One window may hold the end of one document and the start of the next, and one document
    spans many windows: a window is not a document, so DP over windows protects a document only
    window by window. The CLI trains on records instead (pipedp.data.rows)."""
    data = torch.tensor(ids, dtype=torch.long)
    count = (len(data) - 1) // seq_len
    if count < 1:
        raise ValueError(f"the dataset has {len(data)} tokens: too few for one window of {seq_len + 1}")
    x = data[: count * seq_len].reshape(count, seq_len)
    y = data[1 : count * seq_len + 1].reshape(count, seq_len)
    return x, y
