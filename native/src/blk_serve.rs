//! virtio-blk served on the native event loop without the GIL: `BlkServer`, built by
//! `NativeTransport` (`transport.rs`, `DeviceKind::Blk`) at each activation.
//!
//! `blk.rs` serves the requests (chain walk, checks, `preadv`/`pwritev`, status byte,
//! used ring); this object is the device around it while the native loop serves the
//! queue, from activation to reset, as `rng_serve.rs` does it for rng.
//!
//! * **The media** (`fd`, capacity, read-only, disk id) are the transport's: it owns
//!   the fd and retires the server (`retire`) before it closes it or puts a slot's new
//!   disk in (a new server then). `retire` takes the media lock, which a wake holds
//!   for its whole serving, so no read or write starts on an fd after it returned.
//! * **One owner of the indices**, as in `rng_serve.rs`; `indices` gives them back.
//! * **Budget.** At most `max_requests` requests or `max_bytes` bytes per wake; a wake
//!   that used it re-arms by writing the queue's ioeventfd (or, entered from Python
//!   without one, says so and Python serves again on a later turn).
//! * **Counters** accumulate here (`stats`), added to the transport's at reset.
//! * **Events**: a guest fault (the queue stops; the transport's `NativeEvents` sets
//!   DEVICE_NEEDS_RESET) and the host failures (a read, write or fdatasync that
//!   failed or came up short, counted and the last kept) go through the server's
//!   `DeviceEvents`.
//!
//! Locks, in this order: `state`, then `media`, then guest RAM's, then the register
//! file's.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::blk::{self, Counters, Disk, Warning};
use crate::eventloop::{drain_eventfd, Deferred, NativeReader};
use crate::guest_ram::GuestRam as Ram;
use crate::mmio::Registers;
use crate::queue_server::{self, raise_used_buffer, rearm, DeviceEvents};
use crate::virtq::{QueueError, Rings};

/// At most this many warnings kept per wake for Python to log.
const MAX_WARNINGS_KEPT: usize = 8;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The disk as `blk.py` holds it; `fd` None once detached or for an empty slot.
struct Media {
    fd: Option<RawFd>,
    capacity: u64,
    read_only: bool,
    id: Vec<u8>,
}

struct BlkState {
    next_avail: u16,
    next_used: u16,
    counters: Counters,
    /// A guest fault was found: serve no more (until the driver resets the device).
    failed: bool,
    closed: bool,
    /// Used-buffer interrupts raised (the irqfd written): the line's statistics.
    interrupts: u64,
    irq: Option<OwnedFd>,
    /// The queue's ioeventfd, duplicated, written to re-arm (None without one).
    rearm: Option<OwnedFd>,
}

#[derive(Default)]
struct Report {
    fault: Option<QueueError>,
    warnings: Vec<Warning>,
    /// The budget was spent and there is no ioeventfd to re-arm with.
    more: bool,
}

/// A host failure as `blk.py` logs it (`Warning::as_tuple`): the details a wake reports.
pub type WarningFields = (&'static str, u64, u64, i64);

/// The disk a `BlkServer` starts with; `fd` stays the caller's (see `BlkQueue.detach`).
pub struct MediaSpec<'a> {
    pub fd: Option<RawFd>,
    pub capacity: u64,
    pub read_only: bool,
    pub id: &'a [u8],
}

pub struct BlkServer {
    ram: Arc<Ram>,
    registers: Arc<Mutex<Registers>>,
    epoch: u64,
    rings: Rings,
    /// The number of the transport's ioeventfd the loop calls `ready` for.
    notify: Option<RawFd>,
    max_requests: u32,
    max_bytes: u64,
    state: Mutex<BlkState>,
    media: Mutex<Media>,
    /// Where a guest fault and the host failures go (Python's `on_report`, or a native
    /// record).
    events: Arc<dyn DeviceEvents<Vec<WarningFields>>>,
}

impl BlkServer {
    /// A server for the ready queue `rings` (checked by the caller: `Virtqueue.validate`
    /// from Python) whose ring indices start at `next_avail`/`next_used`, for the
    /// transport's activation `epoch`; `irq` is the interrupt's eventfd (the KVM irqfd),
    /// `notify` the queue's ioeventfd (the number the loop calls `ready` with) and
    /// `rearm` a duplicate of it, owned from here on.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ram: Arc<Ram>,
        registers: Arc<Mutex<Registers>>,
        epoch: u64,
        rings: Rings,
        (next_avail, next_used): (u16, u16),
        irq: OwnedFd,
        notify: Option<RawFd>,
        rearm: Option<OwnedFd>,
        media: MediaSpec<'_>,
        max_requests: u32,
        max_bytes: u64,
        events: Arc<dyn DeviceEvents<Vec<WarningFields>>>,
    ) -> Result<Self, String> {
        if max_requests == 0 || max_bytes == 0 {
            return Err("max_requests and max_bytes must be at least 1".to_owned());
        }
        Ok(BlkServer {
            ram,
            registers,
            epoch,
            rings,
            notify,
            max_requests,
            max_bytes,
            state: Mutex::new(BlkState {
                next_avail,
                next_used,
                counters: Counters::default(),
                failed: false,
                closed: false,
                interrupts: 0,
                irq: Some(irq),
                rearm,
            }),
            media: Mutex::new(Media {
                fd: media.fd,
                capacity: media.capacity,
                read_only: media.read_only,
                id: media.id[..media.id.len().min(blk::ID_BYTES)].to_vec(),
            }),
            events,
        })
    }

    /// One wake (any thread; the loop thread calls it without the GIL).
    fn serve(&self) -> Report {
        let mut report = Report::default();
        let mut st = lock(&self.state);
        if st.closed || st.failed || lock(&self.registers).failed_in(self.epoch) {
            return report;
        }
        let media = lock(&self.media);
        let disk = Disk {
            fd: media.fd,
            capacity: media.capacity,
            read_only: media.read_only,
            id: &media.id,
        };
        let Ok(ram) = self.ram.lock() else {
            return report; // guest memory is closed: the machine is going away
        };
        let s = blk::serve(
            &ram,
            &self.rings,
            st.next_avail,
            st.next_used,
            &disk,
            self.max_requests,
            self.max_bytes,
        );
        drop(ram);
        drop(media);
        (st.next_avail, st.next_used) = (s.next_avail, s.next_used);
        st.counters.add(&s.counters);
        report.warnings = s.warnings;
        report.warnings.truncate(MAX_WARNINGS_KEPT);
        if let Some(e) = s.error {
            st.failed = true;
            report.fault = Some(e);
            return report;
        }
        if s.served > 0 {
            if let Some(irq) = st.irq.as_ref().map(AsRawFd::as_raw_fd) {
                if raise_used_buffer(&self.registers, self.epoch, irq) {
                    st.interrupts += 1;
                }
            }
        }
        if s.more {
            report.more = !rearm(st.rearm.as_ref().map(AsRawFd::as_raw_fd));
        }
        report
    }

    /// Serve now, on the calling thread (a notify with no ioeventfd, from a native
    /// transport): true if the budget was spent with no ioeventfd to re-arm with.
    /// What a wake leaves for the events goes to them (a native sink hands nothing
    /// back to run).
    pub fn serve_now(&self) -> bool {
        let report = self.serve();
        let more = report.more;
        let _ = self.deferred(report);
        more
    }

    /// (next_avail, next_used); waits out a wake in progress (the state lock).
    pub fn indices(&self) -> (u16, u16) {
        let st = lock(&self.state);
        (st.next_avail, st.next_used)
    }

    /// The requests served since this server was made, and the used-buffer
    /// interrupts it raised.
    pub fn stats(&self) -> (Counters, u64) {
        let st = lock(&self.state);
        (st.counters, st.interrupts)
    }

    /// Serve no more and stop using the fd: once this returns no read or write uses
    /// it again (a wake in progress holds the state and media locks for its serving),
    /// and a wake the loop had already begun to dispatch finds the server closed.
    pub fn retire(&self) {
        let mut st = lock(&self.state);
        st.closed = true;
        lock(&self.media).fd = None;
    }

    /// Hand the report to the events, if it has anything for them.
    fn deferred(&self, report: Report) -> Option<Deferred> {
        let warnings = report.warnings.iter().map(Warning::as_tuple).collect();
        queue_server::report(&self.events, report.fault, warnings)
    }
}

impl NativeReader for BlkServer {
    /// The queue's ioeventfd: drain it and serve.
    fn ready(self: Arc<Self>, fd: RawFd) -> Option<Deferred> {
        if Some(fd) != self.notify {
            return None;
        }
        drain_eventfd(fd);
        let report = self.serve();
        self.deferred(report)
    }
}
