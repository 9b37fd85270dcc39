"""``after_fork``'s clock exchange: the correction of a restored child's clock made on
the op's own connection (protocol 4), and both directions of compatibility with
peers that do not know it.

The agent runs in this process, so its clock is the host's: every step these tests
make the agent apply is a correction of a transit time of microseconds, and the
guest's clock ending up near the host's is checked on the arithmetic
(``clock_exchange_step``), which is where it is decided.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.unit.agent_support import Agent, running_agent
from vmfork.agent import client
from vmfork.agent import conn as agent_conn
from vmfork.agent import server as agent_server
from vmfork.agent.client import (
    AgentProtocolError,
    clock_exchange_step,
)
from vmfork.agent.conn import Conn
from vmfork.agent.protocol import (
    HEADER,
    MAX_CLOCK_STEP_NS,
    ConnectionClosed,
    Frame,
    encode_header,
    recv_frame,
    send_frame,
)


@pytest.fixture
def agent() -> Iterator[Agent]:
    with running_agent() as a:
        yield a


def _count_ops(agent: Agent, *ops: str) -> dict[str, int]:
    """Count the connections the agent serves for ``ops`` (each op is one)."""
    counts = dict.fromkeys(ops, 0)
    for op in ops:
        handler = agent.server._handlers[op]

        def counted(conn: Conn, frame: Frame, op: str = op,
                    handler: Any = handler) -> None:
            counts[op] += 1
            handler(conn, frame)

        agent.server._handlers[op] = counted
    return counts


def _request(exchange: bool | None) -> dict[str, Any]:
    header: dict[str, Any] = {"op": "after_fork", "ns": time.time_ns()}
    if exchange is not None:
        header["clock_exchange"] = exchange
    return header


# -- the arithmetic ------------------------------------------------------------------


def test_the_step_is_half_the_round_trip_net_of_the_guest_processing() -> None:
    # T1 = 1000; the request takes 30 ns to arrive (the guest's clock is set to 1000
    # then, 30 ns behind), the guest works 50 ns, the answer takes 70 ns back.
    step, round_trip = clock_exchange_step(1000, 1050, 50, 1150)
    assert (step, round_trip) == (50, 100)


def test_the_guest_ends_within_half_the_round_trip_of_the_host() -> None:
    rng = random.Random(19)
    for _ in range(10_000):
        there, back, processing = (rng.randrange(0, 10**10) for _ in range(3))
        skew = rng.randrange(-10**9, 10**9)    # the guest's clock minus the host's
        sent = rng.randrange(1, 2**62)
        guest_set = sent + there + skew           # its clock when it was set (T2)
        guest_read = guest_set + processing       # T3
        received = sent + there + processing + back
        step, round_trip = clock_exchange_step(sent, guest_read, processing, received)
        assert round_trip == there + back
        off_after = skew + step                   # the guest minus the host, stepped
        assert abs(off_after) <= round_trip // 2 + 1


def test_a_lying_processing_time_cannot_make_the_bound_negative() -> None:
    assert clock_exchange_step(1000, 1000, -5, 1100) == (50, 100)  # as if 0
    assert clock_exchange_step(1000, 1000, 10**12, 1100)[1] == 0   # as if the whole trip
    assert clock_exchange_step(1000, 1000, 0, 900)[1] == 0          # the host's clock ran back


# -- the frames ----------------------------------------------------------------------


def test_the_exchange_sends_the_clock_then_takes_the_step_then_answers(agent: Agent) -> None:
    with agent.raw() as sock:
        send_frame(sock, _request(True), os.urandom(32))
        clock = recv_frame(sock)
        assert clock.type == "clock"
        assert isinstance(clock.header["ns"], int)
        assert isinstance(clock.header["processing_ns"], int)
        assert clock.header["processing_ns"] >= 0
        send_frame(sock, {"type": "clock_step", "offset_ns": 0})
        result = recv_frame(sock).header
        assert result["type"] == "result" and result["reseed"]["bytes"] == 32
        step = result["clock_step"]
        assert step["offset_ns"] == 0 and step["previous_ns"] == step["ns"], \
            "a zero step leaves the clock alone"
        with pytest.raises(ConnectionClosed) as closed:
            recv_frame(sock)
        assert closed.value.clean


def test_without_the_field_the_agent_answers_at_once_as_before(agent: Agent) -> None:
    for exchange in (None, False):
        with agent.raw() as sock:
            send_frame(sock, _request(exchange), os.urandom(32))
            result = recv_frame(sock).header
            assert result["type"] == "result" and "clock_step" not in result
            assert result["clock"]["ns"] > 0


def test_a_host_that_never_sends_the_step_gets_the_result_anyway(
        agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_server, "CLOCK_STEP_TIMEOUT", 0.3)
    with agent.raw() as sock:
        send_frame(sock, _request(True), os.urandom(32))
        assert recv_frame(sock).type == "clock"
        result = recv_frame(sock).header   # the raw socket gives up after 10 s
        assert result["type"] == "result" and result["clock_step"] is None
        assert result["reseed"]["bytes"] == 32


def test_a_step_trickled_a_byte_at_a_time_cannot_outlast_the_wait(
        agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_server, "CLOCK_STEP_TIMEOUT", 0.5)
    body = encode_header({"type": "clock_step", "offset_ns": 0})
    frame = HEADER.pack(len(body), 0) + body
    with agent.raw() as sock:
        send_frame(sock, _request(True), os.urandom(32))
        assert recv_frame(sock).type == "clock"
        sock.settimeout(0.2)
        result = None
        for byte in frame:
            sock.sendall(bytes([byte]))
            try:
                result = recv_frame(sock)
                break
            except TimeoutError:
                continue
        assert result is not None, "the agent waited for the whole trickled frame"
        assert result.type == "result" and result.header["clock_step"] is None


def test_a_host_that_half_closes_instead_gets_the_result(agent: Agent) -> None:
    with agent.raw() as sock:
        send_frame(sock, _request(True), os.urandom(32))
        assert recv_frame(sock).type == "clock"
        sock.shutdown(socket.SHUT_WR)
        result = recv_frame(sock).header
        assert result["type"] == "result" and result["clock_step"] is None


@pytest.mark.parametrize("step", [
    {"type": "eof"},
    {"type": "clock_step"},
    {"type": "clock_step", "offset_ns": "5"},
    {"type": "clock_step", "offset_ns": True},
    {"type": "clock_step", "offset_ns": 1.5},
    {"type": "clock_step", "offset_ns": MAX_CLOCK_STEP_NS + 1},
    {"type": "clock_step", "offset_ns": -MAX_CLOCK_STEP_NS - 1},
    {"type": "clock_step", "offset_ns": 10**40},
])
def test_a_malformed_or_oversized_step_is_refused_and_not_applied(
        agent: Agent, step: dict[str, Any]) -> None:
    with agent.raw() as sock:
        send_frame(sock, _request(True), os.urandom(32))
        clock = recv_frame(sock)
        assert clock.type == "clock"
        send_frame(sock, step)
        reply = recv_frame(sock).header
        assert reply["type"] == "error" and reply["error"] == "bad_request"
        assert "the clock is as the request set it" in reply["message"]
    # Not applied: the clock is where the request put it plus the time since, not a
    # step of an hour or more away.
    assert abs(time.time_ns() - clock.header["ns"]) < MAX_CLOCK_STEP_NS // 2


# -- the client, with this agent and with an older one ---------------------------------


def test_within_tolerance_one_connection_and_no_step(agent: Agent) -> None:
    counts = _count_ops(agent, "after_fork", "set_time")
    r = agent.client.after_fork(os.urandom(64), clock_tolerance_ns=10**12)
    assert counts == {"after_fork": 1, "set_time": 0}
    assert r.clock_step_ns == 0
    assert 0 < r.clock_error_bound_ns < 10**12
    assert (r.reseed.bytes, r.reseed.entropy_bits) == (64, 512)


def test_beyond_tolerance_the_step_rides_the_same_connection(agent: Agent) -> None:
    counts = _count_ops(agent, "after_fork", "set_time")
    r = agent.client.after_fork(os.urandom(64), clock_tolerance_ns=0)
    assert counts == {"after_fork": 1, "set_time": 0}, "no extra connection for the step"
    # The agent runs here: the request set the clock back by its transit time, the
    # step puts forward half the round trip.
    assert 0 < r.clock_step_ns < MAX_CLOCK_STEP_NS
    assert 0 <= r.clock_error_bound_ns
    assert abs(r.previous_ns - time.time_ns()) < 5_000_000_000


def test_a_round_trip_too_long_to_split_is_bracketed_again_on_fresh_connections(
        agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    # A guest just restored takes the request late and answers at once: half of such
    # a round trip is no estimate of the transit, so no step rides the exchange and
    # sync_clock brackets the clock again, as for an older agent.
    monkeypatch.setattr(client, "CLOCK_EXCHANGE_MAX_BOUND_NS", 1)
    counts = _count_ops(agent, "after_fork", "set_time")
    r = agent.client.after_fork(os.urandom(64), clock_tolerance_ns=0)
    assert counts == {"after_fork": 1, "set_time": 2}, "step_time(0), then the step"
    assert r.clock_step_ns != 0 and 0 <= r.clock_error_bound_ns


def test_a_step_sent_after_the_agent_hung_up_is_late_not_a_failure(
        agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    # A starved VMM answers the clock frame after the agent stopped waiting and hung
    # up: its send breaks, the result is still there to read, and the clock is
    # bracketed on fresh connections as for any step that came too late.
    monkeypatch.setattr(agent_server, "CLOCK_STEP_TIMEOUT", 0.05)
    monkeypatch.setattr(agent_conn, "DRAIN_TIMEOUT", 0.05)
    hung_up = []
    step = client.clock_exchange_step

    def slow_host(*args: int) -> tuple[int, int]:
        time.sleep(1.0)   # the agent's wait and drain are 0.1 s: it has hung up
        hung_up.append(True)
        return step(*args)

    monkeypatch.setattr(client, "clock_exchange_step", slow_host)
    counts = _count_ops(agent, "after_fork", "set_time")
    r = agent.client.after_fork(os.urandom(64), clock_tolerance_ns=0)
    assert hung_up
    assert counts == {"after_fork": 1, "set_time": 2}, "step_time(0), then the step"
    assert r.clock_step_ns != 0 and 0 <= r.clock_error_bound_ns
    assert r.reseed.bytes == 64


def _as_an_older_agent(agent: Agent) -> None:
    """``after_fork`` as protocol 3 serves it: the field is ignored."""
    current = agent.server._after_fork

    def older(conn: Conn, frame: Frame) -> None:
        header = {k: v for k, v in frame.header.items() if k != "clock_exchange"}
        current(conn, Frame(header, frame.payload))

    agent.server._handlers["after_fork"] = older


def test_an_older_agent_over_tolerance_gets_the_two_op_correction(agent: Agent) -> None:
    _as_an_older_agent(agent)
    counts = _count_ops(agent, "after_fork", "set_time")
    r = agent.client.after_fork(os.urandom(64), clock_tolerance_ns=0)
    assert counts == {"after_fork": 1, "set_time": 2}, "step_time(0), then the step"
    assert r.clock_step_ns != 0 and 0 <= r.clock_error_bound_ns


def test_an_older_agent_within_tolerance_gets_nothing_more(agent: Agent) -> None:
    _as_an_older_agent(agent)
    counts = _count_ops(agent, "after_fork", "set_time")
    r = agent.client.after_fork(os.urandom(64), clock_tolerance_ns=10**12)
    assert counts == {"after_fork": 1, "set_time": 0}
    assert r.clock_step_ns == 0 and r.clock_error_bound_ns > 0


@pytest.mark.parametrize("clock", [
    lambda sent: {"type": "clock", "ns": sent - 2 * MAX_CLOCK_STEP_NS, "processing_ns": 0},
    lambda sent: {"type": "clock", "ns": "now", "processing_ns": 0},
    lambda sent: {"type": "clock", "ns": sent, "processing_ns": None},
    lambda sent: {"type": "clock_step", "offset_ns": 0},
], ids=["hours-off", "ns-not-int", "no-processing", "wrong-type"])
def test_a_lying_clock_frame_is_a_protocol_error(
        agent: Agent, clock: Callable[[int], dict[str, Any]]) -> None:
    def lying(conn: Conn, frame: Frame) -> None:
        conn.send(clock(frame.header["ns"]))
        conn.recv(5.0)

    agent.server._handlers["after_fork"] = lying
    with pytest.raises(AgentProtocolError):
        agent.client.after_fork(os.urandom(64))
