"""Gaussian noise for the clipped sums.

Noise comes from Opacus's own generator function, drawn from a torch.Generator seeded by
the (step, parameter name) noise stream (see streams.py): every parameter's noise is
independent, every run with the same seed is reproducible, a resumed run draws the same
noise as one that never stopped, and the noise does not depend on how the model is split
(a run saved on 2 stages may resume on 3). In secure mode it comes from the OS CSPRNG
instead (secure.py).
"""

from __future__ import annotations

from typing import List

import torch
from opacus.optimizers.optimizer import _generate_noise

from .secure import secure_gaussian_like
from .streams import Stream, name_key, stream_seed


def add_noise(
    grads: List[torch.Tensor], names: List[str], std: float, seed: int, step: int, secure_mode: bool = False
) -> None:
    """grads[k] += N(0, std^2) elementwise, in place, from the stream of (step, names[k])."""
    if std == 0:
        return
    for g, name in zip(grads, names):
        if secure_mode:
            g.add_(secure_gaussian_like(g, std))
            continue
        generator = torch.Generator(device=g.device)
        generator.manual_seed(stream_seed(Stream.NOISE, seed, step, name_key(name)))
        g.add_(_generate_noise(std=std, reference=g, generator=generator))
