"""Tensor parallelism for a model without transformers' plan: a pass over each block's fx graph, in the spirit of
Optimum's automatic parallelism.

A Linear fed by a whole value may become column-parallel: its output is then a slice of the features. Elementwise
operations on slices of the same features (activations; sums, products and quotients of such slices, or of a slice
and a number) give a slice; a Linear fed by a slice becomes row-parallel, its output whole again (the partial
products summed over the ranks). A slice that reaches anything else (a reshape into heads, a norm, a reduction, a
tensor every rank holds whole, the block's output) leaves the Linears whose slices reach it whole, and the pass
starts again until nothing changes: that part then runs unsplit on every rank (exact, only not smaller). A plain
Embedding becomes vocabulary-parallel (its output is whole). The block's own forward runs as written: the graph is
only read, to choose; a block fx cannot trace (control flow on values) runs whole.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Dict, FrozenSet, List, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.dropout import _DropoutNd  # every dropout module: Dropout, Dropout1d-3d, AlphaDropout...

from ..errors import UnsupportedModelError
from ..split.blocks import Block

WAY_OUT = "use tensor_parallel=1 (pipeline stages and replicas only)"  # (plan.py's refusals end with it too)

# what keeps a slice a slice: elementwise, the same on every feature
_SLICE_MODULES = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity)
_SLICE_FUNCTIONS = {
    F.gelu,
    F.relu,
    F.silu,
    torch.relu,
    torch.tanh,
    torch.sigmoid,
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.neg,
    torch.add,
    torch.sub,
    torch.mul,
}
_SLICE_METHODS = {"relu", "tanh", "sigmoid", "add", "sub", "mul", "div", "neg"}


def traced_plan(model: nn.Module, blocks: Sequence[Block], size: int, styles: Dict[str, str]) -> Dict[str, str]:
    """{qualified module name: style} for every block; ``styles``: the names of the column, row and vocabulary
    styles (plan.py's). Refused by name when nothing can be split."""
    dropping = dropout_modules(model)
    if dropping:
        refuse_dropout(dropping[0], size)
    graphs: Dict[int, fx.Graph] = {}
    untraced: List[str] = []
    for k, b in enumerate(blocks):
        try:
            graphs[k] = fx.Tracer().trace(b.module)
        except Exception:  # control flow on values, an untraceable call: this block runs whole
            untraced.append(b.name)
            continue
        _refuse_functional_dropout(b, graphs[k], size)
    whole = _kept_whole(model, blocks, graphs)
    plan: Dict[str, str] = {}
    for k, graph in graphs.items():
        plan.update(_block_plan(blocks[k], graph, size, whole, styles))
    if not plan:
        skipped = f" (blocks fx could not trace: {untraced})" if untraced else ""
        raise UnsupportedModelError(
            f"tensor_parallel={size}: nothing in {type(model).__name__} can be split across ranks exactly: the pass "
            "over its blocks' graphs found no plain Linear fed by a whole value whose output reaches another Linear "
            f"through elementwise operations only, and no plain Embedding, of widths that {size} divides{skipped}; "
            f"{WAY_OUT}"
        )
    return plan


def _block_plan(block: Block, graph: fx.Graph, size: int, whole: set, styles: Dict[str, str]) -> Dict[str, str]:
    modules = dict(block.module.named_modules(remove_duplicate=False))
    names = {id(m): block.qualified(n) if n else block.name for n, m in block.module.named_modules()}

    def plain(node: fx.Node, kind: type) -> bool:
        """A call of a plain ``kind`` module that may be split (not one ``_kept_whole`` names)."""
        if node.op != "call_module":
            return False
        module = modules[str(node.target)]
        return type(module) is kind and id(module) not in whole

    linears = {n for n in graph.nodes if plain(n, nn.Linear)}
    columns = {n for n in linears if modules[str(n.target)].out_features % size == 0}
    while True:
        rows, spoiled = _propagate(graph, columns, linears, modules, size)
        if not spoiled:
            break
        columns -= spoiled
    used = set().union(*rows.values()) if rows else set()
    plan = {names[id(modules[str(n.target)])]: styles["column"] for n in columns if n in used}
    plan.update({names[id(modules[str(n.target)])]: styles["row"] for n in rows})
    for n in graph.nodes:
        if plain(n, nn.Embedding):
            embedding = modules[str(n.target)]
            if embedding.num_embeddings % size == 0 and embedding.max_norm is None and not embedding.sparse:
                plan[names[id(embedding)]] = styles["vocab"]
    return plan


def _propagate(graph: fx.Graph, columns: set, linears: set, modules: Dict[str, nn.Module], size: int):
    """One pass in graph order, following each slice with the columns it comes from: (the row-parallel Linears,
    with theirs; the columns whose slices reach something that needs the whole value)."""
    sliced: Dict[fx.Node, FrozenSet[fx.Node]] = {}
    rows: Dict[fx.Node, FrozenSet[fx.Node]] = {}
    spoiled: set = set()
    for n in graph.nodes:
        inputs = n.all_input_nodes
        from_slices = [a for a in inputs if a in sliced]
        if not from_slices:
            if n in columns:
                sliced[n] = frozenset({n})
            continue
        sources = frozenset().union(*(sliced[a] for a in from_slices))
        if n in linears and _only_argument(n, from_slices) and modules[str(n.target)].in_features % size == 0:
            rows[n] = sources
        elif _only_slices(inputs, from_slices) and _keeps_slice(n, modules):
            sliced[n] = sources
        else:
            spoiled |= sources
    return rows, spoiled


def _only_slices(inputs: List[fx.Node], from_slices: List[fx.Node]) -> bool:
    """Every tensor in is a slice: a whole one (a slice times a value every rank holds) would get only this
    rank's part of its gradient."""
    return len(from_slices) == len(inputs)


def _only_argument(node: fx.Node, from_slices: List[fx.Node]) -> bool:
    return len(node.args) == 1 and not node.kwargs and node.args[0] is from_slices[0]


def _keeps_slice(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    """(Keyword arguments are options, as F.silu's inplace: a tensor among them is one of the node's inputs.)"""
    if node.op == "call_module":
        return type(modules[str(node.target)]) in _SLICE_MODULES
    if node.op == "call_function":
        return node.target in _SLICE_FUNCTIONS
    if node.op == "call_method":
        return node.target in _SLICE_METHODS
    return False


def _kept_whole(model: nn.Module, blocks: Sequence[Block], graphs: Dict[int, fx.Graph]) -> set:
    """The ids of the modules no split may touch: called more than once (under any name, in any block: each
    call would need its own half), held by more than one block or by a block fx could not trace, holding a
    parameter another module holds (a tie), or whose parameter a forward reads outside the module's call
    (``x @ self.up.weight.t()``: that read would get the slice)."""
    kept: set = set()
    calls: Counter = Counter()
    holders: Counter = Counter()
    for k, b in enumerate(blocks):
        modules = dict(b.module.named_modules(remove_duplicate=False))
        ids = {id(m) for m in modules.values()}
        holders.update(ids)
        if k not in graphs:
            kept |= ids
            continue
        for n in graphs[k].nodes:
            if n.op == "call_module":
                calls[id(modules[str(n.target)])] += 1
            elif n.op == "get_attr" and "." in str(n.target):
                owner = modules.get(str(n.target).rsplit(".", 1)[0])
                if owner is not None:
                    kept.add(id(owner))
    kept |= {m for m, count in calls.items() if count > 1} | {m for m, count in holders.items() if count > 1}
    owners: Dict[int, List[int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(id(module))
    return kept | {m for ids in owners.values() if len(ids) > 1 for m in ids}


_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, torch.dropout}


def _refuse_functional_dropout(block: Block, graph: fx.Graph, size: int) -> None:
    """F.dropout(x, p, self.training) in a forward: traced in training mode, the call is recorded with its rate."""
    for n in graph.nodes:
        if n.op == "call_function" and n.target in _DROPOUTS:
            rate = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
            training = n.kwargs.get("training", n.args[2] if len(n.args) > 2 else True)
            if training and (not isinstance(rate, (int, float)) or rate > 0):
                where = f"block {block.name!r}" if block.name else "the model's forward"
                refuse_dropout(f"{n.target.__name__} in {where}, at {n.name!r}", size)


def dropout_modules(model: nn.Module) -> List[str]:
    """The names of the dropout modules (any class: Dropout, Dropout1d-3d, AlphaDropout...) that draw masks."""
    return [repr(n) for n, m in model.named_modules() if isinstance(m, _DropoutNd) and m.p > 0 and m.training]


def refuse_dropout(what: str, size: int) -> None:
    raise UnsupportedModelError(
        f"tensor_parallel={size} with dropout ({what}): each rank would draw its own masks, so the activations every "
        f"rank holds whole would differ between them; set its rate to 0, put the model in eval mode, or {WAY_OUT}"
    )
