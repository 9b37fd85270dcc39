//! virtio-vsock served on the native event loop without the GIL (`NativeTransport`'s
//! `DeviceKind::Vsock`, `_core.NativeDevice` from Python).
//!
//! The vsock device's one implementation: the connection table, the state machine,
//! credit, the host listener and its CONNECT lines, the per-connection Unix sockets,
//! the transport reset event and the hold of host connections until the guest handled
//! it, and the three queues (rx, tx, event). The contract, bounds and counter keys are
//! those `vsock.py`'s module docstring and constants state. The native transport
//! (`transport.rs`) builds it at the restore, hands it the queues at each DRIVER_OK,
//! and serves config space; Python keeps only `VsockState` and the constants.
//!
//! * **Its fds.** One private epoll holds the listener, every accepted socket still
//!   owing its CONNECT line, every connection's socket (readable and/or writable
//!   interest), a timerfd for the
//!   timeouts and an eventfd to re-arm a run that used its budget. The loop watches the
//!   private epoll's fd (readable when any member is ready) and, while the device is
//!   active, the queues' ioeventfds: four fds on the loop whatever the connection count.
//! * **Lifetime.** The object lives as long as the device (the listener is open from
//!   construction on); `attach` gives it the queues at each activation and `detach`
//!   takes them back at the driver's reset, dropping every connection. While attached it is the one owner of the queues' ring
//!   indices (`sync` copies them back for a snapshot), as in `rng_serve.rs`.
//! * **Timers.** The CONNECT line's and the guest answer's `CONNECT_TIMEOUT` and
//!   `RESET_ACK_WAIT_S` are deadlines in a heap; the timerfd is set to the earliest.
//!   Entries for a connection that went away meanwhile expire as no-ops.
//! * **A guest fault** (the device becomes NEEDS_RESET) goes through the activation's
//!   `DeviceEvents` (each `Activation` brings its own, so a fault is told to the
//!   activation that found it): the native transport's `NativeEvents` for the epoch.
//!   A healthy device never takes the GIL, nor does a faulty one.
//!
//! Locks, in this order: `inner`, then guest RAM's, then the register file's. None is
//! held across a GIL take or release.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::eventloop::{drain_eventfd, Deferred, NativeReader};
use crate::guest_ram::{GuestRam as GuestRamInner, Ram};
use crate::mmio::Registers;
use crate::queue_server::{self, raise_used_buffer, DeviceEvents};
use crate::virtq::{self, Chain, QueueError, Rings};
use crate::vsock_connect_line::parse_connect_line;
use crate::vsock_io::{self, DataHeader, Stop};
use crate::vsock_packet::{self, Header, Op, Verdict, HEADER_SIZE, HOST_CID, TYPE_STREAM};

const RX: usize = 0;
const TX: usize = 1;
const EV: usize = 2;

// vsock.py's bounds (its module docstring).
pub const BUF_ALLOC: u32 = 256 * 1024;
const MAX_PACKET_PAYLOAD: usize = 64 * 1024;
pub const MAX_CONNECTIONS: usize = 1024;
pub const MAX_PACKETS_PER_RUN: u32 = 256;
pub const MAX_ORPHAN_RSTS: usize = 1024;
const NATIVE_RX_BATCH: u32 = 32;
pub const CONNECT_LINE_MAX: usize = 64;
const HOST_PORT_FIRST: u32 = 1 << 30;
const ACCEPTS_PER_WAKE: usize = 16;
const SHUTDOWN_RCV: u32 = 1;
const SHUTDOWN_SEND: u32 = 2;
const EVENT_TRANSPORT_RESET: u32 = 0;
/// Events taken from the private epoll per wake; the rest keep it readable.
const MAX_EVENTS: usize = 64;

// The private epoll's tokens; connections and pending host sockets take ids above.
const TOKEN_LISTENER: u64 = 1;
const TOKEN_TIMER: u64 = 2;
const TOKEN_KICK: u64 = 3;
const FIRST_ID: u64 = 16;

// The counter keys (`NativeDevice.vsock_errors`), fixed strings: never a guest number.
const TOO_MANY_GUEST: &str = "guest connection refused: too many connections";
const REQUEST_EXISTS: &str = "REQUEST on a connection that already exists";
const NOT_ESTABLISHED: &str = "op on a connection that is not established";
const UNKNOWN_OP: &str = "tx packet with an unknown op";
const UNASKED_RESPONSE: &str = "RESPONSE on a connection that did not request one";
const DATA_AFTER_SHUTDOWN: &str = "data after the guest shut down sending";
const CREDIT_OVERRUN: &str = "guest overran the credit we advertised";
const ORPHAN_FULL: &str = "orphan RST dropped: queue full";
const HOLD_EXPIRED: &str = "host connections sent before the guest acknowledged a transport reset";
const ACCEPT_FAILED: &str = "accept failed";
const TOO_MANY_HOST: &str = "host connection refused: too many connections";
const NO_CONNECT_LINE: &str = "host connection closed without a CONNECT line";
const BAD_CONNECT_LINE: &str = "bad CONNECT line";
const NOT_RUNNING: &str = "host connection while the device is not running";
const NO_ANSWER: &str = "guest did not answer a host connection request";

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// recv(2) into `buf`; Err(errno), EINTR retried.
fn recv(fd: RawFd, buf: &mut [u8], flags: libc::c_int) -> Result<usize, i32> {
    loop {
        // SAFETY: `buf` is a live, writable buffer of `buf.len()` bytes.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags) };
        if n >= 0 {
            return Ok(n as usize);
        }
        match errno() {
            libc::EINTR => continue,
            e => return Err(e),
        }
    }
}

/// send(2) without blocking or SIGPIPE; Err(errno) (EAGAIN included), EINTR retried.
fn send(fd: RawFd, buf: &[u8]) -> Result<usize, i32> {
    loop {
        // SAFETY: `buf` is a live buffer of `buf.len()` bytes; the kernel only reads it.
        let n = unsafe {
            libc::send(
                fd,
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        match errno() {
            libc::EINTR => continue,
            e => return Err(e),
        }
    }
}

/// A non-blocking connect to the Unix socket at `path` (ENOENT/ECONNREFUSED: nobody
/// listens; EAGAIN: its backlog is full; ENAMETOOLONG: the path does not fit).
fn connect_unix(path: &[u8]) -> Result<OwnedFd, i32> {
    // SAFETY: an all-zero sockaddr_un is valid; the path is copied in below.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if path.len() >= addr.sun_path.len() || path.contains(&0) {
        return Err(libc::ENAMETOOLONG);
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, &src) in addr.sun_path.iter_mut().zip(path) {
        *dst = src as libc::c_char;
    }
    // SAFETY: plain socket(2); the fd is owned right below.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(errno());
    }
    // SAFETY: `fd` was just made and is owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sa_family_t>() + path.len() + 1;
    // SAFETY: `addr` is a valid sockaddr_un of at least `len` bytes.
    let rc = unsafe {
        libc::connect(
            sock.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(errno());
    }
    Ok(sock)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ConnState {
    /// Host-initiated: OP_REQUEST sent (or to send), awaiting the guest.
    Requested,
    Established,
}

/// One connection, either way (the credit fields count payload bytes, mod 2**32).
struct Conn {
    sock: OwnedFd,
    /// The host side's vsock port.
    local_port: u32,
    /// The guest side's vsock port.
    peer_port: u32,
    state: ConnState,
    /// The guest's credit, from the last header it sent on this connection.
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// Payload bytes sent to the guest.
    tx_cnt: u32,
    /// Payload bytes received from the guest.
    rx_cnt: u32,
    /// Of those, bytes written to the Unix socket.
    fwd_cnt: u32,
    /// `fwd_cnt` in the last header we sent.
    last_told_fwd: u32,
    /// Guest -> host bytes not yet written; at most BUF_ALLOC (checked before adding).
    out: VecDeque<u8>,
    /// Control packets owed to the guest.
    need_request: bool,
    need_response: bool,
    need_credit_update: bool,
    need_credit_request: bool,
    /// A CREDIT_REQUEST went out and credit has not returned since.
    credit_requested: bool,
    /// SHUTDOWN flags owed to the guest.
    shutdown_to_send: u32,
    /// The Unix socket was readable; its bytes wait for an rx buffer and credit.
    data_ready: bool,
    /// The Unix socket's reader side hit EOF (SHUTDOWN sent or owed).
    host_eof: bool,
    /// We shut the Unix socket's writing side (the guest will send no more).
    host_wr_shut: bool,
    /// SHUTDOWN flags received from the guest.
    peer_shut: u32,
    /// Both directions shut: RST once the buffered bytes are written.
    reset_after_flush: bool,
    /// Read and write interest wanted in the private epoll.
    reading: bool,
    writing: bool,
    /// In the rx turn queue.
    queued: bool,
    /// The interest the private epoll has for the socket (0: not in it).
    interest: u32,
}

impl Conn {
    fn new(sock: OwnedFd, local_port: u32, peer_port: u32, state: ConnState) -> Conn {
        Conn {
            sock,
            local_port,
            peer_port,
            state,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            tx_cnt: 0,
            rx_cnt: 0,
            fwd_cnt: 0,
            last_told_fwd: 0,
            out: VecDeque::new(),
            need_request: false,
            need_response: false,
            need_credit_update: false,
            need_credit_request: false,
            credit_requested: false,
            shutdown_to_send: 0,
            data_ready: false,
            host_eof: false,
            host_wr_shut: false,
            peer_shut: 0,
            reset_after_flush: false,
            reading: false,
            writing: false,
            queued: false,
            interest: 0,
        }
    }

    fn credit(&self) -> u32 {
        let in_flight = self.tx_cnt.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    fn wants_host_data(&self) -> bool {
        self.state == ConnState::Established
            && !self.host_eof
            && self.peer_shut & SHUTDOWN_RCV == 0
            && !self.reset_after_flush
    }

    fn has_work(&self) -> bool {
        self.need_request
            || self.need_response
            || self.shutdown_to_send != 0
            || self.need_credit_update
            || self.need_credit_request
            || (self.data_ready && self.credit() > 0)
    }

    fn data_only(&self) -> bool {
        self.data_ready
            && !self.need_request
            && !self.need_response
            && self.shutdown_to_send == 0
            && !self.need_credit_update
            && !self.need_credit_request
            && self.wants_host_data()
            && self.credit() > 0
    }
}

/// An accepted host socket that has not yet sent its CONNECT line.
struct Pending {
    sock: OwnedFd,
    line: Vec<u8>,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    /// A pending host socket's CONNECT line is due.
    Line(u64),
    /// A host-initiated connection's answer from the guest is due.
    Answer(u64),
    /// The hold of this generation ends.
    Hold(u64),
}

/// The activation's fixed part: what the transport handed over.
struct Attached {
    ram: Arc<GuestRamInner>,
    registers: Arc<Mutex<Registers>>,
    epoch: u64,
    rings: [Rings; 3],
    irq: OwnedFd,
    /// The queues' ioeventfds (the transport's; None without ioeventfds).
    notify: [Option<RawFd>; 3],
    /// Where a guest fault this activation finds goes.
    events: Arc<dyn DeviceEvents<()>>,
}

struct Inner {
    closed: bool,
    attached: Option<Arc<Attached>>,
    avail: [u16; 3],
    used: [u16; 3],
    /// A guest fault was found in this activation: serve no more.
    failed: bool,
    interrupts: u64,
    guest_cid: u64,
    connect_timeout: Duration,
    reset_ack_wait: Duration,
    /// `<uds_path>` as bytes; a guest connection to port P goes to `<uds_path>_<P>`.
    uds_path: Option<Vec<u8>>,
    listener: Option<OwnedFd>,
    /// The private epoll, the timer and the budget's re-arm (None once closed: closed
    /// by `close`, not left to the collector, which frees the device's cycle late).
    epoll: Option<Epoll>,
    timerfd: Option<OwnedFd>,
    timer_armed: Option<Instant>,
    kick: Option<EventFd>,
    next_id: u64,
    conns: HashMap<u64, Conn>,
    keys: HashMap<(u32, u32), u64>,
    pending: HashMap<u64, Pending>,
    rx_queue: VecDeque<u64>,
    orphan_rsts: VecDeque<Header>,
    timers: BinaryHeap<Reverse<(Instant, Timer)>>,
    next_port: u32,
    reset_event_pending: bool,
    reset_delivered: bool,
    buffers_at_delivery: u16,
    holding: bool,
    held: Vec<u64>,
    hold_generation: u64,
    hold_timer: Option<u64>,
    errors: BTreeMap<&'static str, u64>,
}

/// What one wake needs of guest memory, if the device is active and healthy.
struct Guest<'a> {
    ram: &'a Ram<'a>,
    att: &'a Attached,
    /// A chain was put on a used ring: raise the interrupt at the end.
    used: bool,
}

type Step = Result<(), QueueError>;

impl Inner {
    fn count(&mut self, what: &'static str) {
        *self.errors.entry(what).or_insert(0) += 1;
    }

    fn usable(&self) -> bool {
        match &self.attached {
            Some(att) => !self.failed && !lock(&att.registers).failed_in(att.epoch),
            None => false,
        }
    }

    fn header(&self, conn: &Conn, op: Op, len: u32, flags: u32) -> Header {
        Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: conn.local_port,
            dst_port: conn.peer_port,
            len,
            type_: TYPE_STREAM,
            op: op as u16,
            flags,
            buf_alloc: BUF_ALLOC,
            fwd_cnt: conn.fwd_cnt,
        }
    }

    fn set_interest(&self, fd: RawFd, token: u64, old: u32, new: u32) {
        if old == new {
            return;
        }
        let (op, event) = match (old, new) {
            (0, _) => (
                ControlOperation::Add,
                EpollEvent::new(EventSet::from_bits_truncate(new), token),
            ),
            (_, 0) => (ControlOperation::Delete, EpollEvent::default()),
            _ => (
                ControlOperation::Modify,
                EpollEvent::new(EventSet::from_bits_truncate(new), token),
            ),
        };
        // Cannot fail for an open socket this epoll has (or lacks) as asked.
        if let Some(epoll) = &self.epoll {
            let _ = epoll.ctl(op, fd, event);
        }
    }

    fn update_interest(&mut self, id: u64) {
        let Some(conn) = self.conns.get(&id) else {
            return;
        };
        let mut want = 0;
        if conn.reading {
            want |= EventSet::IN.bits();
        }
        if conn.writing {
            want |= EventSet::OUT.bits();
        }
        let (fd, old) = (conn.sock.as_raw_fd(), conn.interest);
        self.set_interest(fd, id, old, want);
        if let Some(conn) = self.conns.get_mut(&id) {
            conn.interest = want;
        }
    }

    fn schedule(&mut self, id: u64) {
        if let Some(conn) = self.conns.get_mut(&id) {
            if !conn.queued {
                conn.queued = true;
                self.rx_queue.push_back(id);
            }
        }
    }

    fn queue_orphan_rst(&mut self, src_port: u32, dst_port: u32) {
        if self.orphan_rsts.len() >= MAX_ORPHAN_RSTS {
            self.count(ORPHAN_FULL);
            return;
        }
        self.orphan_rsts.push_back(Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port,
            dst_port,
            len: 0,
            type_: TYPE_STREAM,
            op: Op::Rst as u16,
            flags: 0,
            buf_alloc: 0,
            fwd_cnt: 0,
        });
    }

    fn close(&mut self, id: u64, rst: bool) {
        let Some(conn) = self.conns.remove(&id) else {
            return;
        };
        self.keys.remove(&(conn.local_port, conn.peer_port));
        self.set_interest(conn.sock.as_raw_fd(), id, conn.interest, 0);
        if rst {
            self.queue_orphan_rst(conn.local_port, conn.peer_port);
        }
        drop(conn); // the socket closes
    }

    fn close_pending(&mut self, id: u64) {
        if let Some(p) = self.pending.remove(&id) {
            self.set_interest(p.sock.as_raw_fd(), id, EventSet::IN.bits(), 0);
        }
    }

    fn drop_all(&mut self) {
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            self.close(id, false);
        }
        let ids: Vec<u64> = self.pending.keys().copied().collect();
        for id in ids {
            self.close_pending(id);
        }
        self.rx_queue.clear();
        self.orphan_rsts.clear();
        self.held.clear();
    }

    fn arm_reset_event(&mut self) {
        self.reset_event_pending = true;
        self.reset_delivered = false;
        self.holding = true;
        self.hold_generation += 1;
    }

    fn fresh_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn add_timer(&mut self, after: Duration, timer: Timer) {
        let due = Instant::now() + after;
        self.timers.push(Reverse((due, timer)));
    }

    /// Watch the Unix socket if the guest can take its data; else ask for credit.
    fn arm_reader(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        if !conn.wants_host_data() || conn.reading {
            return;
        }
        if conn.credit() == 0 {
            conn.data_ready = false; // relearnt from the socket once credit returns
            if !conn.credit_requested {
                conn.credit_requested = true;
                conn.need_credit_request = true;
                self.schedule(id);
            }
            return;
        }
        conn.credit_requested = false;
        if conn.data_ready {
            self.schedule(id);
            return;
        }
        conn.reading = true;
        self.update_interest(id);
    }

    // -- guest -> host ------------------------------------------------------------------
    fn process_tx(&mut self, g: &mut Guest<'_>) -> Step {
        let rings = g.att.rings[TX];
        let mut handled = 0;
        while handled < MAX_PACKETS_PER_RUN {
            let Some(chain) = virtq::pop(g.ram, &rings, self.avail[TX])? else {
                break;
            };
            self.avail[TX] = self.avail[TX].wrapping_add(1);
            self.handle_packet(g.ram, &chain)?;
            self.used[TX] = virtq::add_used(g.ram, &rings, self.used[TX], chain.head, 0)?;
            handled += 1;
        }
        if handled > 0 {
            g.used = true;
        }
        if handled == MAX_PACKETS_PER_RUN {
            // The rest on a later turn, after the other ready fds.
            self.rearm();
        }
        Ok(())
    }

    /// Serve the rest of a run that used its budget on a later turn, after the other
    /// ready fds.
    fn rearm(&self) {
        if let Some(kick) = &self.kick {
            let _ = kick.write(1);
        }
    }

    fn handle_packet(&mut self, ram: &Ram<'_>, chain: &Chain) -> Step {
        let (hdr, op) = match vsock_packet::classify_tx(ram, &chain.readable, self.guest_cid)? {
            Verdict::Drop(key) => {
                self.count(key);
                return Ok(());
            }
            Verdict::Refuse(key, hdr) => {
                self.count(key);
                match self.keys.get(&(hdr.dst_port, hdr.src_port)) {
                    Some(&id) => self.close(id, true),
                    None if hdr.op != Op::Rst as u16 => {
                        self.queue_orphan_rst(hdr.dst_port, hdr.src_port)
                    }
                    None => {}
                }
                return Ok(());
            }
            Verdict::Packet(hdr, op) => (hdr, op),
        };
        let Some(&id) = self.keys.get(&(hdr.dst_port, hdr.src_port)) else {
            if op == Some(Op::Request) {
                self.guest_connect(&hdr);
            } else if op != Some(Op::Rst) {
                self.queue_orphan_rst(hdr.dst_port, hdr.src_port);
            }
            return Ok(());
        };
        let conn = self.conns.get_mut(&id).expect("keys and conns agree");
        conn.peer_buf_alloc = hdr.buf_alloc;
        conn.peer_fwd_cnt = hdr.fwd_cnt;
        let established = conn.state == ConnState::Established;
        match op {
            Some(Op::Rst) => self.close(id, false),
            Some(Op::Response) => self.established(id),
            Some(Op::Request) => {
                self.count(REQUEST_EXISTS);
                self.close(id, true);
            }
            _ if !established => {
                self.count(NOT_ESTABLISHED);
                self.close(id, true);
            }
            Some(Op::Rw) => self.guest_data(ram, id, chain, hdr.len)?,
            Some(Op::Shutdown) => self.guest_shutdown(id, hdr.flags),
            Some(Op::CreditRequest) => {
                conn.need_credit_update = true;
                self.schedule(id);
            }
            Some(Op::CreditUpdate) => {} // the credit fields were taken above
            None => {
                self.count(UNKNOWN_OP);
                self.close(id, true);
            }
        }
        self.arm_reader(id);
        Ok(())
    }

    fn guest_connect(&mut self, hdr: &Header) {
        if self.conns.len() + self.pending.len() >= MAX_CONNECTIONS {
            self.count(TOO_MANY_GUEST);
            self.queue_orphan_rst(hdr.dst_port, hdr.src_port);
            return;
        }
        let sock = match self.connect_path(hdr.dst_port) {
            Ok(sock) => sock,
            Err(_) => {
                self.queue_orphan_rst(hdr.dst_port, hdr.src_port);
                return;
            }
        };
        let mut conn = Conn::new(sock, hdr.dst_port, hdr.src_port, ConnState::Established);
        conn.peer_buf_alloc = hdr.buf_alloc;
        conn.peer_fwd_cnt = hdr.fwd_cnt;
        conn.need_response = true;
        let id = self.fresh_id();
        self.keys.insert((conn.local_port, conn.peer_port), id);
        self.conns.insert(id, conn);
        self.schedule(id);
        self.arm_reader(id);
    }

    fn connect_path(&self, port: u32) -> Result<OwnedFd, i32> {
        let Some(base) = &self.uds_path else {
            return Err(libc::ENOENT);
        };
        let mut path = base.clone();
        path.extend_from_slice(format!("_{port}").as_bytes());
        connect_unix(&path)
    }

    fn established(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        if conn.state != ConnState::Requested {
            self.count(UNASKED_RESPONSE);
            self.close(id, true);
            return;
        }
        conn.state = ConnState::Established;
        // A fresh socket's send buffer is empty: a 20-byte send cannot block.
        let line = format!("OK {}\n", conn.local_port);
        if send(conn.sock.as_raw_fd(), line.as_bytes()) != Ok(line.len()) {
            self.close(id, true);
        }
    }

    fn guest_data(&mut self, ram: &Ram<'_>, id: u64, chain: &Chain, length: u32) -> Step {
        let conn = self.conns.get_mut(&id).expect("the caller looked it up");
        if conn.peer_shut & SHUTDOWN_SEND != 0 {
            self.count(DATA_AFTER_SHUTDOWN);
            self.close(id, true);
            return Ok(());
        }
        let length = length as usize;
        if conn.out.len() + length > BUF_ALLOC as usize {
            self.count(CREDIT_OVERRUN);
            self.close(id, true);
            return Ok(());
        }
        conn.rx_cnt = conn.rx_cnt.wrapping_add(length as u32);
        let header = HEADER_SIZE as u64;
        if conn.out.is_empty() {
            // One sendmsg straight from the guest's buffers; only what the socket does
            // not take now is copied into `out`.
            match vsock_io::send_segments(
                ram,
                &chain.readable,
                header,
                length,
                conn.sock.as_raw_fd(),
            )? {
                Err(_) => {
                    self.close(id, true);
                    return Ok(());
                }
                Ok(sent) => {
                    conn.fwd_cnt = conn.fwd_cnt.wrapping_add(sent as u32);
                    if sent < length {
                        let rest = virtq::read_segments(
                            ram,
                            &chain.readable,
                            length - sent,
                            header + sent as u64,
                        )?;
                        conn.out.extend(rest);
                    }
                }
            }
        } else {
            let rest = virtq::read_segments(ram, &chain.readable, length, header)?;
            conn.out.extend(rest);
        }
        self.flush(id);
        Ok(())
    }

    fn guest_shutdown(&mut self, id: u64, flags: u32) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        conn.peer_shut |= flags & (SHUTDOWN_RCV | SHUTDOWN_SEND);
        if conn.peer_shut & SHUTDOWN_RCV != 0 {
            conn.data_ready = false;
            conn.reading = false;
        }
        if conn.peer_shut == SHUTDOWN_RCV | SHUTDOWN_SEND {
            // Linux waits for our RST once both directions are shut.
            conn.reset_after_flush = true;
        }
        self.update_interest(id);
        self.flush(id);
    }

    /// Write buffered guest bytes to the Unix socket; settle shutdown and credit.
    fn flush(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let fd = conn.sock.as_raw_fd();
        while !conn.out.is_empty() {
            let (front, _) = conn.out.as_slices();
            let chunk = &front[..front.len().min(MAX_PACKET_PAYLOAD)];
            match send(fd, chunk) {
                Ok(sent) => {
                    conn.out.drain(..sent);
                    conn.fwd_cnt = conn.fwd_cnt.wrapping_add(sent as u32);
                }
                Err(libc::EAGAIN) => break,
                Err(_) => {
                    self.close(id, true);
                    return;
                }
            }
        }
        let pending_out = !conn.out.is_empty();
        if !pending_out && conn.out.capacity() > MAX_PACKET_PAYLOAD {
            // An idle connection keeps no burst's buffer (up to BUF_ALLOC) dirty.
            conn.out = VecDeque::new();
        }
        if pending_out != conn.writing {
            conn.writing = pending_out;
            self.update_interest(id);
        }
        if pending_out {
            return;
        }
        let conn = self.conns.get_mut(&id).expect("still open");
        if conn.peer_shut & SHUTDOWN_SEND != 0 && !conn.host_wr_shut {
            conn.host_wr_shut = true;
            // SAFETY: shutdown(2) of a socket this connection owns.
            unsafe { libc::shutdown(fd, libc::SHUT_WR) };
        }
        if conn.reset_after_flush || (conn.host_eof && conn.peer_shut & SHUTDOWN_SEND != 0) {
            self.close(id, true);
            return;
        }
        let told_free =
            i64::from(BUF_ALLOC) - i64::from(conn.rx_cnt.wrapping_sub(conn.last_told_fwd));
        if conn.fwd_cnt != conn.last_told_fwd && told_free < i64::from(BUF_ALLOC / 2) {
            conn.need_credit_update = true;
            self.schedule(id);
        }
    }

    // -- host -> guest: the rx queue ------------------------------------------------------
    fn process_rx(&mut self, g: &mut Guest<'_>) -> Step {
        let rings = g.att.rings[RX];
        let mut delivered = 0u32;
        while delivered < MAX_PACKETS_PER_RUN
            && (!self.orphan_rsts.is_empty() || !self.rx_queue.is_empty())
        {
            if self.orphan_rsts.is_empty() {
                let front = self.rx_queue[0];
                if self.conns.get(&front).is_some_and(Conn::data_only) {
                    self.rx_queue.pop_front();
                    let (served, buffers_left) =
                        self.native_data(g, front, MAX_PACKETS_PER_RUN - delivered)?;
                    delivered += served;
                    if !buffers_left {
                        break; // the guest's next rx notification brings us back
                    }
                    continue;
                }
            }
            let Some(chain) = virtq::pop(g.ram, &rings, self.avail[RX])? else {
                break; // the guest's next rx notification brings us back
            };
            let room = virtq::total(&chain.writable);
            if room < HEADER_SIZE as u64 {
                return Err(QueueError::Virtqueue(format!(
                    "rx buffer of {room} bytes cannot hold a {HEADER_SIZE}-byte packet header"
                )));
            }
            let room = room - HEADER_SIZE as u64;
            let packet = if let Some(rst) = self.orphan_rsts.pop_front() {
                Some((rst, Vec::new()))
            } else {
                let id = self.rx_queue.pop_front().expect("not empty");
                if let Some(conn) = self.conns.get_mut(&id) {
                    conn.queued = false;
                }
                let packet = self.next_packet(id, room);
                if self.conns.get(&id).is_some_and(Conn::has_work) {
                    self.schedule(id);
                }
                packet
            };
            // None: the chain stays the guest's (not popped).
            let Some((hdr, payload)) = packet else {
                continue;
            };
            self.used[RX] = vsock_packet::deliver_rx(
                g.ram,
                &rings,
                self.used[RX],
                chain.head,
                &chain.writable,
                &hdr,
                &payload,
            )?;
            self.avail[RX] = self.avail[RX].wrapping_add(1);
            delivered += 1;
        }
        if delivered > 0 {
            g.used = true;
        }
        if delivered == MAX_PACKETS_PER_RUN {
            self.rearm();
        }
        Ok(())
    }

    /// A data-only connection's bytes, readv'd straight into rx buffers, at most
    /// NATIVE_RX_BATCH packets. (packets delivered, whether rx buffers may be left).
    fn native_data(
        &mut self,
        g: &mut Guest<'_>,
        id: u64,
        budget: u32,
    ) -> Result<(u32, bool), QueueError> {
        let guest_cid = self.guest_cid;
        let conn = self.conns.get_mut(&id).expect("data_only looked it up");
        conn.queued = false;
        let header = DataHeader {
            src_cid: HOST_CID,
            dst_cid: guest_cid,
            src_port: conn.local_port,
            dst_port: conn.peer_port,
            buf_alloc: BUF_ALLOC,
            fwd_cnt: conn.fwd_cnt,
        };
        let batch = vsock_io::rx_data(
            g.ram,
            &g.att.rings[RX],
            self.avail[RX],
            self.used[RX],
            conn.sock.as_raw_fd(),
            &header,
            u64::from(conn.credit()),
            budget.min(NATIVE_RX_BATCH),
        )?;
        self.avail[RX] = batch.next_avail;
        self.used[RX] = batch.next_used;
        if batch.packets > 0 {
            conn.tx_cnt = conn.tx_cnt.wrapping_add(batch.bytes as u32);
            conn.last_told_fwd = conn.fwd_cnt;
        }
        match batch.stop {
            Stop::Drained => conn.data_ready = false,
            Stop::Eof => {
                // The host will send no more. Tell the guest; keep receiving from it.
                conn.data_ready = false;
                conn.host_eof = true;
                if conn.peer_shut & SHUTDOWN_SEND != 0 && conn.out.is_empty() {
                    self.close(id, true);
                } else {
                    conn.shutdown_to_send |= SHUTDOWN_SEND;
                }
            }
            Stop::Failed(_) => self.close(id, true),
            Stop::Credit | Stop::NoBuffers | Stop::Budget => {}
        }
        if self.conns.contains_key(&id) {
            self.arm_reader(id); // out of credit now? ask for more; drained: watch it
            if self.conns.get(&id).is_some_and(Conn::has_work) {
                self.schedule(id);
            }
        }
        Ok((batch.packets, batch.stop != Stop::NoBuffers))
    }

    /// The next packet this connection owes the guest, if any.
    fn next_packet(&mut self, id: u64, room: u64) -> Option<(Header, Vec<u8>)> {
        let conn = self.conns.get_mut(&id)?;
        let data_ready = conn.data_ready;
        let mut packet = self.control_packet(id);
        if packet.is_none() && data_ready {
            packet = self.data_packet(id, room);
            if packet.is_none() && self.conns.contains_key(&id) {
                self.arm_reader(id);
                packet = self.control_packet(id);
            }
        }
        if packet.is_some() {
            if let Some(conn) = self.conns.get_mut(&id) {
                conn.last_told_fwd = conn.fwd_cnt;
                conn.need_credit_update = false;
                self.arm_reader(id); // out of credit now? ask for more
            }
        }
        packet
    }

    fn control_packet(&mut self, id: u64) -> Option<(Header, Vec<u8>)> {
        let conn = self.conns.get_mut(&id)?;
        let (op, flags) = if conn.need_request {
            conn.need_request = false;
            (Op::Request, 0)
        } else if conn.need_response {
            conn.need_response = false;
            (Op::Response, 0)
        } else if conn.shutdown_to_send != 0 {
            (Op::Shutdown, std::mem::take(&mut conn.shutdown_to_send))
        } else if conn.need_credit_update {
            (Op::CreditUpdate, 0)
        } else if conn.need_credit_request {
            conn.need_credit_request = false;
            (Op::CreditRequest, 0)
        } else {
            return None;
        };
        let conn = &self.conns[&id];
        Some((self.header(conn, op, 0, flags), Vec::new()))
    }

    fn data_packet(&mut self, id: u64, room: u64) -> Option<(Header, Vec<u8>)> {
        let conn = self.conns.get_mut(&id)?;
        let want = room
            .min(u64::from(conn.credit()))
            .min(MAX_PACKET_PAYLOAD as u64) as usize;
        if want == 0 || !conn.wants_host_data() {
            conn.data_ready = false;
            return None;
        }
        let mut data = vec![0u8; want];
        match recv(conn.sock.as_raw_fd(), &mut data, libc::MSG_DONTWAIT) {
            Err(libc::EAGAIN) => {
                conn.data_ready = false;
                None
            }
            Err(_) => {
                self.close(id, true);
                None
            }
            Ok(0) => {
                // EOF: the host will send no more. Tell the guest; keep receiving.
                conn.data_ready = false;
                conn.host_eof = true;
                if conn.peer_shut & SHUTDOWN_SEND != 0 && conn.out.is_empty() {
                    self.close(id, true);
                } else {
                    conn.shutdown_to_send |= SHUTDOWN_SEND;
                }
                None
            }
            Ok(n) => {
                data.truncate(n);
                conn.tx_cnt = conn.tx_cnt.wrapping_add(n as u32);
                let conn = &self.conns[&id];
                Some((self.header(conn, Op::Rw, n as u32, 0), data))
            }
        }
    }

    // -- events ---------------------------------------------------------------------------
    fn post_events(&mut self, g: &mut Guest<'_>) -> Step {
        if !self.reset_event_pending {
            return Ok(());
        }
        let rings = g.att.rings[EV];
        let Some(chain) = virtq::pop(g.ram, &rings, self.avail[EV])? else {
            return Ok(()); // delivered when the guest posts an event buffer
        };
        self.avail[EV] = self.avail[EV].wrapping_add(1);
        let event = EVENT_TRANSPORT_RESET.to_le_bytes();
        let written = virtq::write_segments(g.ram, &chain.writable, &event, 0)?;
        if written < event.len() {
            return Err(QueueError::Virtqueue(format!(
                "event buffer of {} bytes cannot hold a 4-byte event",
                virtq::total(&chain.writable)
            )));
        }
        self.used[EV] = virtq::add_used(g.ram, &rings, self.used[EV], chain.head, written as u32)?;
        self.reset_event_pending = false;
        self.reset_delivered = true;
        self.buffers_at_delivery = virtq::pending(g.ram, &rings, self.avail[EV])?;
        g.used = true;
        Ok(())
    }

    /// The guest gave an event buffer back since the reset event was delivered: it has
    /// handled it (not merely been notified: a transport notifies every queue once when
    /// it activates the device).
    fn reset_acknowledged(&self, g: &Guest<'_>) -> Result<bool, QueueError> {
        let pending = virtq::pending(g.ram, &g.att.rings[EV], self.avail[EV])?;
        Ok(pending != self.buffers_at_delivery)
    }

    fn hold(&mut self, id: u64) {
        self.held.push(id);
        if self.hold_timer != Some(self.hold_generation) {
            self.hold_timer = Some(self.hold_generation);
            self.add_timer(self.reset_ack_wait, Timer::Hold(self.hold_generation));
        }
    }

    fn release_held(&mut self) {
        self.holding = false;
        self.reset_delivered = false;
        for id in std::mem::take(&mut self.held) {
            self.schedule(id); // (not if it was closed meanwhile)
        }
    }

    // -- host-initiated connections -----------------------------------------------------------
    fn accept(&mut self) {
        let Some(listener) = self.listener.as_ref().map(AsRawFd::as_raw_fd) else {
            return;
        };
        for _ in 0..ACCEPTS_PER_WAKE {
            // SAFETY: accept4(2) on the listener this object owns; no address wanted.
            let fd = unsafe {
                libc::accept4(
                    listener,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                )
            };
            if fd < 0 {
                match errno() {
                    libc::EAGAIN | libc::EINTR => return,
                    _ => {
                        self.count(ACCEPT_FAILED);
                        return;
                    }
                }
            }
            // SAFETY: a fresh fd from accept4, owned by nobody else.
            let sock = unsafe { OwnedFd::from_raw_fd(fd) };
            if self.conns.len() + self.pending.len() >= MAX_CONNECTIONS {
                self.count(TOO_MANY_HOST);
                continue; // `sock` closes
            }
            let id = self.fresh_id();
            self.set_interest(sock.as_raw_fd(), id, 0, EventSet::IN.bits());
            self.pending.insert(
                id,
                Pending {
                    sock,
                    line: Vec::new(),
                },
            );
            self.add_timer(self.connect_timeout, Timer::Line(id));
        }
    }

    fn connect_line(&mut self, id: u64) {
        let usable = self.usable();
        let Some(pending) = self.pending.get_mut(&id) else {
            return;
        };
        let fd = pending.sock.as_raw_fd();
        let mut peek = [0u8; CONNECT_LINE_MAX];
        let peeked = match recv(fd, &mut peek, libc::MSG_PEEK | libc::MSG_DONTWAIT) {
            Ok(n) => n,
            Err(libc::EAGAIN) => return,
            Err(_) => return self.close_pending(id),
        };
        let newline = peek[..peeked].iter().position(|&b| b == b'\n');
        // Consume only up to the newline: bytes after it are the stream's first bytes.
        // A partial line is consumed too, or a level-triggered reader would spin on it.
        let take = newline.map_or(peeked, |n| n + 1);
        let mut consumed = [0u8; CONNECT_LINE_MAX];
        match recv(fd, &mut consumed[..take], libc::MSG_DONTWAIT) {
            Ok(n) => pending.line.extend_from_slice(&consumed[..n]),
            Err(libc::EAGAIN) => return,
            Err(_) => return self.close_pending(id),
        }
        if newline.is_none() {
            if peeked == 0 || pending.line.len() >= CONNECT_LINE_MAX {
                self.count(NO_CONNECT_LINE);
                self.close_pending(id);
            }
            return;
        }
        let port = parse_connect_line(&pending.line).and_then(|p| u32::try_from(p).ok());
        let Some(port) = port.filter(|_| usable) else {
            self.count(if port.is_none() {
                BAD_CONNECT_LINE
            } else {
                NOT_RUNNING
            });
            return self.close_pending(id);
        };
        let pending = self.pending.remove(&id).expect("looked up above");
        self.set_interest(fd, id, EventSet::IN.bits(), 0);
        let local = self.allocate_port(port);
        let mut conn = Conn::new(pending.sock, local, port, ConnState::Requested);
        conn.need_request = true;
        let cid = self.fresh_id();
        self.keys.insert((local, port), cid);
        self.conns.insert(cid, conn);
        self.add_timer(self.connect_timeout, Timer::Answer(cid));
        if self.holding {
            self.hold(cid); // its request once the guest has handled the reset
            return;
        }
        self.schedule(cid);
    }

    fn allocate_port(&mut self, peer_port: u32) -> u32 {
        loop {
            // Ends: fewer than MAX_CONNECTIONS keys are taken.
            let port = self.next_port;
            self.next_port = if port < u32::MAX - 1 {
                port + 1
            } else {
                HOST_PORT_FIRST
            };
            if !self.keys.contains_key(&(port, peer_port)) {
                return port;
            }
        }
    }

    fn run_timers(&mut self) {
        if let Some(timerfd) = &self.timerfd {
            let mut buf = [0u8; 8];
            // SAFETY: reading 8 bytes from the non-blocking timerfd this object owns into
            // a live buffer (EAGAIN: it had not expired, nothing to drain).
            let _ = unsafe { libc::read(timerfd.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
        }
        self.timer_armed = None;
        let now = Instant::now();
        while let Some(&Reverse((due, timer))) = self.timers.peek() {
            if due > now {
                break;
            }
            self.timers.pop();
            match timer {
                Timer::Line(id) => self.close_pending(id),
                Timer::Answer(id) => {
                    if self
                        .conns
                        .get(&id)
                        .is_some_and(|c| c.state == ConnState::Requested)
                    {
                        self.count(NO_ANSWER);
                        self.close(id, true);
                    }
                }
                Timer::Hold(generation) => {
                    if self.holding && generation == self.hold_generation {
                        self.count(HOLD_EXPIRED);
                        self.release_held();
                    }
                }
            }
        }
    }

    /// Set the timerfd to the earliest deadline (a relative time: never zero, which
    /// would disarm it).
    fn arm_timerfd(&mut self) {
        let Some(timerfd) = self.timerfd.as_ref().map(AsRawFd::as_raw_fd) else {
            return;
        };
        let next = self.timers.peek().map(|Reverse((due, _))| *due);
        if next == self.timer_armed {
            return;
        }
        self.timer_armed = next;
        let after = next.map_or(Duration::ZERO, |due| {
            due.saturating_duration_since(Instant::now())
                .max(Duration::from_nanos(1))
        });
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: after.as_secs() as libc::time_t,
                tv_nsec: libc::c_long::from(after.subsec_nanos() as i32),
            },
        };
        // SAFETY: timerfd_settime(2) on the timerfd this object owns with a valid spec.
        unsafe { libc::timerfd_settime(timerfd, 0, &spec, std::ptr::null_mut()) };
    }

    /// What the private epoll has ready, without guest memory (the caller runs the
    /// queues after). Returns whether a budget re-arm (the kick) asked for a tx run.
    fn host_events(&mut self) -> bool {
        let mut events = [EpollEvent::default(); MAX_EVENTS];
        let n = match &self.epoll {
            Some(epoll) => epoll.wait(0, &mut events).unwrap_or(0),
            None => 0,
        };
        let mut kicked = false;
        for ev in &events[..n] {
            let token = ev.data();
            let set = ev.event_set();
            match token {
                TOKEN_LISTENER => self.accept(),
                TOKEN_TIMER => self.run_timers(),
                TOKEN_KICK => {
                    if let Some(kick) = &self.kick {
                        let _ = kick.read();
                    }
                    kicked = true;
                }
                id if self.pending.contains_key(&id) => self.connect_line(id),
                id if self.conns.contains_key(&id) => {
                    if !self.usable() {
                        // A dead device keeps no connections, so that a readable socket
                        // it can no longer serve cannot spin the loop.
                        self.drop_all();
                        continue;
                    }
                    let conn = &self.conns[&id];
                    let broken = set.intersects(EventSet::ERROR | EventSet::HANG_UP);
                    if conn.writing && (broken || set.contains(EventSet::OUT)) {
                        self.flush(id);
                    }
                    if let Some(conn) = self.conns.get_mut(&id) {
                        if conn.reading && (broken || set.contains(EventSet::IN)) {
                            conn.reading = false;
                            conn.data_ready = true;
                            self.update_interest(id);
                            self.schedule(id);
                        }
                    }
                }
                _ => {} // closed earlier in this wake
            }
        }
        kicked
    }
}

#[derive(Clone, Copy)]
enum Work {
    Host,
    Notify(usize),
}

pub struct VsockServer {
    inner: Mutex<Inner>,
    epoll_fd: RawFd,
}

/// A guest fault one wake found, and the activation that found it.
type Fault = (QueueError, Arc<Attached>);

/// What an activation hands a `VsockServer` (`VsockServer::attach`).
pub struct Activation {
    pub ram: Arc<GuestRamInner>,
    pub registers: Arc<Mutex<Registers>>,
    pub epoch: u64,
    pub guest_cid: u64,
    /// The rx, tx and event queues' rings (checked by the caller, the transport) and
    /// their (next_avail, next_used).
    pub rings: [Rings; 3],
    pub indices: [(u16, u16); 3],
    /// The interrupt's eventfd (the KVM irqfd), owned from here on.
    pub irq: OwnedFd,
    /// The queues' ioeventfds' numbers (the transport's; None without ioeventfds).
    pub notify: [Option<RawFd>; 3],
    pub connect_timeout: Duration,
    pub reset_ack_wait: Duration,
    /// Where a guest fault this activation finds goes (the native transport's record
    /// for the activation's epoch).
    pub events: Arc<dyn DeviceEvents<()>>,
}

/// Where a device numbers its host-initiated connections' ports from: a random point
/// of their range, as an OS randomises its ephemeral ports (RFC 6056), for the same
/// reason: an old connection's 4-tuple may still be alive at the peer. A restored
/// device's guest may hold sockets of the snapshot source's last connections: a socket
/// the guest's agent closed stays in the guest kernel's connected table until the
/// host's RST, or for `VSOCK_CLOSE_TIMEOUT` (8 s) when none comes, transport reset or
/// not, and the guest answers a REQUEST whose ports name such a socket with RST
/// (`virtio_transport_recv_pkt`). Numbered from one fixed port, a child's Nth
/// connection had the source's Nth connection's ports, and was refused whenever the
/// capture fell inside that one's close (`test_branch.py`'s branch of a branch: its
/// child's second `eval`). A random start makes a reuse as likely as a 30-bit guess.
fn first_host_port() -> u32 {
    let mut bytes = [0u8; 4];
    // SAFETY: getrandom writes at most the 4 bytes of this live local buffer.
    let got = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    let random = if got == 4 {
        u32::from_ne_bytes(bytes)
    } else {
        // Not before the host's entropy pool is up, which a running host's is; a
        // clock's low bits still differ from the source's start.
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a live timespec to write; CLOCK_MONOTONIC always exists.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        ts.tv_nsec as u32
    };
    // `allocate_port` hands out HOST_PORT_FIRST ..= u32::MAX - 1.
    HOST_PORT_FIRST + random % (u32::MAX - HOST_PORT_FIRST)
}

impl VsockServer {
    /// A device listening on `listener` (a bound, listening Unix socket at `uds_path`,
    /// owned from here on, made non-blocking: a wake accepts until it would block);
    /// guest-initiated connections to port P go to `<uds_path>_<P>`.
    pub fn new(
        listener: OwnedFd,
        uds_path: &str,
        guest_cid: u64,
        connect_timeout: Duration,
        reset_ack_wait: Duration,
    ) -> std::io::Result<Self> {
        set_nonblocking(listener.as_raw_fd())?;
        let epoll = Epoll::new()?;
        // SAFETY: plain timerfd_create(2); the fd is owned right below.
        let tfd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if tfd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh fd owned by nobody else.
        let timerfd = unsafe { OwnedFd::from_raw_fd(tfd) };
        let kick = EventFd::new(EFD_NONBLOCK)?;
        for (fd, token) in [
            (listener.as_raw_fd(), TOKEN_LISTENER),
            (timerfd.as_raw_fd(), TOKEN_TIMER),
            (kick.as_raw_fd(), TOKEN_KICK),
        ] {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, token),
            )?;
        }
        let epoll_fd = epoll.as_raw_fd();
        Ok(VsockServer {
            inner: Mutex::new(Inner {
                closed: false,
                attached: None,
                avail: [0; 3],
                used: [0; 3],
                failed: false,
                interrupts: 0,
                guest_cid,
                connect_timeout,
                reset_ack_wait,
                uds_path: Some(uds_path.as_bytes().to_vec()),
                listener: Some(listener),
                epoll: Some(epoll),
                timerfd: Some(timerfd),
                timer_armed: None,
                kick: Some(kick),
                next_id: FIRST_ID,
                conns: HashMap::new(),
                keys: HashMap::new(),
                pending: HashMap::new(),
                rx_queue: VecDeque::new(),
                orphan_rsts: VecDeque::new(),
                timers: BinaryHeap::new(),
                next_port: first_host_port(),
                reset_event_pending: false,
                reset_delivered: false,
                buffers_at_delivery: 0,
                holding: false,
                held: Vec::new(),
                hold_generation: 0,
                hold_timer: None,
                errors: BTreeMap::new(),
            }),
            epoll_fd,
        })
    }

    /// The fd the loop watches for every host socket and timer, for the device's life.
    pub fn epoll_fd(&self) -> RawFd {
        self.epoll_fd
    }

    /// Take the queues at an activation and deliver a pending transport reset; a guest
    /// fault found doing it comes back.
    pub fn attach(&self, a: Activation) -> Option<QueueError> {
        let att = Arc::new(Attached {
            ram: a.ram,
            registers: a.registers,
            epoch: a.epoch,
            rings: a.rings,
            irq: a.irq,
            notify: a.notify,
            events: a.events,
        });
        let old = {
            let mut inner = lock(&self.inner);
            inner.guest_cid = a.guest_cid;
            inner.connect_timeout = a.connect_timeout;
            inner.reset_ack_wait = a.reset_ack_wait;
            inner.avail = a.indices.map(|i| i.0);
            inner.used = a.indices.map(|i| i.1);
            inner.failed = false;
            inner.interrupts = 0;
            inner.attached.replace(att)
        };
        drop(old); // after the lock: the old activation's irqfd closes outside it
        self.wake(Work::Notify(EV)).map(|(error, _)| error)
    }

    /// The driver notified queue `queue` (no ioeventfd: a QueueNotify write, or the
    /// activation's catch-up); a guest fault goes to the activation's events.
    pub fn notify(&self, queue: usize) -> Option<Deferred> {
        self.serve(Work::Notify(queue))
    }

    /// The driver reset the device: drop every connection (and a pending reset event:
    /// a new driver has no stale sockets) and let go of the queues.
    pub fn detach(&self) {
        let old = {
            let mut inner = lock(&self.inner);
            inner.drop_all();
            inner.reset_event_pending = false;
            inner.reset_delivered = false;
            inner.holding = false;
            inner.attached.take()
        };
        drop(old); // after the lock: the activation's irqfd closes outside it
    }

    /// Drop every connection and tell the guest (EVENT_TRANSPORT_RESET); host
    /// connection requests are held until it handled it.
    pub fn transport_reset(&self) -> Option<Deferred> {
        {
            let mut inner = lock(&self.inner);
            inner.drop_all();
            inner.arm_reset_event();
        }
        self.serve(Work::Notify(EV))
    }

    /// A restore: a transport reset for when the device is next activated.
    pub fn arm_reset_event(&self, guest_cid: u64) {
        let mut inner = lock(&self.inner);
        inner.guest_cid = guest_cid;
        inner.arm_reset_event();
    }

    /// Close every socket, the listener's duplicate, the epoll, the timer (after the
    /// loop's reader of `epoll_fd` is gone).
    pub fn close(&self) {
        let old = {
            let mut inner = lock(&self.inner);
            inner.drop_all();
            inner.closed = true;
            inner.listener = None;
            inner.timers.clear();
            inner.epoll = None;
            inner.timerfd = None;
            inner.kick = None;
            inner.attached.take()
        };
        drop(old);
    }

    /// Each queue's (next_avail, next_used): rx, tx, event.
    pub fn sync(&self) -> [(u16, u16); 3] {
        let inner = lock(&self.inner);
        [RX, TX, EV].map(|i| (inner.avail[i], inner.used[i]))
    }

    /// Used-buffer interrupts raised this activation (the irqfd written).
    pub fn interrupts(&self) -> u64 {
        lock(&self.inner).interrupts
    }

    /// Host connections established or being requested.
    pub fn connection_count(&self) -> usize {
        lock(&self.inner).conns.len()
    }

    /// Accepted host sockets still owing their CONNECT line.
    pub fn pending_count(&self) -> usize {
        lock(&self.inner).pending.len()
    }

    /// The refusal counters (`vsock.py`'s keys): (key, n).
    pub fn errors(&self) -> Vec<(&'static str, u64)> {
        let inner = lock(&self.inner);
        inner.errors.iter().map(|(&k, &n)| (k, n)).collect()
    }

    /// One wake, its guest fault handed to the events of the activation that found it.
    fn serve(&self, work: Work) -> Option<Deferred> {
        let (error, att) = self.wake(work)?;
        queue_server::report(&att.events, Some(error), ())
    }

    /// One wake (any thread; the loop thread calls it without the GIL). A guest fault
    /// comes back with its activation.
    fn wake(&self, work: Work) -> Option<Fault> {
        let mut inner = lock(&self.inner);
        if inner.closed {
            return None;
        }
        let mut kicked = false;
        if let Work::Host = work {
            kicked = inner.host_events();
        }
        let fault = self.run_queues(&mut inner, work, kicked);
        inner.arm_timerfd();
        fault
    }

    fn run_queues(&self, inner: &mut Inner, work: Work, kicked: bool) -> Option<Fault> {
        if !inner.usable() {
            return None;
        }
        let att = inner.attached.clone()?;
        let Ok(ram) = att.ram.lock() else {
            return None; // guest memory is closed: the machine is going away
        };
        let mut g = Guest {
            ram: &ram,
            att: &att,
            used: false,
        };
        let result = (|| -> Step {
            match work {
                Work::Notify(TX) => inner.process_tx(&mut g)?,
                Work::Notify(EV) => {
                    if inner.reset_delivered && inner.holding && inner.reset_acknowledged(&g)? {
                        inner.release_held();
                    }
                    inner.post_events(&mut g)?;
                }
                Work::Host if kicked => inner.process_tx(&mut g)?,
                _ => {}
            }
            inner.process_rx(&mut g)
        })();
        let used = g.used;
        drop(ram);
        let fault = result.err();
        if fault.is_some() {
            inner.failed = true;
        }
        if used && raise_used_buffer(&att.registers, att.epoch, att.irq.as_raw_fd()) {
            inner.interrupts += 1;
        }
        fault.map(|error| (error, att))
    }
}

impl NativeReader for VsockServer {
    fn ready(self: Arc<Self>, fd: RawFd) -> Option<Deferred> {
        let work = if fd == self.epoll_fd {
            Work::Host
        } else {
            let notify = lock(&self.inner)
                .attached
                .as_ref()
                .map(|a| a.notify)
                .unwrap_or_default();
            let queue = notify.iter().position(|&n| n == Some(fd))?;
            drain_eventfd(fd);
            Work::Notify(queue)
        };
        self.serve(work)
    }
}

/// Set `O_NONBLOCK` on `fd` (its open file description: a caller's duplicate too).
fn set_nonblocking(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: fcntl(2) F_GETFL on an fd the caller keeps open.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above, F_SETFL with the flags just read plus O_NONBLOCK.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A listening Unix socket bound at `path` (a stale socket file there replaced, as
/// `vsock.py` does), for a native vsock device that is not handed one.
pub fn bind_listener(path: &str) -> std::io::Result<OwnedFd> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    Ok(std::os::unix::net::UnixListener::bind(path)?.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credit_never_goes_negative_and_wraps_with_the_counters() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut c = Conn::new(a.into(), 1, 2, ConnState::Established);
        c.peer_buf_alloc = 100;
        c.tx_cnt = 5;
        c.peer_fwd_cnt = u32::MAX - 4; // 10 in flight across the wrap
        assert_eq!(c.credit(), 90);
        c.tx_cnt = 200;
        c.peer_fwd_cnt = 0;
        assert_eq!(c.credit(), 0);
    }
}
