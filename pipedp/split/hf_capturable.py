"""Making the calls inside a Hugging Face decoder layer capturable per sample, without changing what
they compute. Per-sample capture (runtime/capture.py) needs every module owning parameters to get
batch-first inputs and its output left as it returned it; two families' layers do otherwise:

- flattened inputs: OPT's layer runs its feed-forward on [batch * seq, hidden], a linear attention its
  gated norm on [batch * seq * heads, head_dim] (Qwen3-Next). The module gets [batch, seq (* heads), ...]
  instead, batch-major as the model flattens, and its output is flattened back for the layer (the same
  values). That the model flattens batch-major, for these modules and for a router's or an expert bank's
  flattened tokens (which the capture folds), is checked by autograd on random hidden states
  (``_check_token_order``);
- a child's weight read by the module above it without calling the child (F.conv1d(x, self.conv.weight):
  a Mamba mixer, LFM2's short convolution): that module is one layer with the child (privacy.rules READS);
- an output changed in place: Falcon adds the attention output into the MLP's output (``+=``), the
  output of its last Linear. The container returning that output (the MLP) returns a copy instead.

Which modules need this is found at construction by running one layer of each class on a tiny
batch (zeros for its weights), which also refuses what cannot be made capturable: a module called
with keyword arguments whose rule reads positional inputs only (a module whose rule replays its own
forward, torch.func's, may be: its capture keeps them), a trainable parameter read outside its
module's call (LFM2's convolution weight). The hooks are installed around each call of the layer
only, so that the flattening hook runs after the capture's own hook (which records the unflattened
output).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

import torch
import torch.nn as nn

from ..errors import UnsupportedModelError
from ..privacy.rules import holds_below, layer_parameters, rule_for
from ..privacy.rules.keywords import Guard, guarded
from ..privacy.rules.registry import READS, fold_tokens, read_children, typed_rule
from .hf_runs import modes_kept, outside_calls, reached_from, rng_kept, standing_in, trainable_of


@dataclass(frozen=True)
class LayerFixes:
    flattened: Tuple[str, ...] = ()  # modules (paths in the layer) called with [batch * seq, ...] inputs
    copied: Tuple[str, ...] = ()  # modules whose output is a parameter owner's output changed in place later
    # (module, the children whose parameters it reads without calling them): one layer with them (READS); set on
    # every layer of the kind by ``adopt``, needing no hooks around the calls (so not counted by __bool__)
    reads: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.flattened or self.copied)

    def adopt(self, layer: nn.Module, undo: bool = False) -> None:
        """Mark each reading module of ``layer`` as one layer with the children it reads (privacy.rules READS)."""
        for path, children in self.reads:
            module = layer.get_submodule(path)
            if undo:
                module.__dict__.pop(READS, None)
            else:
                setattr(module, READS, children)


def _reads_trainable(module: nn.Module, trainable: set) -> bool:
    """Trainable parameters of its own, or in the parameter containers it reads, or below it for a layer that
    holds them all (a layer, for capture)."""
    if holds_below(module):
        return True
    holders = [module] + [c for c in module.children() if isinstance(c, (nn.ParameterDict, nn.ParameterList))]
    holders += [m for path in read_children(module) for m in module.get_submodule(path).modules()]
    return any((id(h), n) in trainable for h in holders for n in h._parameters)


def find_fixes(
    where: str, layer: nn.Module, args: tuple, kwargs: dict, rows: int, length: int, width: Tuple[int, ...]
) -> LayerFixes:
    """Run ``layer`` once on [rows, length, *width] zeros with its recorded arguments (``width``: the hidden
    states' sizes after the positions, [hidden], or [streams, hidden] for DeepSeek-V4's hyper-connections);
    refuse what the fixes cannot cover, naming the module."""
    seen = _run(layer, args, kwargs, rows, length, width, LayerFixes())
    reads = _readers(layer, seen)
    if reads:  # the modules reading a child's parameters without calling it replay it with them (torch.func)
        LayerFixes(reads=reads).adopt(layer)
        again = _run(layer, args, kwargs, rows, length, width, LayerFixes())
        checked = _run(layer, args, kwargs, rows, length, width, LayerFixes(), cut=True)
        # (not so replayable, read by another module too, or not read by that one: refused as read outside)
        unjoinable = any(guard.refusal(who, rows) is not None for who, guard in again.used)
        if unjoinable or again.outside or checked.unread or checked.elsewhere:
            LayerFixes(reads=reads).adopt(layer, undo=True)
            reads = ()
        else:
            seen = again
    for who, guard in seen.used:  # (joined by the capture, as the model uses them)
        refusal = guard.refusal(f"{where}.{who}", rows)
        if refusal is not None:
            raise refusal
    if seen.outside:
        raise UnsupportedModelError(
            f"{where}: {', '.join(seen.outside[:4])} is read outside the call of the module that owns it (e.g. "
            "F.conv1d(x, self.conv.weight)), where per-sample gradient capture cannot see it: freeze it, or give the "
            "model a pipeline_blocks() method"
        )
    for path, keys in seen.keywords.items():
        owner = layer.get_submodule(path)
        if rule_for(owner).keywords:  # its rule replays its own forward, keyword arguments included
            continue
        own = [n for n, p in layer_parameters(owner) if p.requires_grad] if not holds_below(owner) else []
        named = f" owns trainable {own} itself and" if own else ""
        what = f"freeze {own} in every layer (requires_grad_(False); the module's child layers still train)"
        what = what if own else "freeze it"
        raise UnsupportedModelError(
            f"{where}.{path}{named} is called with keyword arguments {keys}, which per-sample capture cannot replay: "
            f"{what}, or give the model a pipeline_blocks() method"
        )
    # a router or expert bank takes the tokens flattened by design: its capture folds them (rules/experts.py)
    rules = {p: rule_for(layer.get_submodule(p)) for p in seen.first_dims}
    tokens = {p for p, rule in rules.items() if rule.flat_tokens}
    # flattened tokens, or tokens x heads (a gated norm over each head of a linear attention: [batch T heads, d])
    flattened = tuple(
        p for p, first in seen.first_dims.items() if first != rows and not first % (rows * length) and p not in tokens
    )
    for path, first in seen.first_dims.items():
        per_expert = rules[path].experts_first  # (Llama-4's experts: every token once per expert)
        if per_expert is not None and first == per_expert(layer.get_submodule(path)) * rows * length:
            continue
        if first != rows and first % (rows * length):
            raise UnsupportedModelError(
                f"{where}.{path} gets inputs whose first dimension is neither the batch nor a multiple of batch x "
                "sequence, so its per-sample gradients cannot be captured: freeze it, or give the model a "
                "pipeline_blocks() method"
            )
    copied = []
    for path in seen.changed:
        owner = next((c for c in _ancestors(path) if seen.outputs.get(c) is seen.owner_outputs[path]), None)
        if owner is None:
            raise UnsupportedModelError(
                f"{where}.{path}: its output is changed in place by the module that called it, so its gradient "
                "cannot be captured exactly: freeze it, or give the model a pipeline_blocks() method"
            )
        copied.append(owner)
    fixes = LayerFixes(flattened, tuple(dict.fromkeys(copied)), reads)
    if fixes:
        again = _run(layer, args, kwargs, rows, length, width, fixes)
        left = [p for p in again.first_dims if again.first_dims[p] != rows and p not in tokens] + again.changed
        if left:
            raise UnsupportedModelError(f"{where}: {left} cannot be made capturable per sample: freeze them")
    _check_token_order(where, layer, args, kwargs, rows, length, width, fixes, (*flattened, *tokens))
    return fixes


def _check_token_order(where, layer, args, kwargs, rows, length, width, fixes: LayerFixes, paths) -> None:
    """Each module called on the tokens flattened (``paths``: a gated norm over each head's tokens, a router, an
    expert bank) gets them batch-major, as the capture folds them (privacy.rules.fold_tokens): the rows of each
    sample's share depend on that sample's hidden states and on no other's. Checked by autograd (one random
    combination of each share's rows) on random hidden states through the layer's own weights (skipped on meta,
    or for a layer that cannot run without the dry run's cache: the self-check compares every checked sample's
    gradient), so that a model flattening [T, batch] is refused by name whether or not the self-check runs,
    instead of each row's gradient going to another sample."""
    if rows < 2 or not paths or any(t.is_meta for t in [*layer.parameters(), *layer.buffers()]):
        return
    seen: Dict[str, torch.Tensor] = {}

    def keep(path: str):
        def hook(module, inputs):
            first = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
            if first is not None and first.dim() and first.requires_grad and first.shape[0] != rows:
                seen.setdefault(path, first)

        return hook

    handles = [layer.get_submodule(p).register_forward_pre_hook(keep(p), prepend=True) for p in paths]
    # (a cache the dry run passed holds its keys by now: this run goes without it)
    kwargs = {k: None if type(v).__name__.endswith("Cache") else v for k, v in kwargs.items()}
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(rows, length, *width, generator=g, dtype=torch.float64).to(
        _device(args, kwargs), _dtype(layer)
    )
    hidden.requires_grad_(True)
    try:
        with torch.enable_grad(), modes_kept(layer), rng_kept(hidden.device), capturable(layer, fixes, rows, length):
            layer.eval()(hidden, *args, **kwargs)
    except Exception:  # (a layer that cannot run this way, e.g. without its cache: the self-check still compares)
        return
    finally:
        for handle in handles:
            handle.remove()
    for path, flat in seen.items():
        rule = rule_for(layer.get_submodule(path))
        experts = rule.experts_first(layer.get_submodule(path)) if rule.experts_first is not None else 1
        if flat.shape[0] % (rows * experts):
            continue  # (refused above: neither the batch nor a multiple of batch x sequence)
        shares = fold_tokens(torch.arange(flat.shape[0]), rows, experts)  # [rows, ...]: each sample's rows
        for i in range(rows):
            with torch.enable_grad():  # (model_blocks may run under no_grad: an evaluation)
                share = flat[shares[i].reshape(-1)]
                weights = torch.randn(share.shape, generator=g, dtype=torch.float64).to(share.device, share.dtype)
                combined = (share * weights).sum()
            (grad,) = torch.autograd.grad(combined, hidden, retain_graph=True, allow_unused=True)
            reached = [] if grad is None else (grad.reshape(rows, -1).abs().sum(1) > 0).tolist()
            if any(reached) and reached != [j == i for j in range(rows)]:
                samples = [j for j, hit in enumerate(reached) if hit]
                raise UnsupportedModelError(
                    f"{where}.{path} ({type(layer.get_submodule(path)).__name__}) is called on the tokens flattened, "
                    f"and the rows per-sample capture reads as sample {i}'s (batch-major) depend on the hidden states "
                    f"of samples {samples}: the model flattens them in another order (e.g. [T, batch]) or mixes "
                    "samples; freeze it, or give the model a pipeline_blocks() method"
                )


def _readers(layer: nn.Module, seen: "_Seen") -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    """For each module whose parameters were read outside its call and which never ran itself: the nearest module
    above it that ran, which read them (F.conv1d(x, self.conv.weight) in a Mamba mixer), as (its path, the
    children it reads); one that ran and was read besides stays outside (refused)."""
    found: Dict[str, List[str]] = {}
    for path, _, _ in seen.outside_params:
        if path in seen.outputs or not path:
            continue
        parts = path.split(".")
        above = next(
            (".".join(parts[:k]) for k in range(len(parts) - 1, -1, -1) if ".".join(parts[:k]) in seen.outputs)
        )
        if typed_rule(layer.get_submodule(above)) is not None:  # (a router's or bank's rule knows its own tensors)
            continue
        child = path[len(above) + 1 :] if above else path
        found.setdefault(above, [])
        if child not in found[above]:
            found[above].append(child)
    return tuple((above, tuple(children)) for above, children in found.items())


@contextmanager
def capturable(layer: nn.Module, fixes: LayerFixes, rows: int, length: int) -> Iterator[None]:
    """The fixes installed for one call of ``layer`` (after the capture's hooks, which are older)."""
    handles = []
    for path in fixes.copied:
        handles.append(layer.get_submodule(path).register_forward_hook(_copy_output))
    for path in fixes.flattened:
        module = layer.get_submodule(path)
        flat: List[int] = []  # the first dimension of the call in progress, restored on its output
        handles.append(module.register_forward_pre_hook(_unflatten(rows, length, flat)))
        handles.append(module.register_forward_hook(_flatten(flat)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _copy_output(module, args, output):
    if isinstance(output, tuple):
        return (output[0].clone(), *output[1:])
    return output.clone()


def _unflatten(rows: int, length: int, flat: List[int]):
    """A call on [rows T k, ...] tensors (batch-major) made on [rows, T k, ...]: every tensor argument of that first
    dimension (a gated norm's input and gate)."""

    def hook(module, args):
        first = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() else None
        if first is None or first == rows or first % (rows * length):
            flat.append(-1)
            return None
        flat.append(first)
        return tuple(
            a.reshape(rows, -1, *a.shape[1:]) if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == first else a
            for a in args
        )

    return hook


def _flatten(flat: List[int]):
    def hook(module, args, output):
        first = flat.pop()
        if first < 0 or not isinstance(output, torch.Tensor) or output.dim() < 2:
            return None
        return output.reshape(first, *output.shape[2:])

    return hook


class _Seen:
    def __init__(self):
        self.first_dims: Dict[str, int] = {}  # trainable parameter owner -> first dimension of its first input
        self.owner_outputs: Dict[str, torch.Tensor] = {}
        self.versions: Dict[str, int] = {}
        self.outputs: Dict[str, object] = {}  # every module -> its output (a tuple's first element)
        self.changed: List[str] = []
        self.keywords: Dict[str, List[str]] = {}  # parameter owners called with keyword arguments
        self.outside: List[str] = []  # trainable parameters read outside their module's call
        self.outside_params: List[Tuple[str, str, nn.Module]] = []  # the same as (module path, name, module)
        # the other outputs of replayed owners (keywords.guarded): (owner, guard); those the layer's output depends
        # on (joined to the owner's first output by the capture: refused if they cannot be)
        self.guards: List[Tuple[str, Guard]] = []
        self.used: List[Tuple[str, Guard]] = []
        self.unread: List[str] = []  # weights a module is marked to read (READS) that its output does not reach
        self.elsewhere: List[str] = []  # weights so marked that the layer's output reaches besides that module


def _run(layer, args, kwargs, rows, length, width, fixes: LayerFixes, cut: bool = False) -> _Seen:
    """One call of ``layer`` on zeros, recorded; with ``cut``, each module reading a child's weight (READS) has
    its outputs detached after checking that they reach the weights it reads (``seen.unread``), so that the
    layer's output reaching them still is a read by another module (``seen.elsewhere``)."""
    seen = _Seen()
    modules = dict(layer.named_modules())
    trainable = trainable_of(modules)
    # modules below a layer that holds every parameter below it (DBRX's bank holds its mlp, which it calls per
    # expert on that expert's rows) are part of that layer, as for the capture (find_layers): no owners here
    holders = [p + "." for p, m in modules.items() if p and holds_below(m)]
    handles = []
    for path, module in modules.items():
        inner = any(path.startswith(h) for h in holders)
        # what per-sample capture records (its rule read before the stand-ins, which may set requires_grad on
        # frozen tensors)
        if not inner and _reads_trainable(module, trainable):
            replays = rule_for(module).keywords
            handles.append(module.register_forward_hook(_record_owner(seen, path, replays), with_kwargs=True))
        handles.append(module.register_forward_hook(_record_output(seen, path)))
        if cut and read_children(module):
            handles.append(module.register_forward_hook(_cut_reader(seen, path, trainable)))
    hidden = torch.zeros(rows, length, *width, dtype=_dtype(layer), device=_device(args, kwargs))
    checkpointing = layer.__dict__.get("gradient_checkpointing")
    layer.gradient_checkpointing = False  # run once, no recomputation (outside these hooks)
    try:
        with torch.enable_grad(), standing_in([layer], hidden.device, real_too=True):
            with capturable(layer, fixes, rows, length):
                out = layer(hidden, *args, **kwargs)
            called = {id(modules[p]) for p in seen.first_dims}
            result = out[0] if isinstance(out, tuple) else out
            seen.outside_params = outside_calls(result, modules, called, trainable)
            seen.outside = [f"{p}.{n} (in a {type(m).__name__})" for p, n, m in seen.outside_params]
            if seen.guards and isinstance(result, torch.Tensor) and result.requires_grad:
                reaches = reached_from(result)
                seen.used = [(who, guard) for who, guard in seen.guards if reaches(guard.view)]
            if cut and isinstance(result, torch.Tensor) and result.requires_grad:
                reaches = reached_from(result)
                seen.elsewhere = [name for name, t in _read_weights(layer, trainable) if reaches(t)]
    finally:
        for handle in handles:
            handle.remove()
        if checkpointing is None:
            del layer.gradient_checkpointing
        else:
            layer.gradient_checkpointing = checkpointing
    seen.changed = [p for p, t in seen.owner_outputs.items() if t._version != seen.versions[p]]
    return seen


def _read_weights(module: nn.Module, trainable: set, prefix: str = "") -> List[Tuple[str, torch.Tensor]]:
    """The trainable tensors of the children that the modules in ``module`` read without calling them (READS),
    as they stand now (stand-ins during a run)."""
    found = []
    for path, reader in module.named_modules(prefix=prefix):
        for child in read_children(reader):
            for sub, m in reader.get_submodule(child).named_modules(prefix=f"{path}.{child}" if path else child):
                found += [(f"{sub}.{n}", t) for n, t in m._parameters.items() if (id(m), n) in trainable]
    return found


def _cut_reader(seen: _Seen, path: str, trainable: set):
    def hook(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        reaches = reached_from(first) if isinstance(first, torch.Tensor) and first.requires_grad else (lambda t: False)
        seen.unread += [name for name, t in _read_weights(module, trainable, path) if not reaches(t)]

        def cut(t):
            return t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

        return tuple(cut(t) for t in output) if isinstance(output, tuple) else cut(output)

    return hook


def _record_owner(seen: _Seen, path: str, replays: bool):
    def hook(module, args, kwargs, output):
        seen.first_dims.setdefault(path, 0)
        if kwargs:
            seen.keywords.setdefault(path, sorted(kwargs))
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is not None and first.dim():  # (the hidden states, passed by keyword to some attentions)
            seen.first_dims[path] = int(first.shape[0])
        passed = None
        if type(output) is tuple and output and replays:  # (the capture keeps its first output)
            passed, views = guarded(output)  # (as the capture passes them on)
            seen.guards += [(f"{path} ({type(module).__name__})", guard) for guard in views]
            output = output[0]
        if isinstance(output, torch.Tensor):
            seen.owner_outputs[path], seen.versions[path] = output, output._version
        return passed

    return hook


def _record_output(seen: _Seen, path: str):
    def hook(module, args, output):
        seen.outputs[path] = output[0] if isinstance(output, tuple) and output else output

    return hook


def _ancestors(path: str) -> List[str]:
    parts = path.split(".")
    return [".".join(parts[:k]) for k in range(len(parts) - 1, -1, -1)]


def _dtype(layer: nn.Module) -> torch.dtype:
    return next((p.dtype for p in layer.parameters() if p.is_floating_point()), torch.float32)


def _device(args, kwargs) -> torch.device:
    tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")
