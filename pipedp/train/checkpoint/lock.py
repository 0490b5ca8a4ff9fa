"""One job per checkpoint folder: DIR/lock, held with flock() for as long as the job runs.

The kernel holds the lock for the open file and drops it when the holder closes it or dies, so a
dead job's lock is free with no takeover logic, and two jobs starting together can never both
hold it: flock(LOCK_EX | LOCK_NB) is atomic. The holder writes its pid and host into the file,
for the refusal's message only. ``release`` unlinks the file before unlocking it; a contender that
opened the file just before the unlink would lock an orphaned inode, so after locking it checks
that the path still names the inode it locked, and starts again if not.

A job's lead process (``pipedp train``) takes the lock before it writes anything into the folder and
``hand_down``s it: the fit loop of that process, or of the ranks it starts (its children, or its fork server's,
which die with it), then uses that lock (``acquire(inherit=True)``) instead of taking its own, which would collide.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from typing import Optional

from ...errors import CheckpointError
from ...runtime.launch import parent_of
from .folder import TMP, remove_temporary

_OPEN = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
HANDED_DOWN = "PIPEDP_RUN_LOCK"  # {"path", "pid"} of the lock a job's lead process holds for its ranks


class FolderLock:
    def __init__(self, root: str):
        self.root = root
        self.path = os.path.join(root, "lock")
        self.held = False
        self._fd: Optional[int] = None

    def acquire(self, inherit: bool = False) -> None:
        """Take the folder, or raise CheckpointError naming the job that holds it; then remove what a
        killed job left behind (its unfinished saves). ``inherit``: if this process or its parent holds the
        folder's lock and handed it down, use that one (``held`` stays False: release leaves it to its holder)."""
        if inherit and self._handed_down():
            return
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create the checkpoint folder {self.root!r}: {exc}") from exc
        for _ in range(100):  # a new file each time the lock was released under us: bounded, not spun
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _holder(fd) if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
                os.close(fd)
                if holder is None:
                    raise CheckpointError(f"cannot lock {self.path!r}: {exc}") from exc
                raise CheckpointError(
                    f"checkpoint folder {self.root!r} is in use by another job ({holder}): wait for it, or use "
                    "another --checkpoint-dir"
                ) from None
            if not _names(self.path, fd):
                os.close(fd)  # released (unlinked) between our open and our lock: lock the file there now
                continue
            mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, mine, 0)
            self._fd, self.held = fd, True
            self._remove_stale_temporaries()
            return
        raise CheckpointError(f"could not take the lock {self.path!r}: it kept being replaced")

    def hand_down(self) -> None:
        """Let this process's fit loop and the ranks it starts (inheriting the environment) use this lock."""
        assert self.held
        os.environ[HANDED_DOWN] = json.dumps({"path": os.path.realpath(self.path), "pid": os.getpid()})

    def _handed_down(self) -> bool:
        """Whether this process or the one that started it handed this folder's lock down, and still holds it."""
        try:
            given = json.loads(os.environ.get(HANDED_DOWN, "null"))
            path, pid = given["path"], int(given["pid"])
        except (ValueError, TypeError, KeyError):
            return False
        # this process, its parent, or its parent's parent (a rank of runtime/launch.py forked by its fork server)
        if path != os.path.realpath(self.path) or pid not in (os.getpid(), os.getppid(), parent_of(os.getppid())):
            return False
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False  # nobody holds it
        except OSError:
            return _holder(fd) == f"pid {pid} on {socket.gethostname()[:100]}"
        finally:
            os.close(fd)

    def _open(self) -> int:
        try:
            return os.open(self.path, _OPEN, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CheckpointError(f"{self.path!r} is a link: refused (remove it)") from exc
            raise CheckpointError(f"cannot write to the checkpoint folder {self.root!r}: {exc}") from exc

    def _remove_stale_temporaries(self) -> None:
        """Unfinished saves of a killed job (``.tmp-`` folders), and temporaries of the older layout."""
        for name in os.listdir(self.root):
            if name.startswith(TMP) or ".tmp-" in name:
                remove_temporary(os.path.join(self.root, name))

    def release(self) -> None:
        if not self.held or self._fd is None:
            return
        self.held = False
        if os.environ.get(HANDED_DOWN) == json.dumps({"path": os.path.realpath(self.path), "pid": os.getpid()}):
            del os.environ[HANDED_DOWN]
        try:
            if _names(self.path, self._fd):
                os.unlink(self.path)  # while still locked: nobody can have locked this inode in between
        except OSError:
            pass
        os.close(self._fd)  # unlocks
        self._fd = None


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` is still the file open as ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _holder(fd: int) -> str:
    """'pid N on HOST' from the lock file (the holder writes it just after locking: wait a moment for it)."""
    for _ in range(20):
        try:
            owner = json.loads(os.pread(fd, 4096, 0).decode())
            return f"pid {int(owner['pid'])} on {str(owner['host'])[:100]}"
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            time.sleep(0.01)
    return "pid unknown: its lock file is not readable"


__all__ = ["HANDED_DOWN", "FolderLock"]
