"""PrivacyConfig(enabled=False): the same pipeline without clipping or noise. Its update is plain SGD on the
summed per-sample losses, computed here by one ordinary torch backward through a copy of the user's model;
no step is charged and epsilon is infinite."""

import copy
import math

import pytest
import torch

from pipedp import PipelineDPTrainer
from pipedp.config import PrivacyConfig
from pipedp.errors import ConfigError, UnsupportedModelError
from tests.loop_models import LoopNet
from tests.steps import class_loss

N, LR = 6, 0.5


def batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 5, generator=g) * 20  # large inputs: every per-sample norm far above C
    return x, torch.randint(0, 3, (N,), generator=g)


def pipedp_step(enabled, **options):
    torch.manual_seed(0)
    model = LoopNet()
    privacy = PrivacyConfig(
        enabled=enabled, expected_batch_size=N, sample_rate=0.5, sampling="poisson", dataset_size=100, seed=1
    )
    trainer = PipelineDPTrainer(
        model, class_loss, lambda p: torch.optim.SGD(p, lr=LR), privacy=privacy, stages=2, microbatches=3, **options
    )
    trainer.step(*batch())
    return trainer, {k: v.detach().clone() for k, v in model.named_parameters()}


def plain_sgd_step():
    """One ordinary backward of sum_i loss_i / B (pipedp divides by the expected batch B, here N), one SGD step."""
    torch.manual_seed(0)
    model = copy.deepcopy(LoopNet())
    x, y = batch()
    (class_loss(model(x), y).sum() / N).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("grad_mode", ["auto", "materialize", "ghost"])
def test_disabled_dp_is_plain_sgd_with_no_charge_and_infinite_epsilon(grad_mode):
    trainer, got = pipedp_step(False, grad_mode=grad_mode)
    want = plain_sgd_step()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert trainer.epsilon() == math.inf and list(trainer.state.accountant.history) == []
    assert trainer.last_clipped_fraction == 0.0


def test_the_comparison_catches_clipping_or_noise():
    """Planted: the private run (C = 1, sigma = 1) on the same batch is far from plain SGD."""
    trainer, got = pipedp_step(True)
    want = plain_sgd_step()
    assert max((got[k] - want[k]).abs().max().item() for k in want) > 1e-2
    assert trainer.last_clipped_fraction == 1.0 and math.isfinite(trainer.epsilon())


def test_a_budget_or_a_target_with_dp_disabled_is_refused():
    for name in ("target_epsilon", "max_epsilon"):
        with pytest.raises(ConfigError, match=f"{name}: a run with DP disabled"):
            PrivacyConfig(enabled=False, expected_batch_size=4, sample_rate=0.1, **{name: 3.0}).validate()


def test_the_switch_is_part_of_a_checkpoints_identity_only_when_off():
    from pipedp.config import describe

    assert "enabled" not in describe(PrivacyConfig(), only_resume=True)  # checkpoints made before it stay valid
    assert describe(PrivacyConfig(enabled=False), only_resume=True)["enabled"] is False


class MixSamples(torch.nn.Module):
    """Subtracts the batch mean: no per-sample gradient exists (the self-check refuses it under DP)."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


def test_a_model_that_mixes_samples_trains_without_dp_as_plain_sgd():
    """The self-check guards per-sample gradients; without DP none is used (every clip factor is 1), so a model it
    refuses under DP trains without it, as plain SGD (one micro-batch: the mixing spans what one pass sees)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), MixSamples(), torch.nn.Linear(8, 3)).double()
    x, y = batch()
    x = x.double()
    want = copy.deepcopy(model)
    (class_loss(want(x), y).sum() / N).backward()
    for enabled in (True, False):
        privacy = PrivacyConfig(
            enabled=enabled, expected_batch_size=N, sample_rate=0.5, sampling="poisson", dataset_size=100, seed=1
        )
        trainer = PipelineDPTrainer(
            copy.deepcopy(model), class_loss, lambda p: torch.optim.SGD(p, lr=1.0), privacy=privacy, stages=2,
            microbatches=1,
        )  # fmt: skip
        if enabled:
            with pytest.raises(UnsupportedModelError, match="its forward mixes samples"):
                trainer.step(x, y)
            continue
        trainer.step(x, y)
    trained = dict(trainer.model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach() - trained[name].detach(), dict(want.named_parameters())[name].grad)
