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

A tensor-parallel rank holding a slice of a parameter (``shards``) draws the whole parameter's pieces from the same
stream and adds the values that fall in its slice: every coordinate of the whole gets exactly the value it gets on
one rank, whatever the number of ranks (draws cost T times one rank's share; memory stays one piece).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from ..shards import Shard
from .secure import secure_gaussian_like
from .streams import Stream, name_key, stream_seed

PIECE = 1 << 22  # elements per draw (16 MiB of float32); a multiple of 16


def add_noise(
    grads: List[torch.Tensor],
    names: List[str],
    std: float,
    seed: int,
    step: int,
    secure_mode: bool = False,
    shards: Optional[Sequence[Optional[Shard]]] = None,
) -> None:
    """grads[k] += N(0, std^2) elementwise, in place, from the stream of (step, names[k]); ``shards[k]``: the
    slice of the whole parameter that grads[k] is (None: the whole)."""
    if std == 0:
        return
    for k, (g, name) in enumerate(zip(grads, names)):
        shard = shards[k] if shards is not None else None
        if secure_mode:  # the OS's entropy: independent for every coordinate, whichever rank draws it
            for piece in _pieces(g):
                piece.add_(secure_gaussian_like(piece, std))
            continue
        generator = torch.Generator(device=g.device)  # the tensor's device: CUDA noise for a CUDA sum
        generator.manual_seed(stream_seed(Stream.NOISE, seed, step, name_key(name)))
        if shard is not None:
            _add_to_slice(g, shard, std, generator)
            continue
        for piece in _pieces(g):
            piece.add_(torch.normal(0.0, std, piece.shape, generator=generator, dtype=g.dtype, device=g.device))


@dataclass
class SumNoise:
    """One step's noise for the clipped sums of some of a stage's parameters (``names``), to be drawn once into
    sums that start as it: the executor draws it before the stage's first receive, where a pipeline stage waits
    for its neighbour anyway (runtime/executor.py), so the draw costs the step nothing there. The values are
    ``add_noise``'s; only the order of the additions changes (noise first, then each micro-batch's clipped part),
    the same order on every stage, split and transport."""

    parameters: List[torch.nn.Parameter]
    names: List[str]  # theirs: each one's noise stream
    std: float
    seed: int
    step: int
    secure_mode: bool = False

    def add_to(self, sums: List[torch.Tensor]) -> None:
        add_noise(sums, self.names, self.std, self.seed, self.step, self.secure_mode)


def _bounds(total: int) -> Iterator[Tuple[int, int]]:
    """[start, end) of each piece of a contiguous tensor of ``total`` elements: PIECE elements each, the last
    one taking the remainder (and the piece before it when the remainder is under 16 elements)."""
    if total <= PIECE:
        yield 0, total
        return
    start = 0
    while start < total:
        end = start + PIECE
        if total - end < 16:
            end = total
        yield start, end
        start = end


def _pieces(g: torch.Tensor) -> Iterator[torch.Tensor]:
    """Views covering ``g`` in order (``_bounds``); ``g`` itself if it is not contiguous."""
    if not g.is_contiguous():
        yield g
        return
    flat = g.view(-1)
    for start, end in _bounds(g.numel()):
        yield flat[start:end]


def _add_to_slice(g: torch.Tensor, shard: Shard, std: float, generator: torch.Generator) -> None:
    """The whole parameter's noise, drawn piece by piece as on one rank, added where it falls in ``g``.

    The whole tensor is seen as [R, L] (L: the elements of one index of the dimensions up to the sliced one,
    together): the slice is columns [a, b) of every row, and a piece a run of consecutive elements."""
    full = torch.Size(shard.full_shape)
    inner = full[shard.dim + 1 :].numel()
    length = full[shard.dim] * inner  # L
    a, b = shard.start * inner, shard.stop * inner
    if not g.is_contiguous():  # a reshaped copy would take the noise, the sum none of it
        raise ValueError("a tensor-parallel slice's clipped sum must be contiguous to be noised in place")
    mine = g.view(-1, b - a)  # [R, b - a]
    for s, e in _bounds(full.numel()):
        values = torch.normal(0.0, std, (e - s,), generator=generator, dtype=g.dtype, device=g.device)
        r0, r1 = s // length, (e - 1) // length  # the rows the piece touches, first and last
        ends = [(r0, s - r0 * length, min(e - r0 * length, length))]  # (row, first column, past the last)
        if r1 > r0:
            ends.append((r1, 0, e - r1 * length))
        for row, lo, hi in ends:
            x, y = max(lo, a), min(hi, b)
            if x < y:
                mine[row, x - a : y - a] += values[row * length + x - s : row * length + y - s]
        if r1 - r0 > 1:  # the whole rows between
            middle = values[(r0 + 1) * length - s : r1 * length - s].view(r1 - r0 - 1, length)
            mine[r0 + 1 : r1] += middle[:, a:b]
