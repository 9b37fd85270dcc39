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

Holds. A capture's writer, forked at the pause, lists the pages that changed by reading
this process's page tables after the resume (a live capture); a page dropped then would
read as the base file's, and the snapshot would lose what the page held at the pause.
So a capture holds the drops from before its pause until its writer is done
(``NativeDevice.hold``/``release``, vmm/capture.py): reports are still acknowledged,
and the guest's pages stay ours a little longer.

One implementation, native: the balloon's ``NativeTransport`` (``native/src/transport.rs``)
builds a ``BalloonServer`` (``native/src/balloon_serve.rs``) at each activation, which the
native loop serves on the queues' ioeventfds without the GIL (a QueueNotify without an
ioeventfd is served on the writing thread); the transport owns the config space, the
holds of a capture and the counters of every activation (``_core.NativeDevice``, read
by ``Machine.free_page_reporting`` and the control socket's ``status``). A driver that
leaves a queue not ready (Linux readies all three) gets none served. This module keeps
the record, the constants and the rules above.
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICE_ID_BALLOON = 5
VIRTIO_BALLOON_F_REPORTING = 1 << 5

INFLATE_QUEUE, DEFLATE_QUEUE, REPORTING_QUEUE = 0, 1, 2
QUEUE_SIZE = 64                 # the driver needs >= 32 on the reporting queue
MAX_CHAINS_PER_NOTIFY = 16


@dataclass
class BalloonState:
    """The balloon's record: the features and what the driver wrote to
    ``actual`` (always 0 from a Linux guest we never ask to inflate). Counters are
    per process, not state: a restored child starts its own."""

    acked_features: int
    actual: int = 0
