"""Independent random streams by construction.

Every random draw of a run (the noise of one stage at one step, the Poisson batch of one
step, the subset a truncated batch keeps) takes its seed from
``numpy.random.SeedSequence(entropy=seed, spawn_key=(purpose, *keys))``: streams of
different purposes, steps or stages are different children of one root, so no noise
stream can coincide with a sampling stream (an earlier scheme put the purpose constant
at another position of the key, and the noise of step 0x5A11 met the sampling of step
``stage``).

The root seed is secret by default (``run_seed``): pipedp's code is public, so anyone who knows the seed
regenerates every step's noise, subtracts it, and reads the noiseless clipped sum.
"""

from __future__ import annotations

import enum
import hashlib
import secrets
from typing import Optional

import numpy as np


class Stream(enum.IntEnum):
    NOISE = 1  # keys: (step, name_key(parameter name))
    SAMPLING = 2  # keys: (step,)
    TRUNCATION = 3  # keys: (step,)
    AUDIT = 4  # keys: (0,): which canaries a privacy audit includes
    SHUFFLE = 5  # keys: (epoch,): the permutation of a shuffled epoch


KEY_LENGTH = {Stream.NOISE: 2, Stream.SAMPLING: 1, Stream.TRUNCATION: 1, Stream.AUDIT: 1, Stream.SHUFFLE: 1}


def name_key(name: str) -> int:
    """A stable 63-bit integer for a parameter name (a stream key must be an integer)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") >> 1


def stream_seed(purpose: Stream, seed: int, *keys: int) -> int:
    """A 63-bit seed for a torch.Generator, unique to (seed, purpose, keys)."""
    if len(keys) != KEY_LENGTH[purpose]:
        raise ValueError(f"stream {purpose.name} takes {KEY_LENGTH[purpose]} keys, got {keys}")
    sequence = np.random.SeedSequence(entropy=int(seed), spawn_key=(int(purpose), *(int(k) for k in keys)))
    return int(sequence.generate_state(1, dtype=np.uint64)[0] >> 1)


def run_seed(given: Optional[int]) -> int:
    """The root seed of a run's noise and sampling streams: ``given``, else 63 bits of the OS's entropy (a
    secret: the trainer keeps it in its checkpoints only, never in a file meant to be shared)."""
    return int(given) if given is not None else secrets.randbits(63)
