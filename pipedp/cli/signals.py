"""SIGTERM as SIGINT: the run stops through its normal ``finally`` paths (the checkpoint folder's lock is
released, the newest complete checkpoint stays), with a message and exit code 128 + signal (143, 130).

In a process that trains (a rank, or the whole run with --inprocess), the first SIGTERM or SIGINT raises
``Terminated`` (a KeyboardInterrupt, so no ``except Exception`` swallows it) and later ones are ignored
while it unwinds. pipedp's launcher does not raise: it forwards SIGTERM to the ranks it started and waits
for them to stop (a terminal's Ctrl-C reaches them anyway); their reports end the run. A second signal
to the launcher stops it at once.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from contextlib import contextmanager
from typing import Iterator, Optional

STOPPING = (signal.SIGTERM, signal.SIGINT)


class Terminated(KeyboardInterrupt):
    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def exit_code(exc: BaseException) -> int:
    return 128 + (exc.signum if isinstance(exc, Terminated) else signal.SIGINT)


def signal_name(exc: BaseException) -> str:
    return signal.Signals(exc.signum if isinstance(exc, Terminated) else signal.SIGINT).name


@contextmanager
def raising() -> Iterator[None]:
    """The first SIGTERM / SIGINT raises Terminated; later ones are ignored (the first is unwinding)."""
    seen: list = []

    def handler(signum, frame):
        if not seen:
            seen.append(signum)
            raise Terminated(signum)

    previous = {s: signal.signal(s, handler) for s in STOPPING}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class Forwarding:
    """While ranks run: a signal is forwarded to them (SIGTERM) and remembered; a second one raises."""

    def __init__(self):
        self.signum: Optional[int] = None

    @contextmanager
    def active(self) -> Iterator["Forwarding"]:
        def handler(signum, frame):
            if self.signum is not None:
                raise Terminated(signum)
            self.signum = signum
            for child in multiprocessing.active_children():  # only the processes this launcher started
                if child.pid is None:
                    continue
                try:
                    os.kill(child.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

        previous = {s: signal.signal(s, handler) for s in STOPPING}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
