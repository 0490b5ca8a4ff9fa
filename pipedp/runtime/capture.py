"""Per-micro-batch capture of layer inputs and outputs, keyed by micro-batch id.

A *layer* is a module that directly owns trainable parameters (a Linear, an Embedding, a
LayerNorm, or a custom module with its own nn.Parameter). During the forward of
micro-batch j, a forward hook on every layer stores its inputs (detached) and its output
(still in the graph) under key j. The backward pass then asks autograd for the gradient
of the loss w.r.t. those outputs directly, so nothing depends on the order in which
hooks fire — which is what breaks Opacus under interleaved micro-batches.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..errors import UnsupportedModelError
from ..privacy.rules import holds_below, layer_parameters, rule_for
from ..privacy.rules.generic import first_output
from ..privacy.rules.keywords import Guard, Keywords, KeywordSorter, guarded, joined
from ..privacy.rules.registry import fold_tokens, read_children
from ..split.blocks import Block
from ..split.hf_runs import modes_kept, reseeded, rng_kept
from . import self_check


@dataclass
class LayerCall:
    inputs: Tuple[torch.Tensor, ...]
    output: Optional[torch.Tensor]  # dropped once the backward pass has used it
    version: int  # output._version at capture: an in-place change later would corrupt its gradient
    rows: int = 0  # > 0: a layer called on the tokens flattened [rows T, ...]; its inputs are held [rows, T, ...]
    experts: int = 1  # > 1: called on [experts, rows T, ...] flattened expert-first; held [rows, T experts, ...]
    keywords: Optional[Keywords] = None  # a call with keyword arguments: how to replay it from its inputs
    # a call returning a tuple: its other outputs' tensors as passed on (keywords.guarded); those the model used
    # (a gradient reached them) are joined to the first output for the replay (keywords.join), at these paths
    guards: Tuple[Guard, ...] = ()
    joined: Tuple[Tuple[int, int], ...] = ()

    def backprop(self, grad: torch.Tensor, more: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """The output-gradient as the layer's rule reads it: batch first, [rows, T, ...] for flattened tokens;
        with the gradients of its joined outputs (``more``), all flattened per sample side by side."""
        if more:
            assert not self.rows  # (flattened-token layers are never replayed whole: they carry no guards)
            return torch.cat([g.reshape(g.shape[0], -1) for g in (grad, *more)], 1)
        return fold_tokens(grad, self.rows, self.experts) if self.rows else grad

    @contextmanager
    def replayed(self, layer: nn.Module):
        """While a rule replays ``layer`` from this call's inputs: a call with keyword arguments gets them back,
        and one with joined outputs returns them joined."""
        with ExitStack() as stack:
            if self.keywords is not None:
                stack.enter_context(self.keywords.replayed(layer))
            if self.joined:
                stack.enter_context(joined(layer, self.joined))
            yield


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
        for path in read_children(module):  # (their parameters are the module's: a layer with it)
            seen.update(id(m) for m in module.get_submodule(path).modules())
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


def _batch_first(a: torch.Tensor, batch: int, positions: int) -> bool:
    """``a`` is already [batch, positions, ...] (DBRX's experts take the hidden states so beside a flattened
    routing), not tokens flattened."""
    return a.dim() >= 3 and tuple(a.shape[:2]) == (batch, positions)


def _folded_tokens(name: str, module: nn.Module, args, batch: int, experts: int = 1) -> Tuple[torch.Tensor, ...]:
    """A flattened-token layer's inputs [batch T, ...] held as [batch, T, ...] (token t of sample i is row
    i * T + t: how Hugging Face's MoE blocks flatten [batch, T, d]); an input already [batch, T, ...] beside
    them kept as it is; with ``experts`` > 1, inputs [experts batch T, ...] held as [batch, experts T, ...]
    (fold_tokens)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0]
    flat = {int(a.shape[0]) for a in tensors if a.shape[0] != batch} or {int(a.shape[0]) for a in tensors}
    rows = next(iter(flat)) if len(flat) == 1 else 0
    positions = rows // (batch * experts)
    folded = []
    if len(tensors) == len(args) and rows and not rows % (batch * experts):  # (else refused below, before a fold)
        for a in tensors:
            kept = experts == 1 and _batch_first(a, batch, positions)
            folded.append(a if kept or a.shape[0] % (batch * experts) else fold_tokens(a, batch, experts))
    if not folded or any(tuple(f.shape[:2]) != (batch, positions * experts) for f in folded):
        shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args]
        raise UnsupportedModelError(
            f"layer {name!r} ({type(module).__name__}) takes the micro-batch's tokens flattened, but got inputs of "
            f"shapes {shapes}, not all [{batch} x positions, ...] (or [{batch}, positions, ...]): its per-sample "
            "gradients cannot be captured"
        )
    return tuple(f.detach() for f in folded)


def check_sample_rows(
    name: str,
    module: nn.Module,
    inputs: Sequence[torch.Tensor],
    keywords: Optional[Keywords],
    fresh: Sequence[str],
    draws: bool = False,
) -> None:
    """The tensors ``fresh`` just taken as per-sample by their first dimension (keyword arguments, positional ones
    after the first) are: the layer replayed on the first and the last sample's rows alone (its inputs' rows) gives
    that sample's rows of its replay on the whole call, in eval mode from one random state. A tensor shared by
    the batch whose first dimension is the micro-batch's by chance fails here, self-check or not (each sample
    would be replayed with one row of it: its gradient wrong, their sum right).
    With ``draws`` (a layer replayed one sample at a time: rules.LayerRule.alone), first its forward in its own mode,
    run twice from two random states, must agree: one drawing random numbers (a dropout inside a mixture-of-experts
    block) would draw others in its replays than the forward did."""
    batch = int(inputs[0].shape[0])
    device = inputs[0].device
    inputs = [t.clone() for t in inputs]  # (a layer writing its inputs in place would write the forward's own)
    replayed = keywords.replayed(module) if keywords is not None else nullcontext()
    with torch.no_grad(), modes_kept(module), replayed:  # (no grad: the capture's hooks stand by)
        if draws:
            with rng_kept(device), self_check.Precisions() as computed:
                first = first_output(module(*inputs))
            with rng_kept(device):
                reseeded(device)
                second = first_output(module(*inputs))
            if not self_check.same_values(first, second, self_check.alone_tolerance(second, computed.dtypes)):
                raise UnsupportedModelError(
                    f"layer {name!r} ({type(module).__name__}) draws random numbers in its forward (a dropout inside "
                    "it): pipedp replays it one sample at a time, which would draw others than the forward did; set "
                    "its dropout to 0, or freeze it"
                )
        module.eval()
        with rng_kept(device), self_check.Precisions() as computed:
            whole = first_output(module(*inputs))
        for i in sorted({0, batch - 1}):
            try:
                with rng_kept(device):
                    alone = first_output(module(*(t[i : i + 1] for t in inputs)))
            except RuntimeError:  # (a shared matrix sliced to one row no longer fits the product it enters)
                alone = None
            tolerance = self_check.alone_tolerance(alone, computed.dtypes) if alone is not None else 0.0
            if alone is None or not self_check.same_values(whole[i : i + 1], alone, tolerance):
                raise UnsupportedModelError(
                    f"layer {name!r} ({type(module).__name__}) was given argument(s) {fresh} with the "
                    f"micro-batch's size ({batch}) first, taken as one row per sample, but sample {i}'s rows replayed "
                    "alone do not give its rows of the whole call: one of them is a tensor shared by the batch whose "
                    "first dimension matched the micro-batch by chance (give it a leading dimension of 1), or the "
                    "layer mixes samples"
                )


class ActivationCapture:
    """Records, for the micro-batch being forwarded, every layer call as a LayerCall."""

    def __init__(self, layers: Dict[str, nn.Module], tensors: Callable[[], Iterable[torch.Tensor]] = tuple):
        """``tensors``: the stage's parameters and buffers (a keyword argument among them is shared), read at
        each micro-batch (moving a module to a device replaces its buffers)."""
        self.layers = layers
        self.sorter = KeywordSorter(tensors)
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
            passed: Optional[tuple] = None
            guards: Tuple[Guard, ...] = ()
            if rule.keywords and type(output) is tuple and output and isinstance(output[0], torch.Tensor):
                passed, guards = guarded(output)
                output = passed[0]
                if guards and not output.requires_grad:
                    raise UnsupportedModelError(
                        f"layer {name!r} ({type(module).__name__}) returns a tuple whose first element carries no "
                        f"gradient while its {guards[0].what} does: its per-sample replay differentiates the first "
                        "output (the others joined to it); return the differentiable output first, or freeze the layer"
                    )
            if not isinstance(output, torch.Tensor):
                raise UnsupportedModelError(
                    f"layer {name!r} ({type(module).__name__}) returns {type(output).__name__}, not a tensor: "
                    "per-sample gradients need layers with trainable parameters to return one tensor"
                )
            if not output.requires_grad and not guards:  # (an indexer's top-k positions: no gradient reaches it)
                return passed
            self.output_dtypes.setdefault(name, set()).add(output.dtype)
            if rule.flat_tokens:
                experts = rule.experts_first(module) if rule.experts_first is not None else 1
                folded = _folded_tokens(name, module, args, self._batch_size, experts)
                # (an output already [batch, T, ...], as DBRX's experts return theirs, needs no fold)
                rows = 0 if _batch_first(output, self._batch_size, folded[0].shape[1]) else self._batch_size
                calls = self.records[self._active].setdefault(name, [])
                calls.append(LayerCall(folded, output, output._version, rows, experts))
                return
            inputs = []
            tail: tuple = ()  # positional arguments kept with the keyword ones (keywords.py)
            for k, a in enumerate(args):
                if not isinstance(a, torch.Tensor) or a.dim() == 0 or a.shape[0] != self._batch_size:
                    if rule.keywords:  # its rule replays its forward: the rest is passed back as it was
                        tail = tuple(args[k:])
                        break
                    shape = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
                    raise UnsupportedModelError(
                        f"layer {name!r} ({type(module).__name__}) got an input of shape {shape} without the "
                        f"micro-batch dimension ({self._batch_size}) first: per-sample gradients need "
                        "batch-first tensor inputs on every layer with parameters (construct sequence layers with "
                        "batch_first=True, e.g. nn.MultiheadAttention; expand shared inputs such as position ids to "
                        "[batch, ...])"
                    )
                inputs.append(a.detach())
            first = 0 if rule.alone else 1  # (a rule replaying samples alone has its first input checked too)
            fresh = self.sorter.positional(name, len(inputs), self._batch_size, first) if rule.keywords else []
            keywords = (
                self.sorter.keep(name, module, kwargs, self._batch_size, inputs, tail) if kwargs or tail else None
            )
            fresh += self.sorter.fresh if keywords is not None else []
            if fresh:
                check_sample_rows(name, module, inputs, keywords, fresh, draws=rule.alone)
            calls = self.records[self._active].setdefault(name, [])
            calls.append(LayerCall(tuple(inputs), output, output._version, keywords=keywords, guards=guards))
            return passed

        return hook

    @contextmanager
    def recording(self, microbatch: int, batch_size: int):
        self._active, self._batch_size = microbatch, batch_size
        self.records[microbatch] = {}
        self.sorter.model = None  # (read again at the micro-batch's first keyword call)
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
