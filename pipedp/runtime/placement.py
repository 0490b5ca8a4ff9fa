"""Where a run's stages go: which devices, which backend, one process per rank or all in one.

``place(stages, replicas, device, gpus, inprocess)`` is a pure function of the job and the GPU count
(tests pass any count), used by ``pipedp train`` before it starts anything:

- ``device="cpu"``, or ``"auto"`` without a GPU: the CPU, one process per rank over gloo (or this one);
- with at least as many GPUs as ranks: one process per rank over NCCL, rank r on ``cuda:r``;
- with fewer GPUs than stages (one replica): every stage in this process, the stages spread over the
  GPUs in order (the in-process runtime's ``devices=``): NCCL cannot put two ranks on one GPU;
- replicas or tensor-parallel ranks that need more GPUs than there are: one process per rank over gloo, the
  ranks sharing the GPUs round robin, their tensors crossing through host memory (pipedp/wire.py; slower
  than NCCL: for tests and small jobs);
- ``device="cuda"`` without a GPU: refused, naming the fix. Never silently on the CPU when GPUs are there.

``local_device(local_rank, gpus)``: a rank's GPU under NCCL, refused when two ranks would share one.
``backend_for(device, gpus, ranks_here)``: the backend of ranks started by torchrun: NCCL with a GPU per rank,
gloo on the CPU, or gloo with ``device="cuda"`` where ranks share a GPU (tensors cross through host memory:
pipedp/wire.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ..errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def no_cuda() -> ConfigError:
    """The refusal of device "cuda" where torch sees no GPU."""
    return ConfigError(
        "device 'cuda' but torch sees no CUDA device (a CPU build of torch, or CUDA_VISIBLE_DEVICES hides them): "
        "install torch with CUDA, or use device 'cpu' (--device cpu)",
        "device",
    )


@dataclass(frozen=True)
class Placement:
    processes: bool  # one process per rank (else every stage in this one)
    backend: Optional[str]  # "gloo" / "nccl" across processes; None in one process
    devices: Tuple[str, ...]  # per rank (processes) or per stage (one process)

    def describe(self) -> str:
        where = ", ".join(f"{'rank' if self.processes else 'stage'} {i} on {d}" for i, d in enumerate(self.devices))
        how = f"{len(self.devices)} processes over {self.backend}" if self.processes else "one process"
        if self.shared:
            how += " (ranks sharing GPUs: their tensors cross through host memory, slower than NCCL)"
        return f"pipedp: {how}: {where}"

    @property
    def shared(self) -> bool:
        """Processes over gloo on GPUs: several ranks on one GPU."""
        return self.processes and self.backend == "gloo" and self.devices[0].startswith("cuda")


def place(
    stages: int, replicas: int, device: str, gpus: int, inprocess: bool = False, tensor_parallel: int = 1
) -> Placement:
    """The placement of ``stages`` x ``replicas`` ranks on this machine with ``gpus`` CUDA devices."""
    if device not in DEVICES:
        raise ConfigError(f"device: one of {DEVICES}, got {device!r}", "device")
    world = stages * replicas * tensor_parallel
    one_process = inprocess or world == 1
    if device == "cuda" and gpus == 0:
        raise no_cuda()
    if device == "cpu" or gpus == 0:
        if one_process:
            return Placement(False, None, ("cpu",) * stages)
        return Placement(True, "gloo", ("cpu",) * world)
    if not one_process and gpus >= world:
        return Placement(True, "nccl", tuple(f"cuda:{r}" for r in range(world)))
    if replicas > 1 or tensor_parallel > 1:  # a process per rank, more than the GPUs: they share them over gloo
        return Placement(True, "gloo", tuple(f"cuda:{r % gpus}" for r in range(world)))
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
            f"on one GPU; start at most {gpus} ranks per node (torchrun --nproc_per_node {gpus}), or share the "
            f"GPU(s) over gloo with device='cuda' (PipelineConfig and init_from_env; tensors cross through host "
            "memory, slower than NCCL: tests and small jobs), or use gloo on the CPU (--device cpu), or run the "
            "stages in one process (pipedp train without torchrun spreads them over the GPUs)",
            "device",
        )
    return local_rank


def backend_for(device: str, gpus: int, ranks_here: int, masked: bool = False) -> str:
    """The backend of ranks that torchrun started (``ranks_here`` on this node, ``gpus`` visible to each):
    gloo on the CPU (``device="cpu"``, or no GPU); NCCL where each rank has its own GPU; gloo with
    ``device="cuda"`` where there are fewer GPUs than ranks (the ranks share them). With ``device="auto"`` and
    fewer GPUs than ranks, ``local_device`` refuses, naming the choices: never silently on the CPU."""
    if device not in DEVICES:
        raise ConfigError(f"device: one of {DEVICES}, got {device!r}", "device")
    if device == "cuda" and gpus == 0:
        raise no_cuda()
    if device == "cpu" or gpus == 0:
        return "gloo"
    if device == "cuda" and ranks_here > gpus and not (gpus == 1 and masked):
        return "gloo"
    return "nccl"  # (too few GPUs with "auto": local_device says so, naming the choices, before init)
