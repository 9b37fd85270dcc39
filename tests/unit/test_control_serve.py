"""The native control server (``_core.ControlServe``, ``native/src/control_serve.rs``)
on a real Unix socket, with no machine: no vCPU loops (so a machine of none is paused,
as ``Machine.paused`` says of it), the hand-over handler ``vmmchild.handover_reply``
over a dispatch the test writes. What a client sees must be the protocol's
(``runtime.control``): one reply line per request line, in order, a refusal's text
``control.parse_request``'s, an overlong line refused and the connection dropped, at
most ``MAX_CONNECTIONS`` connections."""

from __future__ import annotations

import json
import os
import random
import socket
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_virtio_harness import GuestDriver, Window

from vmfork.runtime import control
from vmfork.runtime.vmmchild import StopSignal, handover_reply
from vmfork.vmm.devices.plan import boot_plan
from vmfork.vmm.devices.virtio.balloon import REPORTING_QUEUE, VIRTIO_BALLOON_F_REPORTING
from vmfork.vmm.devices.virtio.device import STATUS_FEATURES_OK, VIRTIO_F_VERSION_1
from vmfork.vmm.eventloop import NativeEventLoop, new_event_loop
from vmfork.vmm.machine import exit_profile_of
from vmfork.vmm.memory import GuestMemory
from vmfork.vmm.native import CORE_BUILT

if not CORE_BUILT:
    pytest.skip("the native core is not built", allow_module_level=True)

from vmfork import _core  # noqa: E402 - after the skip

MAX_CONNECTIONS = 16     # control_serve.rs
SEND_TIMEOUT_S = 2       # control_serve.rs
# `exits` spelled so the native server does not recognise it as plain: handed over.
EXITS_HANDED = b'{"op": "\\u0065xits"}'


class Served:
    """A server on ``path``, its stop signal, and the lines handed over to Python."""

    def __init__(self, path: Path, *, balloon: _core.NativeDevice | None = None,
                 jailed: bool = False,
                 dispatch: Callable[[control.AnyRequest], control.WireRecord] | None = None,
                 handler: Callable[[bytes, int], bytes] | None = None,
                 counters: Callable[[], _core.MachineCounts] | None = None) -> None:
        self.path = str(path)
        self.stop = StopSignal()
        self.handed: list[bytes] = []

        def default_dispatch(request: control.AnyRequest) -> control.WireRecord:
            if isinstance(request, control.Exits):
                return control.ExitsReply(profile={"hlt": 3})
            if isinstance(request, control.Status):
                return control.StatusReply(paused=False, exit=None)
            raise RuntimeError(f"{request.op} is not served here")

        def handover(line: bytes, fd: int) -> bytes:
            self.handed.append(line)
            return handover_reply(line, dispatch or default_dispatch)

        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        listener.bind(self.path)
        listener.listen(8)
        self.server = _core.ControlServe(listener.detach(), self.stop.write_fd, [], jailed,
                                         balloon, counters or (lambda: ((0, 0, 0, 0), [])),
                                         handler or handover)

    def connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(30)
        sock.connect(self.path)
        return sock

    def close(self) -> None:
        assert self.server.close(10.0)
        self.stop.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    made: list[Served] = []

    def make(**kwargs: object) -> Served:
        s = Served(tmp_path / f"control{len(made)}.sock", **kwargs)  # type: ignore[arg-type]
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def read_lines(sock: socket.socket, count: int) -> list[bytes]:
    buffer = b""
    while buffer.count(b"\n") < count:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {buffer!r}"
        buffer += chunk
    lines = buffer.split(b"\n")
    assert lines[count:] == [b""], "more than the replies asked for"
    return [line + b"\n" for line in lines[:count]]


def read_to_end(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def refusal(line: bytes) -> bytes:
    with pytest.raises(control.ControlError) as err:
        control.parse_request(line)
    return control.encode(control.error_reply(err.value.message))


def test_pause_resume_and_status_are_served_without_python(
        served: Callable[..., Served]) -> None:
    s = served(jailed=True)
    s.server.set_snapshot_status([("base", "restore"), (None, "previous"),
                                  ("t\u00e9\"\n\U0001f600", "previous")], "soft-dirty")
    with s.connect() as sock:
        sock.sendall(b'{"op": "pause"}\n{"op":"resume"}\n {"op" : "status"} \r\n')
        replies = read_lines(sock, 3)
    assert replies[:2] == [control.encode(control.Ack())] * 2
    assert replies[2] == control.encode(control.StatusReply(
        paused=True, exit=None,
        snapshot_bases=(control.SnapshotBase("base", "restore"),
                        control.SnapshotBase(None, "previous"),
                        control.SnapshotBase("t\u00e9\"\n\U0001f600", "previous")),
        snapshot_tracking="soft-dirty", jailed=True))
    assert s.handed == []


def test_status_says_the_exit_it_was_told(served: Callable[..., Served]) -> None:
    s = served()
    s.server.set_exit("reset")
    with s.connect() as sock:
        sock.sendall(b'{"op": "status"}\n')
        reply = control.parse_reply(control.Status(), read_lines(sock, 1)[0][:-1])
    assert reply == control.StatusReply(paused=True, exit="reset")


def test_status_with_a_balloon_is_served_natively_as_python_answers_it(
        served: Callable[..., Served]) -> None:
    """A native balloon that served a report: ``status`` is answered without Python,
    the very bytes ``control.encode`` writes for the counters the machine reports."""
    memory = GuestMemory.anonymous(16 << 20)
    loop = new_event_loop("control-balloon")
    assert isinstance(loop, NativeEventLoop) and memory.native is not None
    loop.start()
    irq = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        device = _core.NativeDevice.restore(boot_plan("balloon"), memory.native,
                                            loop.native_loop, irq, [None] * 3)
        windows = _core.MmioWindows()
        windows.add_native(0xD000_0000, device)
        driver = GuestDriver(Window(windows, 0xD000_0000), memory)  # type: ignore[arg-type]
        assert driver.negotiate(VIRTIO_F_VERSION_1 | VIRTIO_BALLOON_F_REPORTING) \
            & STATUS_FEATURES_OK
        queues = [driver.setup_queue(i, 64, 8 * 4096) for i in range(3)]
        driver.driver_ok()
        assert device.active
        reporting = queues[REPORTING_QUEUE]
        reporting.post(writable=[8 * 4096])   # one free block of 8 pages
        driver.notify(REPORTING_QUEUE)        # served on this thread (no ioeventfd)
        assert len(reporting.take_used()) == 1

        s = served(balloon=device)
        with s.connect() as sock:
            sock.sendall(b'{"op": "status"}\n')
            [line] = read_lines(sock, 1)
        assert s.handed == []
        age = json.loads(line)["free_page_reporting"]["last_report_age_s"]
        assert isinstance(age, float) and 0 <= age < 60
        assert line == control.encode(control.StatusReply(
            paused=True, exit=None, free_page_reporting=control.FreePageReporting(
                active=True, reports=1, bytes_discarded=8 * 4096, discard_errors=0,
                last_report_age_s=age)))
        device.close()
        assert not device.active
    finally:
        loop.stop()
        os.close(irq)
        memory.close()


def test_exits_is_served_natively_with_the_machines_counters(
        served: Callable[..., Served]) -> None:
    """No vCPU loops: an empty profile of theirs, the machine's counters asked for at
    each request (a Python machine's buses and lines), the bytes Python writes."""
    asked: list[int] = []

    def counters() -> _core.MachineCounts:
        asked.append(len(asked))
        return (1, 2, 3, len(asked)), [(4, 0), (5, 12)]

    s = served(counters=counters)
    with s.connect() as sock:
        sock.sendall(b'{"op": "exits"}\n' * 2)
        replies = read_lines(sock, 2)
    assert s.handed == []
    assert replies == [control.encode(control.ExitsReply(profile=exit_profile_of(
        {}, {}, (1, 2, 3, n), [(4, 0), (5, 12)]))) for n in (1, 2)]


def test_close_lets_go_of_the_machines_counters(tmp_path: Path) -> None:
    """A Python machine's counters are its bound method, and the machine holds the
    server: ``close`` lets go of them, so the pair needs no cycle collector."""
    class Machine:
        def counters(self) -> _core.MachineCounts:
            return (0, 0, 0, 0), []

    machine = Machine()
    gone = weakref.finalize(machine, lambda: None)
    s = Served(tmp_path / "control.sock", counters=machine.counters)
    del machine
    assert gone.alive
    s.close()
    assert not gone.alive


def test_counters_that_fail_are_an_error_reply(served: Callable[..., Served]) -> None:
    def counters() -> _core.MachineCounts:
        raise OSError("gone")

    s = served(counters=counters)
    with s.connect() as sock:
        sock.sendall(b'{"op": "exits"}\n{"op": "pause"}\n')
        assert read_lines(sock, 2) == [
            control.encode(control.error_reply("the machine's counters: gone")),
            control.encode(control.Ack())]


@pytest.mark.parametrize("seed", range(200))
def test_exits_bytes_are_pythons_for_the_same_counters(seed: int) -> None:
    """Random counters, ties likely, more I/O addresses than the profile lists,
    counts up to 2**64 - 1: the native reply is ``control.encode`` of
    ``Machine.exit_profile``'s dict, byte for byte."""
    rng = random.Random(seed)

    def count() -> int:
        return rng.choice([0, 1, 2, 3, rng.randrange(1 << 64)])

    reasons = ["hlt", "io", "mmio", "intr", "irq_window_open", "shutdown", "other\u00e9"]
    by_reason = {r: count() for r in rng.sample(reasons, rng.randrange(len(reasons) + 1))}
    io = {(rng.choice(["pio", "mmio", "other"]), rng.randrange(1 << rng.choice([4, 16, 40]))):
          count() for _ in range(rng.randrange(30))}
    unmapped = (count(), count(), count(), count())
    irqs = [(gsi, count()) for gsi in sorted(rng.sample(range(24), rng.randrange(6)))]
    assert _core.exits_reply_line(by_reason, io, unmapped, irqs) == control.encode(
        control.ExitsReply(profile=exit_profile_of(by_reason, io, unmapped, irqs)))


def test_a_client_that_never_reads_does_not_stall_the_others(
        served: Callable[..., Served]) -> None:
    """Requests whose replies fill the socket's buffer, never read: the control thread
    gives up on that connection after its send timeout and serves the next client."""
    s = served()
    hog = s.connect()
    hog.setblocking(False)
    request = b'{"op": "status"}\n' * 4096
    sent = 0
    try:
        # Until the server stops reading us: its replies to us have filled both buffers.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                sent += hog.send(request)
            except BlockingIOError:
                time.sleep(0.5)
                try:
                    sent += hog.send(request)
                except BlockingIOError:
                    break
        assert sent > 0
        started = time.monotonic()
        with s.connect() as sock:
            sock.sendall(b'{"op": "status"}\n')
            [line] = read_lines(sock, 1)
        assert json.loads(line)["ok"]
        assert time.monotonic() - started < SEND_TIMEOUT_S + 10
    finally:
        hog.close()


@pytest.mark.parametrize("line", [
    b"",
    b"not json",
    b"[1, 2]",
    b'{"op": "status"',
    b'{"op": "reboot"}',
    b'{"op": 7}',
    b'{"op": "status", "x": 1}',
    b'{"op": "snapshot", "mode": "full"}',
    b'{"op": "snapshot", "memory_path": "m", "state_path": "s", "parent": "p"}',
    b"\xff\xfe{",
    b"[" * 100_000,
])
def test_a_malformed_line_gets_parse_requests_refusal(
        served: Callable[..., Served], line: bytes) -> None:
    s = served()
    with s.connect() as sock:
        sock.sendall(line + b"\n" + b'{"op": "pause"}\n')
        assert read_lines(sock, 2) == [refusal(line), control.encode(control.Ack())]
    assert s.handed == [line]


def test_replies_come_in_request_order_across_both_sides(
        served: Callable[..., Served]) -> None:
    s = served()
    with s.connect() as sock:
        # One write, split at every byte boundary the kernel likes: the framing holds.
        sock.sendall(EXITS_HANDED + b'\n{"op": "status"}\n' + EXITS_HANDED
                     + b'\n{"op": "resume"}\n')
        replies = read_lines(sock, 4)
    exits = control.encode(control.ExitsReply(profile={"hlt": 3}))
    assert replies[0] == replies[2] == exits
    assert control.parse_reply(control.Status(), replies[1][:-1]).paused
    assert replies[3] == control.encode(control.Ack())


def test_a_line_sent_a_byte_at_a_time_is_one_request(served: Callable[..., Served]) -> None:
    s = served()
    with s.connect() as sock:
        for byte in EXITS_HANDED + b"\n":
            sock.send(bytes([byte]))
        assert read_lines(sock, 1) == [control.encode(control.ExitsReply({"hlt": 3}))]


def test_a_dispatch_that_raises_is_an_error_reply(served: Callable[..., Served]) -> None:
    s = served()
    with s.connect() as sock:
        sock.sendall(b'{"op": "snapshot", "memory_path": "m", "state_path": "s"}\n')
        assert read_lines(sock, 1) == [control.encode(control.error_reply(
            "RuntimeError: snapshot is not served here"))]


def test_a_handler_that_fails_is_an_error_reply_not_the_servers_end(
        served: Callable[..., Served]) -> None:
    answers: list[object] = [ValueError("boom"), "a str, not bytes", b"two\nlines\n"]

    def handler(line: bytes, fd: int) -> bytes:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[return-value]

    s = served(handler=handler)
    with s.connect() as sock:
        sock.sendall((EXITS_HANDED + b"\n") * 3 + b'{"op": "pause"}\n')
        replies = [control.decode(line[:-1]) for line in read_lines(sock, 4)]
    assert replies[0] == control.error_reply("ValueError: boom")
    assert replies[1]["ok"] is False and replies[2]["ok"] is False
    assert replies[3] == {"ok": True}


def test_an_overlong_line_is_refused_and_the_connection_dropped(
        served: Callable[..., Served]) -> None:
    s = served()
    with s.connect() as sock:
        sock.sendall(b'{"op": "pause"}\n' + b"x" * (control.MAX_LINE_BYTES + 1))
        assert read_to_end(sock) == control.encode(control.Ack()) + control.encode(
            control.error_reply(f"a request line longer than {control.MAX_LINE_BYTES} bytes"))
    assert s.handed == []
    with s.connect() as sock:   # the server itself serves on
        sock.sendall(b'{"op": "resume"}\n')
        assert read_lines(sock, 1) == [control.encode(control.Ack())]


def test_connections_beyond_the_bound_are_refused(served: Callable[..., Served]) -> None:
    s = served()
    held: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS):   # each one accepted and served (one at a
            held.append(s.connect())       # time: the listen backlog is 8)
            held[-1].sendall(b'{"op": "pause"}\n')
            assert read_lines(held[-1], 1) == [control.encode(control.Ack())]
        with s.connect() as extra:
            reply = read_to_end(extra)
        assert control.decode(reply[:-1]) == control.error_reply(
            f"too many control connections (at most {MAX_CONNECTIONS}); close one and retry")
        held.pop().close()
        # A request on a held connection after the close: the server's turn that
        # serves it has seen the closed one go (it was readable first).
        held[0].sendall(b'{"op": "resume"}\n')
        assert read_lines(held[0], 1) == [control.encode(control.Ack())]
        with s.connect() as again:
            again.sendall(b'{"op": "resume"}\n')
            assert read_lines(again, 1) == [control.encode(control.Ack())]
    finally:
        for sock in held:
            sock.close()


def test_stop_sets_the_stop_signal_and_ends_serving(served: Callable[..., Served]) -> None:
    s = served()
    with s.connect() as sock:
        sock.sendall(b'{"op": "stop"}\n')
        assert read_to_end(sock) == control.encode(control.Ack())
    assert s.stop.is_set()
    assert s.server.close(10.0)
    assert not s.server.serving
    with pytest.raises(OSError):
        s.connect()


def test_close_ends_the_thread_and_the_listener(served: Callable[..., Served]) -> None:
    s = served()
    with s.connect() as sock:
        sock.sendall(b'{"op": "pause"}\n')
        read_lines(sock, 1)
        assert s.server.close(10.0)
        assert read_to_end(sock) == b""   # its connections closed with it
    assert not s.server.serving
    assert not s.stop.is_set()
    with pytest.raises(OSError):
        s.connect()
    assert s.server.close(10.0)   # idempotent


def test_the_snapshot_hand_over_gets_the_connection(served: Callable[..., Served]) -> None:
    # As ControlServer.snapshot does: its own descriptor of the connection, for the
    # progress line before the reply.
    def dispatch(request: control.AnyRequest) -> control.WireRecord:
        raise AssertionError("not reached")

    def handler(line: bytes, fd: int) -> bytes:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.sendall(control.encode(control.Resumed({"pause_s": 0.5})))
        return handover_reply(b'{"op": "reboot"}', dispatch)

    s = served(handler=handler)
    with s.connect() as sock:
        sock.sendall(b'{"op": "snapshot", "memory_path": "m", "state_path": "s"}\n')
        lines = read_lines(sock, 2)
    assert lines[0] == control.encode(control.Resumed({"pause_s": 0.5}))
    assert lines[1] == refusal(b'{"op": "reboot"}')


def test_the_bounds_are_the_protocols() -> None:
    source = (Path(__file__).parents[2] / "native/src/control_serve.rs").read_text()
    assert f"pub const MAX_LINE_BYTES: usize = 1 << {control.MAX_LINE_BYTES.bit_length() - 1};" \
        in source
    assert f"pub const MAX_CONNECTIONS: usize = {MAX_CONNECTIONS};" in source
