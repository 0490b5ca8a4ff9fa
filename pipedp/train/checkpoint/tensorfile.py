"""Tensor files in the safetensors format, written and read one tensor at a time, and frozen-tensor digests.

A file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and byte
range) and the tensors' bytes. The header needs only shapes and dtypes, so ``write`` streams each
tensor's own memory to disk (a CPU tensor is never copied; another device's goes through in chunks
of ``CHUNK`` bytes) and hashes it on the way: a save adds a few MB to the peak, not the stage's size.
``TensorFile`` checks a file's size and sha256 (streamed) and its header before reading any tensor;
its files load with the ``safetensors`` library too. Nothing in a file is ever executed.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, Tuple

import torch

from ...errors import CheckpointError
from .format import Fingerprint

CHUNK = 8 << 20  # bytes written, hashed or copied from another device at a time
_MAX_HEADER = 256 << 20
_SAMPLE = 1024  # elements of a frozen tensor read for its fingerprint
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)

_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"), ("uint32", "U32")):
    if hasattr(torch, _name):
        _CODES[getattr(torch, _name)] = _code
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


def write(path: str, tensors: List[Tuple[str, torch.Tensor]]) -> Tuple[str, int]:
    """Write ``tensors`` (key, tensor) to a new file at ``path``; return its sha256 and size."""
    if sys.byteorder != "little":
        raise CheckpointError("checkpoints are written little-endian (safetensors): this machine is big-endian")
    header: Dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, t in tensors:
        if t.dtype not in _CODES:
            raise CheckpointError(f"cannot checkpoint {key!r}: dtype {t.dtype} has no safetensors code")
        size = t.numel() * t.element_size()
        header[key] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    digest = hashlib.sha256()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    except OSError as exc:
        raise CheckpointError(f"cannot write the checkpoint file {path!r}: {exc}") from exc
    try:
        _write_all(fd, struct.pack("<Q", len(head)) + head, digest)
        for _, t in tensors:
            for piece in _pieces(t):
                _write_all(fd, piece, digest)
        os.fsync(fd)
    except OSError as exc:
        raise CheckpointError(f"cannot write the checkpoint file {path!r}: {exc}") from exc
    finally:
        os.close(fd)
    return digest.hexdigest(), 8 + len(head) + offset


def _write_all(fd: int, data, digest) -> None:
    view = memoryview(data).cast("B")
    for start in range(0, len(view), CHUNK):
        part = view[start : start + CHUNK]
        digest.update(part)
        while part:
            part = part[os.write(fd, part) :]


def _pieces(t: torch.Tensor) -> Iterator[memoryview]:
    """The tensor's bytes in order: its own memory (CPU, contiguous), else chunks copied to the CPU."""
    t = t.detach()
    if t.numel() == 0:
        return
    if t.device.type == "cpu" and t.is_contiguous():
        yield _bytes(t)
        return
    if t.is_contiguous():
        flat = t.reshape(-1)
        step = max(1, CHUNK // t.element_size())
        for start in range(0, flat.numel(), step):
            yield _bytes(flat[start : start + step].cpu())
        return
    rows = max(1, CHUNK // max(1, t[0].numel() * t.element_size())) if t.dim() else 1
    for start in range(0, t.shape[0] if t.dim() else 1, rows):
        yield _bytes((t[start : start + rows] if t.dim() else t).contiguous().cpu())


def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory, as bytes, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class TensorFile:
    """A tensor file, checked before use: its size and sha256 against the manifest, then its header."""

    def __init__(self, path: str, sha256: str, size: int):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        except OSError as exc:
            raise CheckpointError(f"checkpoint file {path!r} is missing or unreadable: {exc}") from exc
        try:
            self._check(sha256, size)
            self.entries = self._header()
        except BaseException:
            os.close(self.fd)
            raise

    def _check(self, sha256: str, size: int) -> None:
        actual = os.fstat(self.fd).st_size
        digest = hashlib.sha256()
        buffer = bytearray(min(CHUNK, max(actual, 1)))
        offset = 0
        while offset < actual:
            n = os.preadv(self.fd, [buffer], offset)
            if n == 0:
                break
            digest.update(memoryview(buffer)[:n])
            offset += n
        if actual != size or digest.hexdigest() != sha256:
            raise CheckpointError(
                f"checkpoint file {self.path!r} is truncated or corrupted ({actual} bytes, the manifest says {size}; "
                "sha256 mismatch with the manifest): restore it from a copy, or remove this step folder"
            )

    def _header(self) -> Dict[str, Tuple[torch.dtype, Tuple[int, ...], int, int]]:
        def bad(problem: str) -> CheckpointError:
            return CheckpointError(f"checkpoint file {self.path!r} is not a valid tensor file: {problem}")

        size = os.fstat(self.fd).st_size
        length = struct.unpack("<Q", self._read(0, 8))[0] if size >= 8 else -1
        if not 0 <= length <= min(size - 8, _MAX_HEADER):
            raise bad("its header length is out of range")
        try:
            header = json.loads(self._read(8, length).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise bad(f"its header is not JSON ({exc})") from exc
        if not isinstance(header, dict):
            raise bad("its header is not an object")
        data_size = size - 8 - length
        entries = {}
        for key, e in header.items():
            if key == "__metadata__":
                continue
            if not isinstance(e, dict):
                raise bad(f"entry {key[:80]!r} is malformed")
            shape: Any = e.get("shape")
            offsets: Any = e.get("data_offsets")
            if not (e.get("dtype") in _DTYPES and _sizes(shape) and _sizes(offsets) and len(offsets) == 2):
                raise bad(f"entry {key[:80]!r} is malformed")
            dtype, begin, end = _DTYPES[e["dtype"]], offsets[0], offsets[1]
            nbytes = _numel(tuple(shape)) * torch.empty((), dtype=dtype).element_size()
            if not begin <= end <= data_size or end - begin != nbytes:
                raise bad(f"entry {key[:80]!r} has a byte range that does not fit its shape or the file")
            entries[key] = (dtype, tuple(shape), 8 + length + begin, nbytes)
        return entries

    def _read(self, offset: int, n: int) -> bytes:
        data = os.pread(self.fd, n, offset)
        if len(data) != n:
            raise CheckpointError(f"checkpoint file {self.path!r} ends early")
        return data

    def meta(self, key: str) -> Tuple[torch.dtype, Tuple[int, ...]]:
        if key not in self.entries:
            raise CheckpointError(f"checkpoint file {self.path!r} holds no tensor {key!r}, which the manifest names")
        dtype, shape, _, _ = self.entries[key]
        return dtype, shape

    def read(self, key: str) -> torch.Tensor:
        dtype, shape = self.meta(key)
        _, _, offset, nbytes = self.entries[key]
        out = torch.empty(shape, dtype=dtype)
        if nbytes:
            view = _bytes(out)
            done = 0
            while done < nbytes:
                n = os.preadv(self.fd, [view[done:]], offset + done)
                if n == 0:
                    raise CheckpointError(f"checkpoint file {self.path!r} ends early")
                done += n
        return out

    def close(self) -> None:
        os.close(self.fd)


def _sizes(value: Any) -> bool:
    """A JSON list of non-negative integers."""
    return isinstance(value, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value)


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def fingerprint(t: torch.Tensor) -> Fingerprint:
    """Shape, dtype, the sha256 of every byte (streamed: a CPU tensor's own memory, another device's in
    pieces of CHUNK bytes; no copy of the tensor) and a position-weighted float64 sum of up to 1024 evenly
    strided elements (the check of checkpoints written before the sha256)."""
    t = t.detach()
    shape, dtype = tuple(t.shape), str(t.dtype).removeprefix("torch.")
    n = t.numel()
    if n == 0 or t.is_meta:
        return Fingerprint(shape, dtype, 0.0 if n == 0 else float("nan"), 0.0, None if t.is_meta else _sha256(t))
    index = torch.arange(0, n, max(1, n // _SAMPLE), device=t.device)[:_SAMPLE]
    sample = t.reshape(-1)[index] if t.is_contiguous() else t[torch.unravel_index(index, t.shape)]
    if sample.is_complex():
        sample = torch.view_as_real(sample).sum(-1)
    terms = sample.to(torch.float64) * (1 + (index % 7)).to(torch.float64)
    return Fingerprint(shape, dtype, float(terms.sum()), float(terms.abs().sum()), _sha256(t))


def fingerprints(tensors: Dict[str, torch.Tensor]) -> Dict[str, Fingerprint]:
    """``fingerprint`` of each tensor, on up to 8 threads (hashlib lets go of the GIL while it hashes)."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(tensors)))) as pool:
        return dict(zip(tensors, pool.map(fingerprint, tensors.values())))


def _sha256(t: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for piece in _pieces(t):
        for start in range(0, len(piece), CHUNK):
            digest.update(piece[start : start + CHUNK])
    return digest.hexdigest()


__all__ = ["CHUNK", "TensorFile", "fingerprint", "fingerprints", "write"]
