//! virtio-rng served on the native event loop without the GIL (`RngServer`).
//!
//! While a queue is attached (from the device's activation to its reset), this object
//! is the **one owner** of the queue's ring indices (`next_avail`, `next_used`); the
//! transport holds them only before (they seed this object) and after (`sync` copies
//! them back for the device's plan, so a BRANCH of a running child captures the
//! indices this object advanced). The ring
//! registers (size, addresses) are fixed from DRIVER_OK on, so they are copied in.
//!
//! A notification (the queue's ioeventfd becoming readable, or `serve` on the writing
//! vCPU's thread for a queue without one) pops at most `max_requests` chains, fills at most
//! `max_bytes` of each with getrandom(2), puts them on the used ring, and raises the
//! used-buffer interrupt the way the transport does (`Registers::raise` for the
//! activation's epoch, then a write to the interrupt's eventfd, the KVM irqfd). A run
//! that used its whole budget re-arms by writing the ioeventfd itself, so the rest is
//! served on a later loop turn, after the other ready fds.
//!
//! A guest fault (`QueueError`) makes the queue stop serving and goes to the server's
//! `DeviceEvents`, its transport's `NativeEvents`, which sets DEVICE_NEEDS_RESET.
//!
//! The server holds Rust values only (guest RAM's and the register file's `Arc`s, the
//! events sink): `RngServer::new` builds one with no Python object.
//!
//! Locks, in this order: `state`, then guest RAM's, then the register file's. None is
//! held across a GIL take or release.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::eventloop::{drain_eventfd, Deferred, NativeReader};
use crate::guest_ram::GuestRam as Ram;
use crate::mmio::Registers;
use crate::queue_server::{raise_used_buffer, rearm, DeviceEvents};
use crate::virtq::{self, QueueError, Rings};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct QueueIndices {
    next_avail: u16,
    next_used: u16,
    /// A guest fault was found: serve no more (until the driver resets the device).
    failed: bool,
    served: u64,
    bytes: u64,
    /// Used-buffer interrupts raised (the irqfd written): the line's statistics.
    interrupts: u64,
}

pub struct RngServer {
    ram: Arc<Ram>,
    registers: Arc<Mutex<Registers>>,
    epoch: u64,
    rings: Rings,
    irq: OwnedFd,
    /// The queue's ioeventfd (a duplicate), written to re-arm; None without one.
    notify: Option<OwnedFd>,
    max_requests: u32,
    max_bytes: usize,
    state: Mutex<QueueIndices>,
    /// Where a guest fault goes (Python's `on_error`, or a native record).
    events: Arc<dyn DeviceEvents<()>>,
}

/// What one notification did.
pub enum Served {
    Done,
    /// The whole budget was spent and there is no ioeventfd to re-arm with: the
    /// caller must serve again later, or the rest waits for the guest's next kick
    /// (which a driver that has already kicked does not send).
    Budget,
    Fault(QueueError),
}

impl RngServer {
    /// A server for the ready queue `rings` (checked by the caller: `Virtqueue.validate`
    /// from Python) whose ring indices start at `next_avail`/`next_used`, for the
    /// transport's activation `epoch`; `irq` is the interrupt's eventfd (the KVM irqfd)
    /// and `notify` the queue's ioeventfd (None without one), both owned from here on.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ram: Arc<Ram>,
        registers: Arc<Mutex<Registers>>,
        epoch: u64,
        rings: Rings,
        (next_avail, next_used): (u16, u16),
        irq: OwnedFd,
        notify: Option<OwnedFd>,
        max_requests: u32,
        max_bytes: usize,
        events: Arc<dyn DeviceEvents<()>>,
    ) -> Result<Self, String> {
        if max_requests == 0 {
            return Err("max_requests must be at least 1".to_owned());
        }
        Ok(RngServer {
            ram,
            registers,
            epoch,
            rings,
            irq,
            notify,
            max_requests,
            max_bytes,
            state: Mutex::new(QueueIndices {
                next_avail,
                next_used,
                failed: false,
                served: 0,
                bytes: 0,
                interrupts: 0,
            }),
            events,
        })
    }

    /// Where a guest fault goes, for a caller that served it itself (`serve`).
    pub fn events(&self) -> Arc<dyn DeviceEvents<()>> {
        self.events.clone()
    }

    /// (next_avail, next_used, requests served, bytes served, failed, interrupts).
    pub fn sync(&self) -> (u16, u16, u64, u64, bool, u64) {
        let st = lock(&self.state);
        (
            st.next_avail,
            st.next_used,
            st.served,
            st.bytes,
            st.failed,
            st.interrupts,
        )
    }

    /// Serve one notification (any thread; the loop thread calls it without the GIL).
    pub fn serve(&self) -> Served {
        let mut st = lock(&self.state);
        if st.failed {
            return Served::Done;
        }
        if lock(&self.registers).failed_in(self.epoch) {
            return Served::Done;
        }
        let ram = match self.ram.lock() {
            Ok(ram) => ram,
            // Guest memory is closed: the machine is going away.
            Err(_) => return Served::Done,
        };
        let mut served = 0u32;
        let mut fault = None;
        while served < self.max_requests {
            let step = (|| -> Result<bool, QueueError> {
                let Some(chain) = virtq::pop(&ram, &self.rings, st.next_avail)? else {
                    return Ok(false);
                };
                st.next_avail = st.next_avail.wrapping_add(1);
                let want = (virtq::total(&chain.writable) as usize).min(self.max_bytes);
                let written = virtq::fill_random(&ram, &chain.writable, want)?;
                st.next_used =
                    virtq::add_used(&ram, &self.rings, st.next_used, chain.head, written as u32)?;
                st.bytes += written as u64;
                Ok(true)
            })();
            match step {
                Ok(true) => served += 1,
                Ok(false) => break,
                Err(e) => {
                    fault = Some(e);
                    break;
                }
            }
        }
        drop(ram);
        st.served += u64::from(served);
        if let Some(e) = fault {
            st.failed = true;
            return Served::Fault(e);
        }
        if served > 0 && raise_used_buffer(&self.registers, self.epoch, self.irq.as_raw_fd()) {
            st.interrupts += 1;
        }
        drop(st);
        if served == self.max_requests && !rearm(self.notify.as_ref().map(AsRawFd::as_raw_fd)) {
            return Served::Budget;
        }
        Served::Done
    }
}

impl NativeReader for RngServer {
    /// The queue's ioeventfd: drain it, serve, and hand a guest fault to the events.
    fn ready(self: Arc<Self>, fd: RawFd) -> Option<Deferred> {
        drain_eventfd(fd);
        match self.serve() {
            // The loop serves only through the ioeventfd, which the server re-arms.
            Served::Done | Served::Budget => None,
            Served::Fault(e) => self.events.clone().report(Some(e), ()),
        }
    }
}
