"""Gram matrices x x^T of [n, T, d] tensors, the shared ingredient of ghost norms."""

from __future__ import annotations

from typing import Dict, Tuple

import torch


def gram(x: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x, x.transpose(1, 2))


def gram_norms(a3: torch.Tensor, g3: torch.Tensor) -> torch.Tensor:
    """Per-sample ||sum_t g_t a_t^T||^2 for [n, T, in] inputs and [n, T, out] output grads."""
    return (gram(g3) * gram(a3)).sum((1, 2))


class GramCache:
    """Gram matrices x x^T of captured tensors, each computed once: projections that read the same hidden
    state (q/k/v, gate/up) share their input's, and layers whose outputs are summed into one tensor (a
    parallel residual's attention and MLP outputs: GPT-J, GPT-NeoX, Falcon, Phi) share their output-gradient's,
    which autograd hands to both as one tensor. Lives for one micro-batch's norms, keyed by the tensor's storage
    and layout; each entry holds its tensor, so no address is reused while the cache lives (a privacy unit's
    folding copies a non-contiguous tensor, which would otherwise be freed after its layer and its address taken
    by a later layer's copy of the same shape)."""

    def __init__(self) -> None:
        self._grams: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}

    def gram(self, captured: torch.Tensor, a3: torch.Tensor) -> torch.Tensor:
        """The Gram matrix of ``a3``, the captured tensor ``captured`` (an input or an output-gradient) as
        [n, T, features] in the arithmetic's dtype (keyed by the captured tensor: a bf16 capture is converted
        anew by every layer reading it)."""
        # the storage itself, not data_ptr(): fake tensors (the planner's simulation) all read pointer 0
        storage = captured.untyped_storage()._cdata
        layout = (captured.storage_offset(), tuple(captured.shape), tuple(captured.stride()))
        key = (storage, *layout, captured.dtype, a3.dtype)
        if key not in self._grams:
            self._grams[key] = (captured, gram(a3))
        return self._grams[key][1]
