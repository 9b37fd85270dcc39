//! virtio-net served on the native event loop without the GIL (`NativeTransport`'s
//! `DeviceKind::Net`, `_core.NativeDevice` from Python).
//!
//! `net.rs` moves the frames; this object is the device around it while the native loop
//! serves the device, from its activation to its reset: what a tx notification, an rx
//! notification and a readable tap do.
//!
//! * **Its fds.** The loop calls it for three, each a wake (below): the tx queue's
//!   ioeventfd (drained), the rx queue's ioeventfd (drained; the tap is watched again)
//!   and the tap. The ioeventfds are the transport's (it
//!   closes them); the tap is a duplicate of the device's, registered under the
//!   duplicate's number, so the number the loop watches is this object's until
//!   `retire`.
//! * **One owner of the indices.** Both queues' `next_avail`/`next_used` are this
//!   object's while it is attached; the transport seeds it and gets them back
//!   (`indices`: a BRANCH of a running child captures what was served), as in
//!   `rng_serve.rs`.
//! * **The tap is watched only while the guest has rx buffers**: a receive that finds
//!   none, or a read that fails, stops watching the tap (the loop keeps its reader;
//!   `LoopLink::watch` takes it out of the epoll set, since a readable tap would
//!   otherwise wake the loop at every turn), and the rx notification watches it again.
//!   Frames meanwhile wait in the tap's queue.
//! * **Budget.** One wake serves at most `max_frames` chains (tx) and receive turns (rx).
//!   A tx run that used its budget re-arms by writing the tx ioeventfd (the rest is
//!   served on a later turn, after the other ready fds); rx needs nothing, the tap being
//!   level-triggered and still readable.
//! * **Both queues per wake, one interrupt per wake, and only if the driver wants it.**
//!   Whatever woke it (a tx or rx notification, the tap), a wake serves the tx queue,
//!   then the rx queue while the tap is watched. A wake
//!   that put chains on a used ring asks `virtq::needs_interrupt` (EVENT_IDX's `used_event`
//!   against the used index before and after the wake, or the NO_INTERRUPT flag) and
//!   only then sets InterruptStatus for the activation's epoch (`Registers::raise`, so a
//!   reset in between drops it) and writes the irqfd, as the transport's `trigger` does.
//!   With EVENT_IDX the driver's kicks are moderated too: a queue found empty asks for
//!   a kick at its next chain (`virtq::pop`), and no kick is asked for while a wake is
//!   still popping.
//! * **What it reports** (through the server's `DeviceEvents`, the native transport's
//!   record): a guest fault (the server stops, stops watching the tap, and the transport
//!   sets DEVICE_NEEDS_RESET) and a failed tap read (the tap is no longer watched). The
//!   frames the tap refuses are only counted. Nothing takes the GIL.
//!
//! Locks, in this order: `state`, then guest RAM's or the register file's (never both),
//! then the loop's (`LoopLink::watch`). None is held across a GIL take or release, and
//! `link` is only cloned out under its own.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::eventloop::{drain_eventfd, Deferred, LoopLink, NativeReader};
use crate::guest_ram::GuestRam as Ram;
use crate::mmio::Registers;
use crate::net::{self, Counters, RxStop};
use crate::queue_server::{self, raise_used_buffer, write_eventfd, Details, DeviceEvents};
use crate::virtq::{self, QueueError, Rings};

const RX_QUEUE: u32 = 0;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Clone, Copy)]
enum Work {
    /// The driver offered tx chains.
    Tx,
    /// The driver offered rx chains: watch the tap again and receive.
    RxNotify,
    /// The tap has frames.
    TapReadable,
}

struct NetState {
    /// The duplicate of the tap (None: no tap, or closed).
    tap: Option<OwnedFd>,
    /// The duplicated irqfd and tx ioeventfd (None once closed; the latter also
    /// without ioeventfds).
    irq: Option<OwnedFd>,
    tx_rearm: Option<OwnedFd>,
    rx_avail: u16,
    rx_used: u16,
    tx_avail: u16,
    tx_used: u16,
    /// Whether the tap is to be watched (the last thing asked of the loop).
    watched: bool,
    /// A guest fault was found: serve no more (until the driver resets the device).
    failed: bool,
    closed: bool,
    counters: Counters,
    /// Used-buffer interrupts raised (the irqfd written): the line's statistics.
    interrupts: u64,
}

/// What a wake leaves for Python.
#[derive(Default)]
struct Report {
    fault: Option<QueueError>,
    details: NetDetails,
    /// A tx run used its budget and there is no ioeventfd to re-arm with: the caller
    /// (the transport, serving a notify on the writing thread) serves again.
    rearm: bool,
}

/// What a wake reports besides a fault.
#[derive(Default)]
pub struct NetDetails {
    /// The errno of a failed tap read (the tap is no longer watched).
    pub read_error: Option<i32>,
}

impl Details for NetDetails {
    fn count(&self) -> u64 {
        u64::from(self.read_error.is_some())
    }
}

/// The fds a `NetServer` is made with: the tap (owned: its number is what the loop
/// calls `ready` with), the queues' ioeventfds' numbers (the transport's, registered
/// with the loop) and a duplicate of the tx one to re-arm with (owned), the irqfd
/// (owned).
pub struct NetFds {
    pub tap: Option<OwnedFd>,
    pub rx_notify: Option<RawFd>,
    pub tx_notify: Option<RawFd>,
    pub tx_rearm: Option<OwnedFd>,
    pub irq: OwnedFd,
}

pub struct NetServer {
    ram: Arc<Ram>,
    registers: Arc<Mutex<Registers>>,
    epoch: u64,
    rx: Rings,
    tx: Rings,
    /// The numbers of the fds the loop calls `ready` for: the tap's duplicate (fixed
    /// while registered: `close` comes after the reader's removal) and the transport's
    /// ioeventfds.
    tap_fd: Option<RawFd>,
    rx_notify: Option<RawFd>,
    tx_notify: Option<RawFd>,
    max_frames: u32,
    max_tx_bytes: u64,
    link: Mutex<Option<LoopLink>>,
    state: Mutex<NetState>,
    /// Where a guest fault and a failed tap read go (the native transport's record).
    events: Arc<dyn DeviceEvents<NetDetails>>,
}

impl NetServer {
    /// A server for the ready rx and tx queues (their rings, checked by the caller:
    /// `Virtqueue.validate` from Python, and their ring indices' start), for the
    /// transport's activation `epoch`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ram: Arc<Ram>,
        registers: Arc<Mutex<Registers>>,
        epoch: u64,
        (rx, (rx_avail, rx_used)): (Rings, (u16, u16)),
        (tx, (tx_avail, tx_used)): (Rings, (u16, u16)),
        fds: NetFds,
        max_frames: u32,
        max_tx_bytes: u64,
        events: Arc<dyn DeviceEvents<NetDetails>>,
    ) -> Result<Self, String> {
        if max_frames == 0 {
            return Err("max_frames must be at least 1".to_owned());
        }
        Ok(NetServer {
            ram,
            registers,
            epoch,
            rx,
            tx,
            tap_fd: fds.tap.as_ref().map(AsRawFd::as_raw_fd),
            rx_notify: fds.rx_notify,
            tx_notify: fds.tx_notify,
            max_frames,
            max_tx_bytes,
            link: Mutex::new(None),
            state: Mutex::new(NetState {
                tap: fds.tap,
                irq: Some(fds.irq),
                tx_rearm: fds.tx_rearm,
                rx_avail,
                rx_used,
                tx_avail,
                tx_used,
                // The loop watches an fd from its `Loop::add_native` on.
                watched: true,
                failed: false,
                closed: false,
                counters: Counters::default(),
                interrupts: 0,
            }),
            events,
        })
    }

    /// Ask the loop to watch the tap (`on`) or not; `st.watched` is what was asked.
    fn watch(&self, st: &mut NetState, on: bool) {
        let Some(fd) = st.tap.as_ref().map(AsRawFd::as_raw_fd) else {
            return;
        };
        if st.watched == on {
            return;
        }
        st.watched = on;
        let link = lock(&self.link).clone();
        if let Some(link) = link {
            link.watch(fd, on);
        }
    }

    /// One wake (any thread; the loop thread calls it without the GIL), whatever woke
    /// it: the tx queue, then the rx queue while the tap is watched, then at most one
    /// interrupt for both (the device has one line), if the driver wants one. Serving
    /// both queues per wake is the moderation that counts with a fast device: a tx
    /// frame's answer (a TCP ACK the host wrote during the `writev`) is often in the
    /// tap already, and goes in under the same interrupt as the frame's completion.
    fn serve(&self, work: Work) -> Report {
        let mut report = Report::default();
        let mut st = lock(&self.state);
        if st.closed {
            return report;
        }
        if st.failed || lock(&self.registers).failed_in(self.epoch) {
            // A failed or reset device must not leave a readable tap spinning the loop.
            self.watch(&mut st, false);
            return report;
        }
        match work {
            Work::TapReadable if !st.watched => return report, // parked earlier this turn
            Work::RxNotify => self.watch(&mut st, true),
            _ => {}
        }
        let tap = st.tap.as_ref().map(AsRawFd::as_raw_fd);
        let Ok(ram) = self.ram.lock() else {
            // Guest memory is closed: the machine is going away.
            self.watch(&mut st, false);
            return report;
        };
        let (tx_old, rx_old) = (st.tx_used, st.rx_used);
        let s = net::transmit(
            &ram,
            &self.tx,
            st.tx_avail,
            st.tx_used,
            tap,
            self.max_frames,
            self.max_tx_bytes,
        );
        (st.tx_avail, st.tx_used) = (s.next_avail, s.next_used);
        st.counters.add(&s.counters);
        report.fault = s.error;
        let budget_spent = report.fault.is_none() && s.chains == self.max_frames;
        let mut rx_stop = None;
        if let (None, true, Some(tap)) = (&report.fault, st.watched, tap) {
            let r = net::receive(
                &ram,
                &self.rx,
                st.rx_avail,
                st.rx_used,
                tap,
                self.max_frames,
            );
            (st.rx_avail, st.rx_used) = (r.next_avail, r.next_used);
            st.counters.add(&r.counters);
            report.fault = r.error;
            rx_stop = Some(r.stop);
        }
        // A failed read of the guest's word (RAM going away) interrupts: a spurious
        // interrupt costs a look, a lost one a stall.
        let wanted = report.fault.is_none()
            && (virtq::needs_interrupt(&ram, &self.tx, tx_old, st.tx_used).unwrap_or(true)
                || virtq::needs_interrupt(&ram, &self.rx, rx_old, st.rx_used).unwrap_or(true));
        drop(ram);
        if report.fault.is_some() {
            st.failed = true;
            self.watch(&mut st, false);
            return report;
        }
        if budget_spent {
            match &st.tx_rearm {
                Some(fd) => write_eventfd(fd.as_raw_fd()),
                None => report.rearm = true,
            }
        }
        match rx_stop {
            // Until the driver posts buffers (its rx notification).
            Some(RxStop::NoBuffers) => self.watch(&mut st, false),
            // Not the guest's doing: stop rather than spin on an fd that keeps failing;
            // the next rx notification tries again.
            Some(RxStop::Failed(errno)) => {
                self.watch(&mut st, false);
                report.details.read_error = Some(errno);
            }
            Some(RxStop::Drained | RxStop::Budget) | None => {}
        }
        if wanted {
            if let Some(irq) = st.irq.as_ref().map(AsRawFd::as_raw_fd) {
                if raise_used_buffer(&self.registers, self.epoch, irq) {
                    st.interrupts += 1;
                }
            }
        }
        report
    }

    /// Serve queue `queue` (0 rx, 1 tx) now, on the calling thread (a notify with no
    /// ioeventfd, from a native transport): true if a tx run used its budget with no
    /// ioeventfd to re-arm with. What a wake leaves for the events goes to them (a
    /// native sink hands nothing back to run).
    pub fn serve_now(&self, queue: u32) -> bool {
        let work = if queue == RX_QUEUE {
            Work::RxNotify
        } else {
            Work::Tx
        };
        let report = self.serve(work);
        let rearm = report.rearm;
        let _ = self.deferred(report);
        rearm
    }

    /// The tap's duplicate, the fd the loop watches (None without a tap).
    pub fn tap_fd(&self) -> Option<RawFd> {
        self.tap_fd
    }

    /// Both queues' (next_avail, next_used), rx first; waits out a wake in progress.
    pub fn indices(&self) -> [(u16, u16); 2] {
        let st = lock(&self.state);
        [(st.rx_avail, st.rx_used), (st.tx_avail, st.tx_used)]
    }

    /// The frames moved since this server was made, and the used-buffer interrupts
    /// it raised.
    pub fn stats(&self) -> (Counters, u64) {
        let st = lock(&self.state);
        (st.counters, st.interrupts)
    }

    /// Close the duplicated fds and serve no more (after the loop's readers are gone:
    /// the tap's duplicate is the number the loop watched); a wake in progress holds
    /// the state lock, so once this returns none uses them.
    pub fn retire(&self) {
        let mut st = lock(&self.state);
        st.closed = true;
        st.tap = None;
        st.irq = None;
        st.tx_rearm = None;
    }

    /// Hand the report to the events, if it has anything for them.
    fn deferred(&self, report: Report) -> Option<Deferred> {
        queue_server::report(&self.events, report.fault, report.details)
    }

    fn work_for(&self, fd: RawFd) -> Option<Work> {
        if Some(fd) == self.tap_fd {
            Some(Work::TapReadable)
        } else if Some(fd) == self.tx_notify {
            drain_eventfd(fd);
            Some(Work::Tx)
        } else if Some(fd) == self.rx_notify {
            drain_eventfd(fd);
            Some(Work::RxNotify)
        } else {
            None
        }
    }
}

impl NativeReader for NetServer {
    fn ready(self: Arc<Self>, fd: RawFd) -> Option<Deferred> {
        let work = self.work_for(fd)?;
        let report = self.serve(work);
        self.deferred(report)
    }

    fn bind(&self, link: LoopLink) {
        *lock(&self.link) = Some(link);
    }
}
