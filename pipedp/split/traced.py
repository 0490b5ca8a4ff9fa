"""Any traceable module split with no marks: torch.fx traces its forward once (shape-agnostic,
so any micro-batch size and sequence length runs), keeping each top-level call (a direct child,
or an element of a ModuleList / Sequential child, e.g. ``layers.3``) as one node; the graph is cut
after such calls wherever exactly one tensor crosses, and every piece becomes a block, a small
GraphModule holding the model's own submodules under their own names. The partitioner then
balances those blocks into stages like any others.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch.fx as fx
import torch.nn as nn

from ..errors import UnsupportedModelError
from .blocks import Block


class _TopLevelTracer(fx.Tracer):
    """Keeps top-level calls (``child`` or ``child.i``) as leaves: their insides are not traced."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return qualified_name.count(".") <= 1 or super().is_leaf_module(module, qualified_name)


def traced_blocks(model: nn.Module) -> Optional[List[Block]]:
    """Blocks cut from the traced forward, or None when fewer than two pieces come out."""
    try:
        graph = _TopLevelTracer().trace(model)
    except Exception as exc:
        raise UnsupportedModelError(
            f"{type(model).__name__} could not be traced to split it automatically ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}): its forward has Python control flow on tensor values or "
            "non-tensor inputs. Give the model a pipeline_blocks() method, mark split points with pipe_split() "
            "and wrap it in pipedp.SplitModel, or move the data-dependent part inside one submodule"
        ) from exc
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise UnsupportedModelError(
            f"{type(model).__name__}.forward takes {len(placeholders)} inputs: the automatic split needs one "
            "tensor (pass masks and other side inputs inside a dict to a model with pipeline_blocks())"
        )
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    cuts = [i + 1 for i, n in enumerate(body[:-1])
            if n.op == "call_module" and _crossing(placeholders + body, len(placeholders) + i + 1) == [n]]
    bounds = [0] + cuts + [len(body)]
    pieces = [body[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    if len(pieces) < 2:
        return None
    output = next(n for n in nodes if n.op == "output")
    blocks, carried = [], placeholders[0]
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        result = output.args[0] if last else piece[-1]
        blocks.append(Block("", _piece_module(model, piece, carried, result)))
        carried = piece[-1]
    return blocks


def _crossing(nodes: List[fx.Node], cut: int) -> List[fx.Node]:
    """The values made before ``cut`` (the input included) and used at or after it (the output included)."""
    later = set(nodes[cut:])
    return [n for n in nodes[:cut] if any(user in later or user.op == "output" for user in n.users)]


def _piece_module(root: nn.Module, piece: List[fx.Node], incoming: fx.Node, result) -> fx.GraphModule:
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {incoming: graph.placeholder("x")}
    for node in piece:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(fx.map_arg(result, lambda n: env[n]))
    return fx.GraphModule(root, graph)  # copies the referenced submodules under their qualified names
