"""User-level DP: a privacy unit of several rows (one user's records), clipped as one, against a loop of
one backward pass per unit through the user's own model."""

import copy

import pytest
import torch
import torch.nn as nn
from loop_models import MaskedNet
from oracles import loop_unit_clipped_sum, max_relative_error
from steps import class_loss, pipedp_clipped_sum

from pipedp import BatchError, PipelineDPTrainer
from pipedp.models import GPTConfig, tiny_gpt, token_loss


@pytest.mark.parametrize("mode", ["ghost", "materialize", "keep"])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_gpt_with_units_of_three_rows_matches_the_unit_loop(mode, stages):
    torch.manual_seed(0)
    model = tiny_gpt(GPTConfig(vocab_size=20, seq_len=6, d_model=8, n_heads=2, n_layers=2)).double()
    x, y = torch.randint(0, 20, (12, 6)), torch.randint(0, 20, (12, 6))
    y[5] = -100  # a unit with fewer records is filled with rows that score nothing
    want = loop_unit_clipped_sum(copy.deepcopy(model), token_loss, x, y, 0.3, rows=3)
    got = pipedp_clipped_sum(model, token_loss, x, y, 0.3, stages=stages, microbatches=2, grad_mode=mode, unit_rows=3)
    assert max_relative_error(got, want) < 1e-10


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_units_through_layers_that_cannot_fold_rows_and_a_two_input_model(mode):
    """GroupNorm (an Opacus sampler: per-row gradients summed per unit) and a traced two-input model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GroupNorm(2, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    want = loop_unit_clipped_sum(copy.deepcopy(model), class_loss, x, y, 0.2, rows=2)
    got = pipedp_clipped_sum(model, class_loss, x, y, 0.2, stages=2, microbatches=2, grad_mode=mode, unit_rows=2)
    assert max_relative_error(got, want) < 1e-10
    torch.manual_seed(0)
    masked = MaskedNet().double()
    ids = torch.randint(0, 11, (6, 5))
    inputs, targets = {"ids": ids, "mask": torch.ones_like(ids)}, torch.randint(0, 11, (6, 5))
    want = loop_unit_clipped_sum(copy.deepcopy(masked), token_loss, inputs, targets, 0.2, rows=2)
    got = pipedp_clipped_sum(
        masked, token_loss, inputs, targets, 0.2, stages=2, microbatches=2, grad_mode=mode, unit_rows=2
    )
    assert max_relative_error(got, want) < 1e-10


def test_a_tied_embedding_and_head_across_stages_with_units():
    """The tie's cross term between different rows of one unit counts too."""
    torch.manual_seed(0)
    model = tiny_gpt(GPTConfig(vocab_size=20, seq_len=6, d_model=8, n_heads=2, n_layers=2)).double()
    model[-1].head.weight = model[0].tok.weight
    x, y = torch.randint(0, 20, (8, 6)), torch.randint(0, 20, (8, 6))
    want = loop_unit_clipped_sum(copy.deepcopy(model), token_loss, x, y, 0.3, rows=2)
    got = pipedp_clipped_sum(model, token_loss, x, y, 0.3, stages=3, microbatches=2, unit_rows=2)
    assert max_relative_error(got, want) < 1e-10


def test_fit_samples_units_and_counts_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    trainer = PipelineDPTrainer(
        model, class_loss, stages=2, expected_batch_size=5, sample_rate=0.25, unit_rows=4, noise_multiplier=1.0
    )
    x, y = torch.randn(80, 6, dtype=torch.float64), torch.randint(0, 3, (80,))
    trainer.fit((x, y), steps=3)
    assert trainer.privacy.dataset_size == 20  # units, not rows
    with pytest.raises(BatchError, match="whole privacy units of 4 rows"):
        trainer.step(x[:6], y[:6])
