"""Where a rank's tensors are when torch.distributed moves them: the wire.

NCCL moves tensors on the rank's GPU, and gloo moves host memory: its send and receive read and write the
tensor's raw pointer, and of its collectives only broadcast and all-reduce take CUDA tensors. So a rank whose
stage is on a GPU but whose group runs gloo (several ranks sharing one GPU, where NCCL cannot run: tests and
small jobs) hands torch.distributed host copies, staged through pinned memory, and brings what arrives back
to its GPU. Every tensor pipedp gives torch.distributed comes from here, so no path can hand gloo a GPU
pointer. Elsewhere (NCCL, or gloo with the stage on the CPU) the wire is the stage's own device and nothing
is copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def carrier(backend: str, device_type: str) -> str:
    """The backend that carries ``device_type``'s tensors: ``backend`` itself, or its part for that type in
    torch.distributed's mixed form ("cpu:gloo,cuda:nccl"; "" where it names none)."""
    if ":" not in backend:
        return backend
    return dict(part.split(":", 1) for part in backend.split(",")).get(device_type, "")


@dataclass(frozen=True)
class Wire:
    device: torch.device  # the stage's
    staged: bool = False  # tensors cross through host memory (gloo with the stage on a GPU)

    @classmethod
    def of(cls, device: torch.device, backend: str) -> "Wire":
        """The wire of a stage on ``device`` whose process groups run ``backend``."""
        return cls(device, staged=carrier(backend, device.type) != "nccl" and device.type != "cpu")

    @property
    def host(self) -> torch.device:
        """Where the tensors handed to torch.distributed are."""
        return torch.device("cpu") if self.staged else self.device

    @property
    def pinned(self) -> bool:
        """Host buffers in page-locked memory: the copies to and from the GPU run at full speed, and a copy back
        runs asynchronously (the caching host allocator keeps the buffer until it is done)."""
        return self.staged and self.device.type == "cuda" and torch.cuda.is_available()

    def empty(self, shape: Sequence[int], dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
        """A buffer for torch.distributed to fill. ``pinned=False``: one whose contents are kept (a checkpoint's
        state), out of the caching host allocator's page-locked blocks, which are scarce."""
        return torch.empty(tuple(shape), dtype=dtype, device=self.host, pin_memory=self.pinned and pinned)

    def copy(self, t: torch.Tensor, pinned: bool = True) -> torch.Tensor:
        """A new tensor on the wire holding ``t``'s values, complete when this returns (gloo reads it at once);
        ``pinned`` as for ``empty``."""
        if not (self.pinned and pinned):
            return t.detach().to(self.host, copy=True, memory_format=torch.contiguous_format)
        buffer = self.empty(t.shape, t.dtype)
        buffer.copy_(t.detach())
        return buffer

    def out(self, t: torch.Tensor, pinned: bool = True) -> torch.Tensor:
        """``t`` on the wire, contiguous: ``t`` itself where it already is (an in-place collective then changes
        it), else a copy (``pinned`` as for ``empty``); after an in-place collective on a copy, copy it back
        (``Wire.into``)."""
        if self.staged:
            return self.copy(t, pinned)
        return t.to(self.host).contiguous()  # (both return t itself where nothing is to change)

    def back(self, t: torch.Tensor) -> torch.Tensor:
        """What arrived on the wire, on the stage's device."""
        return t.to(self.device, non_blocking=self.pinned) if self.staged else t

    @staticmethod
    def into(target: torch.Tensor, wired: torch.Tensor) -> None:
        """An in-place collective's result back into ``target`` when it ran on a copy."""
        if wired is not target:
            target.copy_(wired.view_as(target))
