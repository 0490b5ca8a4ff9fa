"""The training forward must not write the model's state: a parameter or buffer it changes holds a function
of the private batch, un-noised, that state_dict(), checkpoints and exports would publish.

Two views of a tensor, compared before and after:
- ``versions``: its identity, storage and version counter, free to read, taken around every micro-batch's
  forward. Blind to writes through ``.data`` (``buf.data.mul_(...)``: the alias has its own counter). A
  weight PEFT's LoRA parametrizes for each call is set to itself then (its counter moves by one, its
  values do not): those sets are counted (SelfSets) and taken off its version, so any other write shows.
- ``digests``: three integer sums of its bytes (plain, and weighted by the position modulo 2**16 and modulo
  the prime 65521: no two positions under 2**32 apart share both weights), which see any change of its
  values however it was made. They read every byte once: the buffers' are taken around every pass, the
  parameters' around the passes the self-check checks (and a run's first).
Versions are also compared around the whole pass (a write in a backward hook).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..errors import UnsupportedModelError

Named = Iterable[Tuple[str, bool, torch.Tensor]]  # (qualified name, is a parameter, tensor)
VERSION = " (version)"  # the key of a tensor's version view beside its digest (Stage.watch_values)
PIECE = 1 << 22  # 16-bit words summed at a time: each piece's weighted sum stays below 2**53


def is_fake(t: torch.Tensor) -> bool:
    """A meta or fake tensor: it holds no values (the memory planner's simulation runs on them)."""
    return t.is_meta or type(t).__name__ == "FakeTensor"


def versions(named: Named, self_sets: Optional[Mapping[int, int]] = None) -> Dict[str, Tuple[bool, int, int, int]]:
    """{name: (is a parameter, id, storage address, version)}, less, for a tensor whose id ``self_sets``
    holds, the times a library set it to itself (PEFT's LoRA on a parameter, counted by SelfSets): any other
    write still moves what is compared."""
    sets = self_sets or {}
    return {
        name: (is_parameter, id(t), 0 if is_fake(t) else t.data_ptr(), t._version - sets.get(id(t), 0))
        for name, is_parameter, t in named
    }


class SelfSets:
    """How many times each watched tensor was set to itself, counted by a forward pre-hook on the module
    that does it: ``pairs`` of (module, tensor), and ``sets(module)``, whether this call of it will."""

    def __init__(self, pairs: Sequence[Tuple[nn.Module, torch.Tensor]], sets: Callable[[nn.Module], bool]):
        self.counts: Dict[int, int] = {}
        self._handles = [module.register_forward_pre_hook(self._hook(t, sets)) for module, t in pairs]

    def _hook(self, tensor: torch.Tensor, sets: Callable[[nn.Module], bool]):
        key = id(tensor)

        def hook(module: nn.Module, args) -> None:
            if sets(module):
                self.counts[key] = self.counts.get(key, 0) + 1

        return hook


def digests(named: Named) -> Dict[str, Tuple[bool, int, int, int, int]]:
    """{name: (is a parameter, id, plain sum, two weighted sums)} of each tensor's bytes."""
    return {name: (is_parameter, id(t), *_digest(t)) for name, is_parameter, t in named}


def _digest(t: torch.Tensor) -> Tuple[int, int, int]:
    if is_fake(t) or t.numel() == 0:  # (a meta or fake tensor holds no values: the planner's)
        return 0, 0, 0
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8)
    words = raw.view(torch.int16) if raw.numel() % 2 == 0 else raw.to(torch.int16)
    plain = weighted = primed = 0
    for start in range(0, words.numel(), PIECE):
        piece = words[start : start + PIECE].to(torch.int64)
        # a change of one word moves the plain sum; two that cancel there move a weighted one
        position = torch.arange(start, start + piece.numel(), device=piece.device)
        plain += int(piece.sum())
        weighted += int((piece * position.remainder(1 << 16).add_(1)).sum())
        primed += int((piece * position.remainder_(65521).add_(1)).sum())
    return plain, weighted, primed


def _named(view: str) -> str:
    return view[: -len(VERSION)] if view.endswith(VERSION) else view


def refuse_changes(stage: int, before: Dict[str, tuple], after: Dict[str, tuple], when: str) -> None:
    """Refuse, by name, the parameters and buffers whose view differs (appeared, went, or changed)."""
    keys = [k for k in set(before) | set(after) if before.get(k) != after.get(k)]
    kinds = {_named(k): bool((before.get(k) or after[k])[0]) for k in keys}  # (a view's name: the tensor's)
    changed = sorted(kinds)
    parameters: List[str] = [k for k in changed if kinds[k]]
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
