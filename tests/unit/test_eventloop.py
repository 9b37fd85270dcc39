"""The VMM's I/O loop: the native epoll loop (``native/src/eventloop.rs``, the one
implementation) behind ``EventLoop``'s contract."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from vmfork.vmm.eventloop import EventLoop, NativeEventLoop, new_event_loop


@pytest.fixture
def make_loop() -> Callable[[str], EventLoop]:
    return new_event_loop


@pytest.fixture
def loop(make_loop: Callable[[str], EventLoop]) -> Iterator[EventLoop]:
    ev = make_loop("test-loop")
    ev.start()
    yield ev
    ev.stop()


def wait_for(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.002)


def test_call_soon_runs_on_the_loop_thread_in_order(loop: EventLoop) -> None:
    seen: list[tuple[int, bool]] = []
    for i in range(100):
        loop.call_soon(lambda i=i: seen.append((i, loop.in_loop_thread())))
    wait_for(lambda: len(seen) == 100)
    assert seen == [(i, True) for i in range(100)]
    assert not loop.in_loop_thread()


def test_call_soon_from_many_threads(loop: EventLoop) -> None:
    count = [0]

    def bump() -> None:
        count[0] += 1   # on the loop thread only: no lock needed

    def producer() -> None:
        for _ in range(500):
            loop.call_soon(bump)
    threads = [threading.Thread(target=producer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_for(lambda: count[0] == 2000)


def test_a_reader_is_called_while_its_fd_is_readable_and_not_after_removal(
        loop: EventLoop) -> None:
    fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        got: list[int] = []

        def ready() -> None:
            got.append(os.eventfd_read(fd))
        loop.call_soon(lambda: loop.add_reader(fd, ready))
        os.eventfd_write(fd, 3)
        wait_for(lambda: got == [3])
        os.eventfd_write(fd, 4)
        wait_for(lambda: got == [3, 4])
        removed = threading.Event()
        loop.call_soon(lambda: (loop.remove_reader(fd), removed.set()))
        assert removed.wait(5)
        os.eventfd_write(fd, 5)
        time.sleep(0.1)
        assert got == [3, 4]
        loop.remove_reader(fd)   # a second removal is no error
    finally:
        os.close(fd)


def test_timers_run_in_due_order_and_not_early(loop: EventLoop) -> None:
    seen: list[tuple[str, float]] = []
    t0 = time.monotonic()
    loop.call_soon(lambda: loop.call_later(0.15, lambda: seen.append(
        ("late", time.monotonic() - t0))))
    loop.call_soon(lambda: loop.call_later(0.05, lambda: seen.append(
        ("early", time.monotonic() - t0))))
    wait_for(lambda: len(seen) == 2)
    assert [name for name, _ in seen] == ["early", "late"]
    assert seen[0][1] >= 0.05 and seen[1][1] >= 0.15


def test_a_timer_set_from_another_thread_wakes_an_idle_native_loop() -> None:
    # The native loop waits with no timeout when it has no timer: a new one must
    # shorten that wait.
    loop = NativeEventLoop("test-loop")
    loop.start()
    try:
        done = threading.Event()
        time.sleep(0.05)
        loop.call_later(0.01, done.set)   # from this thread, not the loop's
        assert done.wait(5)
    finally:
        loop.stop()


def test_the_event_loop_keeps_a_bounded_error_list(loop: EventLoop) -> None:
    def boom() -> None:
        raise ValueError("a device bug a guest can trigger per packet")
    for _ in range(10_000):
        loop.call_soon(boom)
    wait_for(lambda: loop.error_count == 10_000, timeout=30)
    assert len(loop.errors) == 16 and isinstance(loop.errors[-1], ValueError)
    ran = threading.Event()
    loop.call_soon(ran.set)   # the loop goes on after its callbacks failed
    assert ran.wait(5)


def test_stop_from_a_callback_ends_the_loop(make_loop: Callable[[str], EventLoop]) -> None:
    ev = make_loop("test-stop")
    ev.start()
    assert ev.running
    ev.call_soon(ev.stop)
    wait_for(lambda: not ev.running)


def test_stop_before_start_and_running(make_loop: Callable[[str], EventLoop]) -> None:
    ev = make_loop("test-never-started")
    assert not ev.running
    ev.stop()
    assert not ev.running


def test_the_native_loop_rejects_bad_input_clearly() -> None:
    ev = NativeEventLoop("test-bad")
    try:
        with pytest.raises(ValueError, match="invalid file descriptor"):
            ev.add_reader(-1, lambda: None)
        with pytest.raises(ValueError, match="NaN"):
            ev.call_later(float("nan"), lambda: None)
        fd = os.eventfd(0, os.EFD_CLOEXEC)
        try:
            ev.add_reader(fd, lambda: None)
            with pytest.raises(ValueError, match="already registered"):
                ev.add_reader(fd, lambda: None)
        finally:
            ev.remove_reader(fd)
            os.close(fd)
        with pytest.raises(OSError):
            ev.add_reader(10_000_000, lambda: None)   # not an open fd: epoll_ctl's EBADF
    finally:
        ev.stop()


def _task_cpu_ticks(thread_name: str) -> tuple[int, int]:
    """(utime + stime clock ticks, voluntary context switches) of this process's thread
    named ``thread_name``."""
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() != thread_name:
                continue
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/self/task/{tid}/status") as f:
            switches = next(int(line.split()[1]) for line in f
                            if line.startswith("voluntary_ctxt_switches"))
        return int(fields[11]) + int(fields[12]), switches
    raise AssertionError(f"no thread named {thread_name}")


def test_an_idle_native_loop_does_not_wake() -> None:
    ev = NativeEventLoop("idle-loop")
    ev.start()
    try:
        fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        ev.add_reader(fd, lambda: None)
        ran = threading.Event()
        ev.call_soon(ran.set)
        assert ran.wait(5)
        time.sleep(0.05)
        before = _task_cpu_ticks("idle-loop")
        time.sleep(0.5)
        after = _task_cpu_ticks("idle-loop")
        # Each wake-up is a voluntary context switch out of epoll_wait: none at all.
        assert after == before
        ev.remove_reader(fd)
        os.close(fd)
    finally:
        ev.stop()


def test_a_forked_child_does_not_join_the_parents_loop_thread() -> None:
    ev = NativeEventLoop("fork-loop")
    ev.start()
    try:
        pid = os.fork()
        if pid == 0:  # the child: the loop's thread is not here
            ok = not ev.running
            ev.stop()   # must return, not wait for a thread that does not exist
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert ev.running
    finally:
        ev.stop()


def test_a_stopped_loop_gives_its_fds_back_once_dropped(
        make_loop: Callable[[str], EventLoop]) -> None:
    # The zygote restores a snapshot once into a VM that never runs and drops it
    # (vmmchild._warm_up_restore); its loop's fds must not outlive it. The native loop
    # holds its dispatch function in Rust, out of the collector's sight, so no cycle
    # through it may keep the loop alive.
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))
    gc.collect()
    before = fds()
    for _ in range(5):
        ev = make_loop("test-fds")
        ev.start()
        ev.call_soon(lambda: None)
        ev.stop()
        del ev
    assert fds() == before


def test_a_stopped_loop_closes_its_fds_while_still_referenced(
        make_loop: Callable[[str], EventLoop]) -> None:
    # A stopped loop that something still reaches (a device's callback in a cycle, a
    # machine kept for its stats) holds no fds: the stop closes them. The zygote's
    # warm-up restore left the native loop's epoll and wake eventfd open this way until
    # the collector ran.
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))
    before = fds()
    kept = []
    for started in (True, False, True):
        ev = make_loop("test-fds")
        if started:
            ev.start()
            ev.call_soon(lambda: None)
        ev.stop()
        kept.append(ev)
    assert fds() == before
    # Work handed to a stopped loop is not run, and asks for no fd.
    ran: list[int] = []
    kept[0].call_soon(lambda: ran.append(1))
    assert ran == [] and fds() == before


def test_work_queued_before_a_stop_still_runs(make_loop: Callable[[str], EventLoop]) -> None:
    # A machine's close queues the closing of its ioeventfds on the loop, then stops
    # it: that work runs (the native loop once dropped it, and the zygote's warm-up
    # restore leaked 14 eventfds).
    ev = make_loop("test-drain")
    ev.start()
    ran: list[int] = []
    for i in range(50):
        ev.call_soon(lambda i=i: ran.append(i))
    ev.stop()
    assert ran == list(range(50))
