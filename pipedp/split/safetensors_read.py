"""Reading safetensors tensors straight into tensors that already have memory.

safetensors' own reader returns a new tensor (and touches the file's pages through a memory map), so
loading a stage that way holds every tensor twice for a moment: a 32000 x 4096 bf16 embedding costs
500 MiB to load 250. The format is one little-endian u64 header length, a JSON header
({name: {dtype, shape, data_offsets}}, offsets from the end of the header) and the raw bytes, so a
tensor whose stored dtype and shape match its target is read with ``readinto`` into the target's own
bytes; any other (another dtype, a device tensor) goes through safetensors and ``copy_``, one at a time.
"""

from __future__ import annotations

import json
from typing import Dict, List, Sequence, Tuple

import torch

from ..errors import CheckpointError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def header(path: str) -> Tuple[Dict[str, dict], int]:
    """({tensor name: its entry}, the byte offset where the data begins)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        entries = json.loads(f.read(length))
    entries.pop("__metadata__", None)
    return entries, 8 + length


def check_shape(name: str, stored: Sequence[int], target: torch.Tensor) -> None:
    if tuple(stored) != tuple(target.shape):
        raise CheckpointError(
            f"{name!r}: the weights hold shape {tuple(stored)}, the model {tuple(target.shape)}: they belong to "
            "another configuration of the model"
        )


def read_into(path: str, pairs: List[Tuple[torch.Tensor, str]]) -> None:
    """Fill each (target, stored name) of ``pairs`` from the safetensors file ``path``."""
    entries, start = header(path)
    with open(path, "rb", buffering=0) as f:
        for target, name in pairs:
            entry = entries[name]
            check_shape(name, entry["shape"], target)
            same_layout = DTYPES.get(entry["dtype"]) == target.dtype and target.is_contiguous()
            if not (same_layout and target.device.type == "cpu"):
                _copy_through_safetensors(path, name, target)
                continue
            begin, end = entry["data_offsets"]
            if end - begin != target.numel() * target.element_size():
                raise CheckpointError(f"{name!r} in {path!r}: its byte range does not match its shape (a damaged file)")
            if begin == end:
                continue
            raw = memoryview(target.detach().reshape(-1).view(torch.uint8).numpy())
            f.seek(start + begin)
            done = 0
            while done < len(raw):
                got = f.readinto(raw[done:])
                if not got:
                    raise CheckpointError(f"{name!r} in {path!r}: the file ends early (a truncated copy)")
                done += got


def _copy_through_safetensors(path: str, name: str, target: torch.Tensor) -> None:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        target.copy_(f.get_tensor(name))
