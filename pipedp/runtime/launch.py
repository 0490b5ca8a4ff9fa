"""Launch a function on N local processes (gloo, or NCCL with a GPU per rank, on loopback), like torchrun,
and fail fast.

When any rank raises, dies or stops, the others are stopped within a grace period and a
RankFailedError names the rank at fault: a rank that died (its exit code or signal) or
stopped (SIGSTOP) is named before a healthy rank that only reported the broken
connection or the timeout it caused. Every rank dies with the launcher (Linux parent-death
signal), so killing the launcher never leaves ranks training unattended.
The ranks rendezvous through a FileStore in a folder only this user can enter (no listening store: no
other local user can reach the rendezvous), and gloo's pairs listen on loopback only.
Used by the tests, the CLI (when not started by torchrun) and the benchmarks.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import multiprocessing.forkserver
import os
import queue
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import RankFailedError
from .lifeline import watch_agent
from .placement import backend_for, local_device


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def bounded(what: str, seconds: float, grace: float = 30.0):
    """Wait at most ``seconds`` (plus ``grace``, for the call's own timeout to fire first) for a blocking
    distributed call whose own timeout may not apply (a rendezvous with a peer that will never come, a
    stale store): past it, say so on stderr and end the process, rather than sit there unbounded. Exit
    code 75 (EX_TEMPFAIL)."""

    def expire() -> None:
        sys.stderr.write(
            f"pipedp: rank {os.environ.get('RANK', '?')}: {what} did not finish within {seconds:.0f} s (a rank is "
            "missing, or the rendezvous is stale after a killed launcher): stopping this process; start the job "
            "again (with --resume to continue from the last checkpoint)\n"
        )
        sys.stderr.flush()
        os._exit(75)

    timer = threading.Timer(seconds + grace, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


NCCL_FAULTS = {
    # wait() blocks and raises in the calling thread once the operation's timeout passes: the receive or
    # collective then fails like gloo's, and pipedp names the rank that stopped answering
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    # if NCCL's watchdog still sees an error: abort the communicator only (1 and 3 end the process)
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
}


def nccl_fault_handling() -> None:
    """Faults under NCCL end like faults under gloo (unless the user chose otherwise): read by every NCCL
    process group when it is created, so set before init_process_group and new_group."""
    for key, value in NCCL_FAULTS.items():
        os.environ.setdefault(key, value)


def cuda_device_of_rank() -> int:
    """This rank's CUDA device under NCCL: its own GPU, from LOCAL_RANK (see placement.local_device)."""
    return local_device(
        int(os.environ.get("LOCAL_RANK", "0")),
        torch.cuda.device_count(),
        int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        masked="CUDA_VISIBLE_DEVICES" in os.environ,
    )


def shared_cuda_device() -> int:
    """This rank's CUDA device where ranks share the GPUs (gloo with device "cuda"): LOCAL_RANK, round robin."""
    return int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()


def init_from_env(
    backend: Optional[str] = None, timeout_s: float = 300.0, store: Optional[dist.Store] = None, device: str = "auto"
) -> None:
    """init_process_group from torchrun's environment (or the given store). The backend, unless given, follows
    ``device`` (PipelineConfig.device: pass the same) and the GPUs here (placement.backend_for): NCCL with a GPU
    per rank, gloo on the CPU, gloo with ``device="cuda"`` where ranks share a GPU. Under NCCL each rank takes its
    own GPU (refused, by name, where two would share one) and NCCL's faults raise within ``timeout_s``. Under
    torchrun the rank stops if torchrun's agent dies (lifeline.py)."""
    watch_agent(timeout_s)
    if dist.is_initialized():
        return
    if backend is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        backend = backend_for(device, gpus, ranks_here, masked="CUDA_VISIBLE_DEVICES" in os.environ)
    if backend == "nccl":
        torch.cuda.set_device(cuda_device_of_rank())
        nccl_fault_handling()
    elif device == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(shared_cuda_device())
    with bounded("creating the default process group", timeout_s):
        if store is None:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        else:
            dist.init_process_group(
                backend,
                store=store,
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=timedelta(seconds=timeout_s),
            )


RENDEZVOUS = "PIPEDP_RENDEZVOUS"  # a launched rank's FileStore: the file its ranks rendezvous through


@contextlib.contextmanager
def _private_rendezvous() -> Iterator[str]:
    """The path of the ranks' rendezvous file, in a folder only this user can enter (mkdtemp: mode 0700),
    removed with everything in it at the end. A FileStore listens on no port: no other local user can
    connect to it or read its keys (a TCPStore, even on loopback, takes any local connection)."""
    folder = tempfile.mkdtemp(prefix="pipedp-rendezvous-")
    try:
        yield os.path.join(folder, "store")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _loopback_interface() -> Optional[str]:
    """The loopback interface's name ('lo' on Linux, 'lo0' on macOS), for gloo to bind its pairs to."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def _encode(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _die_with_parent(launcher: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); exit if that parent is already gone.
    The parent is the launcher (spawn) or its fork server, which exits when the launcher does (its pipe from the
    launcher closes), so either way the rank dies with the launcher."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own cleanup still stops ranks
        pass
    parent = os.getppid()
    if parent == launcher:
        return
    _release_fork_server()
    grandparent = parent_of(parent)
    if grandparent == launcher:  # forked by the launcher's fork server
        return
    if grandparent is None:  # no /proc (not Linux, no parent-death signal either): is the launcher there?
        try:
            os.kill(launcher, 0)
            return
        except OSError:
            pass
    os._exit(1)  # orphaned before prctl took effect: re-parented, the signal would never come


def _stat(pid: int) -> List[str]:
    """The fields of Linux's /proc/PID/stat after the command name (state, parent pid, ...); [] where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def parent_of(pid: int) -> Optional[int]:
    """The parent pid of process ``pid`` (Linux's /proc), or None."""
    fields = _stat(pid)
    return int(fields[1]) if len(fields) > 1 else None


def _release_fork_server() -> None:
    """A process the fork server forks inherits the write end of the pipe through which the server learns that
    the launcher has gone (so that it could ask the same server for processes of its own): the server would then
    outlive a killed launcher while its ranks hold that end, and they it. Closed here: the server ends with the
    launcher, and the ranks with the server."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


def _start_method(fn: Callable, backend: str) -> str:
    """How ranks start. Under gloo, from a fork server that has imported pipedp and ``fn``'s module once: a
    rank then starts in milliseconds instead of importing torch again (seconds each; the fork server is a
    fresh interpreter, not a copy of the launcher's state, and lives as long as the launcher). Under NCCL,
    each rank is spawned: a rank must not inherit anything that touched CUDA before it forked."""
    if backend != "gloo" or "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.set_forkserver_preload(["pipedp.runtime.launch", fn.__module__])  # read only when the server starts
    return "forkserver"


def _worker(rank, world, rendezvous, fn, args, results, threads, op_timeout_s, backend, launcher, environ):
    _die_with_parent(launcher)
    torch.set_num_threads(threads)
    os.environ.clear()  # the launcher's environment now, not the fork server's when it started
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        **{RENDEZVOUS: rendezvous},
    )
    loopback = _loopback_interface()
    if loopback is not None:  # gloo's pairs listen on loopback, whatever the host name resolves to
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    try:
        store = dist.FileStore(rendezvous, world)
        store.set_timeout(timedelta(seconds=op_timeout_s))
        init_from_env(backend, op_timeout_s, store)
        value = fn(rank, *args)
        results.put((rank, "ok", _encode(value)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # report every failure, then exit non-zero
        summary = f"{type(exc).__name__}: {exc}"
        results.put((rank, "error", summary + "\n" + traceback.format_exc()))
        results.close()
        results.join_thread()  # flush the report before dying, so it arrives before the peers' errors
        os._exit(1)


def launch(
    fn: Callable,
    nprocs: int,
    args: tuple = (),
    timeout_s: float = 600.0,
    threads: int = 1,
    grace_s: float = 3.0,
    backend: str = "gloo",
    op_timeout_s: float = 600.0,
) -> List[Any]:
    """Run fn(rank, *args) on nprocs processes; return the per-rank results in rank order.

    ``timeout_s`` bounds the whole run; ``op_timeout_s`` bounds any one collective or receive.
    """
    ctx = mp.get_context(_start_method(fn, backend))
    results = ctx.Queue()
    with _private_rendezvous() as rendezvous:
        procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                args=(
                    r,
                    nprocs,
                    rendezvous,
                    fn,
                    args,
                    results,
                    threads,
                    min(timeout_s, op_timeout_s),
                    backend,
                    os.getpid(),
                    dict(os.environ),
                ),
            )
            for r in range(nprocs)
        ]
        failure, values = _run_ranks(procs, results, timeout_s, grace_s)
    if failure is not None:
        rank, message = failure
        who = f"rank {rank}" if rank is not None else "the run"
        raise RankFailedError(f"{who} failed: {message.strip()}", rank, [p.exitcode for p in procs])
    return [values[r] for r in range(nprocs)]


def _run_ranks(procs, results, timeout_s: float, grace_s: float) -> Tuple[Optional[tuple], dict]:
    """Start the ranks and wait for every report (or the first failure, then stop the rest within
    ``grace_s``): (failure as (rank, message), or None; the values reported, by rank)."""
    for p in procs:
        p.start()
    values: dict = {}
    failure: Optional[tuple] = None
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < len(procs) and failure is None:
            if time.monotonic() > deadline:
                unfinished = {r: _state(procs[r]) for r in range(len(procs)) if r not in values}
                failure = (None, f"timed out after {timeout_s:.0f}s with ranks unfinished: {unfinished}")
                break
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:  # killed (OOM, signal) before it could report
                    failure = (dead[0], f"{_state(procs[dead[0]])} without a report")
                continue
            if status == "ok":
                values[rank] = torch.load(io.BytesIO(payload), weights_only=True)
            else:
                failure = _at_fault(procs, rank, payload, values)
        if failure is None:
            for p in procs:
                p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if failure is not None:
            stop = time.monotonic() + grace_s
            for p in procs:
                p.join(timeout=max(0.0, stop - time.monotonic()))
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    _continue(p)  # a stopped process only receives the SIGTERM once continued
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    return failure, values


def _state(p) -> str:
    """How a rank's process is doing: 'running', 'stopped (SIGSTOP)', 'killed by SIGKILL', 'exited with code N'."""
    if p.exitcode is not None:
        if p.exitcode < 0:
            return f"killed by {signal.Signals(-p.exitcode).name}"
        return f"exited with code {p.exitcode}"
    fields = _stat(p.pid)
    return "stopped (SIGSTOP)" if fields and fields[0] in ("T", "t") else "running"


def _at_fault(procs, reporter: int, report: str, finished: dict, settle_s: float = 1.0):
    """(rank, message) for the failure: a rank that died or stopped without reporting, if any
    (the reporter often only saw the connection it broke), else the rank whose failed step the reporter's
    StepFailedError names (every rank raises it), else the reporter."""
    deadline = time.monotonic() + settle_s
    while True:
        silent = [
            (r, _state(p))
            for r, p in enumerate(procs)
            if r != reporter and r not in finished and _state(p) != "running"
        ]
        silent = [(r, how) for r, how in silent if not how.startswith("exited with code 1")]  # those report
        if silent or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if silent:
        rank, how = silent[0]
        return rank, f"{how} and stopped answering; rank {reporter} then reported: {report.strip()}"
    named = re.match(r"StepFailedError: rank (\d+) \(stage \d+\) failed in a step", report)
    if named is not None and int(named.group(1)) < len(procs):
        return int(named.group(1)), report
    return reporter, report


def _continue(p) -> None:
    try:
        os.kill(p.pid, signal.SIGCONT)
    except (ProcessLookupError, TypeError):
        pass
