"""One stage's weights, and only those: a model built on the meta device gets real memory for
the blocks of one stage, read from a weight source, so no rank ever holds the whole model.

A weight source is a safetensors file, a folder of safetensors shards (``model.safetensors``
or ``model.safetensors.index.json``: the weight map), or a mapping name -> tensor (e.g. a state
dict from ``torch.load(path, mmap=True)``, which reads lazily). Hugging Face models use the same
machinery through ``hf_loading.load_pipeline_stage``.

Tensors split across tensor-parallel ranks may be left on the meta device, each marked with where it is
stored (``later``), so that the split reads only each rank's slice (parallel/layers.py).
"""

from __future__ import annotations

import json
import os
from typing import Collection, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn

from ..config import Balance
from ..errors import CheckpointError, PartitionError
from .adapters import model_blocks
from .blocks import Block
from .partition import partition
from .safetensors_read import Stored, check_shape, leave_stored, read_into

WeightSource = Union[str, "os.PathLike[str]", Mapping[str, torch.Tensor]]


def weight_map(path: str) -> Dict[str, str]:
    """Tensor name -> the safetensors file holding it, for a file or a folder of shards."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return {k: path for k in _safetensors_keys(path)}
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return {k: single for k in _safetensors_keys(single)}
    raise FileNotFoundError(
        f"no safetensors weights at {path!r} (a .safetensors file, or a folder with model.safetensors or "
        "model.safetensors.index.json): save them with safetensors.torch.save_file or save_pretrained"
    )


def _safetensors_keys(path: str) -> List[str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return list(f.keys())


def _locate(
    source: WeightSource, names: List[str], twins: Optional[Dict[str, List[str]]]
) -> Dict[str, List[Tuple[str, str]]]:
    """{file ("" for a mapping): [(name, the name it is stored under)]}, refusing a name the source lacks."""
    twins = twins or {}
    stored_in: Dict[str, str] = (
        {k: "" for k in source} if isinstance(source, Mapping) else weight_map(os.fspath(source))
    )
    wanted: Dict[str, List[Tuple[str, str]]] = {}
    for name in names:
        stored = next((n for n in [name] + twins.get(name, []) if n in stored_in), None)
        if stored is None:
            raise CheckpointError(
                f"{name!r} is not in the weights at {_describe(source)}: they belong to another model or an "
                "incomplete save"
            )
        wanted.setdefault(stored_in[stored], []).append((name, stored))
    return wanted


def read_tensors(
    source: WeightSource, names: List[str], twins: Optional[Dict[str, List[str]]] = None
) -> Dict[str, torch.Tensor]:
    """Read only ``names`` from ``source`` (``twins``: the other names of a tied tensor, one of which a
    checkpoint may store instead)."""
    wanted = _locate(source, names, twins)
    if isinstance(source, Mapping):
        return {name: source[stored] for pairs in wanted.values() for name, stored in pairs}
    from safetensors import safe_open

    out = {}
    for path, pairs in wanted.items():
        with safe_open(path, framework="pt") as f:
            for name, stored in pairs:
                out[name] = f.get_tensor(stored)
    return out


def load_into(
    source: WeightSource, targets: Dict[str, torch.Tensor], twins: Optional[Dict[str, List[str]]] = None
) -> None:
    """Fill each allocated tensor of ``targets`` ({name: tensor}) with the stored tensor of its name. From
    safetensors files the bytes are read straight into the tensor's memory where dtype and layout allow
    (``safetensors_read.read_into``): loading holds the stage's tensors once, not once more in a copy."""
    wanted = _locate(source, list(targets), twins)
    with torch.no_grad():
        for path, pairs in wanted.items():
            if not isinstance(source, Mapping):
                read_into(path, [(targets[name], stored) for name, stored in pairs])
                continue
            for name, stored in pairs:  # a mapping: one tensor at a time
                value = source[stored]
                check_shape(stored, value.shape, targets[name].shape)
                targets[name].copy_(value)


def _describe(source: WeightSource) -> str:
    return "the given mapping" if isinstance(source, Mapping) else repr(os.fspath(source))


def materialize_stage(
    source: WeightSource,
    stage_blocks: List[Block],
    twins: Optional[Dict[str, List[str]]] = None,
    device="cpu",
    later: Collection[str] = (),
) -> None:
    """Give this stage's blocks real memory and load their tensors from ``source`` (this breaks
    every parameter sharing: ``load_stage`` restores it). The parameters named in ``later`` that ``source``
    stores as they are stay on the meta device, marked with where they lie (read slice by slice when split)."""
    for block in stage_blocks:
        own = {k: block.qualified(k) for k in block.module.state_dict().keys()}
        missing = _non_persistent_buffers(block.module)
        if missing:  # nothing on disk holds them, and on meta they have no value to keep
            raise CheckpointError(
                f"{', '.join(block.qualified(n) for n in missing[:4])}: buffers that are not saved with the weights "
                "(register_buffer(..., persistent=False)) and were built on the meta device have no value; make "
                "them persistent, compute them in forward, or build the model on the CPU"
            )
        held = _held_back(block, source, set(later), twins)
        for module, name, _p, _ in held:  # an empty slot while the rest gets memory (it keeps its place in order)
            module._parameters[name] = None
        block.module.to_empty(device=device)
        for module, name, p, stored in held:
            module._parameters[name] = p
            leave_stored(p, stored)
        allocated = block.module.state_dict(keep_vars=True)
        skipped = {id(p) for _, _, p, _ in held}
        load_into(source, {q: allocated[k] for k, q in own.items() if id(allocated[k]) not in skipped}, twins)
        for module in block.module.modules():  # Hugging Face: non-persistent buffers (rotary frequencies)
            if hasattr(module, "reset_buffers"):
                module.reset_buffers(device)


def _held_back(
    block: Block, source: WeightSource, later: set, twins: Optional[Dict[str, List[str]]]
) -> List[Tuple[nn.Module, str, nn.Parameter, Stored]]:
    """(module, attribute, parameter, where it is stored) of each parameter of ``block`` named in ``later``
    that ``source`` holds in a safetensors file under some name (a mapping's tensors are loaded whole)."""
    out = []
    for prefix, module in block.module.named_modules():
        for name, p in module._parameters.items():
            qualified = block.qualified(f"{prefix}.{name}" if prefix else name)
            if p is None or qualified not in later:
                continue
            stored = _stored(source, qualified, twins)
            if stored is not None:
                out.append((module, name, p, stored))
    return out


def _stored(source: WeightSource, name: str, twins: Optional[Dict[str, List[str]]]) -> Optional[Stored]:
    if isinstance(source, Mapping):
        where = getattr(source, "location", None)  # a mapping that reads safetensors files (hf_loading._Renamed)
        return where(name) if callable(where) else None
    ((path, pairs),) = _locate(source, [name], twins).items()
    return Stored(path, pairs[0][1])


def _non_persistent_buffers(module: nn.Module) -> List[str]:
    out = []
    for prefix, m in module.named_modules():
        if hasattr(m, "reset_buffers"):
            continue
        for name in getattr(m, "_non_persistent_buffers_set", ()):
            buffer = m._buffers.get(name)
            if buffer is not None and buffer.is_meta:
                out.append(f"{prefix}.{name}" if prefix else name)
    return out


def load_stage(
    model: nn.Module,
    weights: WeightSource,
    stages: int,
    stage: int,
    balance: Balance = "compute",
    device="cpu",
    untie_weights: bool = False,
    later: Collection[str] = (),
) -> nn.Module:
    """``model`` built on the meta device (``with torch.device("meta"): model = Net()``), with only
    ``stage``'s parameters given memory and loaded from ``weights``. Hand the result to
    PipelineDPTrainer with the same ``stages``, ``balance`` and ``untie_weights`` on the rank that
    runs that stage. Tied parameters stay tied: giving a module memory replaces its parameters, so
    every sharer is pointed back at the one real tensor afterwards (pipedp then trains an
    embedding tied to the head exactly across stages, and refuses any other sharing across stages).
    ``later``: parameters (qualified names) left on the meta device, to be read slice by slice by the
    tensor-parallel split (``materialize_stage``)."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in 0..{stages - 1}, got {stage}")
    if callable(balance):
        raise PartitionError(
            "a measured balance runs the blocks, and a model on the meta device has no values to run: pass "
            "balance='params', 'uniform' or the per-block costs as a list (e.g. measured once on a small copy)"
        )
    twins = _twin_names(model)  # before any untying: a tied checkpoint may store one name only
    blocks = model_blocks(model, untie_weights)
    shared = _sharing(model)  # the ties that remain
    stage_blocks = partition(blocks, stages, balance)
    materialize_stage(weights, stage_blocks[stage], twins, device, later)
    _write_back(model, stage_blocks[stage])
    _load_orphans(model, stage_blocks, weights, twins, device)
    for uses in shared:
        tensors = [getattr(module, name) for module, name in uses]
        real = next((t for t in tensors if not t.is_meta), tensors[0])  # on a middle stage: keep the meta one
        for module, name in uses:
            setattr(module, name, real)
    return model


def _write_back(model: nn.Module, blocks: List[Block]) -> None:
    """A block that holds a tensor of the model itself rather than one of its submodules (a traced piece
    reading a buffer of the root module) got its own copy when it was given memory: the model's own
    attribute is pointed at it, so the model (traced again by the trainer) sees the loaded value."""
    own = dict(model.state_dict(keep_vars=True))
    for block in blocks:
        for key, tensor in block.module.state_dict(keep_vars=True).items():
            name = block.qualified(key)
            if name in own and own[name].is_meta and not tensor.is_meta:
                _set_tensor(model, name, tensor)


def _load_orphans(
    model: nn.Module, stage_blocks: List[List[Block]], source: WeightSource, twins: Dict[str, List[str]], device
) -> None:
    """Tensors of the model that no block holds (a layer defined but never called): loaded on every
    stage, so that state_dict() and checkpoints are whole."""
    held = {b.qualified(k) for blocks in stage_blocks for b in blocks for k in b.module.state_dict()}
    orphans = [n for n, t in model.state_dict(keep_vars=True).items() if n not in held and t.is_meta]
    if orphans:
        for name, value in read_tensors(source, orphans, twins).items():
            _set_tensor(model, name, value.to(device))


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace the model's parameter or buffer ``name`` by ``value`` (a parameter stays a parameter)."""
    path, _, leaf = name.rpartition(".")
    module = model.get_submodule(path) if path else model
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = (
            value
            if isinstance(value, nn.Parameter)
            else nn.Parameter(value, requires_grad=old.requires_grad if old is not None else True)
        )
    else:
        module._buffers[leaf] = value


def _twin_names(model: nn.Module) -> Dict[str, List[str]]:
    """Each name of a tensor the model holds under several names -> its other names."""
    names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n: [m for m in group if m != n] for group in names.values() if len(group) > 1 for n in group}


def _sharing(model: nn.Module) -> List[List[Tuple[nn.Module, str]]]:
    """(module, attribute) of every use of each parameter that several modules hold."""
    uses: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                uses.setdefault(id(p), []).append((module, name))
    return [u for u in uses.values() if len(u) > 1]


def resident_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters that have real memory (meta parameters count 0)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen and not p.is_meta:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
