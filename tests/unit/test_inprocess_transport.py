"""The in-process transport's mailboxes: a message goes to the peer its kind names, on its channel, in order;
what is not there blocks; a micro-batch out of order and a message left unreceived are refused."""

import pytest
import torch

from pipedp.errors import TransportError
from pipedp.runtime.inprocess_transport import InProcessHub
from pipedp.runtime.protocols import WouldBlock
from schedules import Kind


def test_messages_reach_the_peer_on_their_channel_in_order():
    hub = InProcessHub(stages=2)
    first, second = hub.transport(0), hub.transport(1)
    with pytest.raises(WouldBlock):
        second.recv(Kind.RECV_F, 0)
    first.send(Kind.SEND_F, 0, torch.ones(2))
    first.send(Kind.SEND_F, 1, torch.full((2,), 2.0))
    with pytest.raises(WouldBlock):  # an activation is not a gradient
        first.recv(Kind.RECV_B, 0)
    assert second.recv(Kind.RECV_F, 0).tolist() == [1.0, 1.0]
    with pytest.raises(
        TransportError, match="expected the activation of micro-batch 0 from stage 0, got micro-batch 1"
    ):
        second.recv(Kind.RECV_F, 0)
    second.send(Kind.SEND_B, 0, torch.zeros(2))
    assert first.recv(Kind.RECV_B, 0).tolist() == [0.0, 0.0]
    with pytest.raises(TransportError, match="messages left unreceived"):
        hub.end_pass()
    assert second.recv(Kind.RECV_F, 1).tolist() == [2.0, 2.0]
    hub.end_pass()


def test_the_norm_reduction_waits_for_every_stage_and_sums():
    hub = InProcessHub(stages=2)
    waiting = hub.transport(0).norm_reduce_start(0, torch.tensor([1.0, 2.0]))
    with pytest.raises(WouldBlock):
        waiting.wait()
    hub.transport(1).norm_reduce_start(0, torch.tensor([3.0, 4.0]))
    assert waiting.wait().tolist() == [4.0, 6.0]
