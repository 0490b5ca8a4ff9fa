"""A float32 clipped sum turned into a bf16 / fp16 gradient inside the sum's own storage.

A bf16 parameter's update is summed in float32; its gradient must be bf16. ``sum.to(bf16)`` allocates the
bf16 copy while the float32 sum is alive: for a 32000x4096 head that is 250 MiB on top of the 500 MiB
sum, the largest transient of a bf16-true step. Here the bf16 values are written over the sum's first half,
in order, so that no value is overwritten before it is read:

- bf16 element i lives in bytes [2i, 2i+2), inside float32 element i // 2;
- the float32 elements [a, b) converted into bf16 positions [a, b) therefore overwrite float32 elements
  [a/2, b/2): already read when b <= 2a. The first ``piece`` elements go through a small temporary; after
  that every piece starts at a >= ``piece`` and is ``piece`` long, so b <= 2a holds.

The values are those of ``.to(dtype)`` bit for bit (the same elementwise rounding). The gradient keeps the
float32 storage (4 bytes per element) until it is dropped after the optimizer step, which only pays when
the optimizer's step makes no parameter-sized temporaries of its own (see ``steps_without_temporaries``).
"""

from __future__ import annotations

import torch

PIECE = 1 << 22  # elements (16 MiB of float32); the temporary is at most PIECE bf16 values


def narrow_in_storage(total: torch.Tensor, dtype: torch.dtype, piece: int = PIECE) -> torch.Tensor:
    """``total.to(dtype)`` written over ``total``'s storage; ``total`` must not be used afterwards. Falls back
    to ``total.to(dtype)`` where that is not safe: not a float32 to 2-byte narrowing, or a tensor that does
    not own its whole storage (a view, an offset, a storage shared with other tensors)."""
    n = total.numel()
    if total.dtype != torch.float32 or dtype.itemsize != 2 or not total.is_contiguous() or not _owns(total) or n == 0:
        return total.to(dtype)
    flat = total.view(-1)
    out = flat.view(dtype)[:n]  # the storage's first 2n bytes, read as 2-byte values
    first = min(n, piece)
    out[:first].copy_(flat[:first].to(dtype))  # overlaps its own source: through a temporary
    a = first
    while a < n:
        b = min(n, a + piece)  # a >= piece, so b <= 2a: it writes only float32 elements below a, already read
        out[a:b].copy_(flat[a:b])
        a = b
    return out.view(total.shape)


def _owns(total: torch.Tensor) -> bool:
    """``total`` is the only tensor on its whole storage: no view of it, no alias (``detach()``), no offset."""
    storage = total.untyped_storage()
    count = getattr(torch._C, "_storage_Use_Count", None)  # private: without it, nothing counts as owned
    if count is None or total._base is not None or total.storage_offset() != 0 or storage.nbytes() != 4 * total.numel():
        return False
    return count(storage._cdata) == 2  # the tensor's reference and ``storage``'s


def steps_without_temporaries(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step allocates no gradient-sized temporaries: SGD without weight decay,
    Nesterov or maximize (its momentum is in place) and the fused Adam / AdamW kernels. There the gradient may
    keep the float32 storage (``narrow_in_storage``): the step then holds no more than the
    conversion did, and the conversion no bf16 copy beside the sums. Torch's other Adam paths make a
    square-root and a division temporary per tensor; for them the gradients are copied (the float32 sums
    freed one at a time), which holds less during their step."""
    groups = optimizer.param_groups
    if isinstance(optimizer, torch.optim.SGD):  # each of these copies every gradient at once (foreach)
        return all(not (g.get("weight_decay") or g.get("nesterov") or g.get("maximize")) for g in groups)
    # the groups' own flags: a loaded state dict may have changed them from the defaults
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and all(g.get("fused") for g in groups)
