"""Under torchrun, a rank never outlives its agent.

torchrun starts its ranks in their own session, so a killed agent (SIGKILL, out of memory) leaves them
running: training unattended and holding the run folder's lock. ``watch_agent`` starts a daemon thread
that polls the parent pid (an orphan is re-parented, so its ``getppid()`` changes; no parent-death signal,
which Linux sends when the forking *thread* exits, not the process). When the agent is gone it says so on
stderr, raises ``AgentLostError`` in the main thread (so the rank unwinds through its ``finally`` paths:
fit releases the folder's lock), and ends the process if it has not stopped within the run's timeout
(a main thread blocked in a receive only sees the error once that returns). The kernel drops a dead
holder's ``flock``, so the next job takes the folder either way.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from typing import Dict

from ..errors import AgentLostError

POLL_S = 0.5  # how often the parent pid is read: one getppid() call
EXIT_CODE = 75  # EX_TEMPFAIL, as a rendezvous that never completes (launch.bounded): start the job again

_watch: Dict[str, float] = {}  # "timeout": the run's, once a watcher runs (a later call may set it)


def under_torchrun() -> bool:
    """Whether torchrun's agent started this process (it sets TORCHELASTIC_RUN_ID for its workers)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def watch_agent(timeout_s: float, poll_s: float = POLL_S) -> bool:
    """Under torchrun, stop this rank when its agent dies (once per process; a later call sets the timeout
    to the run's). Returns whether a watcher runs."""
    if not under_torchrun():
        return False
    first = not _watch
    _watch["timeout"] = timeout_s
    if first:
        parent, main = os.getppid(), threading.main_thread().ident
        assert main is not None
        thread = threading.Thread(target=_watch_parent, args=(parent, main, poll_s), name="pipedp-agent-watch")
        thread.daemon = True
        thread.start()
    return True


def _watch_parent(parent: int, main: int, poll_s: float) -> None:
    while parent != 1 and os.getppid() == parent:  # pid 1 at start: the agent died before we looked
        time.sleep(poll_s)
    timeout = _watch["timeout"]
    message = (
        f"rank {os.environ.get('RANK', '?')}: torchrun's agent (pid {parent}) that started this rank is gone "
        "(killed, or out of memory): this rank stops rather than train unattended; start the job again (with "
        "--resume to continue from the last checkpoint)"
    )
    sys.stderr.write(f"pipedp: {message}\n")
    sys.stderr.flush()
    _raise_in(main, message)
    time.sleep(timeout)
    sys.stderr.write(f"pipedp: rank {os.environ.get('RANK', '?')} did not stop within {timeout:.0f} s: ending it\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


def _raise_in(thread_id: int, message: str) -> None:
    """Raise AgentLostError(message) in the thread at its next Python instruction. CPython raises an
    asynchronous exception by class, so the class carries the message."""

    class Lost(AgentLostError):
        def __init__(self, *args: object) -> None:
            super().__init__(*(args or (message,)))

    Lost.__name__ = Lost.__qualname__ = AgentLostError.__name__
    set_async = getattr(ctypes.pythonapi, "PyThreadState_SetAsyncExc", None)
    if set_async is not None:
        set_async(ctypes.c_ulong(thread_id), ctypes.py_object(Lost))
