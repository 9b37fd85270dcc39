//! virtio-balloon's three queues served on the native event loop without the GIL: free
//! page reporting, `balloon.py`'s contract, natively (the server a balloon's
//! `NativeTransport` builds at each activation, `transport.rs`).
//!
//! The balloon offers only `VIRTIO_BALLOON_F_REPORTING`, so its work is: a chain on
//! the reporting queue names free blocks the guest gives up, and each whole page inside
//! them is dropped from our mapping of guest RAM (`madvise`: `MADV_DONTNEED` on a
//! snapshot file mapped private or anonymous RAM, `MADV_REMOVE` on a shared memfd; the
//! device chooses at activation). A chain on the inflate or deflate queue (we never ask
//! for either) goes back untouched. What it changes and why is `balloon.py`'s module
//! comment; this file keeps its rules word for word:
//!
//! * **The checks, in order, per buffer:** a capture in flight (`hold`) keeps the
//!   range (counted as held); a buffer holding no whole page is ignored; a range that
//!   starts outside guest RAM or crosses the end of its region is a guest fault, with
//!   `balloon.py`'s messages. A failing `madvise` is counted; the buffer still goes
//!   back.
//! * **Budget.** At most `max_chains` chains per queue per wake; a run that used it
//!   re-arms by writing the queue's ioeventfd (or, without one, tells its caller to
//!   serve again), as `rng_serve.rs` does.
//! * **Holds and the fork of a capture.** A capture holds the drops from its pause
//!   until its writer is done, and forks that writer on the loop thread
//!   (`run_on_loop`); this object runs on the same thread, so no drop straddles the
//!   fork, and the hold count is read per buffer, so none starts after a hold.
//! * **One owner of the indices**, from activation to reset: this object; `indices`
//!   gives them back for a snapshot (as `rng_serve.rs`).
//! * **What it reports**: a guest fault (the queues stop, the transport's register
//!   file gets DEVICE_NEEDS_RESET) and the failed `madvise` calls, through the
//!   server's `DeviceEvents`, the transport's `NativeEvents` record: nothing goes to
//!   Python.
//!
//! Locks, in this order: `state`, then guest RAM's, then the register file's. None is
//! held across a GIL take or release.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::eventloop::{drain_eventfd, Deferred, NativeReader};
use crate::guest_ram::{GuestRam as GuestRamInner, Ram, RamError};
use crate::mmio::Registers;
use crate::queue_server::{self, raise_used_buffer, rearm, DeviceEvents};
use crate::virtq::{self, QueueError, Rings};

const REPORTING_QUEUE: usize = 2;
const PAGE: u64 = 4096;
/// At most this many failed `madvise` calls kept per wake for Python to log.
const MAX_ERRORS_KEPT: usize = 8;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a server did over its activation (`balloon.py`'s `BalloonStats`, plus the
/// reports kept for a capture).
#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counters {
    pub reports: u64,
    pub bytes_discarded: u64,
    pub discard_errors: u64,
    pub ignored_buffers: u64,
    pub discards_held: u64,
}

impl Counters {
    /// `self` and `other` added (an earlier activation's and the running one's).
    pub fn plus(self, other: Counters) -> Counters {
        Counters {
            reports: self.reports + other.reports,
            bytes_discarded: self.bytes_discarded + other.bytes_discarded,
            discard_errors: self.discard_errors + other.discard_errors,
            ignored_buffers: self.ignored_buffers + other.ignored_buffers,
            discards_held: self.discards_held + other.discards_held,
        }
    }
}

/// A server's statistics: its counters, when the guest last reported, and the
/// used-buffer interrupts it raised.
#[derive(Default, Clone, Copy, Debug)]
pub struct BalloonStats {
    pub counters: Counters,
    pub last_report: Option<Instant>,
    pub interrupts: u64,
}

struct BalloonState {
    /// (next_avail, next_used) of the inflate, deflate and reporting queues.
    indices: [(u16, u16); 3],
    counters: Counters,
    last_report: Option<Instant>,
    /// A guest fault was found: serve no more (until the driver resets the device).
    failed: bool,
    /// Used-buffer interrupts raised (the irqfd written): the line's statistics.
    interrupts: u64,
    irq: Option<OwnedFd>,
    /// The queues' ioeventfds, duplicated, written to re-arm (None without one).
    rearm: [Option<OwnedFd>; 3],
}

/// What a wake leaves for its caller.
#[derive(Default)]
struct Report {
    fault: Option<QueueError>,
    /// (start, length, errno) of failed `madvise` calls, for Python to log.
    discard_errors: Vec<DiscardError>,
    /// The budget was spent and there is no ioeventfd to re-arm with.
    rearm: bool,
}

/// (start, length, errno) of a failed `madvise`: the details a wake reports.
pub type DiscardError = (u64, u64, i32);

pub struct BalloonServer {
    ram: Arc<GuestRamInner>,
    registers: Arc<Mutex<Registers>>,
    epoch: u64,
    rings: [Rings; 3],
    /// The numbers of the transport's ioeventfds the loop calls `ready` for.
    notify: [Option<RawFd>; 3],
    max_chains: u32,
    /// `MADV_DONTNEED` or `MADV_REMOVE`, chosen by the device at activation.
    advice: i32,
    /// Captures in flight (`hold`/`release`): their drops are kept.
    holds: AtomicU64,
    state: Mutex<BalloonState>,
    /// Where a guest fault and the failed discards go (the transport's native record).
    events: Arc<dyn DeviceEvents<Vec<DiscardError>>>,
}

/// One buffer's outcome on the reporting queue.
enum Discard {
    Dropped(u64),
    Held,
    Ignored,
    Failed(u64, u64, i32),
}

impl BalloonServer {
    /// A server for the inflate, deflate and reporting queues' ready `rings` (checked by
    /// the caller: `Virtqueue.validate` from Python), their ring indices starting at
    /// `indices`, for the transport's activation `epoch`; `irq` is the interrupt's
    /// eventfd (the KVM irqfd), `notify` the queues' ioeventfds (the numbers the loop
    /// calls `ready` with) and `rearm` duplicates of them, owned from here on; `advice`
    /// the `madvise` advice that drops a page from this machine's RAM mapping.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ram: Arc<GuestRamInner>,
        registers: Arc<Mutex<Registers>>,
        epoch: u64,
        rings: [Rings; 3],
        indices: [(u16, u16); 3],
        irq: OwnedFd,
        notify: [Option<RawFd>; 3],
        rearm: [Option<OwnedFd>; 3],
        max_chains: u32,
        advice: i32,
        events: Arc<dyn DeviceEvents<Vec<DiscardError>>>,
    ) -> Result<Self, String> {
        if max_chains == 0 {
            return Err("max_chains must be at least 1".to_owned());
        }
        if advice != libc::MADV_DONTNEED && advice != libc::MADV_REMOVE {
            return Err(format!(
                "advice {advice} is neither MADV_DONTNEED nor MADV_REMOVE"
            ));
        }
        Ok(BalloonServer {
            ram,
            registers,
            epoch,
            rings,
            notify,
            max_chains,
            advice,
            holds: AtomicU64::new(0),
            state: Mutex::new(BalloonState {
                indices,
                counters: Counters::default(),
                last_report: None,
                failed: false,
                interrupts: 0,
                irq: Some(irq),
                rearm,
            }),
            events,
        })
    }

    /// Drop the whole pages of guest range `gpa`+`length` (the rule in `balloon.py`'s
    /// module comment).
    fn discard(&self, ram: &Ram<'_>, gpa: u64, length: u32) -> Result<Discard, QueueError> {
        if self.holds.load(Ordering::SeqCst) > 0 {
            return Ok(Discard::Held);
        }
        let start = gpa.div_ceil(PAGE).saturating_mul(PAGE);
        let end = (gpa.saturating_add(u64::from(length))) / PAGE * PAGE;
        if end <= start {
            return Ok(Discard::Ignored);
        }
        let Some(region) = ram.region_containing(start) else {
            return Err(QueueError::Memory(RamError::OutOfRange(format!(
                "reported range {gpa:#x}+{length:#x} is not in guest RAM"
            ))));
        };
        let region_end = region.gpa + region.size;
        if end > region_end {
            return Err(QueueError::Memory(RamError::OutOfRange(format!(
                "reported range {gpa:#x}+{length:#x} crosses the end of RAM region \
                 {:#x}..{region_end:#x}",
                region.gpa
            ))));
        }
        let host = ram.host(start, end - start)?;
        // SAFETY: `host..host + (end - start)` lies inside one region of guest RAM
        // (checked just above), which stays mapped while `ram` (the read lock) lives;
        // start and end are page-aligned, and the region's mapping starts on a page.
        // Dropping pages the guest gave up is what the device is for: the guest never
        // reads a reported page before it reuses it (balloon.py).
        let rc = unsafe { libc::madvise(host.cast(), (end - start) as usize, self.advice) };
        if rc != 0 {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            return Ok(Discard::Failed(start, end - start, errno));
        }
        Ok(Discard::Dropped(end - start))
    }

    /// Serve queue `index` (any thread; the loop thread calls it without the GIL).
    fn serve(&self, index: usize) -> Report {
        let mut report = Report::default();
        let mut st = lock(&self.state);
        if st.failed || lock(&self.registers).failed_in(self.epoch) {
            return report;
        }
        let Ok(ram) = self.ram.lock() else {
            return report; // guest memory is closed: the machine is going away
        };
        let rings = &self.rings[index];
        let (mut next_avail, mut next_used) = st.indices[index];
        let mut served = 0u32;
        while served < self.max_chains {
            let chain = match virtq::pop(&ram, rings, next_avail) {
                Ok(Some(chain)) => chain,
                Ok(None) => break,
                Err(e) => {
                    report.fault = Some(e);
                    break;
                }
            };
            next_avail = next_avail.wrapping_add(1);
            if index == REPORTING_QUEUE {
                for &(gpa, length) in &chain.writable {
                    match self.discard(&ram, gpa, length) {
                        Ok(Discard::Dropped(n)) => st.counters.bytes_discarded += n,
                        Ok(Discard::Held) => st.counters.discards_held += 1,
                        Ok(Discard::Ignored) => st.counters.ignored_buffers += 1,
                        Ok(Discard::Failed(start, len, errno)) => {
                            st.counters.discard_errors += 1;
                            if report.discard_errors.len() < MAX_ERRORS_KEPT {
                                report.discard_errors.push((start, len, errno));
                            }
                        }
                        Err(e) => {
                            report.fault = Some(e);
                            break;
                        }
                    }
                }
                if report.fault.is_some() {
                    break;
                }
                st.counters.ignored_buffers += chain.readable.len() as u64;
                st.counters.reports += 1;
                st.last_report = Some(Instant::now());
            } else {
                st.counters.ignored_buffers += (chain.readable.len() + chain.writable.len()) as u64;
            }
            match virtq::add_used(&ram, rings, next_used, chain.head, 0) {
                Ok(n) => next_used = n,
                Err(e) => {
                    report.fault = Some(e);
                    break;
                }
            }
            served += 1;
        }
        drop(ram);
        st.indices[index] = (next_avail, next_used);
        if report.fault.is_some() {
            st.failed = true;
            return report;
        }
        if served > 0 {
            if let Some(irq) = st.irq.as_ref().map(AsRawFd::as_raw_fd) {
                if raise_used_buffer(&self.registers, self.epoch, irq) {
                    st.interrupts += 1;
                }
            }
        }
        if served == self.max_chains {
            report.rearm = !rearm(st.rearm[index].as_ref().map(AsRawFd::as_raw_fd));
        }
        report
    }

    /// Hand the report to the events, if it has anything for them.
    fn deferred(&self, report: Report) -> Option<Deferred> {
        queue_server::report(&self.events, report.fault, report.discard_errors)
    }

    /// Serve queue `index` now, on the caller's thread (a notify with no ioeventfd, to a
    /// server whose events need no Python: a native transport's); true if the budget
    /// was spent and more may be waiting.
    pub(crate) fn serve_now(&self, index: usize) -> bool {
        let report = self.serve(index);
        let rearm = report.rearm;
        // A native sink acts on the report itself and hands nothing back.
        if let Some(work) = self.deferred(report) {
            drop(work);
        }
        rearm
    }

    /// The three queues' (next_avail, next_used), after any serve in flight.
    pub(crate) fn indices(&self) -> [(u16, u16); 3] {
        lock(&self.state).indices
    }

    /// A capture is in flight: keep reported pages until `release`.
    pub(crate) fn hold(&self) {
        self.holds.fetch_add(1, Ordering::SeqCst);
    }

    pub(crate) fn release(&self) {
        // Never below zero, as `balloon.py` (a release without a hold is a no-op).
        let _ = self
            .holds
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    pub(crate) fn stats(&self) -> BalloonStats {
        let st = lock(&self.state);
        BalloonStats {
            counters: st.counters,
            last_report: st.last_report,
            interrupts: st.interrupts,
        }
    }
}

impl NativeReader for BalloonServer {
    /// A queue's ioeventfd: drain it and serve that queue.
    fn ready(self: Arc<Self>, fd: RawFd) -> Option<Deferred> {
        let index = self.notify.iter().position(|n| *n == Some(fd))?;
        drain_eventfd(fd);
        // The loop serves only through the ioeventfds, which the server re-arms.
        let report = self.serve(index);
        self.deferred(report)
    }
}
