"""Atomic, verifiable checkpoints: one file per stage, a manifest, a ``latest`` pointer.

    DIR/step-00000012/stage-0.pt ... stage-{p-1}.pt   parameters + optimizer state of a stage
    DIR/step-00000012/manifest.json                   step, config, accountant state, sha256 of each stage file
    DIR/latest                                        name of the newest complete step folder

Every file is written to a temporary name and renamed (atomic on POSIX), the manifest only
after every stage file is complete, and ``latest`` only after the manifest: a crash at any
moment leaves the previous checkpoint intact. Loading checks each file against its hash,
so a truncated or altered file is refused with a clear error instead of being half-loaded.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Any, Dict, List

import torch

from ..errors import CheckpointError
from ..runtime.protocols import Runtime
from .state import TrainingState


def atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def write_stage(root: str, step: int, stage: int, state: dict) -> str:
    """Write one stage's file; return its hash for the manifest."""
    folder = step_dir(root, step)
    os.makedirs(folder, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    atomic_write(os.path.join(folder, f"stage-{stage}.pt"), data)
    return sha256(data)


def write_manifest(root: str, step: int, manifest: dict) -> None:
    folder = step_dir(root, step)
    atomic_write(os.path.join(folder, "manifest.json"), json.dumps(manifest, indent=1).encode())
    atomic_write(os.path.join(root, "latest"), os.path.basename(folder).encode())


def latest_manifest(root: str) -> dict:
    pointer = os.path.join(root, "latest")
    if not os.path.exists(pointer):
        raise CheckpointError(f"no checkpoint in {root!r} (no 'latest' file): start without resume, or check the path")
    folder = os.path.join(root, open(pointer).read().strip())
    try:
        with open(os.path.join(folder, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint manifest in {folder!r} is missing or unreadable: {exc}") from exc
    manifest["folder"] = folder
    return manifest


def read_stage(manifest: dict, stage: int) -> dict:
    path = os.path.join(manifest["folder"], f"stage-{stage}.pt")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path!r} is missing: {exc}") from exc
    if sha256(data) != manifest["stage_sha256"][stage]:
        raise CheckpointError(
            f"checkpoint file {path!r} is truncated or corrupted (sha256 mismatch with the manifest); "
            "restore it, or resume from an earlier step folder by pointing 'latest' at it"
        )
    return torch.load(io.BytesIO(data), weights_only=False)


def check_compatible(manifest: dict, config: Dict) -> None:
    saved = manifest["config"]
    diffs: List[str] = [f"{k}: checkpoint {saved.get(k)!r}, now {v!r}" for k, v in config.items() if saved.get(k) != v]
    if diffs:
        raise CheckpointError("checkpoint was written by a different configuration:\n  " + "\n  ".join(diffs))


def save(directory: str, state: TrainingState, runtime: Runtime, identity: Dict[str, Any], stages: int) -> None:
    """Every rank calls this: replica 0 writes its stages' files, rank 0 the manifest and 'latest'."""
    hashes = {}
    if runtime.replica == 0:
        for stage, opt in zip(runtime.local_stages, state.optimizers):
            payload = {"params": stage.named_state(), "optimizer": opt.state_dict()}
            hashes[stage.index] = write_stage(directory, state.step, stage.index, payload)
    merged: Dict[int, str] = {}
    for part in runtime.all_gather(hashes):  # also the barrier: every stage file is complete
        merged.update(part)
    if runtime.rank == 0:
        accountant = state.accountant.state_dict()
        write_manifest(directory, state.step, {
            "step": state.step,
            "config": identity,
            "accountant": {"mechanism": accountant["mechanism"], "history": [list(h) for h in accountant["history"]]},
            "stage_sha256": [merged[s] for s in range(stages)],
        })
    runtime.all_gather(None)  # nobody reads 'latest' before it is written


def load(directory: str, state: TrainingState, runtime: Runtime, identity: Dict[str, Any]) -> None:
    """Restore parameters, optimizers, accountant and step from the newest checkpoint."""
    manifest = latest_manifest(directory)
    check_compatible(manifest, identity)
    for stage, opt in zip(runtime.local_stages, state.optimizers):
        payload = read_stage(manifest, stage.index)
        stage.load_named_state(payload["params"])
        opt.load_state_dict(payload["optimizer"])
    saved = manifest["accountant"]
    state.accountant.load_state_dict({"mechanism": saved["mechanism"], "history": [tuple(h) for h in saved["history"]]})
    state.step = int(manifest["step"])
