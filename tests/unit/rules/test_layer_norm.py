"""The LayerNorm rule, in closed form."""

import pytest
import torch
import torch.nn as nn
from rule_oracle import check_rule


@pytest.mark.parametrize("shape", [(5, 6), (5, 3, 6), (5, 2, 3, 6)])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_per_sample_autograd(shape, bias):
    torch.manual_seed(0)
    layer = nn.LayerNorm(6, bias=bias).double()
    nn.init.normal_(layer.weight)
    check_rule(layer, [torch.randn(*shape, dtype=torch.float64)], torch.randn(*shape, dtype=torch.float64))
