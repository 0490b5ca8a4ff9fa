"""Counting a stage's bytes: ``MemoryTracker`` sees every storage the operations create while it is active (on real
or fake tensors alike) and forgets it when torch frees it; the planner's simulation tags each allocation with the
stage and action that made it, and tests/numerics/test_plan.py runs it on real training steps too.
"""

from __future__ import annotations

import weakref
from typing import Dict, Iterable, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.state_watch import is_fake

# ---- the tracker ------------------------------------------------------------------------------------
_aten = torch.ops.aten
_READS = (_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default)


class MemoryTracker(TorchDispatchMode):
    """Counts, per stage, the bytes of the storages that operations create while it is active (on real or
    fake tensors alike), and frees them when torch frees the storage. ``stage`` and ``phase`` say whom an
    allocation belongs to; storages that existed before (parameters, buffers) are never counted.

    On fake tensors, a value read back (``.item()``, ``bool(t)``, ``torch.equal``) gets a stand-in: True for
    a bool (an all-ones attention mask; "some row has clip factor 0", so W takes its zeroing path, as with
    padded micro-batches; equal tensors), 0.0 for a float (a self-check error of zero), 1 for an integer."""

    def __init__(self, stages: int, answer_reads: bool = True):
        super().__init__()
        self.stage, self.phase = 0, ""
        self.answer_reads = answer_reads
        self.current = [0] * stages
        self.peak = [0] * stages
        self.peak_phase = [""] * stages
        self.live: Dict[int, Tuple[int, int, str]] = {}  # storage -> (stage, bytes, phase)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.answer_reads and func in _READS and is_fake(args[0]):
            t = args[0]
            if func is not _aten._local_scalar_dense.default:
                return True
            return True if t.dtype == torch.bool else 0.0 if t.is_floating_point() else 1
        out = func(*args, **kwargs)
        fresh = _fresh_outputs(func)
        if isinstance(out, torch.Tensor):
            if fresh[0]:
                self._add(out)
        elif isinstance(out, (tuple, list)):
            for t, new in zip(out, fresh):
                if new and isinstance(t, torch.Tensor):
                    self._add(t)
                elif new and isinstance(t, (tuple, list)):  # a list of tensors (split, unbind, foreach ops)
                    for u in t:
                        if isinstance(u, torch.Tensor):
                            self._add(u)
        return out

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:  # (an op may return one new tensor twice)
            return
        nbytes = storage.nbytes()
        self.live[key] = (self.stage, nbytes, self.phase)
        s = self.stage
        self.current[s] += nbytes
        if self.current[s] > self.peak[s]:
            self.peak[s], self.peak_phase[s] = self.current[s], self.phase
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current[entry[0]] -= entry[1]


_FRESH: Dict[object, Tuple[bool, ...]] = {}


def _fresh_outputs(func) -> Tuple[bool, ...]:
    """Per output of the operator, whether it is a new tensor: its schema marks the outputs that alias an
    input (views, in-place and out= variants), which own no new storage."""
    fresh = _FRESH.get(func)
    if fresh is None:
        returns = getattr(getattr(func, "_schema", None), "returns", None)
        fresh = tuple(r.alias_info is None for r in returns) if returns else (True,)
        _FRESH[func] = fresh or (True,)
    return fresh


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the distinct storages behind ``tensors``."""
    seen: Dict[int, int] = {}
    for t in tensors:
        seen.setdefault(_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())
