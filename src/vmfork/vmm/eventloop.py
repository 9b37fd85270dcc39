"""The VMM's I/O thread: one loop for every device back end.

vCPU threads handle register accesses (MMIO/PIO exits). Everything that waits
on the host -- queue notifications arriving through ioeventfds, Unix sockets of
the vsock back end, timers -- is handled here, on one thread, so that device
back ends need no locking among themselves. Work from other threads is handed
over with ``call_soon`` (thread-safe; it wakes the loop through an eventfd).

The loop is ``NativeEventLoop``, an epoll loop on a native thread
(``native/src/eventloop.rs``) that waits without the GIL and without a timeout when
idle, and takes the GIL only to run a callback; the devices' native servers (which
their native transports register on ``native_loop``) run on it without the GIL at all. ``EventLoop`` is its
interface, and logs and counts what a callback raises (``_call``). There is no Python
loop: the selector loop that was its twin is deleted (design notes, "The last Python
twins").
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable

from vmfork.vmm.native import CORE_BUILT, require_core

if CORE_BUILT:
    from vmfork import _core

log = logging.getLogger(__name__)

Callback = Callable[[], None]


class EventLoop:
    """The loop's interface, and its error accounting."""

    def __init__(self, name: str) -> None:
        self.name = name
        # The last few exceptions escaped from callbacks (a guest that triggers one per
        # packet must not grow a list without end), and how many there were.
        self.errors: deque[BaseException] = deque(maxlen=16)
        self.error_count = 0

    def add_reader(self, fd: int, callback: Callback) -> None:
        raise NotImplementedError

    def remove_reader(self, fd: int) -> None:
        raise NotImplementedError

    def call_later(self, delay: float, callback: Callback) -> None:
        raise NotImplementedError

    def call_soon(self, callback: Callback) -> None:
        """Run ``callback`` on the loop thread (safe from any thread)."""
        raise NotImplementedError

    def in_loop_thread(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def _call(self, callback: Callback) -> None:
        try:
            callback()
        except Exception as err:  # a device bug must not stop every other device
            log.exception("%s: callback %r failed", self.name, callback)
            self.errors.append(err)
            self.error_count += 1


def new_event_loop(name: str = "vmm-io") -> EventLoop:
    """The VMM's I/O loop (``CoreMissing`` where the native core is not built)."""
    require_core()
    return NativeEventLoop(name)


# Native loops still running when the interpreter exits are stopped first: a native
# thread must not try to take the GIL of a finalising interpreter.
_native_loops: weakref.WeakSet[NativeEventLoop] = weakref.WeakSet()


@atexit.register
def _stop_native_loops() -> None:
    for loop in list(_native_loops):
        loop.stop()


def _forget_native_loops() -> None:
    """In a forked child: the loops' threads are the parent's and do not exist here, so
    the child's copies are neither running nor to be joined. (A zygote's children do
    not run it, ``zygote_child.fork``: a zygote forks with one thread, so with no loop
    running, and a stopped loop is not stopped again.)"""
    for loop in list(_native_loops):
        loop._forked = True
    _native_loops.clear()


os.register_at_fork(after_in_child=_forget_native_loops)


class NativeEventLoop(EventLoop):
    """The epoll loop of ``native/src/eventloop.rs``; each callback runs as ``_call``."""

    def __init__(self, name: str = "vmm-io") -> None:
        super().__init__(name)
        # The native loop holds its dispatch function from Rust, where the collector
        # cannot see it: a bound method there would be a cycle (this object -> the
        # native loop -> the method -> this object) never freed, and with it the
        # loop's epoll fd and eventfd (the e2e leak test counts the zygote's fds after
        # its warm-up restore). A weak reference breaks it.
        this = weakref.ref(self)

        def dispatch(callback: Callback) -> None:
            loop = this()
            if loop is not None:
                loop._call(callback)

        self._native = _core.EventLoop(name, dispatch)
        self._stopped = False
        self._forked = False
        _native_loops.add(self)

    @property
    def native_loop(self) -> _core.EventLoop:
        """The native loop itself, where a native device registers its server."""
        return self._native

    def add_reader(self, fd: int, callback: Callback) -> None:
        self._native.add_reader(fd, callback)

    def remove_reader(self, fd: int) -> None:
        self._native.remove_reader(fd)

    def call_later(self, delay: float, callback: Callback) -> None:
        self._native.call_later(delay, callback)

    def call_soon(self, callback: Callback) -> None:
        self._native.call_soon(callback)

    def in_loop_thread(self) -> bool:
        return bool(self._native.in_loop_thread())

    def start(self) -> None:
        self._native.start()

    @property
    def running(self) -> bool:
        return not self._forked and bool(self._native.running)

    def stop(self) -> None:
        if self._forked or (self._stopped and not self.in_loop_thread()):
            return
        self._stopped = True
        if self.running and not self.in_loop_thread():
            # What was queued before the stop still runs (the native stop drops what
            # is still queued).
            drained = threading.Event()
            self._native.call_soon(drained.set)
            if not drained.wait(5.0):
                log.warning("%s: queued work did not finish before the stop", self.name)
        self._native.stop()
