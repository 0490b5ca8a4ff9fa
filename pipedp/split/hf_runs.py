"""Running a Hugging Face model's own forward with its decoder layers stood in for: the one mechanism
behind every block of the Hugging Face adapter (hf_blocks.py).

Before its first decoder layer the model's forward computes the embeddings (with the family's own
scaling, position embeddings, dropout), the position ids, the attention mask of every layer type
(transformers' own mask functions for the model's config and attention implementation, alibi where
the family uses it) and the rotary embeddings; after its last layer, the final norm, the head and
the family's output transforms (logit scaling, soft-capping, a classifier's pooling). Rather than
re-implement any of it, the adapter runs that forward with the layer list swapped for stubs, which
record what the forward gives each layer and return or stop as the run needs.

Two helpers keep those runs compatible with per-sample capture (runtime/capture.py):
- ``standing_in``: a part a run computes only to throw away (the embeddings, on a stage that does not
  own them) may be on the meta device (a model loaded stage by stage): its tensors are replaced by
  zeros that take no memory (stride 0) for the run;
- ``positional_calls``: a part called with keyword arguments or with a batch-shared tensor (GPT-2's
  position table reads ids of shape [1, T]) is called instead with its leading tensor arguments,
  expanded to the micro-batch, after checking that this gives exactly the model's own output.
"""

from __future__ import annotations

import contextlib
import inspect
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import UnsupportedModelError
from ..privacy.rules.registry import CONTAINERS, holds_below, read_children

LayerCall = Tuple[tuple, dict]  # what the forward gives a layer besides the hidden state: (args, kwargs)


class Stop(Exception):
    """Ends a run at a decoder layer (or at a router, split/hf_experts.py), carrying a value out of the
    model's forward."""

    def __init__(self, value=None):
        super().__init__("run stopped at a decoder layer")
        self.value = value


@contextmanager
def modes_kept(*modules: nn.Module) -> Iterator[None]:
    """Each of the modules, and every module below them, back in its own training mode after."""
    modes = [(m, m.training) for top in modules for m in top.modules()]
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


class LayerStub(nn.Module):
    """Stands in for decoder layer ``index`` during a run; attributes the forward reads from its
    layers (``attention_type``, ``self_attn`` ...) are the real layer's."""

    def __init__(self, index: int, layer: nn.Module, on_call: Callable):
        super().__init__()
        self.__dict__["_layer"], self.__dict__["_index"], self.__dict__["_on_call"] = layer, index, on_call

    def __getattr__(self, name):
        return getattr(self.__dict__["_layer"], name)

    def forward(self, *args, **kwargs):
        return self.__dict__["_on_call"](self.__dict__["_index"], args, kwargs)


@contextmanager
def layers_replaced(body: nn.Module, name: str, on_call: Callable) -> Iterator[None]:
    """``body.<name>`` (the decoder layer list) swapped for stubs calling ``on_call(i, args, kwargs)``."""
    real = body._modules[name]
    body._modules[name] = nn.ModuleList(LayerStub(i, layer, on_call) for i, layer in enumerate(real))
    try:
        yield
    finally:
        body._modules[name] = real


@contextmanager
def standing_in(
    parts: Sequence[nn.Module], device, real_too: bool = False, own: Sequence[nn.Module] = ()
) -> Iterator[None]:
    """Every meta tensor (``real_too``: every tensor) of ``parts``, and those the modules ``own`` hold themselves
    (not their children's: the modules on the way to the layers, ZAYA's base model with its embedding scales),
    replaced by zeros of its shape and dtype on ``device`` that take no memory, for a run that discards what these
    parts compute. With
    ``real_too`` (the dry run) the parameters' zeros require gradients, so that what is computed from
    a parameter can be told apart whether the model is real or on meta."""
    swapped: List[Tuple[nn.Module, dict, str, torch.Tensor]] = []
    stand_ins: set = set()
    try:
        for module in [m for part in parts for m in part.modules()] + list(own):
            for table in (module._parameters, module._buffers):
                for key, tensor in table.items():
                    if tensor is None or not (real_too or tensor.is_meta):
                        continue
                    grad = real_too and table is module._parameters and tensor.is_floating_point()
                    zero = torch.zeros((), dtype=tensor.dtype, device=device, requires_grad=grad)
                    swapped.append((module, table, key, tensor))
                    table[key] = zero.expand(tensor.shape)
                    stand_ins.add(id(table[key]))
        with _ZeroProducts(stand_ins) if stand_ins else contextlib.nullcontext(), _eager_experts(parts):
            yield
    finally:
        for module, table, key, tensor in reversed(swapped):
            table[key] = tensor
            # a forward that parametrized a stood-in parameter for its call (PEFT's LoRA on the experts' weights)
            # put it back as a buffer, not being an nn.Parameter: the stand-in goes with the run
            if table is module._parameters and id(module._buffers.get(key)) in stand_ins:
                del module._buffers[key]


@contextmanager
def _eager_experts(parts: Sequence[nn.Module]) -> Iterator[None]:
    """Expert banks run transformers' eager loop: its grouped and batched products take no stride-0 weight."""
    configs = {id(c): c for p in parts for m in p.modules() if (c := getattr(m, "config", None)) is not None}
    changed = [(c, c._experts_implementation) for c in configs.values() if _implementation(c) not in (None, "eager")]
    try:
        for config, _ in changed:
            config._experts_implementation = "eager"
        yield
    finally:
        for config, before in changed:
            config._experts_implementation = before


def _implementation(config) -> Optional[str]:
    return getattr(config, "_experts_implementation", None) if hasattr(config, "to_dict") else None


class _ZeroProducts(TorchFunctionMode):
    """``F.linear`` with a stood-in weight, computed without the weight: a matrix product first copies a
    stride-0 weight into a full one (a 32000 x 4096 head: 250 MiB for a run on 2 x 3 tokens). The
    product with a zero matrix is each row's ``sum(x * 0)`` (0, or NaN where x is not finite, as the
    product), taken through the weight's own view so that the graph still reaches it."""

    def __init__(self, stand_ins: set):
        super().__init__()
        self.stand_ins = stand_ins

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and id(args[1]) in self.stand_ins:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            device = x.device.type  # the dtype the product would have: autocast's, or the promoted one
            autocast = torch.is_autocast_enabled(device)
            dtype = torch.get_autocast_dtype(device) if autocast else torch.promote_types(x.dtype, weight.dtype)
            zero = weight[(0,) * weight.dim()]  # a view: the graph goes through the stood-in weight
            out = (x.to(dtype) * zero.to(dtype)).sum(-1, keepdim=True).expand(*x.shape[:-1], weight.shape[0])
            out = out.contiguous()
            return out if bias is None else out + bias.to(dtype)
        return func(*args, **kwargs)


@contextmanager
def positional_calls(parts: Dict[str, nn.Module], rows: int) -> Iterator[None]:
    """While the forward runs, every call of a module owning parameters in ``parts`` (path -> module)
    is made positionally with batch-first tensors, as per-sample capture needs (see _positional)."""
    handles = []
    for path, part in parts.items():
        for name, module in part.named_modules():
            if owns_parameters(module):
                where = f"{path}.{name}" if name else path
                hook = _positional_hook(where, rows)
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _positional_hook(where: str, rows: int):
    def hook(module, args, kwargs):
        if not torch.is_grad_enabled():  # nothing is captured
            return None
        return positional(where, module, args, kwargs, rows)

    return hook


def positional(where: str, module: nn.Module, args: tuple, kwargs: dict, rows: int, weights=None):
    """None when the call already is positional and batch-first; else (leading tensors, {}) — each
    tensor with one row expanded to ``rows`` — once checked to give exactly the model's own output
    (e.g. OPT's position embedding, called with the mask and the position ids it computes from it).
    ``weights``: a function giving other values for the module's own parameters to check with (the
    dry run's), called only for a call that needs the check."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    lead = []
    for value in bound.values():  # in the order of the forward's parameters
        if not isinstance(value, torch.Tensor):
            break
        shared = rows > 1 and value.dim() and value.shape[0] == 1  # one row for the whole batch
        lead.append(value.expand(rows, *value.shape[1:]) if shared else value)
    if not kwargs and len(lead) == len(args) and all(a is b for a, b in zip(lead, args)):
        return None
    if lead and all(t.dim() and t.shape[0] == rows for t in lead):
        with torch.no_grad(), _parameters_set(module, weights() if weights else {}):
            want, got = module.forward(*args, **kwargs), module.forward(*lead)
        if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and _broadcast_equal(got, want):
            return tuple(lead), {}
    raise UnsupportedModelError(
        f"{where} ({type(module).__name__}) is called by the model's forward in a way per-sample gradients cannot "
        f"replay (arguments {list(bound)}), and called with its leading tensor arguments alone it gives another "
        "output: give the model a pipeline_blocks() method, or freeze this module"
    )


@contextmanager
def _parameters_set(module: nn.Module, values: Dict[str, torch.Tensor]) -> Iterator[None]:
    old = {k: module._parameters[k] for k in values}
    module._parameters.update(values)
    try:
        yield
    finally:
        module._parameters.update(old)


def _broadcast_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    try:
        return got.shape == torch.broadcast_shapes(got.shape, want.shape) and torch.equal(got, want.expand_as(got))
    except RuntimeError:
        return False


def call_forward(module: nn.Module, inputs: Dict[str, torch.Tensor]):
    """``module(**inputs)`` with no key/value cache: the layers run one call at a time, and a cache
    would carry one call's keys and values into the next."""
    extra = {"use_cache": False} if "use_cache" in inspect.signature(module.forward).parameters else {}
    return module(**inputs, **extra)


def owns_parameters(module: nn.Module) -> bool:
    """A module the blocks call as one layer: parameters of its own, or parameter containers it reads
    itself (PEFT's LoRA on an embedding, IA3; privacy.rules.layer_parameters), or a layer holding every
    parameter below it (PEFT's LoRA on an expert bank; privacy.rules.holds_below)."""
    if next(module.parameters(recurse=False), None) is not None or holds_below(module):
        return True
    return any(isinstance(c, CONTAINERS) and next(c.parameters(), None) is not None for c in module.children())


def trainable_of(modules: Dict[str, nn.Module]) -> set:
    """(module id, parameter name) of every trainable parameter (taken before standing_in replaces them)."""
    return {(id(m), n) for m in modules.values() for n, p in m._parameters.items() if p is not None and p.requires_grad}


def read_outside_calls(output, modules: Dict[str, nn.Module], called: set, trainable: set) -> List[str]:
    """The trainable parameters of ``modules`` (path -> module) that ``output`` depends on although
    their module never ran (``called``: ids of the modules that did): read functionally, e.g.
    ``F.conv1d(x, self.conv.weight)``, where per-sample capture cannot see them."""
    found = outside_calls(output, modules, called, trainable)
    return [f"{f'{p}.{n}' if p else n} (in a {type(m).__name__})" for p, n, m in found]


def outside_calls(
    output, modules: Dict[str, nn.Module], called: set, trainable: set
) -> List[Tuple[str, str, nn.Module]]:
    """read_outside_calls' parameters as (their module's path, their name, their module)."""
    owners = [(p, n, m) for p, m in modules.items() for n, t in m._parameters.items() if (id(m), n) in trainable]
    if not owners or not isinstance(output, torch.Tensor) or not output.requires_grad:
        return []
    reaches = reached_from(output)  # the graph walked, not differentiated: no parameter-sized gradient

    def reader(path: str, module: nn.Module) -> nn.Module:
        """The layer whose call is captured (privacy.rules.layer_parameters): a parameter container is read
        by the module holding it (PEFT's LoRA on an embedding, IA3), and every module below a layer that
        holds them all is read by that layer (PEFT's LoRA on an expert bank)."""
        parts = path.split(".") if path else []
        for k in range(len(parts)):  # the outermost holder first
            above = modules.get(".".join(parts[:k]))
            if above is not None and holds_below(above):
                return above
            below = ".".join(parts[k:])
            if above is not None and any(below == c or below.startswith(c + ".") for c in read_children(above)):
                return above  # (a child read without being called by the module above it: READS)
        if isinstance(module, CONTAINERS):
            return modules.get(path.rpartition(".")[0], module)
        return module

    return [(p, n, m) for p, n, m in owners if reaches(m._parameters[n]) and id(reader(p, m)) not in called]


def reached_from(output: torch.Tensor) -> Callable[[torch.Tensor], bool]:
    """Whether ``output``'s autograd graph reaches a tensor (a leaf, or a view such as a stood-in weight):
    where torch.autograd.grad with allow_unused=True would give a gradient (not None), found without
    computing any."""
    seen, stack, leaves = set(), [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: its leaf
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return lambda t: t.grad_fn in seen if t.grad_fn is not None else id(t) in leaves


def rng_kept(device: torch.device):
    """The global random state (CPU and ``device``) restored after a run whose results are thrown away: the
    probe runs inside a layer block, before the layer, only when the record misses, and its embeddings draw
    dropout masks. Activation checkpointing's recomputation restores the random state the block's forward
    started from but finds the record: had the probe moved the state, the layer would draw other masks."""
    accelerator = device.type not in ("cpu", "meta")
    return torch.random.fork_rng(devices=[device] if accelerator else [], device_type=device.type)


def reseeded(device: torch.device) -> None:
    """Another state for the random generators a forward on ``device`` draws from (restored by rng_kept)."""
    torch.default_generator.manual_seed(torch.default_generator.initial_seed() + 1)
    if device.type == "cuda":
        generator = torch.cuda.default_generators[device.index if device.index is not None else 0]
        generator.manual_seed(generator.initial_seed() + 1)
