"""A VMM child's wait at its batch's start gate (vmmchild._wait_for_start_gate)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmfork.runtime.vmmchild import StopSignal, _wait_for_start_gate

LONG = 120.0   # a wait that ended before this ended for its reason, not the deadline


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """The gate FIFO and the spawner's end of it (open for writing)."""
    path = str(tmp_path / "gate")
    os.mkfifo(path, 0o600)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # so the writer can open
    writer = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    os.close(reader)
    yield path, writer
    try:
        os.close(writer)
    except OSError:
        pass


@pytest.fixture
def sigterm_sets() -> Iterator[StopSignal]:
    """SIGTERM handled as vmmchild.main handles it."""
    stop = StopSignal()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    yield stop
    signal.signal(signal.SIGTERM, previous)
    stop.close()


def _later(seconds: float, action: object) -> None:
    assert callable(action)
    timer = threading.Timer(seconds, action)
    timer.daemon = True
    timer.start()


def test_a_byte_opens_the_gate(gate: tuple[str, int], sigterm_sets: StopSignal) -> None:
    path, writer = gate
    _later(0.1, lambda: os.write(writer, b"x"))
    waited = _wait_for_start_gate(path, LONG, sigterm_sets)
    assert 0 < waited < LONG and not sigterm_sets.is_set()


def test_sigterm_ends_the_wait_at_once(gate: tuple[str, int],
                                       sigterm_sets: StopSignal) -> None:
    path, _ = gate
    _later(0.1, lambda: os.kill(os.getpid(), signal.SIGTERM))
    waited = _wait_for_start_gate(path, LONG, sigterm_sets)
    assert sigterm_sets.is_set() and waited < LONG
    assert signal.set_wakeup_fd(-1) == -1   # the wait's wake-up pipe is gone again


def test_a_closed_or_missing_gate_and_the_deadline(gate: tuple[str, int], tmp_path: Path,
                                                   sigterm_sets: StopSignal) -> None:
    path, writer = gate
    assert _wait_for_start_gate(str(tmp_path / "none"), LONG, sigterm_sets) == 0.0
    assert _wait_for_start_gate(path, 0.05, sigterm_sets) >= 0.05   # nobody wrote
    _later(0.1, lambda: os.close(writer))
    assert _wait_for_start_gate(path, LONG, sigterm_sets) < LONG   # EOF: the spawner left
    fds = len(os.listdir("/proc/self/fd"))
    _wait_for_start_gate(path, 0.01, sigterm_sets)
    assert len(os.listdir("/proc/self/fd")) == fds
