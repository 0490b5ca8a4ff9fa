"""What a Hugging Face decoder is made of, found from its structure and one dry run of its own forward.

A ``*ForCausalLM`` / ``*LMHeadModel`` / ``*ForSequenceClassification`` is taken when its base model
holds one list of decoder layers (mixture-of-experts blocks checked by hf_experts.py), and its forward, run once with
every layer stubbed (hf_dry_run.py), computes the input embedding before the first layer and a final
norm and the head after the last. One layer of each class is then run alone (hf_capturable.py).
Anything the adapter cannot drive exactly is refused here, at construction, naming the model, the
part and the way out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch.nn as nn

from ..errors import UnsupportedModelError
from .hf_capturable import LayerFixes, find_fixes
from .hf_dry_run import WAY_OUT, dry_run, reads_token_ids
from .hf_experts import accept_experts, forget_replayed, refuse_experts

SUPPORTED_ATTENTION = ("eager", "sdpa")
KINDS = {"ForCausalLM": "causal", "LMHeadModel": "causal", "ForSequenceClassification": "classification"}


@dataclass
class Structure:
    model: nn.Module  # the *ForCausalLM / *ForSequenceClassification
    kind: str  # "causal" or "classification"
    base: nn.Module  # model.base_model: its forward is run up to and from the layers
    body: nn.Module  # the module holding the layer list (the base, or e.g. OPT's base.decoder)
    layers_name: str  # the layer list's attribute on the body
    layers_path: str  # ... and its path in the model ("model.layers")
    pre: Dict[str, nn.Module] = field(default_factory=dict)  # parts with parameters run before the layers
    post: Dict[str, nn.Module] = field(default_factory=dict)  # ... and after them (final norm, head)
    context: Dict[str, nn.Module] = field(default_factory=dict)  # parts with buffers only (rotary embeddings)
    tuple_output: bool = False  # the forward takes a layer's output as the first element of a tuple
    # the first positional arguments a layer takes from the previous one's output: the hidden state, and streams of
    # the layers' own after it (ZAYA's router states: 2), which cross stages with it
    streams: int = 1
    # the modules from the model down to the body: tensors they hold themselves (ZAYA's base model's embedding
    # scales, frozen) are stood in beside the parts' on meta
    holders: List[nn.Module] = field(default_factory=list)
    fixes: List[LayerFixes] = field(default_factory=list)  # per layer: what makes its calls capturable
    reads_ids: bool = False  # the layers' arguments depend on the token ids, not only on their shape

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.body, self.layers_name)

    def stand_in(self, args: tuple, hidden=None):
        """What a stood-in layer returns, called with ``args``: ``hidden`` (else its own hidden state) as the forward
        takes a layer's output, its streams passed on as it was given them."""
        hidden = args[0] if hidden is None else hidden
        if self.streams > 1:
            return (hidden, *args[1 : self.streams])
        return (hidden,) if self.tuple_output else hidden


def model_kind(model: nn.Module) -> Optional[str]:
    """The kind of head, from the name of the model's class or, for a user's subclass, of the transformers
    class it derives from."""
    family = next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.")), type(model))
    return next((kind for suffix, kind in KINDS.items() if family.__name__.endswith(suffix)), None)


def find_structure(model: nn.Module, kind: str) -> Structure:
    """The parts of ``model`` (of ``kind``: model_kind's), checked; UnsupportedModelError naming what is
    missing otherwise."""
    name = type(model).__name__
    config = model.config
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        raise UnsupportedModelError(
            f"{name}: attention implementation {impl!r} is not supported for pipelining (pipedp drives the model's "
            f"own forward for {list(SUPPORTED_ATTENTION)} only): load the model with attn_implementation='sdpa' "
            "or 'eager'"
        )
    base = _base_model(model)
    if base is model:
        refuse_experts(model, "this one has no base model under its head")
        raise UnsupportedModelError(f"{name} has no base model under its head: {WAY_OUT}")
    layers_path, body, layers_name = _layer_list(model, base)
    structure = Structure(model, kind, base, body, layers_name, layers_path, holders=_chain(model, body))
    _accept_routing(structure)
    parts = _parts(model, base, body, layers_name)
    _refuse_loose_parameters(structure, parts)
    sides, (structure.tuple_output, structure.streams), calls = dry_run(structure, parts)
    structure.fixes = _layer_fixes(structure, calls)
    owning = {p: m for p, m in parts.items() if next(m.parameters(), None) is not None}
    structure.pre = {p: m for p, m in owning.items() if "pre" in sides.get(p, ())}
    # parts the forward never calls (e.g. an unused projection) go with the head, so that every tensor has a stage
    structure.post = {p: m for p, m in owning.items() if p not in structure.pre}
    structure.context = {p: m for p, m in parts.items() if p not in owning and next(m.buffers(), None) is not None}
    structure.reads_ids = reads_token_ids(structure, parts)
    _require_parts(structure, sides)
    return structure


def _layer_list(model: nn.Module, base: nn.Module) -> Tuple[str, nn.Module, str]:
    count = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    found = [
        (path, m)
        for path, m in base.named_modules()
        if isinstance(m, nn.ModuleList)
        and len(m) > 0
        and (count is None or len(m) == count)
        and all(next(layer.parameters(), None) is not None for layer in m)
    ]
    if len(found) != 1:
        what = "no list" if not found else f"{len(found)} lists ({[p for p, _ in found]})"
        raise UnsupportedModelError(
            f"{type(model).__name__}: found {what} of {count} decoder layers in its base model "
            f"{type(base).__name__}, where pipedp needs exactly one: {WAY_OUT}"
        )
    path, _ = found[0]
    parent, _, attr = path.rpartition(".")
    body = base.get_submodule(parent) if parent else base
    prefix = _path_of(model, base)
    return f"{prefix}.{path}" if prefix else path, body, attr


def _path_of(model: nn.Module, target: nn.Module) -> str:
    return next(p for p, m in model.named_modules() if m is target)


def _parts(model: nn.Module, base: nn.Module, body: nn.Module, layers_name: str) -> Dict[str, nn.Module]:
    """The children of every module from the model down to the body, but the path itself and the
    layers (e.g. lm_head, model.embed_tokens, model.rotary_emb, model.norm), by path in the model."""
    chain = [m for m in _chain(model, body)]
    parts = {}
    for module in chain:
        prefix = _path_of(model, module)
        for name, child in module.named_children():
            if child in chain or (module is body and name == layers_name):
                continue
            parts[f"{prefix}.{name}" if prefix else name] = child
    return parts


def _chain(model: nn.Module, body: nn.Module) -> List[nn.Module]:
    path = _path_of(model, body)
    chain = [model]
    for name in path.split(".") if path else []:
        chain.append(getattr(chain[-1], name))
    return chain


def is_transformers_model(module: nn.Module) -> bool:
    """A transformers model, or a user's subclass of one (a family's class is in its method order)."""
    return any(cls.__module__.startswith("transformers.") for cls in type(module).__mro__)


def _base_model(model: nn.Module) -> nn.Module:
    """model.base_model, or where its base_model_prefix names no attribute (Llama-4's text model: prefix
    "language_model", base held as "model") the one child that is a transformers model."""
    base = getattr(model, "base_model", model)
    if base is model:
        found = [c for c in model.children() if is_transformers_model(c) and hasattr(c, "config")]
        base = found[0] if len(found) == 1 else model
    return base


def _accept_routing(s: Structure) -> None:
    forget_replayed(s.layers)  # (a class replayed per sample for another model is decided again for this one)
    for i, layer in enumerate(s.layers):
        accept_experts(s.model, f"{s.layers_path}.{i}", layer)


def _layer_fixes(s: Structure, calls: list) -> List[LayerFixes]:
    """One layer of each kind run on its own (hf_capturable.py): the same fixes for its kind (its class, its
    modules' classes and its trainable parameters: a decoder may hold dense and mixture-of-experts layers of one
    class, and layers frozen in part)."""
    found: Dict[tuple, LayerFixes] = {}
    # (and what it trains: a layer frozen in part reads, calls and flattens the same, but what needs fixing differs)
    kinds = [
        (
            type(layer),
            tuple(type(m) for m in layer.modules()),
            tuple(n for n, p in layer.named_parameters() if p.requires_grad),
        )
        for layer in s.layers
    ]
    for i, (layer, kind, (shape, args, kwargs)) in enumerate(zip(s.layers, kinds, calls)):
        if kind not in found:
            where = f"{type(s.model).__name__}: {s.layers_path}.{i}"
            found[kind] = find_fixes(where, layer, args, kwargs, shape[0], shape[1], tuple(shape[2:]))
            if found[kind] and getattr(layer, "gradient_checkpointing", False):
                raise UnsupportedModelError(
                    f"{where}: its calls are made capturable per sample by hooks around each call "
                    f"({found[kind]}), which activation checkpointing's recomputation would run without: "
                    "disable activation checkpointing for this model"
                )
    for layer, kind in zip(s.layers, kinds):
        found[kind].adopt(layer)  # (the first of its kind has them already)
    return [found[kind] for kind in kinds]


def _refuse_loose_parameters(s: Structure, parts: Dict[str, nn.Module]) -> None:
    """Every trainable parameter is in a part or a layer: one held by a module on the path to the layers itself
    (ZAYA's base model scales the embeddings with its own ``input_hidden_states_scale``), read by its forward outside
    any part, would be in no block, left untrained while the others train."""
    held = {id(p) for m in (*parts.values(), s.layers) for p in m.parameters()}
    loose = [n for n, p in s.model.named_parameters() if p.requires_grad and id(p) not in held]
    if loose:
        raise UnsupportedModelError(
            f"{type(s.model).__name__}: {', '.join(loose[:4])} (held by a module on the way to its decoder layers "
            "itself, read by that module's own forward outside the parts pipedp puts on stages: embeddings, layers, "
            f"norm, head) would not train; freeze it (requires_grad_(False)), or {WAY_OUT}"
        )


def _require_parts(s: Structure, sides: Dict[str, Set[str]]) -> None:
    embedding = s.model.get_input_embeddings()
    body = _path_of(s.model, s.body)
    missing = []
    if not any(any(embedding is c for c in m.modules()) for m in s.pre.values()):
        missing.append("input embedding run before the decoder layers")
    if not any(p.startswith(f"{body}.") and "post" in ran for p, ran in sides.items()):
        missing.append(f"final norm after the decoder layers (in {type(s.body).__name__})")
    if not any(not p.startswith(f"{body}.") and "post" in ran for p, ran in sides.items()):
        missing.append("head after the decoder layers")
    if missing:
        raise UnsupportedModelError(
            f"{type(s.model).__name__}: pipedp splits a decoder made of embeddings, a list of decoder layers, a final "
            f"norm and a head; it found no {', no '.join(missing)}: {WAY_OUT}"
        )
