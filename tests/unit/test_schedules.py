import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import Action, Kind, Schedule, ScheduleError, build, simulate, validate

NO_W = {Kind.F: 1.0, Kind.I: 1.0, Kind.W: 0.0}


def test_text_form_round_trips():
    for text in ["1F3", "0SEND_F12", "3NORM_REDUCE0", "2W7", "1RECV_B4"]:
        assert str(Action.parse(text)) == text
    s = build("1f1b", 3, 4)
    assert Schedule.from_text("1f1b", s.to_text()).actions == s.actions
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("F1")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@given(p=st.integers(1, 8), m=st.integers(1, 16))
@settings(max_examples=40, deadline=None)
def test_builders_are_valid_and_bubble_matches_theory(name, p, m):
    schedule = build(name, p, m)
    validate(schedule)
    result = simulate(schedule, NO_W)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)


@given(p=st.integers(1, 8), m=st.integers(1, 16))
@settings(max_examples=40, deadline=None)
def test_peak_inflight_1f1b_at_most_p_gpipe_m(p, m):
    assert simulate(build("1f1b", p, m)).peak_inflight[0] == min(p, m)
    assert simulate(build("gpipe", p, m)).peak_inflight[0] == m
    # DP captures (F done, W not yet) stay bounded by p under 1F1B with the lagged W placement
    assert max(simulate(build("1f1b", p, m)).peak_captured) <= min(p, m) + 1


def test_unknown_schedule_name():
    with pytest.raises(ValueError, match="unknown schedule 'zb'.*1f1b.*gpipe"):
        build("zb", 2, 2)


def test_validator_catches_broken_schedules():
    good = build("1f1b", 2, 2)
    # W before its norm reduce: a clip before all stages' norms are summed
    acts = {s: list(a) for s, a in good.actions.items()}
    w = next(a for a in acts[1] if a.kind is Kind.W)
    acts[1].remove(w)
    acts[1].insert(0, w)
    with pytest.raises(ScheduleError, match="1W0 comes before 1NORM_REDUCE0"):
        validate(Schedule("broken", 2, 2, acts))
    # a send without its receive
    acts = {s: list(a) for s, a in good.actions.items()}
    acts[1] = [a for a in acts[1] if not (a.kind is Kind.RECV_F and a.microbatch == 1)]
    with pytest.raises(ScheduleError, match="RECV_F of micro-batch 1 appears 0 times"):
        validate(Schedule("broken", 2, 2, acts))
    # swapped receive order: structurally complete but deadlocks/mismatches
    acts = {s: list(a) for s, a in good.actions.items()}
    i0 = acts[0].index(Action(0, Kind.RECV_B, 0))
    i1 = acts[0].index(Action(0, Kind.RECV_B, 1))
    acts[0][i0], acts[0][i1] = acts[0][i1], acts[0][i0]
    with pytest.raises(ScheduleError):
        validate(Schedule("broken", 2, 2, acts))


def test_simulator_is_fast_at_scale():
    start = time.perf_counter()
    result = simulate(build("1f1b", 64, 512))
    assert time.perf_counter() - start < 20
    assert result.peak_inflight[0] == 64


@pytest.mark.parametrize("name, factor", [("dp-zb", 1), ("dp-zb-2x", 2)])
@given(p=st.integers(1, 8), m=st.integers(1, 24), f=st.floats(0.3, 2), i=st.floats(0.3, 3), w=st.floats(0.1, 2))
@settings(max_examples=40, deadline=None)
def test_dp_zero_bubble_is_valid_bounded_and_never_slower_than_1f1b(name, factor, p, m, f, i, w):
    costs = {Kind.F: f, Kind.I: i, Kind.W: w}
    schedule = build(name, p, m, costs)
    validate(schedule)  # sends meet receives in order, F < I < NORM_REDUCE < W, no deadlock
    result = simulate(schedule, costs)
    assert max(result.peak_captured) <= factor * p + 1  # DP captures: 1F1B's bound (x2 for -2x)
    assert result.makespan <= simulate(build("1f1b", p, m), costs).makespan * (1 + 1e-9)


def test_dp_zero_bubble_fills_bubbles_where_1f1b_leaves_them():
    costs = {Kind.F: 1.0, Kind.I: 2.0, Kind.W: 0.7}  # I heavier than F, as per-sample norms make it
    one_f = simulate(build("1f1b", 4, 8), costs)
    zb = simulate(build("dp-zb-2x", 4, 8, costs), costs)
    assert zb.makespan < 0.96 * one_f.makespan and zb.bubble_fraction < one_f.bubble_fraction


def test_each_send_meets_its_receive_on_the_peer_and_channel():
    from schedules import ACTIVATIONS, COMMUNICATION_KINDS, GRADIENTS

    pairs = {Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B}
    assert set(pairs) | set(pairs.values()) == COMMUNICATION_KINDS
    for send, recv in pairs.items():
        assert send.peer == -recv.peer and send.channel == recv.channel  # stage s sends to s + p, which hears s
    assert Kind.SEND_F.peer == +1 and Kind.SEND_F.channel == ACTIVATIONS  # activations go forward
    assert Kind.SEND_B.peer == -1 and Kind.SEND_B.channel == GRADIENTS  # gradients back
    with pytest.raises(ValueError, match="W is not a communication"):
        getattr(Kind.W, "channel")  # noqa: B009 (the property raises)
