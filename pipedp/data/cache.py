"""Tokenise once: rows cached in one file per (data, tokenizer, options), keyed by their hashes.

The key is the sha256 of the source's bytes (pipedp.data.sources.fingerprint), the tokenizer's
fingerprint (its files), the format, fields and seq_len, and this module's VERSION: any change
to one of them is a new file. Files are written to a temporary name and renamed (a crash leaves
no half file), and read back with ``torch.load(weights_only=True)`` (tensors and plain values
only). The rows are a copy of the data: keep the cache folder as private as the data (by default
it is inside the run folder).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from typing import Callable, Iterable, Optional

import torch

from .corpus import generated_records
from .rows import Tokenized, to_rows
from .sources import Records, fingerprint, read_records

VERSION = 1
GENERATED = "the generated corpus"


def cache_key(source: str, tokenizer: str, seq_len: int, fmt: str, text_field: str, user_field: Optional[str]) -> str:
    spec = {
        "version": VERSION,
        "source": source,
        "tokenizer": tokenizer,
        "seq_len": seq_len,
        "format": fmt,
        "text_field": text_field,
        "user_field": user_field,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def source_fingerprint(path: Optional[str], seed: int) -> str:
    return f"generated corpus v1 seed {seed}" if path is None else fingerprint(path)


def tokenized(
    path: Optional[str],
    tokenizer,
    seq_len: int,
    fmt: str = "auto",
    text_field: str = "text",
    user_field: Optional[str] = None,
    cache_dir: Optional[str] = None,
    seed: int = 0,
    progress: Callable[[Iterable, int], Iterable] = lambda it, total: it,
    source_hash: Optional[str] = None,
) -> "tuple[Tokenized, Optional[str], bool]":
    """(rows, the cache file or None, whether it was read from the cache) of a source (None: the generated
    corpus, seeded with ``seed``). ``source_hash``: the source's fingerprint if already computed."""
    key = cache_key(
        source_hash or source_fingerprint(path, seed), tokenizer.fingerprint, seq_len, fmt, text_field, user_field
    )
    file = os.path.join(cache_dir, f"rows-{key[:32]}.pt") if cache_dir else None
    if file is not None and os.path.exists(file):
        cached = load(file, key)
        if cached is not None:
            return cached, file, True
    source = Records(GENERATED, generated_records(seed=seed)) if path is None else read_records(path, text_field)
    rows = to_rows(source, tokenizer, seq_len, fmt, text_field, user_field, progress)
    if file is not None:
        save(file, key, rows)
    return rows, file, False


def save(file: str, key: str, rows: Tokenized) -> None:
    os.makedirs(os.path.dirname(file), exist_ok=True)
    payload = {
        "key": key,
        "input_ids": rows.input_ids,
        "labels": rows.labels,
        "lengths": rows.lengths,
        "users": rows.users,
        "counts": rows.counts,
        "format": rows.format,
        "pad_id": rows.pad_id,
    }
    tmp = f"{file}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    torch.save(payload, tmp)
    os.replace(tmp, file)


def load(file: str, key: Optional[str] = None) -> Optional[Tokenized]:
    """The rows in ``file`` (None if it is unreadable or holds another key: it is then rebuilt)."""
    try:
        payload = torch.load(file, weights_only=True)
    except Exception:
        return None
    if not isinstance(payload, dict) or (key is not None and payload.get("key") != key):
        return None
    return Tokenized(
        payload["input_ids"],
        payload["labels"],
        payload["lengths"],
        payload["users"],
        dict(payload["counts"]),
        payload["format"],
        int(payload["pad_id"]),
    )
