"""Gram matrices x x^T of [n, T, d] tensors, the shared ingredient of ghost norms."""

from __future__ import annotations

from collections import Counter
from typing import Dict, Iterable, Optional, Set, Tuple

import torch


def gram(x: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x, x.transpose(1, 2))


def gram_norms(a3: torch.Tensor, g3: torch.Tensor) -> torch.Tensor:
    """Per-sample ||sum_t g_t a_t^T||^2 for [n, T, in] inputs and [n, T, out] output grads."""
    return (gram(g3) * gram(a3)).sum((1, 2))


def _storage(t: torch.Tensor) -> int:
    # the storage itself, not data_ptr(): fake tensors (the planner's simulation) all read pointer 0
    return t.untyped_storage()._cdata


def shared_storages(tensors: Iterable[torch.Tensor]) -> Set[int]:
    """The storages that more than one of ``tensors`` lies in (one per layer: its input, its output-gradient)."""
    return {storage for storage, count in Counter(map(_storage, tensors)).items() if count > 1}


class GramCache:
    """Gram matrices x x^T of captured tensors, each computed once for the layers that read one tensor:
    projections reading one hidden state (q/k/v, gate/up) share their input's; layers whose outputs are summed
    into one tensor (a parallel residual's attention and MLP output projections: GPT-J, GPT-NeoX, Falcon, Phi)
    share their output-gradient's, which autograd hands to both as one tensor.
    Lives for one micro-batch's norms, keyed by the tensor's storage and layout. ``shared``: the storages of the
    tensors several layers read (``shared_storages``); only their Gram matrices are kept, the others computed and
    let go (None: keep every one). Each entry holds its tensor, so no address is reused while the cache lives."""

    def __init__(self, shared: Optional[Set[int]] = None) -> None:
        self._grams: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._shared = shared

    def gram(self, captured: torch.Tensor, a3: torch.Tensor) -> torch.Tensor:
        """The Gram matrix of ``a3``, the captured tensor ``captured`` (an input or an output-gradient) as
        [n, T, features] in the arithmetic's dtype (keyed by the captured tensor: a bf16 capture is converted
        anew by every layer reading it)."""
        storage = _storage(captured)
        if self._shared is not None and storage not in self._shared:
            return gram(a3)
        layout = (captured.storage_offset(), tuple(captured.shape), tuple(captured.stride()))
        key = (storage, *layout, captured.dtype, a3.dtype)
        if key not in self._grams:
            self._grams[key] = (captured, gram(a3))
        return self._grams[key][1]
