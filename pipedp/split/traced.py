"""Any traceable module split with no marks: torch.fx traces its forward once (shape-agnostic,
so any micro-batch size and sequence length runs), keeping each top-level call (a direct child,
or an element of a ModuleList / Sequential child, e.g. ``layers.3``) as one node. The graph may
be cut after any such call where what crosses the cut is tensors (one, or several: a skip
connection, a mask, the embedding output reused at the end travel as a tuple), and every piece
becomes a block, a small GraphModule holding the model's own submodules under their own names.
The partitioner then balances those blocks into stages like any others.

The graph also answers, before anything runs, what hooks could only find out later:
- a trainable parameter read directly in forward (``F.linear(x, self.embed.weight)``) has no
  module call to capture its per-sample gradient: refused, naming it;
- an in-place update of the output of a layer with parameters corrupts that layer's captured
  output: refused, naming both;
- a module called twice, or two modules sharing a parameter: the graph is never cut between
  those calls, so one stage sees every use (an input embedding tied to an output head is the
  exception: pipedp splits that tie exactly across the first and last stage).

Forward arguments without a default are the model's inputs (several: the micro-batch is a dict
keyed by their names); arguments with a default keep it. ``pipe_split()`` marks in the forward
override the choice: the graph is cut at the marks and nowhere else.
"""

from __future__ import annotations

import inspect
import operator
from typing import Dict, List, Optional, Set

import torch.fx as fx
import torch.nn as nn

from ..errors import UnsupportedModelError
from .blocks import Block

_META_ATTRIBUTES = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"}
_META_METHODS = {"size", "dim", "numel", "__len__", "tolist", "item", "type", "is_contiguous", "get_device"}
_INPLACE_FUNCTIONS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.ipow,
    operator.imod,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.setitem,
}


def _split_mark() -> None:
    """Where the traced forward called ``torch.distributed.pipelining.pipe_split()``."""


class _TopLevelTracer(fx.Tracer):
    """Keeps top-level calls (``child`` or ``child.i``) as leaves: their insides are not traced;
    records each ``pipe_split()`` call as a ``_split_mark`` node."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return qualified_name.count(".") <= 1 or super().is_leaf_module(module, qualified_name)

    def trace(self, root, concrete_args=None):
        # pipe_split() calls torch.ops.pippy._pipe_split() with no tensor argument, which tracing would
        # run rather than record: while tracing, that op records a mark instead (restored right after);
        # importing torch's pipelining registers the op
        import torch.distributed.pipelining  # noqa: F401

        namespace = torch.ops.pippy
        original = namespace._pipe_split
        namespace._pipe_split = lambda: self.create_proxy("call_function", _split_mark, (), {})
        try:
            return super().trace(root, concrete_args)
        finally:
            namespace._pipe_split = original


def traced_blocks(model: nn.Module) -> Optional[List[Block]]:
    """Blocks cut from the traced forward (one, the whole forward, where no cut sends only tensors), or
    None for an empty forward."""
    graph = _trace(model)
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if not placeholders:
        raise UnsupportedModelError(f"{type(model).__name__}.forward takes no input to split a pipeline over")
    _refuse_what_per_sample_clipping_cannot_see(model, nodes)
    body: List[fx.Node] = []
    marks: List[int] = []
    for n in nodes:
        if n.op == "call_function" and n.target is _split_mark:
            marks.append(len(body))  # a cut before the next node
        elif n.op not in ("placeholder", "output"):
            body.append(n)
    kept_together = _spans_sharing_parameters(model, body)
    meta = _non_tensor_values(nodes)
    if marks:  # the user's marks choose the cuts
        for k, cut in enumerate(marks):
            _check_mark(model, k, cut, placeholders + body, len(placeholders), kept_together, meta)
        cuts = sorted({c for c in marks if 0 < c < len(body)})
    else:  # after any top-level call (or the last index into its tuple) where only tensors cross and no
        # layer is used on both sides
        cuts = [
            i + 1
            for i, node in enumerate(body[:-1])
            if (node.op == "call_module" or _ends_indexing_of_a_call(node))
            and not any(a <= i < b for a, b in kept_together)
            and _only_tensors_cross(placeholders + body, len(placeholders) + i + 1, meta)
        ]
    bounds = [0] + cuts + [len(body)]
    pieces = [body[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    if not pieces:
        return None
    output = next(n for n in nodes if n.op == "output")
    blocks, incoming = [], placeholders
    for k, piece in enumerate(pieces):
        if k == len(pieces) - 1:
            result, outgoing = output.args[0], []
        else:
            outgoing = _crossing(placeholders + body, len(placeholders) + bounds[k + 1])
            result = outgoing[0] if len(outgoing) == 1 else tuple(outgoing)
        names = tuple(p.target for p in placeholders) if k == 0 else ()
        blocks.append(Block("", _piece_module(model, piece, incoming, result), input_names=names))
        incoming = outgoing
    return blocks


def _only_tensors_cross(nodes: List[fx.Node], cut: int, meta: Set[fx.Node]) -> bool:
    crossing = _crossing(nodes, cut)
    return bool(crossing) and not any(n in meta for n in crossing)


def _check_mark(model: nn.Module, k: int, cut: int, nodes: List[fx.Node], offset: int, kept_together, meta) -> None:
    """A user's pipe_split() mark must be a place where only tensors cross and no layer is used on
    both sides."""
    where = f"{type(model).__name__}.forward's pipe_split() mark {k + 1}"
    crossing = _crossing(nodes, offset + cut)
    if any(n in meta for n in crossing):
        names = ", ".join(n.name for n in crossing if n in meta)
        raise UnsupportedModelError(
            f"{where}: a non-tensor value ({names}: a size, shape or number) crosses it; only tensors can travel "
            "between stages: move the mark, or compute that value after it"
        )
    for a, b in kept_together:
        if a < cut <= b:
            raise UnsupportedModelError(
                f"{where} falls between two uses of one layer's weights ({nodes[offset + a].target!r} and "
                f"{nodes[offset + b].target!r}): each stage must see every use of a parameter; move the mark"
            )


def _trace(model: nn.Module) -> fx.Graph:
    defaults = {
        name: p.default
        for name, p in inspect.signature(model.forward).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    try:
        graph = _TopLevelTracer().trace(model, concrete_args=defaults or None)
    except Exception as exc:
        raise UnsupportedModelError(
            f"{type(model).__name__} could not be traced to split it automatically ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}): its forward has Python control flow on tensor values or "
            "non-tensor inputs. Give the model a pipeline_blocks() method, mark split points with pipe_split() "
            "and wrap it in pipedp.SplitModel, or move the data-dependent part inside one submodule"
        ) from exc
    _drop_baked_defaults(graph, set(defaults))
    return graph


def _drop_baked_defaults(graph: fx.Graph, names: Set[str]) -> None:
    """An argument with a default is traced as a constant (its value is baked into the graph), but fx
    still makes it a placeholder guarded by an assertion that the value did not change: the model's
    inputs are the other arguments, so those placeholders and their guards go."""
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.args]:
        if node.target.rsplit("_", 1)[0] not in names and node.target not in names:
            continue
        guards, frontier = [], list(node.users)
        while frontier:  # eq(value, default) -> _assert(...), or _assert_is_none(value)
            user = frontier.pop()
            guards.append(user)
            frontier.extend(user.users)
        if not all(_is_guard(g) for g in guards):
            continue  # the value is used by the computation itself: it stays an input
        for guard in reversed(_in_graph_order(graph, guards)):
            graph.erase_node(guard)
        graph.erase_node(node)


def _is_guard(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", "")
    return node.op == "call_function" and (node.target is operator.eq or name in ("_assert", "_assert_is_none"))


def _in_graph_order(graph: fx.Graph, nodes: List[fx.Node]) -> List[fx.Node]:
    wanted = set(nodes)
    return [n for n in graph.nodes if n in wanted]


def _crossing(nodes: List[fx.Node], cut: int) -> List[fx.Node]:
    """The values made before ``cut`` (the inputs included) and used at or after it (the output
    included); attribute reads are not values that cross: each piece reads its own."""
    later = set(nodes[cut:])
    return [
        n for n in nodes[:cut] if n.op != "get_attr" and any(user in later or user.op == "output" for user in n.users)
    ]


def _non_tensor_values(nodes: List[fx.Node]) -> Set[fx.Node]:
    """Nodes computing shapes, sizes, dtypes and arithmetic on those, and tuples (a call whose result is
    only ever indexed, as an LSTM's (output, (h, c))): values no transport can carry as one tensor."""
    meta: Set[fx.Node] = set()
    for n in nodes:
        args = [a for a in n.all_input_nodes]
        indexed = bool(n.users) and all(u.op == "call_function" and u.target is operator.getitem for u in n.users)
        if indexed and n.op in ("call_module", "call_function", "call_method"):
            meta.add(n)
        elif n.op == "call_function" and n.target is getattr and n.args[1] in _META_ATTRIBUTES:
            meta.add(n)
        elif n.op == "call_method" and n.target in _META_METHODS:
            meta.add(n)
        elif n.op == "call_function" and n.target is len:
            meta.add(n)
        elif n.op == "call_function" and args and all(a in meta for a in args) and not _indexes_a_call(n):
            meta.add(n)  # operator.getitem / mul / ... on sizes
    return meta


def _ends_indexing_of_a_call(n: fx.Node) -> bool:
    """``out[:, -1]`` after ``out, _ = self.lstm(x)``: the last index into a layer's tuple result, where a
    cut sends a tensor (the call itself, a tuple, never crosses: ``_only_tensors_cross`` sees to that)."""
    return _indexes_a_call(n) and not any(_indexes_a_call(u) for u in n.users)


def _indexes_a_call(n: fx.Node) -> bool:
    """``x[k]`` of a layer's tuple result: a tensor again (a size's item stays a size)."""
    if n.target is not operator.getitem or not isinstance(n.args[0], fx.Node):
        return False
    source = n.args[0]
    while source.op == "call_function" and source.target is operator.getitem and isinstance(source.args[0], fx.Node):
        source = source.args[0]
    return source.op == "call_module"


def _refuse_what_per_sample_clipping_cannot_see(model: nn.Module, nodes: List[fx.Node]) -> None:
    name = type(model).__name__
    for n in nodes:
        if n.op == "get_attr":
            value = _attribute(model, n.target)
            if isinstance(value, nn.Parameter) and value.requires_grad:
                raise UnsupportedModelError(
                    f"{name}.forward reads the trainable parameter {n.target!r} directly (not by calling the module "
                    "that owns it): its per-sample gradients cannot be captured. Call the owning module (e.g. "
                    "self.head(x) rather than F.linear(x, self.embed.weight)), hold it in a module such as "
                    "nn.Embedding or nn.Linear, or freeze it"
                )
    for n in nodes:
        if not _in_place(model, n) or not n.args or not isinstance(n.args[0], fx.Node):
            continue
        target = n.args[0]
        if target.op == "call_module" and _owns_trainable(_attribute(model, target.target)):
            raise UnsupportedModelError(
                f"{name}.forward updates the output of layer {target.target!r} in place ({_describe(n)}): the "
                "layer's captured output would change and its per-sample gradient would be wrong; use the "
                "out-of-place operation (x = x + y, torch.relu(x), inplace=False)"
            )


def _in_place(model: nn.Module, n: fx.Node) -> bool:
    if n.op == "call_function":
        return (
            n.target in _INPLACE_FUNCTIONS
            or getattr(n.target, "__name__", "").endswith("_")
            or n.kwargs.get("inplace") is True
        )
    if n.op == "call_method":
        return n.target.endswith("_") and not n.target.startswith("__") or n.kwargs.get("inplace") is True
    if n.op == "call_module":
        return bool(getattr(_attribute(model, n.target), "inplace", False))
    return False


def _describe(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))


def _spans_sharing_parameters(model: nn.Module, body: List[fx.Node]) -> List[tuple]:
    """(first, last) body positions of the calls using one trainable parameter: no cut between them
    (one module called twice, or modules sharing a weight), except an embedding tied to a head."""
    uses: Dict[int, List[int]] = {}
    kinds: Dict[int, Set[type]] = {}
    for i, n in enumerate(body):
        if n.op != "call_module":
            continue
        module = _attribute(model, n.target)
        for owner in module.modules():
            for p in owner.parameters(recurse=False):
                if p.requires_grad:
                    uses.setdefault(id(p), []).append(i)
                    kinds.setdefault(id(p), set()).add(type(owner))
    spans = []
    for key, positions in uses.items():
        if len(positions) > 1 and not (len(positions) == 2 and _embedding_and_head(kinds[key])):
            spans.append((min(positions), max(positions)))
    return spans


def _embedding_and_head(kinds: Set[type]) -> bool:
    return any(issubclass(k, nn.Embedding) for k in kinds) and nn.Linear in kinds


def _owns_trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


def _attribute(model: nn.Module, target: str):
    value = model
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _piece_module(root: nn.Module, piece: List[fx.Node], incoming: List[fx.Node], result) -> fx.GraphModule:
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {n: graph.placeholder(n.name) for n in incoming}

    def value(n: fx.Node) -> fx.Node:
        if n not in env and n.op == "get_attr":  # a buffer or frozen tensor made before the cut: read it again
            env[n] = graph.get_attr(n.target)
        return env[n]

    for node in piece:
        env[node] = graph.node_copy(node, value)
    graph.output(fx.map_arg(result, value))
    return fx.GraphModule(root, graph)  # copies the referenced submodules under their qualified names
