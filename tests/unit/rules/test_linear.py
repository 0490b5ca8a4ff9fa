"""The Linear rule (and Hugging Face's Conv1D, a Linear stored [in, out])."""

import pytest
import torch
import torch.nn as nn
from rule_oracle import check_rule

from pipedp.privacy.rules import rule_for


@pytest.mark.parametrize("shape", [(5, 3), (5, 4, 3), (5, 2, 3, 3)])  # [n, d], [n, T, d], [n, A, B, d]
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_per_sample_autograd(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(3, 7, bias=bias).double()
    a = torch.randn(*shape, dtype=torch.float64)
    g = torch.randn(*shape[:-1], 7, dtype=torch.float64)
    check_rule(layer, [a], g)


def test_conv1d_matches_per_sample_autograd():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    layer = transformers.pytorch_utils.Conv1D(7, 3).double()
    assert rule_for(layer).name == "linear"
    check_rule(layer, [torch.randn(5, 4, 3, dtype=torch.float64)], torch.randn(5, 4, 7, dtype=torch.float64))


def test_ghost_norms_are_declined_where_gram_matrices_outweigh_the_gradients():
    layer = nn.Linear(2, 2).double()
    assert not check_rule(layer, [torch.randn(3, 5, 2, dtype=torch.float64)], torch.randn(3, 5, 2, dtype=torch.float64))
