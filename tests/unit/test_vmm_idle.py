"""The VMM child's stop signal (``runtime.vmmchild.StopSignal``): an idle child blocks
in ``poll`` on it beside the machine's exit fd, so it must become readable whoever
sets it, a SIGTERM handler included, and stay readable."""

from __future__ import annotations

import os
import select
import signal
import threading

from vmfork.runtime.vmmchild import StopSignal


def _readable(fd: int, timeout_ms: float) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_ms))


def test_readable_once_set_and_after() -> None:
    stop = StopSignal()
    try:
        assert not stop.is_set()
        assert not _readable(stop.fileno(), 0)
        stop.set()
        assert stop.is_set()
        assert _readable(stop.fileno(), 0)
        assert _readable(stop.fileno(), 0)   # a level, not an edge
    finally:
        stop.close()


def test_set_many_times_never_blocks() -> None:
    # More writes than a pipe holds: a full pipe is readable already.
    stop = StopSignal()
    try:
        for _ in range(70_000):
            stop.set()
        assert _readable(stop.fileno(), 0)
    finally:
        stop.close()


def test_a_signal_handler_wakes_a_blocked_poll() -> None:
    # As in vmmchild.main: SIGTERM's handler sets it while the main thread waits.
    stop = StopSignal()
    previous = signal.signal(signal.SIGUSR1, lambda *_: stop.set())
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        poller = select.poll()
        poller.register(stop.fileno(), select.POLLIN)
        # (poll resumes after the handler ran, PEP 475; a bounded wait, not a timing)
        assert poller.poll(30_000) == [(stop.fileno(), select.POLLIN)]
        assert stop.is_set()
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
        stop.close()
