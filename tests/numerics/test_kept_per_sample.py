"""Both ways of one stage's W pass against the loop oracle: per-sample gradients kept from I (their
weighted sum) and the clipped product of captured inputs and scaled output-grads (ghost norms or
materialized norms in I)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from loop_models import MaskedNet
from oracles import loop_clipped_sum, max_relative_error

from pipedp.models import token_loss
from pipedp.runtime.stage import Stage, StageOptions
from pipedp.split.adapters import model_blocks

seq_loss = token_loss  # per-sample mean over positions


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_one_stage_clipped_sum_equals_the_loop_oracle(keep, mode):
    torch.manual_seed(0)
    model = MaskedNet().double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 11, (5, 7), generator=g)
    x, y = {"ids": ids, "mask": torch.ones_like(ids)}, torch.randint(0, 11, (5, 7), generator=g)
    want = loop_clipped_sum(copy.deepcopy(model), seq_loss, x, y, 0.1)
    stage = Stage(0, 1, model_blocks(model), seq_loss, StageOptions(mode, keep_ratio=None if keep else 0))
    stage.forward(0, x, y)
    norms = stage.backward_input(0, torch.ones(5)).squared_norms
    kept = bool(stage.pending[0].kept)
    assert kept == keep  # the path under test was taken
    stage.weight(0, torch.clamp(0.1 / (norms.sqrt() + 1e-6), max=1.0))
    got = dict(zip(stage.parameter_names(), stage.take_clipped_sum()))
    assert max_relative_error(got, want) < 1e-10


@pytest.mark.parametrize("keep", [True, False])
def test_layers_over_single_vectors_too(keep):
    """[n, d] inputs (no sequence dimension): a LayerNorm's per-sample gradients are its rows."""
    from loop_models import LoopNet

    torch.manual_seed(0)
    model = LoopNet().double()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
    ce = lambda o, t: F.cross_entropy(o, t, reduction="none")  # noqa: E731
    want = loop_clipped_sum(copy.deepcopy(model), ce, x, y, 0.1)
    stage = Stage(0, 1, model_blocks(model), ce, StageOptions("ghost", keep_ratio=None if keep else 0))
    stage.forward(0, x, y)
    norms = stage.backward_input(0, torch.ones(6)).squared_norms
    assert bool(stage.pending[0].kept) == keep
    stage.weight(0, torch.clamp(0.1 / (norms.sqrt() + 1e-6), max=1.0))
    got = dict(zip(stage.parameter_names(), stage.take_clipped_sum()))
    assert max_relative_error(got, want) < 1e-10


def test_keep_mode_keeps_every_linear_and_layer_norm():
    """grad_mode="keep" holds the per-sample gradients of layers the default memory rule would not
    (here the tied-free head and the projections wider than their inputs), exactly."""
    from pipedp.models import GPTConfig, tiny_gpt

    torch.manual_seed(0)
    model = tiny_gpt(GPTConfig(vocab_size=40, seq_len=6, d_model=8, n_heads=2, n_layers=1)).double()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 40, (5, 6), generator=g), torch.randint(0, 40, (5, 6), generator=g)
    want = loop_clipped_sum(copy.deepcopy(model), seq_loss, x, y, 0.1)
    kept = {}
    for mode in ("ghost", "keep"):
        stage = Stage(0, 1, model_blocks(model), seq_loss, StageOptions(mode))
        stage.forward(0, x, y)
        norms = stage.backward_input(0, torch.ones(5)).squared_norms
        kept[mode] = set(stage.pending[0].kept)
        stage.weight(0, torch.clamp(0.1 / (norms.sqrt() + 1e-6), max=1.0))
        got = dict(zip(stage.parameter_names(), stage.take_clipped_sum()))
        stage.close()
        assert max_relative_error(got, want) < 1e-10
    linears = {n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm))}
    assert kept["keep"] == linears  # every one of them, the wide head included
    assert kept["ghost"] < linears  # the default rule leaves some out (the comparison is not empty)
    with pytest.raises(ValueError, match="keep_ratio=0 contradicts"):
        StageOptions("keep", keep_ratio=0)
