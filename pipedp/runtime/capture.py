"""Per-micro-batch capture of layer inputs and outputs, keyed by micro-batch id.

A *layer* is a module that directly owns trainable parameters (a Linear, an Embedding, a
LayerNorm, or a custom module with its own nn.Parameter). During the forward of
micro-batch j, a forward hook on every layer stores its inputs (detached) and its output
(still in the graph) under key j. The backward pass then asks autograd for the gradient
of the loss w.r.t. those outputs directly, so nothing depends on the order in which
hooks fire — which is what breaks Opacus under interleaved micro-batches.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..errors import UnsupportedModelError
from ..privacy.rules import holds_below, layer_parameters, rule_for
from ..split.blocks import Block

# the layers a LayerCall.replayed context is rebuilding the keyword arguments of
_REPLAYING: set = set()
# what a keyword argument may be besides a tensor: kept as it is for the replay
PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


@dataclass
class Keywords:
    """The keyword arguments of a layer's call, kept for replaying it (a rule replaying the layer's own forward:
    LayerRule.keywords). Their tensors with the micro-batch first are per-sample: they ride with the call's
    inputs, after its positional ones, so that every path slicing, folding or zeroing a call's rows treats them
    as it treats the positional inputs; the rest (shared tensors, None, flags) is kept whole. Which is which is
    read from each call's shapes, and verified by the self-check at each new input signature (a shared tensor
    whose first dimension equals the batch by chance would be split per sample: a wrong gradient it catches)."""

    positional: int  # the call's first inputs are its positional arguments
    spec: TreeSpec  # the keyword arguments' tree
    leaves: List[Any]  # its leaves, None where a per-sample tensor goes
    per_sample: Tuple[int, ...]  # the leaves that are per-sample tensors, in the order they follow the inputs

    def rebuild(self, inputs: tuple) -> Tuple[tuple, Dict[str, Any]]:
        """(args, kwargs) of the call from its inputs as a rule replays them (whole, a sample's slice, or
        in another dtype: the shared floating tensors follow the per-sample ones' dtype)."""
        leaves = list(self.leaves)
        given = inputs[self.positional :]
        dtype = next((t.dtype for t in given if t.is_floating_point()), None)
        for k, leaf in enumerate(leaves):
            if dtype is not None and isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                leaves[k] = leaf.to(dtype)
        for k, t in zip(self.per_sample, given):
            leaves[k] = t
        return tuple(inputs[: self.positional]), tree_unflatten(leaves, self.spec)


@dataclass
class LayerCall:
    inputs: Tuple[torch.Tensor, ...]
    output: Optional[torch.Tensor]  # dropped once the backward pass has used it
    version: int  # output._version at capture: an in-place change later would corrupt its gradient
    rows: int = 0  # > 0: a layer called on the tokens flattened [rows T, ...]; its inputs are held [rows, T, ...]
    experts: int = 1  # > 1: called on [experts, rows T, ...] flattened expert-first; held [rows, T experts, ...]
    keywords: Optional[Keywords] = None  # a call with keyword arguments: how to replay it from its inputs

    def backprop(self, grad: torch.Tensor) -> torch.Tensor:
        """The output-gradient as the layer's rule reads it: batch first, [rows, T, ...] for flattened tokens."""
        return fold_tokens(grad, self.rows, self.experts) if self.rows else grad

    @contextmanager
    def replayed(self, layer: nn.Module) -> Iterator[None]:
        """While a rule replays ``layer`` from this call's inputs: a call with keyword arguments gets them back."""
        if self.keywords is None or id(layer) in _REPLAYING:  # (nested: the outer context rebuilds)
            yield
            return
        keywords = self.keywords

        def rebuild(module, args, kwargs):
            args, extra = keywords.rebuild(args)
            return args, {**kwargs, **extra}

        handle = layer.register_forward_pre_hook(rebuild, with_kwargs=True, prepend=True)
        _REPLAYING.add(id(layer))
        try:
            yield
        finally:
            _REPLAYING.discard(id(layer))
            handle.remove()


def fold_tokens(t: torch.Tensor, rows: int, experts: int = 1) -> torch.Tensor:
    """Tokens flattened [rows T, ...] as [rows, T, ...]; flattened expert-first, [experts, rows T, ...], as
    [rows, T experts, ...] (sample i's position t E + e: expert e's call on its token t, so that the expert
    of a position is its index modulo E, also once a privacy unit's rows are folded into its positions)."""
    if experts == 1:
        return t.reshape(rows, -1, *t.shape[1:])
    return (
        t.reshape(experts, rows, -1, *t.shape[1:])
        .permute(1, 2, 0, *range(3, t.dim() + 2))
        .reshape(rows, -1, *t.shape[1:])
    )


def find_layers(named_modules: Iterator[Tuple[str, nn.Module]]) -> Dict[str, nn.Module]:
    """Each module owning trainable parameters (privacy.rules.layer_parameters) once, under its first name
    (a module two blocks hold is one layer: hooked twice, its every call would be captured twice); the
    modules below a layer that holds them all (privacy.rules.holds_below) are part of it, not layers."""
    layers: Dict[str, nn.Module] = {}
    seen = set()
    for name, module in named_modules:  # (parents come before their children)
        if id(module) in seen or not layer_parameters(module):
            continue
        seen.add(id(module))
        if holds_below(module):
            seen.update(id(m) for m in module.modules())
        _refuse_sequence_first(name, module)
        layers[name if name not in layers else f"{name}#{len(layers)}"] = module
    return layers


def _refuse_sequence_first(name: str, module: nn.Module) -> None:
    """Opacus's SequenceBias (DPMultiheadAttention's bias_k / bias_v, add_bias_kv=True) appends its bias along
    dimension 0 of sequence-first tensors: the attention transposes to [seq, batch, embed] inside, batch_first or
    not (the shape check of the capture could only see it at the first step, and not at all if seq == batch)."""
    opacus_bias = type(module).__name__ == "SequenceBias" and type(module).__module__.startswith("opacus.")
    if opacus_bias and not getattr(module, "batch_first", False):
        raise UnsupportedModelError(
            f"layer {name!r} (Opacus SequenceBias: the bias_k / bias_v of DPMultiheadAttention(add_bias_kv=True)) "
            "appends its bias to the keys and values in the sequence-first [seq, batch, embed] layout the attention "
            "transposes them to inside, whatever its batch_first, and per-sample gradients need the batch first on "
            f"every layer with parameters: use add_bias_kv=False, or freeze the bias ({name}.bias.requires_grad_(False))"
        )


def block_layers(blocks: Sequence[Block]) -> Dict[str, nn.Module]:
    """The layers of a stage's blocks, under the model's own qualified names."""
    return find_layers(
        (b.qualified(n) if n else b.name or type(m).__name__, m) for b in blocks for n, m in b.module.named_modules()
    )


def _folded_tokens(name: str, module: nn.Module, args, batch: int, experts: int = 1) -> Tuple[torch.Tensor, ...]:
    """A flattened-token layer's inputs [batch T, ...] held as [batch, T, ...] (token t of sample i is row
    i * T + t: how Hugging Face's MoE blocks flatten [batch, T, d]); with ``experts`` > 1, inputs
    [experts batch T, ...] held as [batch, experts T, ...] (fold_tokens)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0]
    rows = {int(a.shape[0]) for a in tensors}
    if len(tensors) != len(args) or len(rows) != 1 or next(iter(rows)) % (batch * experts):
        shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args]
        raise UnsupportedModelError(
            f"layer {name!r} ({type(module).__name__}) takes the micro-batch's tokens flattened, but got inputs of "
            f"shapes {shapes}, not all [{batch} x positions, ...]: its per-sample gradients cannot be captured"
        )
    return tuple(fold_tokens(a.detach(), batch, experts) for a in tensors)


def _keywords(name: str, module: nn.Module, kwargs: dict, positional: int, batch: int, inputs: list) -> Keywords:
    """The call's keyword arguments kept for its replay; their per-sample tensors appended to ``inputs``."""
    leaves, spec = tree_flatten(kwargs)
    kept: List[Any] = []
    per_sample = []
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[0] == batch:
            per_sample.append(k)
            inputs.append(leaf.detach())
            kept.append(None)
        elif isinstance(leaf, torch.Tensor):
            kept.append(leaf.detach())
        elif isinstance(leaf, PLAIN):
            kept.append(leaf)
        else:
            raise UnsupportedModelError(
                f"layer {name!r} ({type(module).__name__}) was given a keyword argument holding a "
                f"{type(leaf).__name__}: replaying a layer per sample passes on tensors, numbers, strings and None "
                "only; pass the tensors it holds instead"
            )
    if not positional and not per_sample:
        raise UnsupportedModelError(
            f"layer {name!r} ({type(module).__name__}) got no tensor with the micro-batch dimension ({batch}) first: "
            "per-sample gradients need the samples' inputs batch-first"
        )
    return Keywords(positional, spec, kept, tuple(per_sample))


class _CarriesNoGradient(torch.autograd.Function):
    """A layer's output other than its first, passed on unchanged: a gradient reaching it is an error, since a
    rule replaying the layer gives its parameters the first output's gradient only."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, what: str):
        ctx.what = what
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if bool(grad.ne(0).any()):
            raise UnsupportedModelError(ctx.what)
        return None, None


def _guarded(t, name: str, module: nn.Module, k: int):
    if not isinstance(t, torch.Tensor) or not t.requires_grad:
        return t
    what = (
        f"layer {name!r} ({type(module).__name__}) returns a tuple whose element {k} reaches the loss: per-sample "
        "gradients replay a layer's first output only (an attention's weights are returned second and used by the "
        "model: do not train on them, e.g. output_attentions=False, or freeze the layer)"
    )
    return _CarriesNoGradient.apply(t, what)


class ActivationCapture:
    """Records, for the micro-batch being forwarded, every layer call as a LayerCall."""

    def __init__(self, layers: Dict[str, nn.Module]):
        self.layers = layers
        self._active: Optional[int] = None
        self._batch_size = 0
        self.records: Dict[int, Dict[str, List[LayerCall]]] = {}
        self._handles = [m.register_forward_hook(self._hook_for(name), with_kwargs=True) for name, m in layers.items()]
        # each layer's output dtypes over its calls: a layer computing in float32 inside a float64 model is
        # compared by the self-check at float32's tolerance (at the tightest of its dtypes' tolerances)
        self.output_dtypes: Dict[str, set] = {}

    def _hook_for(self, name: str):
        rule = rule_for(self.layers[name])

        def hook(module: nn.Module, args, kwargs, output):
            if self._active is None or not torch.is_grad_enabled():
                return
            if rule.reads_inputs is not None:
                args = args[: rule.reads_inputs]
            if rule.kept_part is not None and isinstance(output, tuple):
                args = (*args, output[rule.kept_part].detach())
            if rule.output_part is not None and isinstance(output, tuple):
                output = output[rule.output_part]
            if kwargs and not rule.keywords:
                raise UnsupportedModelError(
                    f"layer {name!r} ({type(module).__name__}) was called with keyword arguments "
                    f"{sorted(kwargs)}: its per-sample gradient rule ({rule.name}) reads positional inputs only; "
                    "pass them positionally"
                )
            guarded = None
            if rule.keywords and type(output) is tuple and output and isinstance(output[0], torch.Tensor):
                guarded = (output[0], *(_guarded(t, name, module, k) for k, t in enumerate(output) if k))
                output = output[0]
            if not isinstance(output, torch.Tensor):
                raise UnsupportedModelError(
                    f"layer {name!r} ({type(module).__name__}) returns {type(output).__name__}, not a tensor: "
                    "per-sample gradients need layers with trainable parameters to return one tensor"
                )
            self.output_dtypes.setdefault(name, set()).add(output.dtype)
            if rule.flat_tokens:
                experts = rule.experts_first(module) if rule.experts_first is not None else 1
                folded = _folded_tokens(name, module, args, self._batch_size, experts)
                calls = self.records[self._active].setdefault(name, [])
                calls.append(LayerCall(folded, output, output._version, self._batch_size, experts))
                return
            inputs = []
            for a in args:
                if not isinstance(a, torch.Tensor) or a.dim() == 0 or a.shape[0] != self._batch_size:
                    shape = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
                    raise UnsupportedModelError(
                        f"layer {name!r} ({type(module).__name__}) got an input of shape {shape} without the "
                        f"micro-batch dimension ({self._batch_size}) first: per-sample gradients need "
                        "batch-first tensor inputs on every layer with parameters (construct sequence layers with "
                        "batch_first=True, e.g. nn.MultiheadAttention; expand shared inputs such as position ids to "
                        "[batch, ...])"
                    )
                inputs.append(a.detach())
            keywords = _keywords(name, module, kwargs, len(inputs), self._batch_size, inputs) if kwargs else None
            calls = self.records[self._active].setdefault(name, [])
            calls.append(LayerCall(tuple(inputs), output, output._version, keywords=keywords))
            return guarded

        return hook

    @contextmanager
    def recording(self, microbatch: int, batch_size: int):
        self._active, self._batch_size = microbatch, batch_size
        self.records[microbatch] = {}
        try:
            yield
        finally:
            self._active = None

    def reset(self) -> None:
        self._active = None
        self.records.clear()

    def pop(self, microbatch: int) -> Dict[str, List[LayerCall]]:
        return self.records.pop(microbatch)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
