"""The Embedding rule (padding_idx gets no gradient, as in PyTorch) and the EmbeddingBag rule."""

import pytest
import torch
import torch.nn as nn
from rule_oracle import check_rule

from pipedp import UnsupportedModelError


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_matches_per_sample_autograd(padding_idx):
    torch.manual_seed(0)
    layer = nn.Embedding(10, 4, padding_idx=padding_idx).double()
    ids = torch.randint(0, 10, (5, 6))
    ids[0, :3] = 0
    ids[1] = 4  # one id repeated
    assert check_rule(layer, [ids], torch.randn(5, 6, 4, dtype=torch.float64))


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_over_rows_of_ids_matches_per_sample_autograd(mode):
    torch.manual_seed(0)
    layer = nn.EmbeddingBag(10, 4, mode=mode, padding_idx=0).double()
    ids = torch.randint(0, 10, (5, 6))
    ids[2, :4] = 0
    assert check_rule(layer, [ids], torch.randn(5, 4, dtype=torch.float64))


def test_embedding_bag_in_max_mode_is_refused_with_the_way_out():
    layer = nn.EmbeddingBag(10, 4, mode="max").double()
    with pytest.raises(UnsupportedModelError, match="mode 'sum' or 'mean'"):
        check_rule(layer, [torch.randint(0, 10, (5, 6))], torch.randn(5, 4, dtype=torch.float64))
