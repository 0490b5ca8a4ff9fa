"""Noise: std sigma*C/expected_batch_size per coordinate, independent across stages,
reproducible from the seed, and an empty batch is a noise-only update."""

import math

import pytest
import torch
import torch.nn as nn
from steps import class_loss

from pipedp import PipelineDPTrainer

SIGMA, CLIP, EBS = 1.3, 0.7, 8


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 40)).double()


def params_after(noise, seed=0, x=None, y=None, stages=3, **kw):
    m = model()
    args = dict(max_grad_norm=CLIP)
    args.update(kw)
    t = PipelineDPTrainer(
        m,
        class_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=stages,
        microbatches=2,
        noise_multiplier=noise,
        expected_batch_size=EBS,
        seed=seed,
        **args,
    )
    g = torch.Generator().manual_seed(5)
    if x is None:
        x, y = torch.randn(6, 40, generator=g, dtype=torch.float64), torch.randint(0, 40, (6,), generator=g)
    t.step(x, y)
    return [p.detach().clone() for p in m.parameters()]


def test_noise_std_and_stage_independence():
    noisy, clean = params_after(SIGMA), params_after(0.0)
    noise = [c - n for c, n in zip(clean, noisy)]  # lr=1: delta = noise / EBS
    flat = torch.cat([z.flatten() for z in noise])
    expected = SIGMA * CLIP / EBS
    # 4920 coordinates: the sample std is within 5% of the truth with overwhelming probability
    # (its relative standard error is 1/sqrt(2 * 4920) = 1.0%)
    assert flat.std().item() == pytest.approx(expected, rel=0.05)
    assert abs(flat.mean().item()) < 5 * expected / math.sqrt(flat.numel())
    # weights of stage 0 (layer 0) and stage 1 (layer 2) have the same shape: their noise is uncorrelated
    a, b = noise[0].flatten(), noise[2].flatten()
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(corr) < 5 / math.sqrt(a.numel())


def test_same_seed_same_run_other_seed_other_noise():
    first, again, other = params_after(SIGMA, seed=3), params_after(SIGMA, seed=3), params_after(SIGMA, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not any(torch.equal(a, b) for a, b in zip(first, other))


def test_empty_batch_is_noise_only():
    empty_x, empty_y = torch.zeros(0, 40, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    m0 = [p.detach().clone() for p in model().parameters()]
    assert all(torch.equal(a, b) for a, b in zip(params_after(0.0, x=empty_x, y=empty_y), m0))
    moved = params_after(SIGMA, x=empty_x, y=empty_y)
    flat = torch.cat([(a - b).flatten() for a, b in zip(m0, moved)])
    assert flat.std().item() == pytest.approx(SIGMA * CLIP / EBS, rel=0.05)


def test_empty_batch_returns_nan_loss():
    t = PipelineDPTrainer(model(), class_loss, stages=2, microbatches=2, noise_multiplier=0.0, expected_batch_size=4)
    assert math.isnan(t.step(torch.zeros(0, 40, dtype=torch.float64), torch.zeros(0, dtype=torch.long)))


def test_per_stage_clipping_noise_std_is_sigma_times_total_sensitivity():
    norms = [0.3, 0.4, 1.2]  # sqrt(0.09 + 0.16 + 1.44) = 1.3
    kw = dict(clipping="per_stage", max_grad_norm=norms)
    noise = [c - n for c, n in zip(params_after(0.0, **kw), params_after(SIGMA, **kw))]
    flat = torch.cat([z.flatten() for z in noise])
    assert flat.std().item() == pytest.approx(SIGMA * 1.3 / EBS, rel=0.05)


def test_per_layer_clipping_noise_std_is_sigma_times_total_sensitivity():
    kw = dict(clipping="per_layer", max_grad_norm=1.3)  # split equally: sqrt(sum C_g^2) = 1.3
    noise = [c - n for c, n in zip(params_after(0.0, **kw), params_after(SIGMA, **kw))]
    flat = torch.cat([z.flatten() for z in noise])
    assert flat.std().item() == pytest.approx(SIGMA * 1.3 / EBS, rel=0.05)
