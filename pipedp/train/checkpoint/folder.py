"""The checkpoint folder on disk: step folders, their signatures, and which one a resume may take.

    DIR/step-00000012/              one complete save; a second save at the same step is step-00000012-1
        stage-0.safetensors ...     what training changes on each stage (see store.py)
        manifest.json               the Manifest (format.py): job id, step, folder name, every file's sha256
        manifest.hmac               HMAC-SHA256 of manifest.json's bytes, with a key only
    DIR/.tmp-*                      a save in progress, or left by a killed job (removed with the lock)
    DIR/lock                        flock()ed by the job that owns the folder (lock.py)

A save is written into a fresh ``.tmp-`` folder (the stage files, then manifest.hmac, then
manifest.json) and renamed to its step name only once complete: a crash at any moment leaves
every step folder as it was. So a step folder is either complete or altered, and a resume takes
the newest one or nothing: every step folder must hold a valid manifest (signed, with a key), of
one job, naming itself; the newest is then loaded. A damaged newest folder is an error, never a
silent fall-back to an older step.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import os
import re
import secrets
import shutil
from typing import Dict, List, Optional, Tuple

from ...errors import CheckpointError
from .format import Manifest

TMP = ".tmp-"
MANIFEST, SIGNATURE = "manifest.json", "manifest.hmac"
_STEP = re.compile(r"^step-(\d{8})(?:-(\d{1,6}))?$")
_MAX_MANIFEST = 256 << 20
_CONTEXT = b"pipedp checkpoint manifest\n"  # the HMAC signs nothing but manifests
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_jobs: Dict[Tuple[int, int, int, int, str], Optional[str]] = {}  # manifest file identity -> its job (prune)


def sign(key: bytes, data: bytes) -> str:
    return hmac.new(key, _CONTEXT + data, hashlib.sha256).hexdigest()


def step_folders(root: str) -> List[str]:
    """The names of the step folders in ``root``, oldest first (by step, then save)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint folder {root!r}: {exc}") from exc
    return sorted((n for n in names if _STEP.match(n)), key=_order)


def _order(name: str) -> Tuple[int, int]:
    m = _STEP.match(name)
    assert m is not None
    return int(m.group(1)), int(m.group(2) or 0)


def exists(root: str) -> bool:
    """Whether ``root`` holds a checkpoint to resume from (damaged or not: loading says which)."""
    return bool(step_folders(root))


def require_key(root: str, key: Optional[bytes]) -> None:
    """Refuse to resume a folder whose checkpoints are signed without a key (nothing would be checked, and the
    steps written then would be unsigned)."""
    if key is None and any(os.path.lexists(os.path.join(root, n, SIGNATURE)) for n in step_folders(root)):
        raise CheckpointError(
            f"{root!r}: this folder's checkpoints are signed: pass the key (--checkpoint-key, PIPEDP_CHECKPOINT_KEY "
            "or checkpoint_key=); resuming without it would check no signature and write unsigned steps"
        )


def new_job() -> str:
    return secrets.token_hex(16)


# ---- writing ---------------------------------------------------------------------------------------
def next_name(root: str, step: int) -> str:
    """The name of the next save at ``step``: step-NNNNNNNN, or -1, -2... after a save at the same step."""
    taken = [_order(n)[1] for n in step_folders(root) if _order(n)[0] == step]
    if not taken:
        return f"step-{step:08d}"
    return f"step-{step:08d}-{max(taken) + 1}"


def make_temporary(root: str, name: str) -> str:
    path = os.path.join(root, f"{TMP}{name}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.makedirs(root, exist_ok=True)
        os.mkdir(path, 0o755)
    except OSError as exc:
        raise CheckpointError(f"cannot write to the checkpoint folder {root!r}: {exc}") from exc
    return path


def unchanged(root: str, manifest: Manifest, key: Optional[bytes]) -> Optional[str]:
    """The newest save at ``manifest``'s step if it holds exactly ``manifest`` (and its signature) but for
    its name: the fit loop saves twice at its last step when checkpoint_every divides it."""
    for name in reversed(step_folders(root)):
        if _order(name)[0] != manifest.step:
            continue
        data = dataclasses.replace(manifest, folder=name).to_bytes()
        try:
            same = _read(os.path.join(root, name, MANIFEST), _MAX_MANIFEST, "") == data
            if key is not None:
                same = same and _read(os.path.join(root, name, SIGNATURE), 4096, "") == sign(key, data).encode()
        except CheckpointError:
            return None
        return name if same else None
    return None


def commit(root: str, temporary: str, manifest: Manifest, key: Optional[bytes]) -> None:
    """Sign and write the manifest into the finished ``temporary`` folder and rename it into place."""
    data = manifest.to_bytes()
    if key is not None:
        _write(os.path.join(temporary, SIGNATURE), sign(key, data).encode())
    _write(os.path.join(temporary, MANIFEST), data)
    _fsync_dir(temporary)
    target = os.path.join(root, manifest.folder)
    try:
        os.rename(temporary, target)  # atomic; refuses to replace anything but an empty folder
    except OSError as exc:
        raise CheckpointError(f"cannot rename the finished save to {target!r}: {exc}") from exc
    _fsync_dir(root)


def _write(path: str, data: bytes) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    except OSError as exc:
        raise CheckpointError(f"cannot write the checkpoint file {path!r}: {exc}") from exc
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems cannot fsync a directory
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def remove(root: str, name: str) -> None:
    """Remove a step folder: renamed to a temporary name first (atomic), so a crash mid-removal never
    leaves a half-deleted step folder; a link is removed itself, never followed."""
    doomed = os.path.join(root, f"{TMP}removed-{name}-{secrets.token_hex(4)}")
    try:
        os.rename(os.path.join(root, name), doomed)
    except FileNotFoundError:
        return
    remove_temporary(doomed)


def remove_temporary(path: str) -> None:
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def prune(root: str, newest: str, job: str, keep_last: Optional[int], key: Optional[bytes]) -> int:
    """After ``newest`` was committed: remove every step folder of another job (or unreadable), the
    earlier saves of each step, and this job's steps beyond ``keep_last``; return how many of another job."""
    foreign, mine = 0, {}  # type: int, Dict[int, str]  # step -> this job's latest save of it
    for name in step_folders(root):  # oldest first
        if name != newest and _job_of(root, name, key) != job:
            remove(root, name)
            foreign += 1
            continue
        step = _order(name)[0]
        if step in mine:
            remove(root, mine[step])  # an earlier save of the same step
        mine[step] = name
    if keep_last is not None:
        for name in list(mine.values())[: max(0, len(mine) - keep_last)]:
            if name != newest:
                remove(root, name)
    return foreign


def _job_of(root: str, name: str, key: Optional[bytes]) -> Optional[str]:
    path = os.path.join(root, name, MANIFEST)
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    ident = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, sign(key, b"") if key is not None else "")
    if ident not in _jobs:
        try:
            _jobs[ident] = read(root, name, key).job
        except CheckpointError:
            _jobs[ident] = None
    return _jobs[ident]


# ---- reading ---------------------------------------------------------------------------------------
def read(root: str, name: str, key: Optional[bytes]) -> Manifest:
    """The manifest of step folder ``name``: a real folder in ``root``, signed with ``key`` (if given),
    naming itself; anything else is a CheckpointError naming the file."""
    folder = os.path.join(root, name)
    if os.path.islink(folder) or not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder {folder!r} is a link or not a folder: refused")
    path = os.path.join(folder, MANIFEST)
    data = _read(
        path, _MAX_MANIFEST, "pipedp renames a step folder into place only once complete, so this one was altered"
    )
    if key is not None:
        sig_path = os.path.join(folder, SIGNATURE)
        raw = _read(sig_path, 4096, "the checkpoint was written without a key, or its signature was removed")
        try:
            signature = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise CheckpointError(f"checkpoint signature {sig_path!r} is not text: damaged or altered") from None
        if not hmac.compare_digest(signature, sign(key, data)):
            raise CheckpointError(
                f"checkpoint manifest {path!r} is not signed with this key (manifest.hmac does not match): the "
                "folder was altered or written with another key; refusing to load it"
            )
    manifest = Manifest.parse(data, path)
    if manifest.folder != name:
        raise CheckpointError(
            f"checkpoint manifest {path!r} was written for the step folder {manifest.folder[:80]!r}, not {name!r}: "
            "a step folder was renamed or copied; refused"
        )
    if manifest.step != _order(name)[0]:
        raise CheckpointError(f"checkpoint manifest {path!r} is for step {manifest.step}, not the folder's: refused")
    return manifest


def _read(path: str, limit: int, missing: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path!r} is missing: {missing}") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path!r} cannot be read (a link?): {exc}") from exc
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"checkpoint file {path!r} is {size} bytes, more than a manifest can be: refused")
        chunks, total = [], 0
        while total <= size:
            chunk = os.read(fd, size + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def newest(root: str, key: Optional[bytes]) -> Manifest:
    """The manifest of the newest step folder, once every step folder in ``root`` has been checked: each
    holds a valid manifest (signed, with a key), and all are of one job."""
    names = step_folders(root)
    if not names:
        raise CheckpointError(f"no checkpoint in {root!r} (no step folder): start without resume, or check the path")
    manifests = [read(root, name, key) for name in reversed(names)]  # the newest first: its error first
    last = manifests[0]
    others = [m.folder for m in reversed(manifests) if m.job != last.job]
    if others:
        raise CheckpointError(
            f"{root!r} holds step folders of two jobs: {last.folder} was written by job {last.job[:12]}, but "
            f"{', '.join(others[:5])} by another: a step folder was copied in from another job (or a fresh job "
            "wrote here). Remove the folders that are not this run's; pipedp resumes only one job's newest step"
        )
    require_key(root, key)
    return last


def refuse_unshared(runtime, directory: str) -> None:
    """Every rank writes its stage's files into the folder rank 0 then commits, so every rank must see one
    folder: a node-local folder on each of several nodes would lose the other nodes' files at every save.
    Rank 0 writes a probe there; each rank says whether it sees it."""
    probe = None
    if runtime.rank == 0:
        probe = f"{TMP}probe-{secrets.token_hex(8)}"  # (a .tmp- name: removed with the lock if left)
        open(os.path.join(directory, probe), "w").close()
    probe = runtime.broadcast(probe)
    sees = runtime.all_gather(os.path.exists(os.path.join(directory, probe)))
    if runtime.rank == 0:
        os.unlink(os.path.join(directory, probe))
    blind = [rank for rank, seen in enumerate(sees) if not seen]
    if blind:
        raise CheckpointError(
            f"checkpoint_dir {directory}: ranks {blind} do not see the files rank 0 writes there, but every rank "
            "writes its stage's files into that one folder: on several nodes give a shared file system (NFS, "
            "Lustre, ...) mounted at the same path on every node"
        )


__all__ = ["exists", "newest", "prune", "read", "refuse_unshared", "require_key", "step_folders"]
