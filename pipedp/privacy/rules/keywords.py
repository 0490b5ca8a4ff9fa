"""The calls of layers whose rule replays their own forward (torch.func's: LayerRule.keywords) made with keyword
arguments or returning tuples, for the capture (runtime/capture.py): an attention owning its sinks, called as
``self_attn(hidden_states=..., attention_mask=..., position_embeddings=(cos, sin))`` and returning
``(output, weights)``.

- ``Keywords``: a call's keyword arguments kept for its replay. Their tensors that are per-sample ride with the
  call's inputs, after its positional ones, so that every path slicing, folding or zeroing a call's rows treats
  them as it treats the positional inputs; the rest (shared tensors, None, numbers, strings) is kept whole.
- ``KeywordSorter``: which keyword tensors are per-sample, per layer and argument: those with the micro-batch's
  size first, except a parameter or buffer of the model, and except an argument seen shared once (its first
  dimension not the micro-batch's: it stays shared). An argument taken as per-sample that later is not, or
  seen shared and later with the micro-batch's size first in another layout, is refused by name; a shared
  tensor the micro-batch's size at every call (a sample's gradient computed from one row of it is wrong, their
  sum right) is caught where it is first taken as per-sample, by replaying the layer on samples' rows alone
  (runtime/capture.py ``check_sample_rows``), and by the self-check.
  The same for positional arguments after the call's batch-first tensors (a compressor called as
  ``compressor(hidden_states, q_residual, position_ids, cache, layer_idx)`` with position ids ``[1, T]``): the
  first that is not a batch-first tensor and those after it are kept with the keyword arguments.
- ``guarded``: a call's other outputs, passed on as views the I pass differentiates too (``Guard``). One whose
  gradient is not zero is *joined* to the first output for the replay (``join``: every output flattened per
  sample, side by side), so the rule gives the layer's parameters the gradient of all its outputs that the model
  uses; one that is not batch-first, or that was changed in place after the call, is refused by name.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import TreeSpec, keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from ...errors import UnsupportedModelError

# what a keyword argument may be besides a tensor: kept as it is for the replay
PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


@dataclass
class Keywords:
    layer: str  # the layer's name, for the errors
    positional: int  # the call's first inputs are its first positional arguments
    spec: TreeSpec  # the tree of (its positional arguments after those, its keyword arguments)
    leaves: List[Any]  # its leaves, None where a per-sample tensor goes
    per_sample: Tuple[int, ...]  # the leaves that are per-sample tensors, in the order they follow the inputs
    versions: Tuple[Tuple[str, torch.Tensor, int], ...]  # (argument, tensor, its version at the call)

    def rebuild(self, inputs: tuple) -> Tuple[tuple, Dict[str, Any]]:
        """(args, kwargs) of the call from its inputs as a rule replays them (whole, a sample's slice, or in the
        layer's dtype: the shared floating tensors follow the inputs' dtype, as generic.in_unit_dtype casts)."""
        leaves = list(self.leaves)
        dtype = next((t.dtype for t in inputs if t.is_floating_point()), None)
        for k, leaf in enumerate(leaves):
            if dtype is not None and isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                leaves[k] = leaf.to(dtype)
        for k, t in zip(self.per_sample, inputs[self.positional :]):
            leaves[k] = t
        tail, kwargs = tree_unflatten(leaves, self.spec)
        return (*inputs[: self.positional], *tail), kwargs

    @contextmanager
    def replayed(self, layer: nn.Module) -> Iterator[None]:
        """While a rule replays ``layer`` from the call's inputs: the call's keyword arguments given back (one
        context at a time: a nested one would rebuild them from the rebuilt arguments)."""
        for argument, tensor, version in self.versions:
            if tensor._version != version:
                raise UnsupportedModelError(
                    f"layer {self.layer!r} was given argument {argument} and it was changed in place after "
                    "the call: replaying the layer per sample would read the changed values; change a copy"
                )

        def rebuild(module, args, kwargs):
            args, extra = self.rebuild(args)
            return args, {**kwargs, **extra}

        handle = layer.register_forward_pre_hook(rebuild, with_kwargs=True, prepend=True)
        try:
            yield
        finally:
            handle.remove()


class KeywordSorter:
    """Which keyword tensors of the layers' calls are per-sample (the module docstring), remembered per layer and
    argument over the run. ``tensors``: the stage's parameters and buffers (shared, whatever their shape), read
    once per micro-batch that has a keyword call (moving a module to a device replaces its buffers)."""

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]]):
        self.tensors = tensors
        self.model: Optional[Set[int]] = None  # their ids, for the micro-batch being recorded
        self.shared: Dict[Tuple[str, str], int] = {}  # (layer, argument) -> the first dimension it was seen with
        self.per_sample: Set[Tuple[str, str]] = set()
        self.fresh: List[str] = []  # the arguments the last call's keep first took as per-sample (to be checked)

    def keep(self, name: str, module: nn.Module, kwargs: dict, batch: int, inputs: list, tail: tuple = ()) -> Keywords:
        """The call's keyword arguments, and its positional ``tail`` after the tensors in ``inputs``, kept for its
        replay; their per-sample tensors appended to ``inputs``."""
        found, spec = tree_flatten_with_path((tuple(tail), kwargs))
        self.fresh = []
        positional = len(inputs)
        kept: List[Any] = []
        per_sample, versions = [], []
        where = f"layer {name!r} ({type(module).__name__})"
        for k, (path, leaf) in enumerate(found):
            argument = _argument(path, positional)
            if not isinstance(leaf, torch.Tensor):
                if not isinstance(leaf, PLAIN):
                    raise UnsupportedModelError(
                        f"{where} was given an argument holding a {type(leaf).__name__} ({argument}): replaying "
                        "a layer per sample passes on tensors, numbers, strings and None only; pass the tensors it "
                        "holds instead"
                    )
                kept.append(leaf)
                continue
            versions.append((argument, leaf, leaf._version))
            if self._is_per_sample(name, argument, leaf, batch, where):
                per_sample.append(k)
                inputs.append(leaf.detach())
                kept.append(None)
                continue
            if leaf.requires_grad:
                raise UnsupportedModelError(
                    f"{where} was given a tensor shared by the batch that carries a gradient ({argument}): replaying "
                    "the layer per sample would miss the gradient through it; pass it positionally with the batch "
                    "first (before any argument that is not), or compute it inside the layer"
                )
            kept.append(leaf.detach())
        if not positional and not per_sample:
            raise UnsupportedModelError(
                f"{where} got no tensor with the micro-batch dimension ({batch}) first: per-sample gradients need "
                "the samples' inputs batch-first"
            )
        return Keywords(name, positional, spec, kept, tuple(per_sample), tuple(versions))

    def positional(self, name: str, inputs: int, batch: int, first: int = 1) -> List[str]:
        """The positional inputs from ``first`` on of a call (``inputs`` of them, each batch-first) not seen before
        at a call of several samples: taken as per-sample by their first dimension, they are checked as the
        keyword tensors are (runtime/capture.py ``check_sample_rows``)."""
        fresh = []
        for k in range(first, inputs if batch > 1 else 0):
            key = (name, f"positional argument {k}")
            if key not in self.per_sample:
                self.per_sample.add(key)
                fresh.append(key[1])
        return fresh

    def _is_per_sample(self, name: str, argument: str, t: torch.Tensor, batch: int, where: str) -> bool:
        key = (name, argument)
        if self.model is None:
            self.model = {id(m) for m in self.tensors()}
        if id(t) in self.model:
            return False
        first = int(t.shape[0]) if t.dim() else -1
        if key in self.shared:
            if first == batch and batch > 1 and first != self.shared[key]:
                raise UnsupportedModelError(
                    f"{where} was given keyword argument {argument} shared by the batch at an earlier call (first "
                    f"dimension {self.shared[key]}) and with the micro-batch's size first now, {tuple(t.shape)}: "
                    "pipedp cannot tell whether it is one row per sample; pass it with the same layout at every call"
                )
            return False
        if batch == 1:  # (uninformative: a shared [1, ...] tensor and a sample's own are the same replay)
            return key in self.per_sample
        if first == batch:
            if key not in self.per_sample:
                self.fresh.append(argument)
            self.per_sample.add(key)
            return True
        if key in self.per_sample:
            raise UnsupportedModelError(
                f"{where} was given keyword argument {argument} with the micro-batch's size first at an earlier "
                f"call, taken as one row per sample, and of shape {tuple(t.shape)} now: a tensor shared by the batch "
                "whose first dimension matched the micro-batch by chance; give it a leading dimension of 1 (or "
                "[batch, ...] if it is per-sample)"
            )
        self.shared[key] = first
        return False


def _argument(path, positional: int) -> str:
    """A kept argument's name for the errors: ``['mask']`` (keyword), ``positional argument 2``, ``... [1]``."""
    rest = keystr(path[2:])
    if path[0].idx == 0:
        return f"positional argument {positional + path[1].idx}" + (f" {rest}" if rest else "")
    return keystr(path[1:])


@dataclass
class Guard:
    """A tensor of a call's output after its first element, passed on in its place as a view (the same values: a
    gradient reaching the view is what the model's use of it contributes)."""

    view: torch.Tensor
    what: str  # "element k", for the errors
    path: Tuple[int, int]  # (element, leaf of its tree)
    version: int  # the view's version at the call: a change in place after it hides what the model used

    def refusal(self, who: str, batch: int, used: bool = True) -> Optional[UnsupportedModelError]:
        """None if the output can be left out (not ``used``: no gradient reached it) or joined to the first one
        for a call on ``batch`` samples, else the refusal naming ``who`` (the layer). Changed in place, it is
        refused either way: its values before the change may have reached the loss where its gradient cannot
        tell."""
        if self.view._version != self.version:
            return UnsupportedModelError(
                f"{who} returns a tuple whose {self.what} was changed in place after the call: its gradient would be "
                "taken at the changed values; change a copy"
            )
        if used and (self.view.dim() == 0 or self.view.shape[0] != batch):
            return UnsupportedModelError(
                f"{who} returns a tuple whose {self.what} reaches the loss and is not batch-first "
                f"({tuple(self.view.shape)} for {batch} samples): per-sample gradients split a layer's outputs by "
                "their first dimension; return it with the batch first, or freeze the layer"
            )
        return None


def guarded(output: tuple) -> Tuple[tuple, Tuple[Guard, ...]]:
    """``output`` with the tensors of its elements after the first that carry a gradient replaced by views, and
    those views as Guards, for the I pass to differentiate (a gradient reaching one joins it: ``join``). The first
    element is passed on as a view too: the gradient taken at it is then the model's use of it alone, not also
    what reaches it through another output the layer computed from it (``return out, 2 * out``), which the join
    replays."""
    first = output[0]
    if isinstance(first, torch.Tensor) and first.requires_grad:
        first = first.view_as(first)
    guards: List[Guard] = []
    rest = []
    for k, element in enumerate(output[1:], start=1):
        leaves, spec = tree_flatten(element)
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaves[j] = leaf.view_as(leaf)
                guards.append(Guard(leaves[j], f"element {k}", (k, j), leaves[j]._version))
        rest.append(tree_unflatten(leaves, spec))
    return (first, *rest), tuple(guards)


def join(output, paths: Tuple[Tuple[int, int], ...]) -> torch.Tensor:
    """A call's first output and its other outputs at ``paths`` (Guard.path), each flattened per sample, side by
    side: [n, features] (their gradients joined the same way are the call's output-gradient)."""
    parts = [output[0]] + [tree_flatten(output[k])[0][j] for k, j in paths]
    n = parts[0].shape[0]
    return torch.cat([p.reshape(n, -1) for p in parts], 1)


@contextmanager
def joined(layer: nn.Module, paths: Tuple[Tuple[int, int], ...]) -> Iterator[None]:
    """While a rule replays ``layer``: its output is the call's joined outputs (``join``)."""
    handle = layer.register_forward_hook(lambda module, args, output: join(output, paths))
    try:
        yield
    finally:
        handle.remove()
