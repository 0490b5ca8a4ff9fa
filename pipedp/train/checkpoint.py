"""Atomic, verifiable checkpoints that cannot run code: one file per stage, a manifest, a pointer.

    DIR/step-00000012/stage-0.pt ... stage-{p-1}.pt   parameters + optimizer state of a stage
    DIR/step-00000012/manifest.json                   step, config, accountant state, sha256 of each stage file
    DIR/step-00000012/manifest.hmac                   HMAC-SHA256 of the manifest (with a key only)
    DIR/latest                                        name of the newest complete step folder
    DIR/lock                                          pid and host of the job writing the folder

Every file is written to a fresh temporary name opened exclusively (O_EXCL | O_NOFOLLOW: a
planted symlink is never followed) and renamed (atomic on POSIX); the manifest only after
every stage file is complete, ``latest`` only after the manifest: a crash at any moment
leaves the previous checkpoint intact. Loading checks each file against its hash, loads
tensors with ``torch.load(weights_only=True)`` (no pickled code runs) and never leaves the
folder (``latest`` must name a ``step-NNNNNNNN`` folder inside it, not a link).

Trust: without a key the hashes catch corruption, not tampering (whoever can write the
folder can rewrite the manifest). With a key (``checkpoint_key`` or the environment variable
PIPEDP_CHECKPOINT_KEY) the manifest — hence every file's hash, the step and the accountant
history — is authenticated, and a checkpoint without a valid signature is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import re
import secrets
import shutil
import socket
from typing import Any, Dict, List, Optional, Union

import torch

from ..errors import CheckpointError
from ..runtime.protocols import Runtime
from .state import TrainingState

KEY_ENV = "PIPEDP_CHECKPOINT_KEY"
_STEP_DIR = re.compile(r"^step-\d{8}$")
_TMP = ".tmp-"


def resolve_key(key: Union[str, bytes, None]) -> Optional[bytes]:
    """The HMAC key: the argument, else PIPEDP_CHECKPOINT_KEY, else None (no authentication)."""
    if key is None:
        key = os.environ.get(KEY_ENV) or None
    if isinstance(key, str):
        key = key.encode()
    return key


def atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}{_TMP}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        raise CheckpointError(f"cannot write the checkpoint file {path!r}: {exc}") from exc
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # rename replaces a link at `path` itself, never its target


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _signature(key: bytes, data: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def _inside(root: str, folder: str) -> str:
    """``folder`` if it is a real directory directly inside ``root`` (no link, no escape)."""
    if os.path.islink(folder) or os.path.dirname(os.path.realpath(folder)) != os.path.realpath(root):
        raise CheckpointError(f"checkpoint folder {folder!r} is a link or lies outside {root!r}: refused")
    return folder


def _make_step_dir(root: str, step: int) -> str:
    folder = step_dir(root, step)
    os.makedirs(folder, exist_ok=True)
    return _inside(root, folder)


def write_stage(root: str, step: int, stage: int, state: dict) -> str:
    """Write one stage's file; return its hash for the manifest."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    atomic_write(os.path.join(_make_step_dir(root, step), f"stage-{stage}.pt"), data)
    return sha256(data)


def write_manifest(
    root: str, step: int, manifest: dict, key: Optional[bytes] = None, keep_last: Optional[int] = None
) -> None:
    folder = _make_step_dir(root, step)
    data = json.dumps(manifest, indent=1).encode()
    if key is not None:
        atomic_write(os.path.join(folder, "manifest.hmac"), _signature(key, data).encode())
    atomic_write(os.path.join(folder, "manifest.json"), data)
    atomic_write(os.path.join(root, "latest"), os.path.basename(folder).encode())
    if keep_last is not None:
        _drop_old_steps(root, keep_last, os.path.basename(folder))


def _drop_old_steps(root: str, keep_last: int, newest: str) -> None:
    steps = sorted(n for n in os.listdir(root) if _STEP_DIR.match(n) and not os.path.islink(os.path.join(root, n)))
    for name in steps[: max(0, len(steps) - keep_last)]:
        if name != newest:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def latest_manifest(root: str, key: Optional[bytes] = None) -> dict:
    pointer = os.path.join(root, "latest")
    if not os.path.exists(pointer):
        raise CheckpointError(f"no checkpoint in {root!r} (no 'latest' file): start without resume, or check the path")
    with open(pointer) as f:
        name = f.read().strip()
    if not _STEP_DIR.match(name):
        raise CheckpointError(f"'latest' in {root!r} names {name[:80]!r}, not a step-NNNNNNNN folder: refused")
    folder = _inside(root, os.path.join(root, name))
    try:
        with open(os.path.join(folder, "manifest.json"), "rb") as f:
            data = f.read()
        manifest = json.loads(data)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint manifest in {folder!r} is missing or unreadable: {exc}") from exc
    if key is not None:
        try:
            with open(os.path.join(folder, "manifest.hmac")) as f:
                signature = f.read().strip()
        except OSError:
            signature = ""
        if not hmac.compare_digest(signature, _signature(key, data)):
            raise CheckpointError(
                f"checkpoint manifest in {folder!r} is not signed with this key (missing or wrong manifest.hmac): "
                "the folder was altered or written with another key; refusing to load it"
            )
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
    try:
        return torch.load(io.BytesIO(data), weights_only=True)  # tensors and plain containers only
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint file {path!r} holds something other than tensors and plain values "
            f"({type(exc).__name__}): refused, nothing in it was run"
        ) from exc


def check_compatible(manifest: dict, config: Dict) -> None:
    saved = manifest["config"]
    diffs: List[str] = [f"{k}: checkpoint {saved.get(k)!r}, now {v!r}" for k, v in config.items() if saved.get(k) != v]
    if diffs:
        raise CheckpointError("checkpoint was written by a different configuration:\n  " + "\n  ".join(diffs))


# ---- one job per folder --------------------------------------------------------------------------
class FolderLock:
    """DIR/lock, created exclusively: a second job on the same folder is refused with the first
    job's pid. A lock left by a process that died on this host is taken over; stale temporary
    files are removed when the lock is taken."""

    def __init__(self, root: str):
        self.root = root
        self.path = os.path.join(root, "lock")
        self.held = False

    def acquire(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create the checkpoint folder {self.root!r}: {exc}") from exc
        mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            except OSError as exc:
                raise CheckpointError(f"cannot write to the checkpoint folder {self.root!r}: {exc}") from exc
            with os.fdopen(fd, "wb") as f:
                f.write(mine)
            self.held = True
            self._remove_stale_temporaries()
            return
        raise CheckpointError(f"could not take the lock {self.path!r}")

    def _take_over_if_stale(self) -> None:
        try:
            with open(self.path) as f:
                owner = json.load(f)
            pid, host = int(owner["pid"]), str(owner["host"])
        except (OSError, ValueError, KeyError, TypeError):
            pid, host = -1, "?"
        if host == socket.gethostname() and not _alive(pid):
            os.unlink(self.path)  # its job died: the folder is free
            return
        raise CheckpointError(
            f"checkpoint folder {self.root!r} is in use by another job (pid {pid} on {host}): wait for it, use "
            f"another --checkpoint-dir, or remove {self.path!r} if that job is gone"
        )

    def _remove_stale_temporaries(self) -> None:
        for folder, _, files in os.walk(self.root):
            for name in files:
                if _TMP in name:
                    os.unlink(os.path.join(folder, name))

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- the training state, on every rank ------------------------------------------------------------
def save(
    directory: str,
    state: TrainingState,
    runtime: Runtime,
    identity: Dict[str, Any],
    stages: int,
    key: Optional[bytes] = None,
    keep_last: Optional[int] = None,
) -> None:
    """Every rank calls this: replica 0 writes its stages' files, rank 0 the manifest and 'latest'."""
    hashes = {}
    if runtime.replica == 0:
        for stage, opt in zip(runtime.local_stages, state.optimizers):
            payload = {"params": stage.named_state(), "optimizer": opt.state_dict() if opt is not None else {}}
            hashes[stage.index] = write_stage(directory, state.step, stage.index, payload)
    merged: Dict[int, str] = {}
    for part in runtime.all_gather(hashes):  # also the barrier: every stage file is complete
        merged.update(part)
    if runtime.rank == 0:
        accountant = state.accountant.state_dict()
        write_manifest(
            directory,
            state.step,
            {
                "step": state.step,
                "config": identity,
                "accountant": {
                    "mechanism": accountant["mechanism"],
                    "history": [list(h) for h in accountant["history"]],
                },
                "stage_sha256": [merged[s] for s in range(stages)],
            },
            key,
            keep_last,
        )
    runtime.all_gather(None)  # nobody reads 'latest' before it is written


def load(
    directory: str, state: TrainingState, runtime: Runtime, identity: Dict[str, Any], key: Optional[bytes] = None
) -> None:
    """Restore parameters, optimizers (as saved), accountant and step from the newest checkpoint."""
    manifest = latest_manifest(directory, key)
    check_compatible(manifest, identity)
    for stage, opt in zip(runtime.local_stages, state.optimizers):
        payload = read_stage(manifest, stage.index)
        stage.load_named_state(payload["params"])
        if opt is not None:
            opt.load_state_dict(payload["optimizer"])
    saved = manifest["accountant"]
    state.accountant.load_state_dict({"mechanism": saved["mechanism"], "history": [tuple(h) for h in saved["history"]]})
    state.step = int(manifest["step"])
