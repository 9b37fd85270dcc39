"""virtio-balloon (device id 5), offering free page reporting and nothing else.

Why a balloon. A diff snapshot keeps every guest page that differs from its base
(``vmm.dirty``): on a ``MAP_PRIVATE`` snapshot mapping, every page the guest ever
wrote. A build step (``pip install``) writes far more than it keeps -- the
interpreter's heap, the downloaded wheel in ``/tmp``, the unzip -- and frees it
when it exits; those pages would stay "changed" and fill the layer. With
``VIRTIO_BALLOON_F_REPORTING`` (virtio 1.2, 5.5.6.7; Linux's
``mm/page_reporting.c``) the guest tells us which blocks of its free lists it is
giving up, and we ``madvise`` them away in our mapping of guest RAM:

* snapshot file mapped ``MAP_PRIVATE`` (a restored sandbox) or anonymous RAM:
  ``MADV_DONTNEED`` drops our private copy. The page reads back as the file's
  page (or zeros), is a file page again to the pagemap, and no diff keeps it;
* RAM in a memfd mapped ``MAP_SHARED`` (a booted parent): ``MADV_REMOVE`` punches
  the hole in the memfd, so the page reads as zeros and its memory is freed.

That is safe only because the guest gave the page up: Linux reuses a reported page
without asking (no ``MUST_TELL_HOST``) and never reads a free page's contents,
unless page poisoning or ``init_on_free`` is on -- then it would check or expect
its pattern, so the driver refuses to report without ``VIRTIO_BALLOON_F_PAGE_POISON``,
which we do not offer. The guest kernel has neither (image/kernel/vmfork.config).

The queues. Linux's driver always sets up ``inflateq`` and ``deflateq``, then one
queue per offered feature with one; with only ``REPORTING`` that is
``reporting_vq`` at index 2 (it numbers the queues that exist, like QEMU). We
never ask for inflation (``num_pages`` stays 0); a buffer the guest puts on
``inflateq`` or ``deflateq`` anyway is returned untouched. The driver wants a
reporting queue of at least 32 entries (``PAGE_REPORTING_CAPACITY``): each report
is one chain of up to 32 device-writable buffers, one free block each, and the
driver waits for it to come back before it reuses those pages.

Hostile input. Every buffer is checked against guest RAM when its chain is walked;
the server checks again that it lies in one RAM region and discards only the
whole pages inside it, so a misaligned or short buffer drops nothing it did not
name. Work per notification is bounded by ``MAX_CHAINS_PER_NOTIFY`` chains of at
most ``QUEUE_SIZE`` buffers each. A failing ``madvise`` is counted and logged; the
buffer still goes back (the guest loses nothing but the saving).

Settling. The guest reports a block about 2 s after it was freed
(``PAGE_REPORTING_DELAY``), and only blocks of ``page_reporting_order`` and up
(the VMM asks for order 0 on the command line, machine.BALLOON_CMDLINE). A diff
capture first waits, while the guest runs, until no report came for a few seconds
(``stats``, read through the control socket's ``status``; runtime/branch.py).

One implementation, native. At activation the three queues are handed to a
``_core.BalloonQueues`` (``native/src/balloon_serve.rs``) that the native loop serves
on their ioeventfds without the GIL (a QueueNotify exit without an ioeventfd enters
it through ``queue_notify``); it owns the ring indices until reset (``sync_queues``
copies them back for a snapshot) and the counters of its activation. This class owns
it: config space, the holds of a capture, the counters of earlier activations, state.
A driver that leaves a queue not ready (Linux readies all three) gets none served. A
transport that cannot hand its queues over (a loop that is not the native one, no
irqfd) has no balloon: the activation fails as a host error.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vmfork.vmm.devices.virtio.device import VirtioDevice, VirtioInterrupt
from vmfork.vmm.devices.virtio.queue import Virtqueue
from vmfork.vmm.errors import GuestError, HostError
from vmfork.vmm.eventloop import EventLoop
from vmfork.vmm.memory import GuestMemory

try:
    from vmfork import _core
except ImportError:
    pass

log = logging.getLogger(__name__)

DEVICE_ID_BALLOON = 5
VIRTIO_BALLOON_F_REPORTING = 1 << 5

INFLATE_QUEUE, DEFLATE_QUEUE, REPORTING_QUEUE = 0, 1, 2
QUEUE_SIZE = 64                 # the driver needs >= 32 on the reporting queue
MAX_CHAINS_PER_NOTIFY = 16
CONFIG_SIZE = 16                # num_pages, actual, free_page_hint_cmd_id, poison_val
_ACTUAL_OFFSET = 4


@dataclass
class BalloonState:
    """Plain-data twin of ``VirtioBalloon``: the features and what the driver wrote to
    ``actual`` (always 0 from a Linux guest we never ask to inflate). Counters are
    per process, not state: a restored child starts its own."""

    acked_features: int
    actual: int = 0


@dataclass(frozen=True)
class BalloonStats:
    reports: int                # chains handled on the reporting queue
    bytes_discarded: int        # whole pages dropped from our mapping
    discard_errors: int
    ignored_buffers: int        # inflate/deflate buffers, device-readable ones, slivers
    last_report_age_s: float | None   # since the last report, None if there was none


class VirtioBalloon(VirtioDevice):
    device_type = DEVICE_ID_BALLOON
    queue_max_sizes = (QUEUE_SIZE, QUEUE_SIZE, QUEUE_SIZE)

    def __init__(self, loop: EventLoop) -> None:
        super().__init__()
        self.features |= VIRTIO_BALLOON_F_REPORTING
        self.loop = loop
        self._server: _core.BalloonQueues | None = None
        self._detach_server: list[Callable[[], None]] = []
        self._config_lock = threading.Lock()
        self.actual = 0
        self.reports = 0
        self.bytes_discarded = 0
        self.discard_errors = 0
        self.ignored_buffers = 0
        self._last_report: float | None = None   # time.monotonic() of the last report
        self._advice: int = mmap.MADV_DONTNEED
        self._holds = 0          # captures in flight (hold_discards); changed under _hold_lock
        self._hold_lock = threading.Lock()
        self._discards_held = 0  # reported ranges kept, in earlier activations

    # -- config space -------------------------------------------------------------------
    def config_bytes(self) -> bytes:
        with self._config_lock:
            actual = self.actual
        return (0).to_bytes(4, "little") + actual.to_bytes(4, "little") + bytes(8)

    def write_config(self, offset: int, data: bytes) -> None:
        """Only ``actual`` is the driver's to write (the pages it holds inflated)."""
        if offset == _ACTUAL_OFFSET and len(data) == 4:
            with self._config_lock:
                self.actual = int.from_bytes(data, "little")
            return
        super().write_config(offset, data)

    # -- queues (I/O thread) --------------------------------------------------------------
    def activate(self, memory: GuestMemory, queues: list[Virtqueue],
                 interrupt: VirtioInterrupt) -> None:
        super().activate(memory, queues, interrupt)
        # A memfd mapped shared keeps the data past MADV_DONTNEED; only a hole frees it.
        shared = memory.backing_fd is not None and not memory.private_file
        self._advice = mmap.MADV_REMOVE if shared else mmap.MADV_DONTNEED
        if not all(q.ready for q in queues):
            return
        natives = [interrupt.native_queue(i) for i in range(len(queues))]
        if memory.native is None or any(n is None for n in natives):
            raise HostError("virtio-balloon is served only natively: its transport needs "
                            "the native register file and loop and an irqfd, its guest "
                            "memory a native view", op="balloon activate")
        first = natives[0]
        assert first is not None
        server = _core.BalloonQueues(
            memory.native, first.registers, first.epoch,
            tuple((q.size, q.desc_table, q.avail_ring, q.used_ring, q.next_avail, q.next_used)
                  for q in queues),
            first.irq_fd, tuple(n.notify_fd for n in natives if n is not None),
            MAX_CHAINS_PER_NOTIFY, self._advice, self._native_report)
        with self._hold_lock:
            for _ in range(self._holds):
                server.hold()
            self._server = server
        for i, native in enumerate(natives):
            assert native is not None
            native.attach(server, count_interrupts=i == 0)   # one line, counted once
            self._detach_server.append(native.detach)

    @property
    def discards_held(self) -> int:
        """Reported ranges kept because a capture was in flight (every activation)."""
        server = self._server
        return self._discards_held + (server.stats()[4] if server is not None else 0)

    @property
    def serving_natively(self) -> bool:
        """Whether the native loop serves the queues without the GIL (this activation)."""
        return self._server is not None

    def _native_report(self, fault: BaseException | None,
                       discard_errors: list[tuple[int, int, int]]) -> None:
        """What the native server leaves for Python (on the loop thread, with the GIL)."""
        for start, length, err in discard_errors:
            log.warning("balloon: madvise of %#x+%#x failed: %s", start, length,
                        os.strerror(err))
        if fault is not None and self.interrupt is not None and isinstance(fault, GuestError):
            self.interrupt.device_error(fault)

    def _let_go_of_server(self) -> None:
        """Fold the native server's counters into ours and close it (a reset, a close)."""
        server, self._server = self._server, None
        if server is None:
            return
        for detach in self._detach_server:
            detach()
        self._detach_server = []
        reports, discarded, errors, ignored, held, age = server.stats()
        self.reports += reports
        self.bytes_discarded += discarded
        self.discard_errors += errors
        self.ignored_buffers += ignored
        self._discards_held += held
        if age is not None:
            self._last_report = time.monotonic() - age
        server.close()

    def sync_queues(self) -> None:
        if self._server is not None:
            for queue, (next_avail, next_used) in zip(self.queues, self._server.sync(),
                                                      strict=True):
                queue.next_avail, queue.next_used = next_avail, next_used

    def close(self) -> None:
        """Let go of the native server (after the transport's close): it holds
        duplicates of the queues' eventfds, and this device through ``on_report``."""
        self._let_go_of_server()

    def queue_notify(self, index: int) -> None:
        if index in (INFLATE_QUEUE, DEFLATE_QUEUE, REPORTING_QUEUE):
            self._serve(index)

    def _serve(self, index: int) -> None:
        if not self._usable() or self._server is None:
            return
        # A guest fault raises; a spent budget without an ioeventfd to re-arm with is
        # served again on a later loop turn.
        if self._server.notify(index):
            self.loop.call_soon(lambda: self._guarded(lambda: self._serve(index)))

    # -- captures (vmm/capture.py) ---------------------------------------------------------
    def hold_discards(self) -> None:
        """Keep reported pages until ``release_discards``. A capture's writer, forked at
        the pause, lists the pages that changed by reading this process's page tables
        after the resume (a live capture); a page dropped then would read as the base
        file's, and the snapshot would lose what the page held at the pause. Reports
        are still acknowledged: the guest's pages stay ours a little longer."""
        with self._hold_lock:
            self._holds += 1
            if self._server is not None:
                self._server.hold()

    def release_discards(self) -> None:
        with self._hold_lock:
            self._holds = max(0, self._holds - 1)
            if self._server is not None:
                self._server.release()

    def reset(self) -> None:
        self._let_go_of_server()
        super().reset()
        with self._config_lock:
            self.actual = 0

    # -- settling (any thread) -----------------------------------------------------------
    def stats(self) -> BalloonStats:
        last = self._last_report
        age = None if last is None else time.monotonic() - last
        reports, discarded, errors, ignored = (self.reports, self.bytes_discarded,
                                               self.discard_errors, self.ignored_buffers)
        server = self._server
        if server is not None:
            more = server.stats()
            reports, discarded, errors, ignored = (reports + more[0], discarded + more[1],
                                                   errors + more[2], ignored + more[3])
            if more[5] is not None:
                age = more[5]   # the server's report is the later one
        return BalloonStats(reports, discarded, errors, ignored, age)

    # -- snapshots ----------------------------------------------------------------------
    def save(self) -> BalloonState:
        with self._config_lock:
            return BalloonState(acked_features=self.acked_features, actual=self.actual)

    def restore(self, state: BalloonState) -> None:
        self.acked_features = state.acked_features
        with self._config_lock:
            self.actual = state.actual & 0xFFFF_FFFF
