"""Noise: std sigma*C/expected_batch_size per coordinate, independent across stages,
reproducible from the seed, and an empty batch is a noise-only update."""

import math

import pytest
import torch
import torch.nn as nn
from steps import class_loss

from pipedp import PipelineDPTrainer
from schedules import Kind

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


def test_each_stage_starts_its_sums_as_the_noise_before_it_first_waits():
    """The noise is drawn into each stage's sums before the stage's first receive (where a pipeline stage waits for
    its neighbour) or, receiving nothing or self-checking the pass, its first W: at that W every sum is exactly
    Opacus's draw from the parameter's stream, and the update is the noiseless one plus that noise once (float64: up
    to rounding)."""
    from opacus.optimizers.optimizer import _generate_noise

    from pipedp.privacy.streams import Stream, name_key, stream_seed

    def drawn(name, like, step):  # the oracle: Opacus's draw from the parameter's own stream (seed 9)
        generator = torch.Generator().manual_seed(stream_seed(Stream.NOISE, 9, step, name_key(name)))
        return _generate_noise(std=SIGMA * CLIP, reference=torch.zeros_like(like), generator=generator)

    clean = params_after(0.0, seed=9)
    m = model()
    t = PipelineDPTrainer(
        m,
        class_loss,
        lambda p: torch.optim.SGD(p, lr=1.0),
        stages=3,
        microbatches=2,
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        expected_batch_size=EBS,
        seed=9,
    )
    events, checked = [], []
    for e in t.runtime.executors:
        stage = e.stage
        for kind, handler in list(e.handlers.items()):
            e.handlers[kind] = lambda mb, s=stage.index, k=kind, h=handler: (events.append((s, k)), h(mb))[1]

        def weight(mb, factors, stage=stage, inner=stage.weight):
            if (stage.index, t.steps_taken) not in checked:  # its first W: the sums are the noise alone
                for p, name in zip(stage.parameters, stage.parameter_names()):
                    assert torch.equal(stage.clipped_sum[p], drawn(name, p, t.steps_taken)), name
                checked.append((stage.index, t.steps_taken))
            inner(mb, factors)

        def draw(stage=stage, inner=stage.draw_noise):
            if stage.noise is not None:
                events.append((stage.index, "noise"))
            inner()

        stage.weight, stage.draw_noise = weight, draw
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, 40, generator=g, dtype=torch.float64), torch.randint(0, 40, (6,), generator=g)
    for step in range(2):  # the first step self-checks its pass: its stages draw before their first W
        t.evaluate(x, y)  # (draws nothing: the next step's sums start as its noise alone)
        events.clear()
        t.step(x, y)
        for s in range(3):  # right before the stage's first receive or W (or first W), once
            mine = [k for i, k in events if i == s]
            waits = (Kind.W,) if step == 0 else (Kind.RECV_F, Kind.RECV_B, Kind.W)
            first = next(i for i, k in enumerate(mine) if k in waits)
            assert mine.index("noise") == first - 1 and mine.count("noise") == 1, (step, mine)
        if step == 0:
            names = [n for e in t.runtime.executors for n in e.stage.parameter_names()]
            for name, c, p in zip(names, clean, m.parameters()):  # lr 1: moved by the noise / EBS once more
                assert torch.allclose((c - p.detach()) * EBS, drawn(name, p, 0), rtol=0, atol=1e-12), name
    assert sorted(checked) == [(s, step) for s in range(3) for step in range(2)]
    assert [k for i, k in events if i == 0][:5] == [Kind.F, Kind.SEND_F, Kind.F, Kind.SEND_F, "noise"]  # waits later
