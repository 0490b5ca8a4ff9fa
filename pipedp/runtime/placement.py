"""Where a run's stages go: which devices, which backend, one process per rank or all in one.

``place(stages, replicas, device, gpus, inprocess)`` is a pure function of the job and the GPU count
(tests pass any count), used by ``pipedp train`` before it starts anything:

- ``device="cpu"``, or ``"auto"`` without a GPU: the CPU, one process per rank over gloo (or this one);
- with at least as many GPUs as ranks: one process per rank over NCCL, rank r on ``cuda:r``;
- with fewer GPUs than stages (one replica): every stage in this process, the stages spread over the
  GPUs in order (the in-process runtime's ``devices=``): NCCL cannot put two ranks on one GPU;
- otherwise (replicas that need more GPUs than there are, or ``device="cuda"`` without a GPU): refused,
  naming the fix. Never silently on the CPU when GPUs are there.

``local_device(local_rank, gpus)``: a rank's GPU under NCCL, refused when two ranks would share one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ..errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Placement:
    processes: bool  # one process per rank (else every stage in this one)
    backend: Optional[str]  # "gloo" / "nccl" across processes; None in one process
    devices: Tuple[str, ...]  # per rank (processes) or per stage (one process)

    def describe(self) -> str:
        where = ", ".join(f"{'rank' if self.processes else 'stage'} {i} on {d}" for i, d in enumerate(self.devices))
        how = f"{len(self.devices)} processes over {self.backend}" if self.processes else "one process"
        return f"pipedp: {how}: {where}"


def place(
    stages: int, replicas: int, device: str, gpus: int, inprocess: bool = False, tensor_parallel: int = 1
) -> Placement:
    """The placement of ``stages`` x ``replicas`` ranks on this machine with ``gpus`` CUDA devices."""
    if device not in DEVICES:
        raise ConfigError(f"device: one of {DEVICES}, got {device!r}", "device")
    world = stages * replicas * tensor_parallel
    one_process = inprocess or world == 1
    if device == "cuda" and gpus == 0:
        raise ConfigError(
            "device 'cuda' but torch sees no CUDA device (a CPU build of torch, or CUDA_VISIBLE_DEVICES hides "
            "them): install torch with CUDA, or use --device cpu",
            "device",
        )
    if device == "cpu" or gpus == 0:
        if one_process:
            return Placement(False, None, ("cpu",) * stages)
        return Placement(True, "gloo", ("cpu",) * world)
    if not one_process and gpus >= world:
        return Placement(True, "nccl", tuple(f"cuda:{r}" for r in range(world)))
    if replicas > 1 or tensor_parallel > 1:
        mesh = f"{stages} stages x {replicas} replicas" + (
            f" x {tensor_parallel} tensor-parallel" if tensor_parallel > 1 else ""
        )
        fewer = (
            "fewer replicas (--replicas 1) or tensor-parallel ranks"
            if tensor_parallel > 1
            else (f"fewer replicas (--replicas {max(1, gpus // stages)})")
        )
        raise ConfigError(
            f"{mesh} need {world} processes, each on its own GPU under NCCL, but {gpus} GPU(s) are here: use "
            f"{fewer} or stages, or --device cpu (gloo)",
            "tensor_parallel" if tensor_parallel > 1 else "replicas",
        )
    used = min(gpus, stages)
    return Placement(False, None, tuple(f"cuda:{s * used // stages}" for s in range(stages)))


def local_device(local_rank: int, gpus: int, ranks_here: int, masked: bool = False) -> int:
    """The CUDA device index of the rank ``local_rank`` of ``ranks_here`` on this node under NCCL: its own
    GPU. NCCL refuses two ranks on one GPU ("duplicate GPU"), so refuse it before init, by name. ``masked``:
    CUDA_VISIBLE_DEVICES is set, so one visible GPU may be this process's own (the rank's device is then 0)."""
    if gpus == 0:
        raise ConfigError(
            "backend 'nccl' needs a CUDA device per rank, and torch sees none: use gloo (--device cpu), or "
            "install torch with CUDA",
            "device",
        )
    if gpus == 1 and masked:
        return 0
    if ranks_here > gpus or local_rank >= gpus:
        raise ConfigError(
            f"{max(ranks_here, local_rank + 1)} ranks on this node but {gpus} GPU(s): NCCL cannot put two ranks "
            f"on one GPU; start at most {gpus} ranks per node (torchrun --nproc_per_node {gpus}), or use gloo on "
            "the CPU (--device cpu), or run the stages in one process (pipedp train without torchrun spreads them "
            "over the GPUs)",
            "device",
        )
    return local_rank
