"""How far two computations of one value may differ by rounding alone, by the dtype they compute in: the one
home of pipedp's tolerances. A sample's gradient given to another, a misread weight layout or a layer that mixes
samples is off by the size of the value itself; rounding, by a few units of the dtype.

- ``ELEMENT_WISE``: the self-check's (runtime/self_check.py), the same arithmetic on another batch (a row alone
  against the row in its micro-batch; a sample's own gradient against its per-sample gradient): (relative
  tolerance, absolute floor as a fraction of the sample's whole gradient on the stage).
- ``FLOAT32_INSIDE``: the self-check's test that the forward keeps samples apart, for a float64 output whose
  forward computed in float32 too (a router's logits); and its gradient comparison, for a float64 layer whose
  rule replays its forward and computes in float32 there (an attention's sink scale), as a relative tolerance.
- ``NORM_WISE``: the construction checks' (split/hf_experts.py), two orders of the same sums (a rule's reading of
  an expert bank against the bank's own forward): the norm of the difference against the value's norm
  (``agree``), since an element-wise tolerance fails where large terms cancel.
"""

from __future__ import annotations

from typing import Optional

import torch

ELEMENT_WISE = {
    torch.float64: (1e-7, 1e-10),
    torch.float32: (2e-3, 1e-5),
    torch.float16: (2e-2, 2e-3),
    torch.bfloat16: (6e-2, 1e-2),
}

# a float64 output whose forward computed in float32 in part, a row alone against the row in its micro-batch (the
# self-check's mixing test): a float32 cast may differ by an ulp (6e-8) and grow through the layers after it
# (measured up to 6e-7 of the loop oracle, Laguna's router); a real coupling of 1e-4 stays refused
FLOAT32_INSIDE = 1e-5

NORM_WISE = {torch.float64: 1e-5, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def agree(got: Optional[torch.Tensor], want: torch.Tensor, dtype: torch.dtype, samples: bool = False) -> bool:
    """``got`` and ``want`` agree as two computations in ``dtype`` of one value: the norm of their difference
    within NORM_WISE of ``want``'s norm, the whole tensor's, or with ``samples`` each sample's (its first
    dimension; a sample whose value is zero or tiny against the others' may differ by the same share of the
    largest)."""
    if got is None or got.shape != want.shape:
        return False
    rows = got.shape[0] if samples else 1
    w = want.to(torch.float64).reshape(rows, -1)
    d = got.to(torch.float64).reshape(rows, -1) - w
    size = w.norm(dim=1)
    return bool((d.norm(dim=1) <= NORM_WISE.get(dtype, 1e-3) * (size + 1e-3 * size.max())).all())
