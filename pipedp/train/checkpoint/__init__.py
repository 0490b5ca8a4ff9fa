"""Checkpoints: what training changes, by parameter name, verifiable, never executed.

    DIR/step-00000012/stage-K.safetensors   stage K's trainable parameters and optimizer tensors
    DIR/step-00000012/manifest.json         job id, step, config, accountant, param groups, LR schedulers,
                                            frozen-tensor fingerprints, every file's size and sha256
    DIR/step-00000012/manifest.hmac         HMAC-SHA256 of manifest.json, with a key only
    DIR/lock                                flock()ed by the job writing the folder

Modules: ``format`` (the Manifest, parsed and validated in one place), ``tensorfile`` (safetensors
files streamed one tensor at a time; frozen-tensor fingerprints), ``folder`` (the layout: atomic
saves, which step a resume takes), ``lock`` (one job per folder), ``optim`` (optimizer and
LR-scheduler state by parameter name), ``store`` (save and load across ranks).

Trust. Without a key the sha256s catch corruption and truncation, not tampering. With a key
(``checkpoint_key`` or PIPEDP_CHECKPOINT_KEY; an empty key is refused) every manifest is signed, and
the manifest covers every file's hash, the job id, the step and the folder's own name. A resume
then takes the newest step folder only after checking that every step folder in DIR is signed, of
one job and named as signed: a step folder of another job with the same key, a renamed or copied
older folder, an unsigned or damaged one is refused by name, never skipped. What a key cannot
catch: deleting the newest step folders (the older ones are still a valid history of the job),
or replacing the whole folder with another job's whole folder.
"""

from __future__ import annotations

import os
from typing import Optional, Union

from ...errors import CheckpointError
from .folder import exists, refuse_unshared
from .lock import FolderLock
from .store import load, save

KEY_ENV = "PIPEDP_CHECKPOINT_KEY"


def resolve_key(key: Union[str, bytes, None]) -> Optional[bytes]:
    """The HMAC key: the argument, else PIPEDP_CHECKPOINT_KEY, else None (no authentication). An empty
    key (which would sign with an empty secret) is refused."""
    source = "checkpoint_key"
    if key is None:
        key, source = os.environ.get(KEY_ENV), KEY_ENV
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, bytes):
        raise CheckpointError(f"{source} must be a string or bytes, got {type(key).__name__}")
    if not key.strip():
        raise CheckpointError(
            f"{source} is {'empty: an empty' if not key else 'only whitespace: a blank'} key signs with no secret at "
            f"all. Give a real key, or unset {KEY_ENV} and pass no checkpoint_key to save unsigned checkpoints"
        )
    return key


__all__ = ["KEY_ENV", "FolderLock", "exists", "load", "refuse_unshared", "resolve_key", "save"]
