"""The clipped sum equals sum_i clip(grad of sample i alone), from batch-size-1 backward passes.

SGD with lr=1 and expected_batch_size=1 turns the parameter change into minus the clipped
sum, so the trainer is observed only through the model's parameters.
"""

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import loop_clipped_sum, max_relative_error
from steps import class_loss

from pipedp import PipelineDPTrainer
from pipedp.models import GPTConfig, mlp, tiny_gpt, token_loss


def pipedp_clipped_sum(model, loss_fn, x, y, clip, **kw):
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = PipelineDPTrainer(
        model,
        loss_fn,
        lambda p: torch.optim.SGD(p, lr=1.0),
        noise_multiplier=0.0,
        max_grad_norm=clip,
        expected_batch_size=1,
        **kw,
    )
    trainer.step(x, y)
    return {k: before[k] - p.detach() for k, p in model.named_parameters()}


class Scale(nn.Module):
    """No Opacus sampler: exercises the torch.func fallback."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x * self.weight


class GatedResidual(nn.Module):
    """Owns a parameter *and* a parameterised child, and calls that child twice."""

    def __init__(self, d):
        super().__init__()
        self.gate = nn.Parameter(torch.full((d,), 0.3))
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.gate) * self.lin(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("mode", ["ghost", "materialize", "keep"])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_custom_layers_reused_layers_match_loop(mode, stages):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), Scale(8), GatedResidual(8), nn.GroupNorm(2, 8), nn.Linear(8, 3)).double()
    x, y = torch.randn(9, 6, dtype=torch.float64), torch.randint(0, 3, (9,))
    want = loop_clipped_sum(copy.deepcopy(model), class_loss, x, y, 0.1)
    got = pipedp_clipped_sum(model, class_loss, x, y, 0.1, stages=stages, microbatches=3, grad_mode=mode)
    assert max_relative_error(got, want) < 1e-8


@pytest.mark.parametrize("mode", ["ghost", "materialize", "keep"])
@pytest.mark.parametrize("padding", [False, True])
def test_tied_embedding_and_head_on_one_stage_match_loop(mode, padding):
    """With ``padding_idx`` (Gemma, OPT) the embedding gives its row no gradient but the tied head does: a
    planted zeroing of that row after each micro-batch's scatter (the old code) is 8% off."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=20, seq_len=6, d_model=8, n_heads=2, n_layers=1)
    model = tiny_gpt(cfg).double()
    model[-1].head.weight = model[0].tok.weight  # GPT-2 style tying, kept on one stage
    x = torch.randint(0, 20, (7, 6))
    y = torch.randint(0, 20, (7, 6))
    if padding:
        model[0].tok.padding_idx = 0
        x[:, 0], y[:, 1] = 0, 0
    want = loop_clipped_sum(copy.deepcopy(model), token_loss, x, y, 0.5)
    got = pipedp_clipped_sum(model, token_loss, x, y, 0.5, stages=1, microbatches=2, grad_mode=mode)
    assert max_relative_error(got, want) < 1e-8


@given(
    n=st.integers(1, 12),
    stages=st.integers(1, 4),
    microbatches=st.integers(1, 6),
    width=st.integers(1, 6),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    mode=st.sampled_from(["ghost", "materialize", "keep"]),
)
@settings(max_examples=30, deadline=None)
def test_random_shapes_match_loop(n, stages, microbatches, width, schedule, mode):
    torch.manual_seed(n * 31 + width)
    model = mlp((5, width, width + 1, width, 2)).double()
    x, y = torch.randn(n, 5, dtype=torch.float64), torch.randint(0, 2, (n,))
    want = loop_clipped_sum(copy.deepcopy(model), class_loss, x, y, 0.2)
    got = pipedp_clipped_sum(
        model, class_loss, x, y, 0.2, stages=stages, microbatches=microbatches, schedule=schedule, grad_mode=mode
    )
    assert max_relative_error(got, want) < 1e-8


@pytest.mark.parametrize("mode", ["ghost", "materialize", "keep"])
def test_embedding_padding_idx_gets_no_gradient(mode):
    """Opacus 1.6's embedding samplers ignore padding_idx; the loop oracle (autograd) does not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4, padding_idx=0), nn.Flatten(), nn.Linear(12, 3)).double()
    x = torch.tensor([[0, 1, 2], [3, 0, 0], [4, 5, 1], [0, 0, 0]])
    y = torch.tensor([0, 1, 2, 1])
    want = loop_clipped_sum(copy.deepcopy(model), class_loss, x, y, 0.1)
    got = pipedp_clipped_sum(model, class_loss, x, y, 0.1, stages=2, microbatches=2, grad_mode=mode)
    assert max_relative_error(got, want) < 1e-10
    assert got["0.weight"][0].abs().max() == 0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_per_stage_clipping_matches_group_wise_loop(schedule):
    torch.manual_seed(0)
    model = mlp((5, 7, 7, 7, 3)).double()  # blocks 0..6; uniform over 3 stages: [0,1,2] [3,4] [5,6]
    x, y = torch.randn(9, 5, dtype=torch.float64), torch.randint(0, 3, (9,))
    norms = [0.05, 0.2, 0.1]
    groups = [(("0.", "1.", "2."), norms[0]), (("3.", "4."), norms[1]), (("5.", "6."), norms[2])]
    want = loop_clipped_sum(copy.deepcopy(model), class_loss, x, y, None, groups=groups)
    flat = loop_clipped_sum(copy.deepcopy(model), class_loss, x, y, 0.1)
    got = pipedp_clipped_sum(
        model,
        class_loss,
        x,
        y,
        norms,
        stages=3,
        microbatches=2,
        schedule=schedule,
        clipping="per_stage",
        balance="uniform",
    )
    assert max_relative_error(got, want) < 1e-10
    assert max_relative_error(got, flat) > 1e-3  # really a different rule from flat clipping


def test_per_stage_noise_is_scaled_to_the_total_sensitivity():
    from pipedp.privacy.clipping import ClipRule

    assert ClipRule.make("per_stage", [0.3, 0.4], 2).sensitivity == pytest.approx(0.5)
    assert ClipRule.make("per_stage", 1.0, 4).stage_thresholds == (0.5, 0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="flat clipping takes one max_grad_norm"):
        ClipRule.make("flat", [0.3, 0.4], 2)
    with pytest.raises(ValueError, match="got 3 max_grad_norm values for 2 stages"):
        ClipRule.make("per_stage", [1, 2, 3], 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "dp-zb"])
@pytest.mark.parametrize("mode", ["ghost", "materialize", "keep"])
def test_per_layer_clipping_matches_the_layer_wise_loop(schedule, mode):
    torch.manual_seed(1)
    cfg = GPTConfig(vocab_size=16, seq_len=6, d_model=8, n_heads=2, n_layers=2)
    model = tiny_gpt(cfg).double()
    x, y = torch.randint(0, 16, (7, 6)), torch.randint(0, 16, (7, 6))
    layers = {name.rsplit(".", 1)[0] for name, _ in model.named_parameters()}  # modules owning parameters
    clips = {layer: 0.01 * (1 + i % 3) for i, layer in enumerate(sorted(layers))}
    groups = [((layer + ".",), c) for layer, c in clips.items()]
    want = loop_clipped_sum(copy.deepcopy(model), token_loss, x, y, None, groups=groups)
    got = pipedp_clipped_sum(
        model,
        token_loss,
        x,
        y,
        clips,
        stages=3,
        microbatches=3,
        schedule=schedule,
        clipping="per_layer",
        grad_mode=mode,
    )
    assert max_relative_error(got, want) < 1e-10
    flat = loop_clipped_sum(copy.deepcopy(model), token_loss, x, y, 0.03)
    assert max_relative_error(got, flat) > 1e-3


def test_per_layer_thresholds_are_checked_and_split_equally():
    from pipedp.privacy.clipping import ClipRule

    equal = ClipRule.make("per_layer", 1.0, 2, ["a", "b", "c", "d"])
    assert equal.layer_thresholds == (("a", 0.5), ("b", 0.5), ("c", 0.5), ("d", 0.5))
    assert equal.sensitivity == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"missing \['b'\], unknown \['z'\]"):
        ClipRule.make("per_layer", {"a": 1.0, "z": 1.0}, 1, ["a", "b"])
    with pytest.raises(ValueError, match="needs clipping='per_layer'"):
        ClipRule.make("per_stage", {"a": 1.0}, 1)


@pytest.mark.parametrize("mode", ["ghost", "materialize", "keep"])
def test_a_fully_frozen_stage_trains_the_rest_exactly(mode, tmp_path):
    torch.manual_seed(2)
    model = mlp((5, 7, 7, 7, 3)).double()  # uniform over 3 stages: [0,1,2] [3,4] [5,6]
    for p in list(model.parameters())[:4]:  # blocks 0 and 2: the whole first stage
        p.requires_grad_(False)
    x, y = torch.randn(9, 5, dtype=torch.float64), torch.randint(0, 3, (9,))
    want = loop_clipped_sum(copy.deepcopy(model), class_loss, x, y, 0.05)
    got = pipedp_clipped_sum(model, class_loss, x, y, 0.05, stages=3, microbatches=2, grad_mode=mode, balance="uniform")
    assert max_relative_error({k: v for k, v in got.items() if k in want}, want) < 1e-10
    assert all(float(got[k].abs().max()) == 0 for k in ("0.weight", "0.bias", "2.weight", "2.bias"))
