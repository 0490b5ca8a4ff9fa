"""The seams of the runtime, as Protocols: what a transport, a pending norm reduction and a
runtime must offer. The executor and the trainer only talk to these; mypy checks in CI
that both implementations of each (in-process and torch.distributed) conform.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch

from schedules import Kind

from ..errors import TransportError
from .microbatch import Activation, Inputs, PassBatch
from .stage import Stage


class WouldBlock(Exception):
    """An in-process operation must wait for another stage (the driver retries it later)."""


class PeerAborted(TransportError):
    """A peer's pass failed: it sent an abort header in place of the expected message, and drains the pass
    (Executor.drain); so does this stage."""


class PendingReduction(Protocol):
    """A started sum of per-sample squared norms over the stages of one pipeline."""

    def wait(self) -> torch.Tensor:
        """The summed norms (in-process: raises WouldBlock while a stage has not joined)."""
        ...


class Transport(Protocol):
    """Moves one stage's activations, gradients and norms to its neighbours."""

    def send(self, kind: Kind, mb: int, message: Activation) -> None:
        """An activation or gradient message: a tensor or a tuple of tensors."""
        ...

    def recv(self, kind: Kind, mb: int) -> Activation:
        """The peer's message; PeerAborted if it sent an abort header instead."""
        ...

    def send_aborted(self, kind: Kind, mb: int) -> None:
        """An abort header in place of the whole message of ``kind``: this stage's pass failed."""
        ...

    def norm_reduce_start(self, mb: int, squared_norms: torch.Tensor) -> PendingReduction: ...

    def release(self, kind: Kind, mb: int) -> None:
        """The peer has received this stage's ``kind`` send (SEND_F / SEND_B) of ``mb``: free it."""
        ...

    def finish_pass(self) -> None:
        """Complete whatever this pass left in flight."""
        ...


class Runtime(Protocol):
    """Runs the passes of the stages this process holds, and the collectives of a step."""

    rank: int  # this process's global rank (0 in-process)
    replica: int  # its data-parallel replica
    replicas: int

    @property
    def local_stages(self) -> List[Stage]: ...

    def check_same_batch(self, inputs: Inputs, targets: torch.Tensor) -> None: ...

    def run_pass(self, batch: PassBatch) -> torch.Tensor:
        """One pipeline pass; returns float64 [3]: the sum of this replica's real-row losses, the number
        of its real rows left out for a non-finite gradient norm, and the number clipped (0 off the last
        stage)."""
        ...

    def run_eval(self, batch: PassBatch) -> torch.Tensor:
        """One forward-only pass (no capture, no gradient); float64 [3] as run_pass, loss sum first."""
        ...

    def sum_over_replicas(self, grads: List[torch.Tensor], owners: Optional[List[int]] = None) -> List[torch.Tensor]:
        """Each clipped sum added over the data-parallel replicas, in place: on every replica, or (a sharded
        optimizer's ``owners``: the replica of each) on its owner only; the others' are then scratch (a backend's
        reduce may write into them): they are dropped, never read."""
        ...

    def share_owned(self, parameters: List[torch.nn.Parameter], owners: List[int]) -> None:
        """A sharded optimizer: every parameter set, on every replica, to its owner's (which stepped it)."""
        ...

    def gather_owned(self, states: List[Optional[Dict[str, Any]]], owners: List[int]) -> List[Optional[Dict[str, Any]]]:
        """A sharded optimizer: each parameter's optimizer state (this replica's where it owns it, else None) from
        its owner onto replica 0's CPU, for the checkpoint; ``states`` as they were on the other replicas."""
        ...

    def broadcast_whole(self, stage: Stage, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """Tensor parallelism: the noisy sums of the parameters every rank of the stage holds whole, rank 0's on
        every rank (they are computed alike; this makes the steps identical by construction)."""
        ...

    def refuse_unequal_whole(self, stage: Stage, grads: List[torch.Tensor]) -> None:
        """Tensor parallelism: refuse, naming the parameter, a whole tensor whose clipped sum differs between the
        stage's ranks (it reads a rank's own slice); nothing otherwise."""
        ...

    def gather_slices(self, stage: Stage, items: List[Tuple[torch.Tensor, Any]]) -> Optional[List[torch.Tensor]]:
        """Tensor parallelism: each (tensor, its Shard or None) whole on the stage's tensor-parallel rank 0, which
        writes the stage's checkpoint file; None on the others. Without it, the tensors as they are."""
        ...

    def combine_tied(self, stage: Stage, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """A tied embedding / head: both clipped parts summed into the tensor(s) that get stepped."""
        ...

    def total(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over every rank."""
        ...

    def all_gather(self, obj: Any) -> List[Any]: ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        ...

    def gather_state(self) -> Optional[Dict[str, torch.Tensor]]:
        """The whole model's state dict (original names) on rank 0; None on the other ranks."""
        ...

    def abort_step(self, error: BaseException) -> None:
        """A step raised: drop what it left behind (messages in flight, captures, partial clipped sums),
        so that the next step is the one it would have been; a runtime that cannot (another rank may be
        past this step or still wait in it) refuses every later call with the first failure named."""
        ...

    def close(self) -> None:
        """Remove every hook the runtime put on the user's modules."""
        ...
