"""Options for big models (issue #25): activation checkpointing, float32 master weights under
bf16-mixed, stages on several devices in one process; each against an independent oracle.
Activation checkpointing with dropout: test_checkpointing_rng.py."""

import copy

import pytest
import torch
import torch.nn as nn
from oracles import loop_clipped_sum, max_relative_error

from pipedp import ConfigError, PipelineDPTrainer
from pipedp.models import GPTConfig, tiny_gpt, token_loss


def gpt(tied=False):
    torch.manual_seed(0)
    model = tiny_gpt(GPTConfig(vocab_size=30, seq_len=8, d_model=16, n_heads=2, n_layers=2)).double()
    if tied:
        model[-1].head.weight = model[0].tok.weight
    return model


def clipped_sum(model, x, y, **kw):
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    options = dict(stages=2, microbatches=2, noise_multiplier=0.0, max_grad_norm=0.3, expected_batch_size=1)
    options.update(kw)
    PipelineDPTrainer(model, token_loss, lambda p: torch.optim.SGD(p, lr=1.0), **options).step(x, y)
    return {k: before[k] - p.detach() for k, p in model.named_parameters()}


def batch(n=6):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 30, (n, 8), generator=g), torch.randint(0, 30, (n, 8), generator=g)


@pytest.mark.parametrize("mode", ["ghost", "materialize", "keep"])
@pytest.mark.parametrize("stages", [2, 3])
def test_activation_checkpointing_is_exact(mode, stages):
    model = gpt(tied=stages == 3)
    x, y = batch()
    want = loop_clipped_sum(copy.deepcopy(model), token_loss, x, y, 0.3)
    got = clipped_sum(model, x, y, stages=stages, grad_mode=mode, activation_checkpointing=True)
    assert max_relative_error(got, want) < 1e-10


def test_activation_checkpointing_recomputes_rather_than_saves():
    """The backward runs each block's forward again: counted on a module inside a block."""
    model = gpt()
    calls = []
    model[1].attn.register_forward_hook(lambda *a: calls.append(1))
    x, y = batch()
    clipped_sum(model, x, y, activation_checkpointing=True, self_check=False)
    assert len(calls) == 2 * 2  # two micro-batches, each forward once and recomputed once


def test_bf16_mixed_keeps_float32_master_weights_of_a_bf16_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).bfloat16()
    model[0].requires_grad_(False)  # frozen weights stay as loaded
    trainer = PipelineDPTrainer(
        model,
        lambda o, y: nn.functional.cross_entropy(o.float(), y, reduction="none"),
        lambda p: torch.optim.Adam(p, lr=1e-3),
        stages=2,
        precision="bf16-mixed",
        expected_batch_size=4,
    )
    assert model[2].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    trainer.step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
    state = trainer.state.optimizers[1].state[model[2].weight]
    assert state["exp_avg"].dtype == torch.float32


def test_stages_on_named_devices_in_one_process_equal_the_default_placement():
    x, y = batch()
    placed = clipped_sum(gpt(), x, y, devices=("cpu", "cpu"), noise_multiplier=1.0, seed=4)
    default = clipped_sum(gpt(), x, y, noise_multiplier=1.0, seed=4)
    assert max_relative_error(placed, default) < 1e-15


def test_devices_are_refused_where_they_cannot_hold():
    with pytest.raises(ConfigError, match="devices: one per stage"):
        PipelineDPTrainer(gpt(), token_loss, stages=2, devices=("cpu",), expected_batch_size=4)
    with pytest.raises(ConfigError, match="tied to the head.*untie_weights=True"):
        PipelineDPTrainer(gpt(tied=True), token_loss, stages=2, devices=("cpu", "cuda:0"), expected_batch_size=4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_in_one_process_match_the_loop_oracle():
    model = gpt()
    x, y = batch()
    want = loop_clipped_sum(copy.deepcopy(model), token_loss, x, y, 0.3)
    got = clipped_sum(model, x, y, devices=("cuda:0", "cuda:1"))
    assert max_relative_error({k: v.cpu() for k, v in got.items()}, want) < 1e-10
