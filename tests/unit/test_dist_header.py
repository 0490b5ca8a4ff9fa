"""The distributed transport's message header (runtime/dist_transport.py), without processes: what a sender
writes is what the receiver checks, and a header of another channel, micro-batch or shape is refused by name."""

import pytest
import torch

from pipedp.errors import TransportError
from pipedp.runtime.dist_transport import _BARE, DistTransport, PipelineGroups
from pipedp.wire import Wire
from schedules import Kind


def transport(stage):
    return DistTransport(
        stage,
        stage,
        stage - 1 if stage else None,
        stage + 1,
        PipelineGroups(None, None, None),
        Wire(torch.device("cpu")),
    )


def test_a_header_says_what_the_receiver_checks():
    sender, receiver = transport(2), transport(1)  # stage 2 sends its input's gradient back to stage 1
    message = torch.zeros(3, 5, 7, dtype=torch.bfloat16)
    header = sender._header(4, Kind.SEND_B, _BARE, message)
    parts, code, shape = receiver._check(header, Kind.RECV_B, 4, None)
    assert parts == _BARE and shape == (3, 5, 7) and code == receiver._check(header, Kind.RECV_B, 4, None)[1]
    assert receiver._check(header, Kind.RECV_B, 4, (parts, code, shape)) == (parts, code, shape)


@pytest.mark.parametrize(
    "kind, mb, expected, says",
    [
        (
            Kind.RECV_F,
            4,
            None,
            "expected the activation of micro-batch 4 from rank 0, got the gradient of micro-batch 4",
        ),
        (Kind.RECV_B, 5, None, "expected the gradient of micro-batch 5 from rank 2, got the gradient of micro-batch 4"),
        (Kind.RECV_B, 4, (_BARE, 0, (3, 5, 7)), "as (parts, dtype, shape)"),  # another dtype than the pass's
    ],
)
def test_a_header_of_another_message_is_refused_by_name(kind, mb, expected, says):
    header = transport(2)._header(4, Kind.SEND_B, _BARE, torch.zeros(3, 5, 7, dtype=torch.bfloat16))
    with pytest.raises(TransportError, match=says.replace("(", r"\(").replace(")", r"\)")):
        transport(1)._check(header, kind, mb, expected)


def test_a_corrupt_channel_is_named_by_its_number():
    header = transport(2)._header(4, Kind.SEND_B, _BARE, torch.zeros(2))
    header[1] = 7
    with pytest.raises(TransportError, match="got the channel 7 of micro-batch 4"):
        transport(1)._check(header, Kind.RECV_B, 4, None)


def closed_connection(*args, **kwargs):
    """Gloo's error for a post to a rank whose connection is closed."""
    raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:29068")


def test_a_send_to_a_peer_whose_connection_closed_names_the_peer(monkeypatch):
    """Gloo fails the isend itself when the peer's connection is already closed (a killed node): the error is
    pipedp's, naming the peer, like a failed receive; the transport is marked broken."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "isend", closed_connection)
    sender = transport(1)
    with pytest.raises(
        TransportError,
        match=r"rank 1 \(stage 1\) could not send the activation of micro-batch 3 to rank 2: rank 2 stopped answering or died \(.*Connection closed by peer",
    ):
        sender.send(Kind.SEND_F, 3, torch.zeros(2))
    assert sender.broken


def test_a_norm_sum_started_after_a_peer_closed_its_connection_says_a_rank_died(monkeypatch):
    """The same for the all-reduce that sums the squared norms over the stages: its post fails alike."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_reduce", closed_connection)
    reducer = transport(1)
    with pytest.raises(
        TransportError,
        match=r"rank 1 \(stage 1\) could not start the sum of micro-batch 2's squared norms over the stages: a rank "
        r"stopped answering or died \(.*Connection closed by peer",
    ):
        reducer.norm_reduce_start(2, torch.ones(3))
    assert reducer.broken
