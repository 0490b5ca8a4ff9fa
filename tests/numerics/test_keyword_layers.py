"""Layers owning parameters, called with keyword arguments and returning tuples (an attention owning its sinks, a
decoder layer owning its residual scales): their rule replays them per sample with the call's keyword arguments
(runtime/capture.py ``Keywords``), against the loop oracle; what it cannot replay exactly is refused by name."""

import copy

import pytest
import torch
import torch.nn as nn
from oracles import loop_clipped_sum, loop_unit_clipped_sum, max_relative_error
from steps import class_loss, pipedp_clipped_sum

from pipedp import UnsupportedModelError


class Gate(nn.Module):
    """Owns a parameter besides its child Linear; takes a per-sample mask, a tensor shared by the batch, a pair
    (one per-sample tensor, one shared), None and a flag by keyword; returns (output, a second tensor)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, dtype=torch.float64))
        self.inner = nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x, *, mask, scale, pair, nothing=None, flag=True):
        a, b = pair
        h = self.inner(x) * self.w * scale + (a * b if flag else 0) + (0 if nothing is None else nothing)
        h = h * mask[:, None]
        return torch.tanh(h), h.sum(-1)


class GateBlock(nn.Module):
    """Calls its Gate with keyword arguments; ``second``: its second output reaches the loss too."""

    def __init__(self, second: bool = False):
        super().__init__()
        self.gate = Gate()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8, dtype=torch.float64))
        self.second = second

    def forward(self, h):
        mask = (h[:, 0] > -0.5).double() + 0.5
        out, total = self.gate(h, mask=mask, scale=self.scale, pair=(h.sin(), self.scale.cos()), nothing=None)
        return out + total[:, None] if self.second else out


def model(second: bool = False):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), GateBlock(second), nn.Linear(8, 4)).double()


def data(rows: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (rows,), generator=g)


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("stages", [1, 2])
def test_a_layer_called_with_keyword_arguments_matches_the_loop(stages, mode):
    x, y = data(6)
    net = model()
    want = loop_clipped_sum(copy.deepcopy(net), class_loss, x, y, 0.3)
    got = pipedp_clipped_sum(net, class_loss, x, y, 0.3, stages=stages, microbatches=2, grad_mode=mode)
    assert max_relative_error(got, want) < 1e-12
    assert float(got["1.gate.w"].abs().max()) > 0


def test_keyword_layers_with_units_of_two_rows():
    x, y = data(8)
    net = model()
    want = loop_unit_clipped_sum(copy.deepcopy(net), class_loss, x, y, 0.3, rows=2)
    got = pipedp_clipped_sum(net, class_loss, x, y, 0.3, stages=2, microbatches=2, unit_rows=2)
    assert max_relative_error(got, want) < 1e-12


def test_planted_a_shared_keyword_tensor_the_size_of_the_micro_batch_is_caught_by_the_self_check():
    """The shared scale has 8 entries: with micro-batches of 8 rows it looks per-sample and is replayed one entry
    per sample, a wrong per-sample gradient whose sum is right. The self-check compares each sample's gradient
    with autograd's at the first step of each input shape and refuses, naming the keyword cause."""
    x, y = data(16)
    with pytest.raises(UnsupportedModelError, match=r"gate.w are wrong though their sum .*passed by keyword"):
        pipedp_clipped_sum(model(), class_loss, x, y, 0.3, stages=1, microbatches=2)
    # without the coincidence (micro-batches of 6), the same model is exact
    x, y = data(12)
    net = model()
    want = loop_clipped_sum(copy.deepcopy(net), class_loss, x, y, 0.3)
    got = pipedp_clipped_sum(net, class_loss, x, y, 0.3, stages=1, microbatches=2)
    assert max_relative_error(got, want) < 1e-12


def test_a_second_output_reaching_the_loss_is_refused_by_name():
    x, y = data(6)
    with pytest.raises(UnsupportedModelError, match=r"layer '1.gate' \(Gate\) returns a tuple whose element 1 reaches"):
        pipedp_clipped_sum(model(second=True), class_loss, x, y, 0.3, stages=1)


def test_a_keyword_argument_holding_an_object_is_refused_by_name():
    class Box:
        def __init__(self, t):
            self.t = t

    class Boxed(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(8, dtype=torch.float64))

        def forward(self, x, *, box):
            return x * self.w * box.t

    class BoxBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.boxed = Boxed()

        def forward(self, h):
            return self.boxed(h, box=Box(h))

    x, y = data(6)
    with pytest.raises(
        UnsupportedModelError, match=r"layer '1.boxed' \(Boxed\) was given a keyword argument holding a Box"
    ):
        net = nn.Sequential(nn.Linear(8, 8), BoxBlock(), nn.Linear(8, 4)).double()
        pipedp_clipped_sum(net, class_loss, x, y, 0.3, stages=1)
