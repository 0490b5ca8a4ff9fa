"""pytest-benchmark micro-benchmarks (not run in CI):

    pytest bench/test_bench_norms.py --benchmark-enable --benchmark-group-by=param:width

Ghost vs materialized per-sample norms of one Linear across sequence length and width
(ghost needs [n, T, T] Gram matrices, materializing [n, out, in] gradients: the crossover
is near T^2 = in * out), and the clip + noise pass of a stage.
"""

import pytest
import torch
import torch.nn as nn

from pipedp.privacy.clipping import clip_factors
from pipedp.privacy.noise import add_noise
from pipedp.privacy.per_sample import clipped_grad_sum, per_sample_grads

BATCH = 16


@pytest.mark.parametrize("width", [32, 128, 512])
@pytest.mark.parametrize("seq", [16, 64, 256])
@pytest.mark.parametrize("mode", ["ghost", "opacus-ghost", "materialize"])
def test_linear_norms(benchmark, mode, seq, width):
    torch.manual_seed(0)
    layer = nn.Linear(width, width)
    a, g = torch.randn(BATCH, seq, width), torch.randn(BATCH, seq, width)
    benchmark.extra_info.update(crossover="ghost cheaper" if seq * seq <= width * width else "materialize cheaper")

    if mode == "ghost":
        from pipedp.privacy.per_sample import gram_norms

        def run():  # pipedp's batched-matmul ghost norm, forced even where it would materialize
            return gram_norms(a, g)
    elif mode == "opacus-ghost":
        from pipedp.privacy.per_sample import NORM_SAMPLERS

        def run():  # Opacus's einsum ghost norm
            return NORM_SAMPLERS[nn.Linear](layer, [a], g)
    else:

        def run():
            return {p: x.reshape(BATCH, -1).pow(2).sum(1) for p, x in per_sample_grads(layer, [a], g).items()}

    benchmark(run)


@pytest.mark.parametrize("width", [128, 512])
def test_clip_and_noise_pass(benchmark, width):
    torch.manual_seed(0)
    layer = nn.Linear(width, width)
    a, g = torch.randn(BATCH, 64, width), torch.randn(BATCH, 64, width)
    norms = torch.rand(BATCH, dtype=torch.float64) * 4

    def run():
        c = clip_factors(norms, 1.0, torch.ones(BATCH)).to(g.dtype).reshape(-1, 1, 1)
        grads = clipped_grad_sum(layer, [a], g * c)
        values = [g.clone() for g in grads.values()]
        add_noise(values, [str(k) for k in range(len(values))], 1.0, seed=0, step=0)
        return values

    benchmark(run)
