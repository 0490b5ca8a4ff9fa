"""One job per checkpoint folder, with real processes: two jobs starting together on a folder with a
dead job's lock never both get it (the old read-decide-unlink takeover let both in, 14 rounds of 200);
a live job's lock is refused by its pid; a killed job's lock is free at once."""

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from pipedp.train.checkpoint import FolderLock

ROUNDS = 300


def _contender(me, folders, barrier, won):
    """One of two jobs: each round, start together with the other, try the folder, hold it until the
    other has tried too, let go."""
    from pipedp.errors import CheckpointError

    for r, folder in enumerate(folders):
        lock = FolderLock(folder)
        barrier.wait()
        try:
            lock.acquire()
            won[2 * r + me] = 1
        except CheckpointError:
            won[2 * r + me] = 0
        barrier.wait()  # both have tried: only now may the winner let go
        lock.release()


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_two_jobs_starting_together_never_both_take_a_folder_with_a_dead_jobs_lock(tmp_path):
    stale = json.dumps({"pid": _dead_pid(), "host": socket.gethostname()})
    folders = []
    for r in range(ROUNDS):
        folder = tmp_path / f"run-{r}"
        folder.mkdir()
        (folder / "lock").write_text(stale)  # left by a job that died
        folders.append(str(folder))
    ctx = multiprocessing.get_context("spawn")
    barrier, won = ctx.Barrier(2, timeout=60), ctx.Array("b", [-1] * (2 * ROUNDS))
    jobs = [ctx.Process(target=_contender, args=(me, folders, barrier, won)) for me in (0, 1)]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(120)
    assert [job.exitcode for job in jobs] == [0, 0]
    rounds = [(won[2 * r], won[2 * r + 1]) for r in range(ROUNDS)]
    assert all(pair in ((1, 0), (0, 1)) for pair in rounds), [
        r for r, p in enumerate(rounds) if p not in ((1, 0), (0, 1))
    ]


HOLDER = """
import sys, time
from pipedp.train.checkpoint import FolderLock
FolderLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_live_jobs_lock_is_refused_by_pid_and_a_killed_jobs_lock_is_free(tmp_path):
    from pipedp.errors import CheckpointError

    root = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            CheckpointError, match=f"in use by another job \\(pid {holder.pid} on {socket.gethostname()}"
        ):
            FolderLock(str(root)).acquire()
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # no release, no cleanup: the kernel drops its lock
        holder.wait()
    assert (root / "lock").exists()  # its file is still there, naming a dead pid
    lock = FolderLock(str(root))
    start = time.monotonic()
    lock.acquire()
    assert time.monotonic() - start < 1.0 and lock.held
    lock.release()
    assert not (root / "lock").exists()
