"""Which layers of a model are split across a stage's tensor-parallel ranks, checked at construction; the split.

For a Hugging Face decoder the plan is transformers' own (``config.base_model_tp_plan``: q/k/v and gate/up
column-parallel, o and down row-parallel), the input embedding vocabulary-parallel and the head
column-parallel: its logits gathered for the user's own loss (which then sees every logit), or left split for
pipedp's token loss on vocabulary slices (loss.py). Every other
parameter is held whole by each rank of the stage (norms, a row-parallel layer's bias) and counted once.
What pipedp cannot split exactly is refused here, by name: head counts or widths T does not divide, a plan style
it does not implement (sequence parallelism, packed projections), dropout, PEFT adapters, models without a plan.
An embedding tied to the head is cut once, along the vocabulary, the same rows on both.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Sequence

import torch.nn as nn

from ..errors import UnsupportedModelError
from ..shards import Shard, TensorParallelPart
from ..split.blocks import Block
from . import rules  # noqa: F401  (registers the parallel layers' rules)
from .layers import ColumnParallelLinear, GatheredColumnLinear, Group, RowParallelLinear, VocabParallelEmbedding

COLUMN, ROW = "colwise", "rowwise"  # transformers' names of the two styles pipedp implements
HEAD, VOCAB = "pipedp:head", "pipedp:vocab"  # pipedp's own: the head and the input embedding
_WAY_OUT = "use tensor_parallel=1 (pipeline stages and replicas only)"


def tensor_parallel_plan(
    model: nn.Module, blocks: Sequence[Block], size: int, gather_logits: bool = True
) -> Dict[str, str]:
    """{qualified module name: COLUMN / ROW / HEAD / VOCAB} over every block, refused where not exact.

    Transformers' plan names modules relative to the base model ("layers.*.self_attn.q_proj"): a pattern matches
    the end of a qualified name, ``*`` one layer index. ``gather_logits=False``: the head stays column-parallel, for
    a loss on vocabulary-split logits (loss.py)."""
    if size == 1:
        return {}
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


def _patterns(model: nn.Module, size: int) -> Dict[str, str]:
    config = getattr(model, "config", None)
    patterns = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not patterns or not hasattr(model, "get_input_embeddings"):
        raise UnsupportedModelError(
            f"tensor_parallel={size}: {type(model).__name__} is not a Hugging Face decoder whose config carries "
            f"transformers' tensor-parallel plan (base_model_tp_plan), the only models pipedp splits across ranks; "
            f"{_WAY_OUT}"
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
            plan[qualified] = _checked(qualified, module, style, size)
    return plan


def _refuse_whole_beside_split(blocks: Sequence[Block], plan: Dict[str, str], size: int) -> None:
    """A parameter held whole next to split layers (under the module that holds them: the attention, the MLP)
    may read a rank's own heads or features (Phi's q_layernorm, Cohere's q_norm): each rank would then hold only
    its part of its gradient, and counting it once would drop the rest. Refused; the norms and biases outside those
    modules read the whole activations."""
    parents = {name.rsplit(".", 1)[0] for name, style in plan.items() if style in (COLUMN, ROW) and "." in name}
    for b in blocks:
        for name, p in b.module.named_parameters():
            qualified = b.qualified(name)
            owner = qualified.rsplit(".", 1)[0]
            inside = next((m for m in parents if qualified.startswith(m + ".")), None)
            if inside is not None and p.requires_grad and owner not in plan:
                raise UnsupportedModelError(
                    f"tensor_parallel={size}: parameter {qualified!r} is held whole by every rank but lives in "
                    f"{inside!r}, whose projections are split, so it may read only a rank's own heads or features "
                    f"(its gradient would be each rank's part); freeze it ({qualified}.requires_grad_(False)) or "
                    f"{_WAY_OUT}"
                )


def _regex(pattern: str) -> "re.Pattern[str]":
    return re.compile(r"(?:^|\.)" + re.escape(pattern).replace(r"\*", r"\d+") + "$")


def _refuse_model(model: nn.Module, size: int) -> None:
    config = model.config
    if type(model).__module__.startswith("peft.") or getattr(model, "peft_config", None):
        raise UnsupportedModelError(
            f"tensor_parallel={size} with PEFT adapters: a LoRA on a split layer needs its own split (not built "
            f"yet); {_WAY_OUT}, or train the whole model"
        )
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
    dropping = [n for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0 and m.training]
    rates = [k for k in vars(config) if "dropout" in k or k.endswith("pdrop")]  # functional dropout reads these
    dropping += [f"config.{f}" for f in rates if _positive(getattr(config, f, 0.0)) and model.training]
    if dropping:
        raise UnsupportedModelError(
            f"tensor_parallel={size} with dropout ({dropping[0]}): each rank would draw its own masks, so the "
            "activations every rank holds whole would differ between them; set the dropout to 0, or the model to "
            f"eval mode, or {_WAY_OUT}"
        )


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _checked(name: str, module: nn.Module, style: str, size: int) -> str:
    kinds = {COLUMN: nn.Linear, ROW: nn.Linear, HEAD: nn.Linear, VOCAB: nn.Embedding}
    if style not in kinds:
        raise UnsupportedModelError(
            f"tensor_parallel={size}: layer {name!r} is planned {style!r} by transformers, a split pipedp does not "
            f"implement (it takes colwise and rowwise Linear layers); {_WAY_OUT}"
        )
    if type(module) is not kinds[style]:
        raise UnsupportedModelError(
            f"tensor_parallel={size}: layer {name!r} is a {type(module).__name__}, not a plain "
            f"{kinds[style].__name__} (an adapter or a quantised layer?), so pipedp cannot split it; {_WAY_OUT}"
        )
    width = {COLUMN: "out_features", HEAD: "out_features", ROW: "in_features", VOCAB: "num_embeddings"}[style]
    value = getattr(module, width)
    if value % size:
        raise UnsupportedModelError(
            f"tensor_parallel={size} does not divide layer {name!r}'s {width}={value}; choose a tensor_parallel "
            "that divides it"
        )
    if style == VOCAB and module.max_norm is not None:
        raise UnsupportedModelError(
            f"layer {name!r}: an embedding with max_norm renormalises its rows in place; {_WAY_OUT}"
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
            if style is None or isinstance(module, _BUILT):
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
    dim = _DIM[style]
    return dim if p.dim() > dim and not (style == ROW and name == "bias") else None
