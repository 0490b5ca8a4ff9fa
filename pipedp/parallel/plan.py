"""Which layers of a model are split across a stage's tensor-parallel ranks, checked at construction; the split.

For a Hugging Face decoder the plan is transformers' own (``config.base_model_tp_plan``: q/k/v and gate/up
column-parallel, o and down row-parallel), the input embedding vocabulary-parallel and the head
column-parallel: its logits gathered for the user's own loss (which then sees every logit), or left split for
pipedp's token loss on vocabulary slices (loss.py). Every other
parameter is held whole by each rank of the stage (norms, a row-parallel layer's bias) and counted once.
A PEFT LoRA on a split projection is split with it: on a column-parallel layer its B is column-parallel (A, which
reads the whole input, held whole); on a row-parallel layer its A is row-parallel (B, which reads the summed
product, held whole). What pipedp cannot split exactly is refused here, by name: head counts or widths T does not
divide, a plan style it does not implement (sequence parallelism, packed projections), dropout, other PEFT adapters
on a split layer, LoRA variants (DoRA), Hugging Face models without a plan.
An embedding tied to the head is cut once, along the vocabulary, the same rows on both.
Any other model (traced, nn.Sequential, pipeline_blocks()) is placed by a pass over its blocks' fx graphs
(traced_plan.py).
"""

from __future__ import annotations

import re
from typing import Any, Dict, Sequence

import torch.nn as nn

from ..errors import UnsupportedModelError
from ..privacy.rules import layer_parameters, rule_for
from ..shards import Shard, TensorParallelPart
from ..split.blocks import Block
from ..split.hf_structure import is_transformers_model
from . import rules  # noqa: F401  (registers the parallel layers' rules)
from .layers import ColumnParallelLinear, GatheredColumnLinear, Group, RowParallelLinear, VocabParallelEmbedding
from .traced_plan import WAY_OUT, dropout_modules, refuse_dropout, traced_plan

COLUMN, ROW = "colwise", "rowwise"  # transformers' names of the two styles pipedp implements
HEAD, VOCAB = "pipedp:head", "pipedp:vocab"  # pipedp's own: the head and the input embedding
WHOLE = "pipedp:whole"  # a LoRA factor beside a split one, held whole by every rank (it reads whole activations)


def tensor_parallel_plan(
    model: nn.Module, blocks: Sequence[Block], size: int, gather_logits: bool = True
) -> Dict[str, str]:
    """{qualified module name: COLUMN / ROW / HEAD / VOCAB} over every block, refused where not exact.

    Transformers' plan names modules relative to the base model ("layers.*.self_attn.q_proj"): a pattern matches
    the end of a qualified name, ``*`` one layer index. ``gather_logits=False``: the head stays column-parallel, for
    a loss on vocabulary-split logits (loss.py)."""
    if size == 1:
        return {}
    if not _from_transformers(model):  # the pass over its blocks' graphs
        return traced_plan(model, blocks, size, {"column": COLUMN, "row": ROW, "vocab": VOCAB})
    _patterns(model, size)
    _refuse_model(model, size)
    plan = _layer_plan(model, blocks, size, gather_logits)
    _refuse_whole_beside_split(blocks, plan, size)
    return plan


def sliced_parameters(model: nn.Module, blocks: Sequence[Block], size: int) -> Dict[str, int]:
    """{qualified name: the dimension it is cut along} of every parameter ``split_stage`` slices, from the layers'
    plan alone (what the loader reads slice by slice; the model-wide refusals wait for the trainer, since the
    caller may still change the model: its dropout, what it trains)."""
    plan = _layer_plan(model, blocks, size)
    out: Dict[str, int] = {}
    for b in blocks:
        for name, module in b.module.named_modules():
            style = plan.get(b.qualified(name) if name else b.name)
            if style is None:
                continue
            for n, p in module.named_parameters():
                dim = _cut(style, n, p)
                if dim is not None:
                    out[b.qualified(f"{name}.{n}" if name else n)] = dim
    return out


def _from_transformers(model: nn.Module) -> bool:
    """A transformers model (a subclass of one too), or one that PEFT wraps: split by transformers' plan."""
    if type(model).__module__.startswith("peft."):
        model = getattr(getattr(model, "base_model", None), "model", model)
    return is_transformers_model(model)


def _patterns(model: nn.Module, size: int) -> Dict[str, str]:
    config = getattr(model, "config", None)
    patterns = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not patterns or not hasattr(model, "get_input_embeddings"):
        raise UnsupportedModelError(
            f"tensor_parallel={size}: {type(model).__name__} is a Hugging Face model whose config carries no "
            f"tensor-parallel plan (base_model_tp_plan), which pipedp splits Hugging Face models by; {WAY_OUT}"
        )
    return patterns


def _layer_plan(model: nn.Module, blocks: Sequence[Block], size: int, gather_logits: bool = True) -> Dict[str, str]:
    compiled = [(_regex(p), style) for p, style in _patterns(model, size).items()]
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    plan: Dict[str, str] = {}
    for b in blocks:
        for name, module in b.module.named_modules():
            qualified = b.qualified(name) if name else b.name
            style = next((s for r, s in compiled if r.search(qualified)), None)
            if module is embedding and type(module) is nn.Embedding:
                style = VOCAB
            elif module is head and type(module) is nn.Linear:
                style = HEAD if gather_logits else COLUMN
            if style is None or qualified in plan:
                continue
            if _is_lora(module):
                plan.update(_lora_plan(qualified, module, style, size))
            else:
                plan[qualified] = _checked(qualified, module, style, size)
    return plan


def _is_lora(module: nn.Module) -> bool:
    """A PEFT LoRA layer: its ``base_layer`` and, per adapter, the Linears ``lora_A`` and ``lora_B``."""
    return type(module).__module__.startswith("peft.tuners.lora") and isinstance(
        getattr(module, "lora_A", None), nn.ModuleDict
    )


def _lora_plan(name: str, layer: nn.Module, style: str, size: int) -> Dict[str, str]:
    """A LoRA layer on a projection planned ``style``: its base split so; per adapter, the factor on the split
    side split so too (B's output rows under a column-parallel base, whose output slice it adds to; A's input
    columns under a row-parallel one, whose input slice it reads: its product then summed over the ranks like the
    base's) and the other factor held whole, its gradient then the whole one on every rank."""
    variants = sorted(getattr(layer, "lora_variant", None) or {})
    if style not in (COLUMN, ROW) or variants or getattr(layer, "lora_embedding_A", None):
        what = (
            f"a LoRA variant ({variants[0]!r} adapter)"
            if variants
            else f"a LoRA on {'a parameter (an expert bank)' if hasattr(layer, 'parameter_name') else 'a head or an embedding'}"
        )
        raise UnsupportedModelError(
            f"tensor_parallel={size}: layer {name!r} carries {what}, which pipedp does not split across ranks (it "
            f"splits plain LoRA on the attention and MLP projections); leave this layer out of the LoRA targets, "
            f"or {WAY_OUT}"
        )
    plan = {f"{name}.base_layer": _checked(f"{name}.base_layer", layer.base_layer, style, size)}
    for adapter in layer.lora_A:
        a, b = f"{name}.lora_A.{adapter}", f"{name}.lora_B.{adapter}"
        split, whole = (b, a) if style == COLUMN else (a, b)
        plan[split] = _checked(split, _lora_factor(layer, split), style, size)
        plan[whole] = _checked(whole, _lora_factor(layer, whole), WHOLE, size)
    return plan


def _lora_factor(layer: nn.Module, name: str) -> nn.Module:
    factors, adapter = name.rsplit(".", 2)[-2:]
    return getattr(layer, factors)[adapter]


# a PEFT LoRA layer's parts, named under the layer the model's plan names
_LORA_PART = re.compile(r"\.(?:base_layer|lora_[AB]\.[^.]+)$")


def _refuse_whole_beside_split(blocks: Sequence[Block], plan: Dict[str, str], size: int) -> None:
    """A parameter held whole next to split layers (under the module that holds them: the attention, the MLP)
    may read a rank's own heads or features (Phi's q_layernorm, Cohere's q_norm): each rank would then hold only
    its part of its gradient, and counting it once would drop the rest. Refused; the norms and biases outside those
    modules read the whole activations."""
    layers = {_LORA_PART.sub("", name) for name, style in plan.items() if style in (COLUMN, ROW)}
    parents = {name.rsplit(".", 1)[0] for name in layers if "." in name}
    for b in blocks:
        for name, module in b.module.named_modules():
            qualified = b.qualified(name) if name else b.name
            own = [n for n, _ in layer_parameters(module)]
            split = next((m for m in layers if m.startswith(qualified + ".")), None)
            if own and split is not None and rule_for(module).keywords:
                raise UnsupportedModelError(
                    f"tensor_parallel={size}: layer {qualified!r} owns {own} itself, so its per-sample gradients "
                    f"replay it whole, and it holds {split!r}, which is split across the ranks (its replay would "
                    f"need the other ranks' parts); freeze {own} or {WAY_OUT}"
                )
        for name, p in b.module.named_parameters():
            qualified = b.qualified(name)
            owner = qualified.rsplit(".", 1)[0]
            inside = next((m for m in parents if qualified.startswith(m + ".")), None)
            if inside is not None and p.requires_grad and owner not in plan:
                raise UnsupportedModelError(
                    f"tensor_parallel={size}: parameter {qualified!r} is held whole by every rank but lives in "
                    f"{inside!r}, whose projections are split, so it may read only a rank's own heads or features "
                    f"(its gradient would be each rank's part); freeze it ({qualified}.requires_grad_(False)) or "
                    f"{WAY_OUT}"
                )


def _regex(pattern: str) -> "re.Pattern[str]":
    return re.compile(r"(?:^|\.)" + re.escape(pattern).replace(r"\*", r"\d+") + "$")


def _refuse_model(model: nn.Module, size: int) -> None:
    config = model.config
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % size:
            raise UnsupportedModelError(
                f"tensor_parallel={size} does not divide {type(config).__name__}.{field}={heads}: each rank computes "
                f"whole attention heads; choose a tensor_parallel that divides it"
            )
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and getattr(head, "weight", None) is getattr(embedding, "weight", False)
    if tied and type(embedding) is not nn.Embedding:
        raise UnsupportedModelError(
            f"tensor_parallel={size}: the head is tied to a {type(embedding).__name__}, which pipedp does not split "
            "per vocabulary slice (only a plain nn.Embedding): give the head its own copy (untie_weights=True)"
        )
    rates = [k for k in vars(config) if "dropout" in k or k.endswith("pdrop")]  # functional dropout reads these
    dropping = dropout_modules(model)
    dropping += [f"config.{f}" for f in rates if _positive(getattr(config, f, 0.0)) and model.training]
    if dropping:
        refuse_dropout(dropping[0], size)


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _checked(name: str, module: nn.Module, style: str, size: int) -> str:
    kinds = {COLUMN: nn.Linear, ROW: nn.Linear, HEAD: nn.Linear, VOCAB: nn.Embedding, WHOLE: nn.Linear}
    if style not in kinds:
        raise UnsupportedModelError(
            f"tensor_parallel={size}: layer {name!r} is planned {style!r} by transformers, a split pipedp does not "
            f"implement (it takes colwise and rowwise Linear layers); {WAY_OUT}"
        )
    if type(module) is not kinds[style]:
        raise UnsupportedModelError(
            f"tensor_parallel={size}: layer {name!r} is a {type(module).__module__}.{type(module).__qualname__}, not a "
            f"plain torch {kinds[style].__name__} (a quantised layer, or a PEFT adapter other than LoRA?), so pipedp "
            f"cannot split it; {WAY_OUT}"
        )
    if style == WHOLE:
        return style
    width = {COLUMN: "out_features", HEAD: "out_features", ROW: "in_features", VOCAB: "num_embeddings"}[style]
    value = getattr(module, width)
    if value % size:
        raise UnsupportedModelError(
            f"tensor_parallel={size} does not divide layer {name!r}'s {width}={value}; choose a tensor_parallel "
            "that divides it"
        )
    if style == VOCAB and module.max_norm is not None:
        raise UnsupportedModelError(
            f"layer {name!r}: an embedding with max_norm renormalises its rows in place; {WAY_OUT}"
        )
    return style


_BUILD: Dict[str, Any] = {
    COLUMN: ColumnParallelLinear,
    ROW: RowParallelLinear,
    HEAD: GatheredColumnLinear,
    VOCAB: VocabParallelEmbedding,
}
_DIM = {COLUMN: 0, HEAD: 0, ROW: 1, VOCAB: 0}
_BUILT = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def split_stage(blocks: Sequence[Block], plan: Dict[str, str], group: Group) -> TensorParallelPart:
    """This rank's slice of every planned layer of one stage's blocks, cut in place (layers.py)."""
    part = TensorParallelPart(group.rank, group.size)
    for b in blocks:
        for name, module in b.module.named_modules():
            style = plan.get(b.qualified(name) if name else b.name)
            if style is None or style == WHOLE or isinstance(module, _BUILT):
                continue
            layer = _BUILD[style].split(module, group)
            for n, p in layer.named_parameters():
                dim = _cut(style, n, p)
                if dim is not None:  # (a weight tied to another layer's, cut by either, is this rank's slice)
                    whole = tuple(s * group.size if d == dim else s for d, s in enumerate(p.shape))
                    part.shards[id(p)] = Shard.even(whole, dim, group.rank, group.size)
    return part


def _cut(style: str, name: str, p: nn.Parameter) -> "int | None":
    """The dimension a layer of ``style`` cuts its parameter ``name`` along; None: held whole (a row-parallel
    layer's bias, added once after the sum)."""
    dim = _DIM.get(style)
    return dim if dim is not None and p.dim() > dim and not (style == ROW and name == "bias") else None
