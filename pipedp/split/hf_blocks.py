"""A Hugging Face decoder as pipeline blocks: [embeddings] [decoder layer 0] ... [layer L-1] [head].

Each block holds the model's own parts under their paths in the model (so its state-dict keys,
prefixed with the block's name, are the model's own) and computes through the model's own forward
(hf_drive.py). Only the hidden state crosses stages (with the layers' own streams after it, where the
forward passes them from layer to layer: ZAYA's router states); every stage recomputes what its layers
need from its micro-batch's input dict.
"""

from __future__ import annotations

from typing import Dict, List

import torch.nn as nn

from .blocks import Block
from .hf_buffers import compute_buffers
from .hf_capturable import capturable
from .hf_drive import Driver
from .hf_structure import Structure


class _Part(nn.Module):
    """Holds some of the model's parts under their dotted paths; recomputes their non-persistent
    buffers (and the shared rotary modules') when stage_loading gives it memory."""

    def __init__(self, driver: Driver, parts: Dict[str, nn.Module]):
        super().__init__()
        self.__dict__["driver"] = driver  # a plain reference: not a submodule of the block
        for path, module in parts.items():
            owner = self
            *holders, name = path.split(".")
            for holder in holders:
                if holder not in owner._modules:
                    owner.add_module(holder, nn.Module())
                owner = owner._modules[holder]
            owner.add_module(name, module)

    def reset_buffers(self, device=None) -> None:
        shared = [m for part in self.driver.s.context.values() for m in part.modules()]
        compute_buffers(self.driver.s.model, [*self.modules(), *shared], device)


class HFEmbeddings(_Part):
    def __init__(self, driver: Driver):
        super().__init__(driver, driver.s.pre)

    def forward(self, inputs, side_inputs=None):
        return self.driver.embed(inputs)


class HFLayer(_Part):
    """Decoder layer ``index``, registered under its index (block name: the layer list's path)."""

    def __init__(self, driver: Driver, index: int):
        super().__init__(driver, {str(index): driver.s.layers[index]})
        self.index = index

    def forward(self, hidden, *streams, side_inputs=None):
        """``streams``: the previous layer's streams after the hidden state (Structure.streams), in place of the
        values the forward gives the first layer (the record's)."""
        args, kwargs = self.driver.layer_call(self.index, hidden, side_inputs)
        args = (*streams, *args[len(streams) :])
        layer = self._modules[str(self.index)]
        with capturable(layer, self.driver.s.fixes[self.index], *hidden.shape[:2]):
            out = layer(hidden, *args, **kwargs)
        if self.driver.s.streams > 1:
            return tuple(out[: self.driver.s.streams])
        return out[0] if isinstance(out, (tuple, list)) else out


class HFHead(_Part):
    def __init__(self, driver: Driver):
        super().__init__(driver, driver.s.post)

    def forward(self, hidden, *streams, side_inputs=None):
        return self.driver.head(hidden, side_inputs)  # (the last layer's streams end there, as in the forward)


def structure_blocks(structure: Structure) -> List[Block]:
    driver = Driver(structure)
    layers = [Block(structure.layers_path, HFLayer(driver, i)) for i in range(len(structure.layers))]
    return [Block("", HFEmbeddings(driver)), *layers, Block("", HFHead(driver))]
