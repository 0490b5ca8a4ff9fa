"""The fallbacks: Opacus's grad samplers for the layers it knows, torch.func for any other."""

import torch
import torch.nn as nn
from rule_oracle import check_rule

from pipedp.privacy.rules import rule_for


class Scale(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return torch.tanh(x * self.weight)


def test_opacus_samplers_serve_group_norm_and_convolutions():
    torch.manual_seed(0)
    for layer, a, g in [
        (nn.GroupNorm(2, 4), torch.randn(5, 4, 3), torch.randn(5, 4, 3)),
        (nn.Conv1d(3, 4, 2), torch.randn(5, 3, 6), torch.randn(5, 4, 5)),
        (nn.RMSNorm(6), torch.randn(5, 3, 6), torch.randn(5, 3, 6)),
    ]:
        layer = layer.double()
        assert rule_for(layer).name == "opacus"
        check_rule(layer, [a.double()], g.double())


def test_any_other_layer_goes_through_torch_func():
    torch.manual_seed(0)
    layer = Scale(4).double()
    assert rule_for(layer).name == "torch.func"
    check_rule(layer, [torch.randn(5, 3, 4, dtype=torch.float64)], torch.randn(5, 3, 4, dtype=torch.float64))
