"""The non-persistent buffers of a Hugging Face model (rotary frequencies, Gemma's embedding scale):
not saved in checkpoints, so a model built on the meta device has no value for them, and
``to_empty`` (stage_loading.materialize_stage) leaves them uninitialised. They are computed the way
``from_pretrained`` computes them, by the model's own ``_init_weights``, run on a copy of each module
whose parameters are on meta (so no loaded weight is touched)."""

from __future__ import annotations

import copy
from typing import Iterable

import torch
import torch.nn as nn

from ..errors import UnsupportedModelError


def compute_buffers(model: nn.Module, modules: Iterable[nn.Module], device) -> None:
    """Give every non-persistent buffer of ``modules`` its value on ``device``."""
    for module in modules:
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        if not names:
            continue
        clone = copy.copy(module)
        clone.__dict__["_parameters"] = {
            k: None if p is None else nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
            for k, p in module._parameters.items()
        }
        clone.__dict__["_modules"] = {}  # _init_weights initialises one module, not its children
        clone.__dict__["_buffers"] = dict(module._buffers)
        for n in names:
            clone._buffers[n] = _unset(module._buffers[n], device)
        model._init_weights(clone)
        for n in names:
            value = clone._buffers[n]
            if _still_unset(value):
                raise UnsupportedModelError(
                    f"{type(model).__name__}: {type(module).__name__}.{n} is a buffer not saved in checkpoints that the "
                    "model's own initialisation does not compute: build the model on a real device instead of meta"
                )
            module._buffers[n] = value


def _unset(buffer: torch.Tensor, device) -> torch.Tensor:
    """A fresh buffer holding a value no initialisation leaves (NaN; the lowest integer)."""
    out = torch.empty_like(buffer, device=device)
    if out.is_floating_point():
        return out.fill_(float("nan"))
    if out.dtype != torch.bool:
        return out.fill_(torch.iinfo(out.dtype).min)
    return out.fill_(False)


def _still_unset(value: torch.Tensor) -> bool:
    if value.is_floating_point():
        return bool(torch.isnan(value).any())
    if value.dtype != torch.bool:
        return bool((value == torch.iinfo(value.dtype).min).any())
    return False
