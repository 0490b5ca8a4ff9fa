"""Records -> rows: one record is one row of ``seq_len`` tokens, the privacy unit of record-level DP.

A record's tokens t_0 .. t_L give the row's inputs t_0 .. t_{L-1} and next-token targets
t_1 .. t_L, truncated to ``seq_len`` (the tokens past seq_len + 1 are cut and counted) or
right-padded to it (targets -100 and attention mask 0 on the padding). Only some targets train:

- text records (``text_field``): every token;
- instruction records (``prompt``, ``completion``): the completion's tokens (and the
  tokenizer's end-of-text token after it), the prompt's targets -100;
- chat records (``messages``: a list of {"role", "content"}), rendered with the tokenizer's chat
  template: the tokens of the assistant turns (each as the template renders it, its closing
  tokens included); everything else -100. The template must render a conversation prefix by
  prefix (the text up to a turn, with the generation prompt, starts the text with that turn);
  each segment is tokenised alone, as a prompt is at generation time.

A record left with no target to train (too short, or its completion truncated away) is dropped
and counted: dropping depends on that record alone, so DP over the rows remains DP over the
records.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .sources import DataError, Records

Segments = List[Tuple[List[int], bool]]  # (token ids, trained)
ROLES = ("system", "user", "assistant", "tool", "developer")  # chat roles templates know; only assistant trains


@dataclass
class Tokenized:
    """Rows of one source: ``input_ids`` and ``labels`` [rows, seq_len] (int32; labels -100 where nothing
    trains), ``lengths`` (real input tokens per row), the user of each row (or None) and the counts."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    lengths: torch.Tensor
    users: Optional[List[str]]
    counts: Dict[str, int] = field(default_factory=dict)
    format: str = "text"
    pad_id: int = 0

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])


def detect_format(record: dict, text_field: str) -> str:
    if "messages" in record:
        return "chat"
    if "prompt" in record and "completion" in record:
        return "instruction"
    if text_field in record:
        return "text"
    raise DataError(
        f"cannot tell the record format from the fields {sorted(record)[:10]}: a text record needs {text_field!r} "
        "(or pass --text-field), an instruction record 'prompt' and 'completion', a chat record 'messages'"
    )


def _string(value, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    return value


def segments(record: dict, fmt: str, tokenizer, text_field: str) -> Segments:
    """The record's tokens in segments, each marked trained or not."""
    if fmt == "text":
        if not isinstance(record.get(text_field), str):
            raise ValueError(
                f"a text record needs a {text_field!r} field holding a string (its fields: {sorted(record)[:10]}; "
                "--text-field names another)"
            )
        return [(tokenizer.encode(record[text_field]), True)]
    if fmt == "instruction":
        prompt = _string(record.get("prompt"), "'prompt'")
        completion = tokenizer.encode(_string(record.get("completion"), "'completion'"), special=False)
        if tokenizer.eos_id is not None:
            completion = completion + [tokenizer.eos_id]
        return [(tokenizer.encode(prompt), False), (completion, True)]
    return _chat_segments(record, tokenizer)


def _chat_segments(record: dict, tokenizer) -> Segments:
    messages = record.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError('\'messages\' must be a list of {"role": str, "content": str} objects')
    full = tokenizer.render_chat(messages)
    out: Segments = []
    done = 0  # characters of `full` already in segments
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.render_chat(messages[:i], add_generation_prompt=True)
        through = tokenizer.render_chat(messages[: i + 1])
        if not (full.startswith(through) and through.startswith(before) and len(before) >= done):
            raise ValueError(
                f"the chat template does not render this conversation prefix by prefix (at message {i + 1}), so "
                "the assistant tokens cannot be told apart: use a template that does, or instruction records"
            )
        if len(before) > done:
            out.append((tokenizer.encode(full[done : len(before)], special=False), False))
        out.append((tokenizer.encode(full[len(before) : len(through)], special=False), True))
        done = len(through)
    if done < len(full):
        out.append((tokenizer.encode(full[done:], special=False), False))
    return out


def row(parts: Segments, seq_len: int) -> Tuple[List[int], List[int], int]:
    """(inputs, targets with -100 where untrained, tokens cut) of one record, before padding."""
    ids: List[int] = []
    trained: List[bool] = []
    for tokens, train in parts:
        ids.extend(tokens)
        trained.extend([train] * len(tokens))
    cut = max(0, len(ids) - (seq_len + 1))
    ids, trained = ids[: seq_len + 1], trained[: seq_len + 1]
    targets = [t if ok else -100 for t, ok in zip(ids[1:], trained[1:])]
    return ids[:-1], targets, cut


def to_rows(
    source: Records,
    tokenizer,
    seq_len: int,
    fmt: str = "auto",
    text_field: str = "text",
    user_field: Optional[str] = None,
    progress: Callable[[Iterable, int], Iterable] = lambda it, total: it,
) -> Tokenized:
    """Every record of ``source`` as one row (see the module's docstring); ``progress(iterable, total)``
    may wrap the loop in a progress bar."""
    if not len(source):
        raise DataError(f"{source.name}: no records")
    if fmt == "auto":
        fmt = detect_format(source.records[0], text_field)
    kept_ids, kept_labels, lengths, users = [], [], [], []
    counts = {"records": len(source), "truncated": 0, "tokens cut": 0, "dropped": 0}
    unknown: Dict[str, int] = {}  # chat roles outside ROLES -> turns
    for i in progress(range(len(source)), len(source)):
        record = source.records[i]
        try:
            inputs, targets, cut = row(segments(record, fmt, tokenizer, text_field), seq_len)
            user = None
            if user_field is not None:
                if user_field not in record or record[user_field] is None or isinstance(record[user_field], bool):
                    raise ValueError(f"no {user_field!r} field naming its user")
                if not isinstance(record[user_field], (str, int)):
                    raise ValueError(f"{user_field!r} must be a string or an integer")
                user = str(record[user_field])
        except ValueError as exc:
            raise DataError(f"{source.where(i)}: {exc}") from exc
        for message in record["messages"] if fmt == "chat" else ():
            if message["role"] not in ROLES:
                unknown[message["role"]] = unknown.get(message["role"], 0) + 1
        if cut:
            counts["truncated"] += 1
            counts["tokens cut"] += cut
        if all(t == -100 for t in targets):
            counts["dropped"] += 1
            continue
        kept_ids.append(inputs)
        kept_labels.append(targets)
        lengths.append(len(inputs))
        users.append(user)
    rows = len(kept_ids)
    if rows == 0:
        raise DataError(
            f"{source.name}: none of its {len(source)} records has a token to train on "
            "(too short, or every completion / assistant turn truncated away: raise --seq-len)"
        )
    ids = torch.full((rows, seq_len), tokenizer.pad_id, dtype=torch.int32)
    labels = torch.full((rows, seq_len), -100, dtype=torch.int32)
    for r, (inputs, targets) in enumerate(zip(kept_ids, kept_labels)):
        ids[r, : len(inputs)] = torch.tensor(inputs, dtype=torch.int32)
        labels[r, : len(targets)] = torch.tensor(targets, dtype=torch.int32)
    counts["rows"] = rows
    if unknown:
        counts["unknown roles"] = sum(unknown.values())
        warnings.warn(unknown_roles(source.name, unknown), stacklevel=2)
    lengths_t = torch.tensor(lengths, dtype=torch.int32)
    named = [str(u) for u in users] if user_field else None
    return Tokenized(ids, labels, lengths_t, named, counts, fmt, int(tokenizer.pad_id))


def record_lengths(source: Records, tokenizer, fmt: str = "auto", text_field: str = "text") -> List[int]:
    """Each record's token count before any truncation (a row of seq_len holds seq_len + 1 of them)."""
    if not len(source):
        raise DataError(f"{source.name}: no records")
    if fmt == "auto":
        fmt = detect_format(source.records[0], text_field)
    out = []
    for i, record in enumerate(source.records):
        try:
            out.append(sum(len(tokens) for tokens, _ in segments(record, fmt, tokenizer, text_field)))
        except ValueError as exc:
            raise DataError(f"{source.where(i)}: {exc}") from exc
    return out


def length_from_data(lengths: List[int], limit: Optional[int], quantile: float = 0.95, multiple: int = 8) -> int:
    """The seq_len that holds ``quantile`` of the records whole: that quantile of (length - 1), rounded up to a
    multiple of ``multiple``, at most ``limit`` (the model's positions)."""
    needed = sorted(max(1, n - 1) for n in lengths)
    value = needed[max(0, math.ceil(quantile * len(needed)) - 1)]
    rounded = math.ceil(value / multiple) * multiple
    return rounded if limit is None else max(1, min(rounded, limit))


def unknown_roles(name: str, unknown: Dict[str, int]) -> str:
    roles = ", ".join(f"{role[:40]!r} ({n})" for role, n in list(unknown.items())[:5])
    return (
        f"{name}: {sum(unknown.values())} chat turns have a role other than {', '.join(ROLES)}: {roles}; they are "
        "rendered into the prompt as the template renders them, and never trained on (only 'assistant' turns are): "
        "check the role names"
    )


def describe_counts(t: Tokenized, name: str, seq_len: int) -> str:
    c = t.counts
    text = (
        f"{name}: {c['records']} {t.format} records -> {c['rows']} rows of {seq_len} tokens; "
        f"{c['truncated']} truncated ({c['tokens cut']} tokens cut), {c['dropped']} dropped with no token to train"
    )
    if c.get("unknown roles"):
        text += f"; {c['unknown roles']} chat turns with an unknown role (not trained on: check the role names)"
    return text
