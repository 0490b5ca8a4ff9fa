"""Launch a function on N local processes (gloo on loopback), like torchrun, and fail fast.

When any rank raises, the others are stopped within a grace period and a RankFailedError
names the first failing rank and its error — no rank is left hanging in a collective.
Used by the tests, the CLI (when not started by torchrun) and the benchmarks.
"""
from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import RankFailedError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(backend: Optional[str] = None, timeout_s: float = 300.0) -> None:
    """init_process_group from torchrun's environment; NCCL when CUDA is there, else gloo."""
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def _encode(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _worker(rank, world, port, fn, args, results, threads, op_timeout_s, backend):
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        init_from_env(backend, op_timeout_s)
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
    fn: Callable, nprocs: int, args: tuple = (), timeout_s: float = 600.0, threads: int = 1,
    grace_s: float = 3.0, backend: str = "gloo", op_timeout_s: float = 600.0,
) -> List[Any]:
    """Run fn(rank, *args) on nprocs processes; return the per-rank results in rank order.

    ``timeout_s`` bounds the whole run; ``op_timeout_s`` bounds any one collective or receive.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, nprocs, port, fn, args, results, threads, min(timeout_s, op_timeout_s), backend),
                    daemon=True)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    values: dict = {}
    failure = None
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < nprocs and failure is None:
            if time.monotonic() > deadline:
                failure = (None, f"timed out after {timeout_s:.0f}s with ranks {sorted(set(range(nprocs)) - set(values))} unfinished")
                break
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:  # killed (OOM, signal) before it could report
                    failure = (dead[0], f"exited with code {procs[dead[0]].exitcode} without a report")
                continue
            if status == "ok":
                values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                failure = (rank, payload)
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
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    if failure is not None:
        rank, message = failure
        who = f"rank {rank}" if rank is not None else "the run"
        raise RankFailedError(f"{who} failed: {message.strip()}", rank, [p.exitcode for p in procs])
    return [values[r] for r in range(nprocs)]
