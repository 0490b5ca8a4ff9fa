"""Reading records from local sources, and a fingerprint of each source for the tokenisation cache.

A record is a dict (one JSON object, one CSV row, one dataset row); a ``.txt`` file gives one
text record per non-blank line. ``.txt``, ``.jsonl``, ``.json`` and ``.csv`` need nothing
beyond Python; ``.parquet`` needs pyarrow and a ``save_to_disk`` folder needs ``datasets``
(``pip install 'pipedp[data]'``), imported only for them. Nothing is downloaded, and nothing is
copied into a global cache (a save_to_disk folder is memory-mapped where it lies).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

from ..errors import ConfigError

FILE_KINDS = (".txt", ".jsonl", ".json", ".csv", ".parquet")
_WHAT = ".txt, .jsonl, .json, .csv or .parquet file, or a folder written by datasets' save_to_disk"
_CHUNK = 1 << 20


class DataError(ConfigError):
    """The data cannot be read, or a record is malformed; the message names the file and the record."""

    def __init__(self, message: str):
        super().__init__(message, "data")


@dataclass
class Records:
    """The records of one source, and where each came from (for messages)."""

    name: str  # the path, or "the generated corpus"
    records: List[dict]
    lines: Optional[List[int]] = None  # line numbers (.txt, .jsonl), else None

    def where(self, index: int) -> str:
        if self.lines is not None:
            return f"{self.name}:{self.lines[index]}"
        return f"{self.name}: record {index + 1}"

    def __len__(self) -> int:
        return len(self.records)


def check_source(path: str) -> None:
    """Refuse a path that is not a readable source, without reading it (the fast pre-flight check)."""
    if not os.path.exists(path):
        raise DataError(f"dataset {path!r} does not exist: pass a local {_WHAT}")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_dict.json")):
            splits = sorted(n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n)))
            raise DataError(
                f"dataset {path!r} holds several splits {splits}: pass one of them, e.g. "
                f"{os.path.join(path, splits[0] if splits else 'train')!r}"
            )
        if not (
            os.path.exists(os.path.join(path, "dataset_info.json")) or os.path.exists(os.path.join(path, "state.json"))
        ):
            raise DataError(
                f"dataset {path!r} is not a file (a folder?) and not a folder written by datasets' save_to_disk: "
                f"pass a local {_WHAT}"
            )
        return
    if not os.path.isfile(path):
        raise DataError(f"dataset {path!r} is not a file (a folder?): pass a local {_WHAT}")
    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_KINDS:
        raise DataError(f"dataset {path!r}: unsupported file type {ext or '(none)'!r}: pass a local {_WHAT}")
    if not os.access(path, os.R_OK):
        raise DataError(f"dataset {path!r} is not readable")


def fingerprint(path: str) -> str:
    """sha256 of the file's bytes (a folder: of every file's relative path and bytes)."""
    h = hashlib.sha256()
    files = [path]
    if os.path.isdir(path):
        files = sorted(
            os.path.join(folder, name)
            for folder, _, names in os.walk(path)
            for name in names
            if not name.startswith(".")
        )
    for name in files:
        h.update(os.path.relpath(name, path).encode() + b"\0")
        with open(name, "rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                h.update(chunk)
    return h.hexdigest()


def read_records(path: str, text_field: str = "text", require_text: bool = False) -> Records:
    """Every record of a local source. ``require_text``: each record must hold a string in ``text_field``
    (otherwise the fields are checked when the records become rows)."""
    check_source(path)
    if os.path.isdir(path):
        out = Records(path, _from_disk(path))
    else:
        ext = os.path.splitext(path)[1].lower()
        reader = {".txt": _txt, ".jsonl": _jsonl, ".json": _json, ".csv": _csv, ".parquet": _parquet}[ext]
        out = reader(path)
    if require_text:
        for i, record in enumerate(out.records):
            if not isinstance(record.get(text_field), str):
                suffix = "JSONL record" if path.endswith(".jsonl") else "record"
                raise DataError(f"{out.where(i)}: a {suffix} needs a {text_field!r} field holding a string")
    return out


_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark (as some tools write): accepted and dropped


def _lines(path: str) -> Iterator[Tuple[int, str]]:
    """(line number, text) of a UTF-8 file; a byte that is not UTF-8 is a DataError naming the file and line."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            yield line_no, _decode(raw.removeprefix(_BOM) if line_no == 1 else raw, path, line_no)


def _text(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read().removeprefix(_BOM)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, data.count(b"\n", 0, exc.start) + 1, data[exc.start]) from None


def _decode(raw: bytes, path: str, line_no: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, line_no, raw[exc.start]) from None


def _not_utf8(path: str, line_no: int, byte: int) -> DataError:
    return DataError(
        f"{path}:{line_no}: byte {byte:#04x} is not UTF-8 (the file is in another encoding, or damaged): convert "
        "it to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
    )


def _txt(path: str) -> Records:
    records, lines = [], []
    for line_no, line in _lines(path):
        text = line.rstrip("\r\n")
        if text.strip():
            records.append({"text": text})
            lines.append(line_no)
    return Records(path, records, lines)


def _object(path: str, where: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(value).__name__}")
    return value


def _jsonl(path: str) -> Records:
    records, lines = [], []
    for line_no, line in _lines(path):
        if line.strip():
            try:
                value = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{path}:{line_no}: not a JSON record ({exc})") from exc
            records.append(_object(path, f"{path}:{line_no}", value))
            lines.append(line_no)
    return Records(path, records, lines)


def _json(path: str) -> Records:
    """A JSON array of objects, or JSON lines in a .json file."""
    text = _text(path)
    try:
        value = json.loads(text)
    except ValueError as exc:
        if "Extra data" in str(exc):
            return _jsonl(path)
        raise DataError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(value, list):
        raise DataError(f"{path}: a .json dataset must be an array of records (or JSON lines), got an object")
    return Records(path, [_object(path, f"{path}: record {i + 1}", v) for i, v in enumerate(value)])


def _csv(path: str) -> Records:
    csv.field_size_limit(1 << 30)
    records = [dict(row) for row in csv.DictReader(io.StringIO(_text(path), newline=""))]
    lines = None  # rows may span lines
    return Records(path, records, lines)


def _parquet(path: str) -> Records:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(f"reading {path!r} needs pyarrow: pip install 'pipedp[data]'") from exc
    return Records(path, pq.read_table(path).to_pylist())


def _from_disk(path: str) -> List[dict]:
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            f"reading the save_to_disk folder {path!r} needs datasets: pip install 'pipedp[data]'"
        ) from exc
    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):  # (check_source refuses these first)
        raise DataError(f"dataset {path!r} holds several splits {sorted(loaded)}: pass one split's folder")
    return [dict(row) for row in loaded]
