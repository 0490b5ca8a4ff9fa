"""Gaussian noise for the clipped sums, added in place.

Each parameter's noise is drawn from a torch.Generator seeded by its (step, parameter name)
stream (see streams.py): every parameter's noise is independent, every run with the same seed is
reproducible, a resumed run draws the same noise as one that never stopped, and the noise does not
depend on how the model is split (a run saved on 2 stages may resume on 3). In secure mode it comes
from the OS CSPRNG instead (secure.py).

The draws are Opacus's (``_generate_noise``: ``torch.normal`` of the tensor's shape), made a piece at
a time and added to the sum in place, so no full-size noise tensor ever exists (for a 32000 x 4096
head in float32 that would be 500 MiB on top of the sum). On the CPU the pieces give exactly the
values of one whole draw: torch fills a tensor of >= 16 elements with uniforms in order and turns
each aligned group of 16 into normals, so pieces whose sizes are multiples of 16 (the last one at
least 16) consume the generator alike; tests/unit/test_noise.py compares with Opacus's function.

On a GPU the generator is the tensor's device's (a CPU generator cannot draw into CUDA memory): for the
same seed CUDA's values differ from the CPU's, and its pieces are consecutive draws rather than one whole
draw's values (each call advances the generator's Philox offset past what it used: the pieces stay
independent N(0, std^2)). The distribution, hence the privacy guarantee, is the same; a run resumed on
another device type draws other values than one that never stopped.
"""

from __future__ import annotations

from typing import Iterator, List

import torch

from .secure import secure_gaussian_like
from .streams import Stream, name_key, stream_seed

PIECE = 1 << 22  # elements per draw (16 MiB of float32); a multiple of 16


def add_noise(
    grads: List[torch.Tensor], names: List[str], std: float, seed: int, step: int, secure_mode: bool = False
) -> None:
    """grads[k] += N(0, std^2) elementwise, in place, from the stream of (step, names[k])."""
    if std == 0:
        return
    for g, name in zip(grads, names):
        if secure_mode:
            for piece in _pieces(g):
                piece.add_(secure_gaussian_like(piece, std))
            continue
        generator = torch.Generator(device=g.device)  # the tensor's device: CUDA noise for a CUDA sum
        generator.manual_seed(stream_seed(Stream.NOISE, seed, step, name_key(name)))
        for piece in _pieces(g):
            piece.add_(torch.normal(0.0, std, piece.shape, generator=generator, dtype=g.dtype, device=g.device))


def _pieces(g: torch.Tensor) -> Iterator[torch.Tensor]:
    """Views covering ``g`` in order: PIECE elements each, the last one taking the remainder (and the
    piece before it when the remainder is under 16 elements); ``g`` itself if it is not contiguous."""
    if not g.is_contiguous() or g.numel() <= PIECE:
        yield g
        return
    flat, start, total = g.view(-1), 0, g.numel()
    while start < total:
        end = start + PIECE
        if total - end < 16:
            end = total
        yield flat[start:end]
        start = end
