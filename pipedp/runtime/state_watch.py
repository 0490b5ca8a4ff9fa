"""The training forward must not write the model's state: a parameter or buffer it changes holds a function
of the private batch, un-noised, that state_dict(), checkpoints and exports would publish.

Two views of a tensor, compared before and after:
- ``versions``: its identity, storage and version counter, free to read, taken around every micro-batch's
  forward. Blind to writes through ``.data`` (``buf.data.mul_(...)``: the alias has its own counter).
- ``digests``: two position-weighted integer sums of its bytes, which see any change of its values however
  it was made. They read every byte once, so they are taken at the passes the self-check checks (and a
  run's first), around the whole pass.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch

from ..errors import UnsupportedModelError
from ..split.plan import is_fake

Named = Iterable[Tuple[str, bool, torch.Tensor]]  # (qualified name, is a parameter, tensor)
PIECE = 1 << 22  # 16-bit words summed at a time: each piece's weighted sum stays below 2**53


def versions(named: Named) -> Dict[str, Tuple[bool, int, int, int]]:
    """{name: (is a parameter, id, storage address, version)}."""
    return {
        name: (is_parameter, id(t), 0 if is_fake(t) else t.data_ptr(), t._version) for name, is_parameter, t in named
    }


def digests(named: Named) -> Dict[str, Tuple[bool, int, int, int]]:
    """{name: (is a parameter, id, plain sum, weighted sum)} of each tensor's bytes."""
    return {name: (is_parameter, id(t), *_digest(t)) for name, is_parameter, t in named}


def _digest(t: torch.Tensor) -> Tuple[int, int]:
    if is_fake(t) or t.numel() == 0:  # (a meta or fake tensor holds no values: the planner's)
        return 0, 0
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8)
    words = raw.view(torch.int16) if raw.numel() % 2 == 0 else raw.to(torch.int16)
    plain = weighted = 0
    for start in range(0, words.numel(), PIECE):
        piece = words[start : start + PIECE].to(torch.int64)
        # weights 1..2**16: a change of one word moves the plain sum; two that cancel there move this one
        weights = torch.arange(start, start + piece.numel(), device=piece.device).remainder_(1 << 16).add_(1)
        plain += int(piece.sum())
        weighted += int((piece * weights).sum())
    return plain, weighted


def refuse_changes(stage: int, before: Dict[str, tuple], after: Dict[str, tuple], when: str) -> None:
    """Refuse, by name, the parameters and buffers whose view differs (appeared, went, or changed)."""
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    parameters: List[str] = [k for k in changed if (before.get(k) or after[k])[0]]
    if parameters:
        raise UnsupportedModelError(
            f"stage {stage}: {when} changes the parameters {parameters[:6]} in place or through .data (e.g. "
            "nn.Embedding(max_norm=...) renormalizes the rows the batch reads): their new values depend on the "
            "private batch, un-noised, and their gradients are taken at values the samples did not see. Drop the "
            "change (max_norm=None; renormalize after the noisy step if needed)"
        )
    if changed:
        raise UnsupportedModelError(
            f"stage {stage}: {when} changes the buffers {changed[:6]} (in place, through .data, or by replacing "
            "them): statistics of the private batch (e.g. running means) would reach state_dict(), checkpoints "
            "and exports without noise. Freeze them (eval() on that layer, track_running_stats=False) or make "
            "them trainable parameters"
        )
