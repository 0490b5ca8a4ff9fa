"""The Linear rule (and Hugging Face's Conv1D, a Linear stored [in, out])."""

import pytest
import torch
import torch.nn as nn
from rule_oracle import check_rule

from pipedp.privacy.rules import rule_for


@pytest.mark.parametrize("lead", [(5,), (5, 4), (5, 2, 3)])  # [n, d], [n, T, d], [n, A, B, d]
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("features", [(3, 7), (7, 3), (4, 4)])  # W scales the input, the output-gradient, either
def test_linear_matches_per_sample_autograd(lead, bias, features):
    torch.manual_seed(0)
    layer = nn.Linear(*features, bias=bias).double()
    a = torch.randn(*lead, features[0], dtype=torch.float64)
    g = torch.randn(*lead, features[1], dtype=torch.float64)
    check_rule(layer, [a], g)


@pytest.mark.parametrize("features", [(3, 7), (7, 3)])
@pytest.mark.parametrize("frozen", ["weight", "bias"])  # BitFit trains only the bias
def test_linear_with_a_frozen_parameter_matches_per_sample_autograd(features, frozen):
    torch.manual_seed(0)
    layer = nn.Linear(*features).double()
    getattr(layer, frozen).requires_grad_(False)
    check_rule(layer, [torch.randn(5, 4, features[0], dtype=torch.float64)], torch.randn(5, 4, features[1]).double())


@pytest.mark.parametrize("features", [(3, 7), (7, 3)])
def test_conv1d_matches_per_sample_autograd(features):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    layer = transformers.pytorch_utils.Conv1D(features[1], features[0]).double()
    assert rule_for(layer).name == "linear"
    a, g = torch.randn(5, 4, features[0], dtype=torch.float64), torch.randn(5, 4, features[1], dtype=torch.float64)
    check_rule(layer, [a], g)


def test_clipped_sum_scales_the_narrower_tensor():
    """W multiplies the factors into the narrower of the input and the output-gradient (bilinear); a
    bf16 capture is promoted by the float32 factors in the same pass."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pipedp.privacy.per_sample import add_clipped_grad_sum

    class Muls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mul.Tensor:
                self.shapes.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    factors = torch.rand(5)
    for features, narrow in [((3, 7), 3), ((7, 3), 3)]:
        layer = nn.Linear(*features)
        a, g = torch.randn(5, 4, features[0]).bfloat16(), torch.randn(5, 4, features[1])
        with Muls() as muls:
            add_clipped_grad_sum(layer, [a], g, factors, {})
        assert muls.shapes == [(5, 4, narrow)]


def test_ghost_norms_are_declined_where_gram_matrices_outweigh_the_gradients():
    layer = nn.Linear(2, 2).double()
    assert not check_rule(layer, [torch.randn(3, 5, 2, dtype=torch.float64)], torch.randn(3, 5, 2, dtype=torch.float64))
