"""Reading safetensors tensors straight into tensors that already have memory.

safetensors' own reader returns a new tensor (and touches the file's pages through a memory map), so
loading a stage that way holds every tensor twice for a moment: a 32000 x 4096 bf16 embedding costs
500 MiB to load 250. The format is one little-endian u64 header length, a JSON header
({name: {dtype, shape, data_offsets}}, offsets from the end of the header) and the raw bytes, so a
tensor whose stored dtype and shape match its target is read with ``readinto`` into the target's own
bytes; any other (another dtype, a device tensor) goes through safetensors and ``copy_``, one at a time.

A tensor split across tensor-parallel ranks is read later, slice by slice (``Stored``): each rank reads its own
slice's bytes and never holds the whole tensor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from ..errors import CheckpointError
from ..shards import Shard

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


def check_shape(name: str, stored: Sequence[int], wanted: Sequence[int]) -> None:
    if tuple(stored) != tuple(wanted):
        raise CheckpointError(
            f"{name!r}: the weights hold shape {tuple(stored)}, the model {tuple(wanted)}: they belong to "
            "another configuration of the model"
        )


def read_into(path: str, pairs: List[Tuple[torch.Tensor, str]]) -> None:
    """Fill each (target, stored name) of ``pairs`` from the safetensors file ``path``."""
    entries, start = header(path)
    with open(path, "rb", buffering=0) as f:
        for target, name in pairs:
            entry = entries[name]
            check_shape(name, entry["shape"], target.shape)
            same_layout = DTYPES.get(entry["dtype"]) == target.dtype and target.is_contiguous()
            if not (same_layout and target.device.type == "cpu"):
                _copy_through_safetensors(path, name, target)
                continue
            begin, end = entry["data_offsets"]
            if end - begin != target.numel() * target.element_size():
                raise CheckpointError(f"{name!r} in {path!r}: its byte range does not match its shape (a damaged file)")
            if begin == end:
                continue
            _read_exact(f, start + begin, _bytes_of(target), name, path)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def _read_exact(f, offset: int, raw: memoryview, name: str, path: str) -> None:
    f.seek(offset)
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


@dataclass(frozen=True)
class Stored:
    """Where a parameter left on the meta device by the loader lies (a safetensors file, the name it is stored
    under), so that a tensor-parallel split reads only its slice (``read``)."""

    path: str
    name: str

    def read(self, shard: Shard, dtype: torch.dtype) -> torch.Tensor:
        """The slice ``shard`` of the stored tensor, in ``dtype``, on the CPU. Only its bytes are read, with
        ``readinto`` into the slice's own memory: one range per index of the dimensions before the cut (one range
        in all for a cut along the first), so neither the whole tensor nor a memory map of it is ever resident."""
        entries, start = header(self.path)
        entry = entries.get(self.name)
        if entry is None:
            raise CheckpointError(f"{self.name!r} is not in {self.path!r} any more: the weights changed after loading")
        check_shape(self.name, entry["shape"], shard.full_shape)
        stored = DTYPES.get(entry["dtype"])
        if stored is None:
            raise CheckpointError(f"{self.name!r} in {self.path!r}: dtype {entry['dtype']} is not one pipedp reads")
        part = torch.empty(shard.shape, dtype=stored)
        size = part.element_size()
        inner = math.prod(shard.full_shape[shard.dim + 1 :]) * size  # bytes of one index of the cut dimension
        chunk = (shard.stop - shard.start) * inner
        raw = _bytes_of(part)
        with open(self.path, "rb", buffering=0) as f:
            for outer in range(math.prod(shard.full_shape[: shard.dim])):
                at = start + entry["data_offsets"][0] + (outer * shard.full_shape[shard.dim] + shard.start) * inner
                _read_exact(f, at, raw[outer * chunk : (outer + 1) * chunk], self.name, self.path)
        return part.to(dtype)


_STORED = "pipedp_stored"  # the attribute of a parameter left on the meta device that says where it lies


def leave_stored(parameter: torch.Tensor, stored: Stored) -> None:
    setattr(parameter, _STORED, stored)


def stored_of(parameter: torch.Tensor) -> "Stored | None":
    """Where a parameter the loader left on the meta device lies (None for any other)."""
    stored = getattr(parameter, _STORED, None)
    return stored if parameter.is_meta else None
