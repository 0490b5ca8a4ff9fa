"""The pipelined DP-SGD step equals Opacus's on one device (noise 0), over the whole grid."""

import functools

import pytest
import torch
from oracles import max_relative_error, opacus_step
from pairwise import grid_with_slow_marks
from steps import class_loss

from pipedp import PipelineDPTrainer
from pipedp.models import GPTConfig, mlp, tiny_gpt, token_loss

LR, CLIP = 0.5, 0.05  # a small clip so that most samples are really clipped


def make_case(model_name, n, dtype):
    g = torch.Generator().manual_seed(1000 + n)
    torch.manual_seed(7)
    if model_name == "mlp":
        model = mlp((8, 16, 16, 16, 4)).to(dtype)
        x = torch.randn(n, 8, generator=g, dtype=dtype)
        y = torch.randint(0, 4, (n,), generator=g)
        return model, x, y, class_loss, False
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=3)
    model = tiny_gpt(cfg).to(dtype)
    x = torch.randint(0, cfg.vocab_size, (n, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (n, cfg.seq_len), generator=g)
    return model, x, y, token_loss, True


@functools.lru_cache(maxsize=None)
def reference(model_name, n, mode, dtype):
    model, x, y, _, token = make_case(model_name, n, dtype)
    return opacus_step(model, x, y, token_model=token, mode=mode, max_grad_norm=CLIP, lr=LR)


def run_pipedp(model_name, n, mode, dtype, stages, microbatches, schedule):
    model, x, y, loss_fn, _ = make_case(model_name, n, dtype)
    trainer = PipelineDPTrainer(
        model,
        loss_fn,
        lambda p: torch.optim.SGD(p, lr=LR),
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
        noise_multiplier=0.0,
        max_grad_norm=CLIP,
        expected_batch_size=n,
        grad_mode=mode,
    )
    trainer.step(x, y)
    return trainer.state_dict()


GRID = [
    ["mlp", "gpt"],  # model_name
    ["ghost", "materialize"],  # mode
    ["gpipe", "1f1b", "dp-zb", "dp-zb-2x"],  # schedule
    [1, 2, 3, 4],  # stages
    [1, 2, 4, 8],  # microbatches
    [16, 13],  # n: 13 does not divide, padded rows
]


# the whole grid; the pairwise subset (every pair of values of any two factors) in the fast tier
@pytest.mark.parametrize("model_name, mode, schedule, stages, microbatches, n", grid_with_slow_marks(pytest, GRID))
def test_matches_opacus_float64(model_name, mode, schedule, stages, microbatches, n):
    got = run_pipedp(model_name, n, mode, torch.float64, stages, microbatches, schedule)
    want = reference(model_name, n, mode, torch.float64)
    assert max_relative_error(got, want) < 1e-5


KEEP_GRID = [["mlp", "gpt"], ["gpipe", "1f1b", "dp-zb", "dp-zb-2x"], [2, 3], [1, 4]]


@pytest.mark.parametrize("model_name, schedule, stages, microbatches", grid_with_slow_marks(pytest, KEEP_GRID))
def test_keep_mode_matches_opacus_float64(model_name, schedule, stages, microbatches):
    """grad_mode="keep": every Linear's and LayerNorm's per-sample gradients held from I to W."""
    got = run_pipedp(model_name, 13, "keep", torch.float64, stages, microbatches, schedule)
    want = reference(model_name, 13, "hooks", torch.float64)
    assert max_relative_error(got, want) < 1e-5


@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
@pytest.mark.parametrize("mode", ["ghost", "materialize", "keep"])
def test_matches_opacus_float32(model_name, mode):
    got = run_pipedp(model_name, 11, mode, torch.float32, 3, 4, "1f1b")
    want = reference(model_name, 11, mode, torch.float32)
    assert max_relative_error(got, want) < 1e-4


def test_the_step_actually_moves_parameters():
    """Guard against a parity test that passes because nothing happens."""
    model, *_ = make_case("gpt", 16, torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    after = reference("gpt", 16, "hooks", torch.float64)
    assert max_relative_error(after, before) > 1e-4
