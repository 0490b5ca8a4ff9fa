"""Any nn.Module split at user-marked points, through torch.distributed.pipelining's graph capture.

Mark the split points with ``torch.distributed.pipelining.pipe_split()`` inside forward (or
give a ``split_spec``), then wrap: ``SplitModel(model, example_input)``. pipedp captures
the graph with ``pipeline()`` and uses each captured stage module as one block; its
parameters are the model's own tensors, under the model's own names. A stage boundary
must carry exactly one tensor: anything else is refused with the construct named (the
automatic split of traced.py, with no wrapper, lets several tensors cross).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn

from ..errors import UnsupportedModelError
from .blocks import Block


class SplitModel(nn.Module):
    """A model plus an example micro-batch, for graph capture at its pipe_split() points."""

    def __init__(self, model: nn.Module, example_input: torch.Tensor, split_spec: Optional[Dict] = None):
        super().__init__()
        self.model = model
        self.example_input = example_input
        self.split_spec = split_spec

    def forward(self, x):
        return self.model(x)


def captured_blocks(model: nn.Module) -> Optional[List[Block]]:
    if not isinstance(model, SplitModel):
        return None
    from torch.distributed.pipelining import pipeline  # (here: torch's pipelining loads only for captured models)

    try:
        pipe = pipeline(model.model, mb_args=(model.example_input,), split_spec=model.split_spec)
    except Exception as exc:
        raise UnsupportedModelError(
            f"graph capture of {type(model.model).__name__} failed ({type(exc).__name__}: {str(exc).splitlines()[0]}): "
            "the model's forward must be traceable by torch.export (no data-dependent Python control flow)"
        ) from exc
    stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    if len(stages) < 2:
        raise UnsupportedModelError(
            f"{type(model.model).__name__} has no split points: call torch.distributed.pipelining.pipe_split() "
            "in its forward where a stage should end (or pass a split_spec)"
        )
    for i, stage in enumerate(stages):
        inputs = [n for n in stage.graph.nodes if n.op == "placeholder"]
        if len(inputs) != 1:
            raise UnsupportedModelError(
                f"captured stage {i} of {type(model.model).__name__} takes {len(inputs)} tensors "
                f"({', '.join(n.name for n in inputs)}): only one tensor may cross a marked split point; move the "
                "split so that skip connections and extra inputs stay inside one stage, or pass the model "
                "without SplitModel: pipedp then traces it, cuts at its pipe_split() marks, and several "
                "tensors may cross"
            )
    # the captured stage modules keep the model's own qualified names (a.weight, layers.0.fc.bias, ...)
    return [Block("model", stage) for stage in stages]
