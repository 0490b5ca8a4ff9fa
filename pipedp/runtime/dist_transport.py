"""Transport over torch.distributed: P2P activations/gradients, norm all-reduce.

Every tensor travels as a small int64 header (micro-batch id, channel, how many tensors the
message holds, dtype, shape) followed by its payload; a tuple of tensors (several values
crossing one cut) is its tensors one after the other, and an empty tuple is one header.
The receiver allocates from the header and checks the micro-batch id, so a
message of another shape can never land in a stale buffer (on gloo a smaller message
into a larger buffer succeeds silently), and an out-of-order message is an error, not a
wrong gradient. Sends are non-blocking (isend) and completed at the end of the pass.
Activations and gradients travel on two separate process groups (two communicators):
in 1F1B neighbours send to each other at the same time, and on NCCL, where the operations
of one communicator run in order on one stream, one shared channel could block a send
behind a receive that waits for it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from schedules import Kind

from ..errors import TransportError
from .microbatch import Activation

_HEADER = 11  # mb, channel, parts, dtype code, ndim, up to 6 dims
_BARE = -1  # "parts" of a bare tensor; a tuple of k tensors says k
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]
_CHANNEL = {Kind.SEND_F: 0, Kind.RECV_F: 0, Kind.SEND_B: 1, Kind.RECV_B: 1}
_NAMES = {0: "activation", 1: "gradient"}


@dataclass
class PipelineGroups:
    """The process groups of one pipeline (one replica's stages)."""

    activations: object  # forward P2P
    gradients: object  # backward P2P
    norms: object  # the per-sample norm all-reduce


class DistReduction:
    def __init__(self, work, tensor: torch.Tensor):
        self.work, self.tensor = work, tensor

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.tensor.cpu()


class DistTransport:
    def __init__(self, stage: int, rank: int, prev_rank, next_rank, groups: "PipelineGroups", device: torch.device):
        self.stage, self.rank = stage, rank
        self.peer = {Kind.SEND_F: next_rank, Kind.RECV_B: next_rank, Kind.SEND_B: prev_rank, Kind.RECV_F: prev_rank}
        self.channel_group = {0: groups.activations, 1: groups.gradients}
        self.group = groups.norms
        self.device = device
        self._pending: Dict[tuple, List] = {}  # (channel, mb) -> [(work, tensor kept alive)]

    def send(self, kind: Kind, mb: int, message: Activation) -> None:
        tensors = [message] if isinstance(message, torch.Tensor) else list(message)
        parts = _BARE if isinstance(message, torch.Tensor) else len(tensors)
        for tensor in tensors:
            if tensor.dtype not in _DTYPES:
                raise TransportError(f"cannot send a {tensor.dtype} tensor between stages: use one of {_DTYPES}")
            if tensor.dim() > _HEADER - 5:
                raise TransportError(f"cannot send a {tensor.dim()}-d tensor between stages (at most {_HEADER - 5})")
        dst, group = self.peer[kind], self.channel_group[_CHANNEL[kind]]
        sent = self._pending.setdefault((_CHANNEL[kind], mb), [])
        if not tensors:  # an empty message: its header says so
            header = self._header(mb, kind, 0, None)
            sent.append((dist.isend(header, dst, group=group), header))
        for tensor in tensors:
            tensor = tensor.detach().contiguous()
            header = self._header(mb, kind, parts, tensor)
            sent.extend([(dist.isend(header, dst, group=group), header), (dist.isend(tensor, dst, group=group), tensor)])

    def _header(self, mb: int, kind: Kind, parts: int, tensor) -> torch.Tensor:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[:3] = torch.tensor([mb, _CHANNEL[kind], parts])
        if tensor is not None:
            header[3:5] = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim()])
            header[5 : 5 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        return header.to(self.device)

    def recv(self, kind: Kind, mb: int) -> Activation:
        parts, first = self._recv_one(kind, mb)
        if parts == _BARE:
            return first
        if parts == 0:
            return ()
        return (first,) + tuple(self._recv_one(kind, mb)[1] for _ in range(parts - 1))

    def _recv_one(self, kind: Kind, mb: int) -> Tuple[int, torch.Tensor]:
        src, group = self.peer[kind], self.channel_group[_CHANNEL[kind]]
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        self._wait_for(lambda: dist.recv(header, src, group=group), src, kind, mb)
        got_mb, channel, parts, dtype, ndim = (int(v) for v in header[:5].tolist())
        if got_mb != mb or channel != _CHANNEL[kind]:
            raise TransportError(
                f"stage {self.stage} expected the {_NAMES[_CHANNEL[kind]]} of micro-batch {mb} from rank {src}, "
                f"got the {_NAMES.get(channel, channel)} of micro-batch {got_mb}: the ranks run different schedules"
            )
        if parts == 0:
            return 0, header
        shape = [int(v) for v in header[5 : 5 + ndim].tolist()]
        payload = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
        self._wait_for(lambda: dist.recv(payload, src, group=group), src, kind, mb)
        return parts, payload

    def _wait_for(self, receive, src: int, kind: Kind, mb: int) -> None:
        """A receive that names the silent peer when it times out or the peer's connection breaks."""
        try:
            receive()
        except RuntimeError as exc:
            raise TransportError(
                f"rank {self.rank} (stage {self.stage}) got no {_NAMES[_CHANNEL[kind]]} of micro-batch {mb} from "
                f"rank {src}: rank {src} stopped answering or died ({str(exc).splitlines()[0][:200]})"
            ) from exc

    def norm_reduce_start(self, mb: int, squared_norms: torch.Tensor) -> DistReduction:
        tensor = squared_norms.to(self.device).clone()
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return DistReduction(work, tensor)

    def release(self, kind: Kind, mb: int) -> None:
        """The peer has received what this stage sent as ``kind`` for ``mb``: complete it, free it."""
        for work, _ in self._pending.pop((_CHANNEL[kind], mb), []):
            work.wait()

    def finish_pass(self) -> None:
        for sends in self._pending.values():
            for work, _ in sends:
                work.wait()
        self._pending = {}
