//! What every device server on the native loop shares (`rng_serve.rs`, `net_serve.rs`,
//! `vsock_serve.rs`, `balloon_serve.rs`, `blk_serve.rs`): the used-buffer interrupt as the transport raises it, the eventfds it
//! duplicates and writes, and where it sends what it cannot act on itself
//! (`DeviceEvents`: its transport's `NativeEvents`, a record that needs no Python).

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;

use crate::eventloop::Deferred;
use crate::mmio::{Registers, INT_USED_BUFFER};
use crate::virtq::QueueError;

/// The used-buffer interrupt, as the transport's `trigger` raises it: InterruptStatus
/// for the activation's `epoch` (a reset in between drops it), then a write to the
/// interrupt's eventfd, the KVM irqfd. True if it was raised (for the line's count).
pub fn raise_used_buffer(registers: &Mutex<Registers>, epoch: u64, irq: RawFd) -> bool {
    let raised = registers
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .raise(INT_USED_BUFFER, epoch);
    if raised {
        write_eventfd(irq);
    }
    raised
}

/// A queue whose per-wake budget is spent is served again on a later loop turn: write
/// its ioeventfd, so the loop finds it readable after the other ready fds. False when
/// there is none (the caller serves again itself).
pub fn rearm(notify: Option<RawFd>) -> bool {
    match notify {
        Some(fd) => {
            write_eventfd(fd);
            true
        }
        None => false,
    }
}

/// Where a device server sends what a wake found that it cannot act on itself: a
/// guest fault (the queue stopped serving) and the device's details (failed discards,
/// refused frames). A native transport installs `NativeEvents`, which needs no Python.
///
/// `report` runs on the thread that served (the loop thread without the GIL, or a
/// Python caller's with the GIL released) with no server lock held, and must not take
/// the GIL: what needs Python comes back as work the loop (or the Python caller) runs
/// with the GIL after the turn's native work.
pub trait DeviceEvents<D>: Send + Sync {
    fn report(self: Arc<Self>, fault: Option<QueueError>, details: D) -> Option<Deferred>;
}

/// How many items a report's details hold, for `NativeEvents`'s count.
pub trait Details {
    fn count(&self) -> u64;
}

impl Details for () {
    fn count(&self) -> u64 {
        0
    }
}

impl<T> Details for Vec<T> {
    fn count(&self) -> u64 {
        self.len() as u64
    }
}

/// Hand `fault` and `details` to `events` unless the wake found neither.
pub fn report<D: Details>(
    events: &Arc<dyn DeviceEvents<D>>,
    fault: Option<QueueError>,
    details: D,
) -> Option<Deferred> {
    if fault.is_none() && details.count() == 0 {
        return None;
    }
    events.clone().report(fault, details)
}

/// The longest fault message `NativeEvents` keeps (a guest's messages are short and
/// formatted from numbers, but the record stays bounded whatever they hold).
const MAX_FAULT_TEXT: usize = 512;

/// What `NativeEvents` recorded, readable at any time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventRecord {
    /// Guest faults reported (each stopped its queue until the driver resets it).
    pub faults: u64,
    /// Reports that carried details, and how many details they carried in all.
    pub reports: u64,
    pub details: u64,
    /// The last fault's message, at most `MAX_FAULT_TEXT` bytes.
    pub last_fault: Option<String>,
}

/// A device's events kept in Rust, for a machine wired with no Python: counters and the
/// last fault's message, read later (`record`), and, given its transport, what the
/// Python transport's `_device_error` does with a fault: DEVICE_NEEDS_RESET for the
/// activation's epoch and the configuration-change interrupt. Nothing goes to Python.
#[derive(Default)]
pub struct NativeEvents {
    record: Mutex<EventRecord>,
    transport: Option<Transport>,
}

/// The register file a fault sets DEVICE_NEEDS_RESET in, the activation's epoch, and the
/// interrupt's eventfd (the KVM irqfd, a duplicate owned here).
struct Transport {
    registers: Arc<Mutex<Registers>>,
    epoch: u64,
    irq: OwnedFd,
}

impl NativeEvents {
    /// Counters and the last fault only (the wiring tests'; a transport's are `for_transport`).
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn new() -> Self {
        NativeEvents::default()
    }

    /// A fault also sets DEVICE_NEEDS_RESET in `registers` for `epoch` and, when that
    /// is new, signals `irq` (InterruptStatus's config-change bit is set with it).
    pub fn for_transport(registers: Arc<Mutex<Registers>>, epoch: u64, irq: OwnedFd) -> Self {
        NativeEvents {
            record: Mutex::default(),
            transport: Some(Transport {
                registers,
                epoch,
                irq,
            }),
        }
    }

    pub fn record(&self) -> EventRecord {
        self.record
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl<D: Details> DeviceEvents<D> for NativeEvents {
    fn report(self: Arc<Self>, fault: Option<QueueError>, details: D) -> Option<Deferred> {
        let mut record = self.record.lock().unwrap_or_else(|p| p.into_inner());
        let count = details.count();
        if count > 0 {
            record.reports += 1;
            record.details += count;
        }
        let fault = fault?;
        record.faults += 1;
        let mut text = match fault {
            QueueError::Virtqueue(m) => m,
            QueueError::Memory(e) => e.to_string(),
        };
        if text.len() > MAX_FAULT_TEXT {
            let mut cut = MAX_FAULT_TEXT;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
        }
        record.last_fault = Some(text.clone());
        drop(record);
        if let Some(t) = &self.transport {
            // The record's lock is released: a server's locks come before the
            // register file's, and none is held here.
            let newly = t
                .registers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .device_error(text, t.epoch);
            if newly {
                write_eventfd(t.irq.as_raw_fd());
            }
        }
        None
    }
}

pub(crate) fn write_eventfd(fd: RawFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: `fd` is an eventfd the server owns (a duplicate); 8 bytes from a live
    // buffer. A full counter (EAGAIN) still leaves the eventfd signalled.
    let _ = unsafe { libc::write(fd, one.as_ptr().cast(), one.len()) };
}

pub(crate) fn dup(fd: RawFd) -> PyResult<OwnedFd> {
    if fd < 0 {
        return Err(PyValueError::new_err(format!(
            "invalid file descriptor {fd}"
        )));
    }
    // SAFETY: the caller passes an fd it keeps open for the duration of this call.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    borrowed
        .try_clone_to_owned()
        .map_err(|e| PyOSError::new_err(format!("dup({fd}): {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest_ram::RamError;

    #[test]
    fn native_events_count_and_keep_the_last_fault_bounded() {
        let native = Arc::new(NativeEvents::new());
        let events: Arc<dyn DeviceEvents<Vec<u8>>> = native.clone();
        // Nothing to report: the sink is not called at all.
        assert!(report(&events, None, Vec::new()).is_none());
        assert_eq!(native.record(), EventRecord::default());
        assert!(report(&events, None, vec![1, 2, 3]).is_none());
        let long = "é".repeat(MAX_FAULT_TEXT); // two bytes a char: cut on a boundary
        let fault = QueueError::Virtqueue(long);
        assert!(report(&events, Some(fault), Vec::new()).is_none());
        let fault = QueueError::Memory(RamError::Closed);
        assert!(report(&events, Some(fault), vec![4]).is_none());
        let record = native.record();
        assert_eq!((record.faults, record.reports, record.details), (2, 2, 4));
        assert_eq!(record.last_fault.as_deref(), Some("guest memory is closed"));

        let events: Arc<dyn DeviceEvents<()>> = native.clone();
        let fault = QueueError::Virtqueue("é".repeat(MAX_FAULT_TEXT));
        assert!(report(&events, Some(fault), ()).is_none());
        let kept = native.record().last_fault.unwrap();
        assert!(kept.len() <= MAX_FAULT_TEXT && kept.len() >= MAX_FAULT_TEXT - 1);
        assert!(kept.chars().all(|c| c == 'é'));
    }
}
