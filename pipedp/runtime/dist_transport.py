"""Transport over torch.distributed: P2P activations/gradients, norm all-reduce.

Every tensor travels with a small int64 header (micro-batch id, channel, how many tensors the
message holds, dtype, shape); a tuple of tensors (several values crossing one cut) is its
tensors one after the other, and an empty tuple is one header. The first message of each kind
in a pass sends the header on its own, then the payload allocated from it; every later one of
the same shape (the micro-batches of a pass are padded to one) travels as one buffer, header
bytes then payload bytes, of the size both sides now know: one message instead of two. A
message of a new shape is announced by a notice in that buffer, then sent as the first was. The receiver
checks every header against what it expects: a message of another shape can never land in a
stale buffer (on gloo a smaller message into a larger buffer succeeds silently), and an
out-of-order message is an error, not a wrong gradient. Sends are non-blocking (isend), freed
once the peer has provably received them, else at the end of the pass. Every tensor crosses on the stage's
wire (pipedp/wire.py): host copies where the stage is on a GPU and the groups run gloo.
Activations and gradients travel on two separate process groups (two communicators):
in 1F1B neighbours send to each other at the same time, and on NCCL, where the operations
of one communicator run in order on one stream, one shared channel could block a send
behind a receive that waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from schedules import ACTIVATIONS, CHANNEL_NAMES, GRADIENTS, Kind

from ..errors import TransportError
from ..wire import Wire
from .microbatch import Activation
from .protocols import PeerAborted

_HEADER = 11  # mb, channel, parts, dtype code, ndim, up to 6 dims
_HEADER_BYTES = 8 * _HEADER  # a multiple of every element size: the payload after it views as any dtype
_BARE = -1  # "parts" of a bare tensor; a tuple of k tensors says k
_RESHAPED = -2  # "parts" of a notice in a joined buffer: this message has a new shape, its header follows
_ABORTED = -3  # "parts" of a header sent in place of a message: the sender's step failed, it drains the pass
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
Spec = Tuple[int, Tuple[Tuple[int, Tuple[int, ...]], ...]]  # parts, then (dtype code, shape) of each tensor


def _channel_name(channel: int) -> str:
    """A received header's channel, named (a corrupt one as its number)."""
    return CHANNEL_NAMES[channel] if 0 <= channel < len(CHANNEL_NAMES) else f"channel {channel}"


def _spec(parts: int, tensors: List[torch.Tensor]) -> Spec:
    return parts, tuple((_DTYPES.index(t.dtype), tuple(t.shape)) for t in tensors)


def _joined_bytes(code: int, shape: Tuple[int, ...]) -> int:
    """The size of a joined buffer: the header, then the payload's bytes."""
    return _HEADER_BYTES + _DTYPES[code].itemsize * int(torch.Size(shape).numel())


@dataclass
class PipelineGroups:
    """The process groups of one pipeline (one replica's stages)."""

    activations: object  # forward P2P
    gradients: object  # backward P2P
    norms: object  # the per-sample norm all-reduce


class DistReduction:
    def __init__(self, work, tensor: torch.Tensor, transport: "DistTransport"):
        self.work, self.tensor, self.transport = work, tensor, transport

    def wait(self) -> torch.Tensor:
        self.transport.complete(self.work, "the norm all-reduce")
        return self.tensor.cpu()


class DistTransport:
    def __init__(self, stage: int, rank: int, prev_rank, next_rank, groups: "PipelineGroups", wire: Wire):
        self.stage, self.rank = stage, rank
        self.neighbour = {+1: next_rank, -1: prev_rank}  # by Kind.peer
        self.channel_group = {ACTIVATIONS: groups.activations, GRADIENTS: groups.gradients}
        self.group = groups.norms
        self.wire = wire
        self._pending: Dict[tuple, List] = {}  # (channel, mb) -> [(work, tensor kept alive)]
        # this pass's message shapes, by (side, channel, n): the n-th message of a micro-batch on a channel
        self._known: Dict[tuple, Spec] = {}
        self._count: Dict[tuple, int] = {}  # (side, channel, mb) -> messages so far
        self.broken = False  # a receive, send or reduction failed: the channels are no longer in step

    def _slot(self, side: str, kind: Kind, mb: int) -> tuple:
        count = (side, kind.channel, mb)
        n = self._count.get(count, 0)
        self._count[count] = n + 1
        return side, kind.channel, n

    def send(self, kind: Kind, mb: int, message: Activation) -> None:
        tensors = [message] if isinstance(message, torch.Tensor) else list(message)
        parts = _BARE if isinstance(message, torch.Tensor) else len(tensors)
        for tensor in tensors:
            if tensor.dtype not in _DTYPES:
                raise TransportError(f"cannot send a {tensor.dtype} tensor between stages: use one of {_DTYPES}")
            if tensor.dim() > _HEADER - 5:
                raise TransportError(f"cannot send a {tensor.dim()}-d tensor between stages (at most {_HEADER - 5})")
        tensors = [t.detach().contiguous() for t in tensors]
        sent = self._pending.setdefault((kind.channel, mb), [])
        slot = self._slot("send", kind, mb)
        spec = _spec(parts, tensors)
        known = self._known.get(slot)
        if known == spec:  # header and payload in one buffer of the size the receiver expects
            for tensor in tensors:
                header = self._header(mb, kind, parts, tensor).view(torch.uint8).to(tensor.device)
                joined = self.wire.out(torch.cat([header, tensor.reshape(-1).view(torch.uint8)]))
                sent.append(self._post(joined, kind, mb))
            return
        if known is not None:  # another shape than this pass's earlier micro-batches: say so in the
            code, shape = known[1][0]  # buffer the receiver expects, then announce the new shape
            padding = torch.zeros(_joined_bytes(code, shape) - _HEADER_BYTES, dtype=torch.uint8)
            notice = self.wire.copy(torch.cat([self._header(mb, kind, _RESHAPED, None).view(torch.uint8), padding]))
            sent.append(self._post(notice, kind, mb))
        if tensors:  # an empty message is never remembered: it always sends its header
            self._known[slot] = spec
        else:
            header = self.wire.copy(self._header(mb, kind, 0, None))
            sent.append(self._post(header, kind, mb))
        for tensor in tensors:  # the header on its own, then the payload allocated from it
            header = self.wire.copy(self._header(mb, kind, parts, tensor))
            sent.extend([self._post(header, kind, mb), self._post(self.wire.out(tensor), kind, mb)])

    def send_aborted(self, kind: Kind, mb: int) -> None:
        """One header in place of the whole message (every tensor of it): this stage's step failed. It fits
        any buffer the receiver posts first (a header, or a larger joined buffer: gloo takes a smaller
        message into a larger buffer), and the receiver then stops reading that message."""
        self._slot("send", kind, mb)
        header = self.wire.copy(self._header(mb, kind, _ABORTED, None))
        self._pending.setdefault((kind.channel, mb), []).append(self._post(header, kind, mb))

    def _post(self, tensor: torch.Tensor, kind: Kind, mb: int) -> tuple:
        """One isend, kept with its tensor until it completes. Gloo fails the post itself when the peer's
        connection is already closed: that names the peer like a failed receive."""
        dst, group = self.neighbour[kind.peer], self.channel_group[kind.channel]
        try:
            return dist.isend(tensor, dst, group=group), tensor
        except RuntimeError as exc:
            what = f"could not send the {CHANNEL_NAMES[kind.channel]} of micro-batch {mb} to rank {dst}"
            raise self._lost(f"{what}: rank {dst} stopped answering or died", exc) from exc

    def _lost(self, what: str, exc: RuntimeError) -> TransportError:
        """The error for a call gloo failed (a timeout, a closed connection), the transport marked broken."""
        self.broken = True
        return TransportError(f"rank {self.rank} (stage {self.stage}) {what} ({str(exc).splitlines()[0][:200]})")

    def _header(self, mb: int, kind: Kind, parts: int, tensor) -> torch.Tensor:
        """The message's header, on the host (``wire.copy`` puts it on the wire: on a GPU, one copy)."""
        values = [mb, kind.channel, parts]
        if tensor is not None:
            values += [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        return torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64)

    def recv(self, kind: Kind, mb: int) -> Activation:
        slot = self._slot("recv", kind, mb)
        known = self._known.get(slot)
        tensors: List[torch.Tensor] = []
        if known is not None:
            parts = known[0]
            for code, shape in known[1]:
                tensor = self._recv_joined(kind, mb, parts, code, shape)
                if tensor is None:  # a notice: this micro-batch's message has a new shape
                    known, tensors = None, []
                    break
                tensors.append(tensor)
        if known is None:
            parts, first = self._recv_one(kind, mb)
            tensors = [] if parts == 0 else [first] + [self._recv_one(kind, mb)[1] for _ in range(parts - 1)]
            if tensors:
                self._known[slot] = _spec(parts, tensors)
        if parts == _BARE:
            return tensors[0]
        return tuple(tensors)

    def _recv_one(self, kind: Kind, mb: int) -> Tuple[int, torch.Tensor]:
        src, group = self.neighbour[kind.peer], self.channel_group[kind.channel]
        header = self.wire.empty((_HEADER,), torch.int64)
        self._wait_for(lambda: dist.recv(header, src, group=group), src, kind, mb)
        parts, dtype, shape = self._check(header, kind, mb, None)
        self._refuse_aborted(parts, kind, mb)
        if parts == 0:
            return 0, header
        payload = self.wire.empty(shape, _DTYPES[dtype])
        self._wait_for(lambda: dist.recv(payload, src, group=group), src, kind, mb)
        return parts, self.wire.back(payload)

    def _recv_joined(
        self, kind: Kind, mb: int, parts: int, code: int, shape: Tuple[int, ...]
    ) -> Optional[torch.Tensor]:
        """The payload of a joined buffer, or None for a notice that a new shape follows."""
        src, group = self.neighbour[kind.peer], self.channel_group[kind.channel]
        joined = self.wire.empty((_joined_bytes(code, shape),), torch.uint8)
        self._wait_for(lambda: dist.recv(joined, src, group=group), src, kind, mb)
        got = self._check(joined[:_HEADER_BYTES].view(torch.int64), kind, mb, (parts, code, shape))[0]
        self._refuse_aborted(got, kind, mb)
        if got == _RESHAPED:
            return None
        return self.wire.back(joined[_HEADER_BYTES:].view(_DTYPES[code]).view(shape))

    def _check(self, header: torch.Tensor, kind: Kind, mb: int, expected: Optional[tuple]):
        """The header's (parts, dtype code, shape), refused unless it is the expected message."""
        src = self.neighbour[kind.peer]
        got_mb, channel, parts, dtype, ndim = (int(v) for v in header[:5].tolist())
        if got_mb != mb or channel != kind.channel:
            raise TransportError(
                f"stage {self.stage} expected the {CHANNEL_NAMES[kind.channel]} of micro-batch {mb} from rank {src}, "
                f"got the {_channel_name(channel)} of micro-batch {got_mb}: the ranks run different schedules"
            )
        shape = tuple(int(v) for v in header[5 : 5 + ndim].tolist())
        if expected is not None and parts not in (_RESHAPED, _ABORTED) and (parts, dtype, shape) != expected:
            raise TransportError(
                f"stage {self.stage} got the {CHANNEL_NAMES[channel]} of micro-batch {mb} from rank {src} as (parts, dtype, "
                f"shape) {(parts, dtype, shape)}, expected {expected} like the earlier micro-batches of this pass"
            )
        return parts, dtype, shape

    def _refuse_aborted(self, parts: int, kind: Kind, mb: int) -> None:
        if parts == _ABORTED:
            raise PeerAborted(
                f"rank {self.neighbour[kind.peer]}'s step failed: it sent no {CHANNEL_NAMES[kind.channel]} of micro-batch {mb}"
            )

    def complete(self, work, what: str) -> None:
        """Wait for a send or reduction; a broken peer or a timeout is an error that says so."""
        try:
            work.wait()
        except RuntimeError as exc:
            raise self._lost(f"{what} did not complete: a rank stopped answering or died", exc) from exc

    def _wait_for(self, receive, src: int, kind: Kind, mb: int) -> None:
        """A receive that names the silent peer when it times out or the peer's connection breaks."""
        try:
            receive()
        except RuntimeError as exc:
            what = f"got no {CHANNEL_NAMES[kind.channel]} of micro-batch {mb} from rank {src}"
            raise self._lost(f"{what}: rank {src} stopped answering or died", exc) from exc

    def norm_reduce_start(self, mb: int, squared_norms: torch.Tensor) -> DistReduction:
        tensor = self.wire.copy(squared_norms)  # (summed in place: the caller's stays as it is)
        try:  # (as for a send: gloo fails the post itself once a rank's connection is closed)
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        except RuntimeError as exc:
            what = f"could not start the sum of micro-batch {mb}'s squared norms over the stages"
            raise self._lost(f"{what}: a rank stopped answering or died", exc) from exc
        return DistReduction(work, tensor, self)

    def release(self, kind: Kind, mb: int) -> None:
        """The peer has received what this stage sent as ``kind`` for ``mb``: complete it, free it."""
        for work, _ in self._pending.pop((kind.channel, mb), []):
            self.complete(work, f"the send of micro-batch {mb}")

    def finish_pass(self) -> None:
        for (_, mb), sends in self._pending.items():
            for work, _ in sends:
                self.complete(work, f"the send of micro-batch {mb}")
        self._pending = {}
        self._known, self._count = {}, {}  # the next pass may have other shapes
