//! A child's control socket served on a native thread (`_core.ControlServe`).
//!
//! The wire is `runtime/control.py`'s: JSON lines over a Unix stream socket, one reply
//! line per request line, in order. This thread owns the listening socket and every
//! connection; it holds no Python object but the hand-over handler, and takes the GIL
//! only to call it.
//!
//! Served here, without Python: `pause`, `resume`, `stop`, `status` (a balloon's
//! counters are its native transport's, `transport.rs`) and `exits` (the vCPU loops'
//! counters, `vcpu.rs`, and the machine's, `MachineCounters`). Everything else --
//! `snapshot`, and every line that is not exactly `{"op": "<one of those>"}`
//! (malformed lines included) -- goes to the handler, for that line only: it runs
//! `control.parse_request`, so an error reply's text has one author.
//!
//! Bounds a client can drive: at most `MAX_CONNECTIONS` connections (one more is told
//! so and closed), a connection's buffer at most `MAX_LINE_BYTES` plus one read (a
//! longer line is refused and the connection dropped, as the protocol says), one
//! `recv` of at most `RECV_CHUNK` bytes per readable connection per turn, and a reply
//! waits at most `SEND_TIMEOUT` for a client that does not read (`SO_SNDTIMEO`; the
//! connection is dropped then), so one such client cannot stall the others.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::transport::NativeTransport;
use crate::transport_py::NativeDevice;
use crate::vcpu::{UnclaimedCounts, VcpuControl, VcpuLoop};

/// `control.MAX_LINE_BYTES`: one request line (a test holds them equal).
pub const MAX_LINE_BYTES: usize = 1 << 20;
/// Connections served at once; the spawner and the daemon use one or two.
pub const MAX_CONNECTIONS: usize = 16;
const RECV_CHUNK: usize = 65536;
/// `Vcpu.pause`'s default: how long a vCPU may take to park.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a reply may wait for room in a connection's send buffer. A client that
/// reads its replies never makes one wait (a reply is a few hundred bytes, the buffer
/// hundreds of KiB); one that stops reading is dropped after this.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(2);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Where a line the server does not serve goes: the request line in, the reply line
/// (with its newline) out. `fd` is the connection, borrowed for the call (a snapshot
/// sends its progress line on it).
pub trait Handover: Send + Sync {
    fn handle(&self, line: &[u8], fd: RawFd) -> Vec<u8>;
}

/// What `exits` reports of a machine besides its vCPU loops' own counters: the port
/// and MMIO accesses no device claimed, and the interrupts raised per line as
/// `(GSI, count)` in the order `exits` lists them. Read on the server's thread.
pub trait MachineCounters: Send + Sync {
    fn counts(&self) -> Result<(UnclaimedCounts, Vec<(u32, u64)>), String>;
}

/// What `status` says of snapshots (`SnapshotTaker.bases` and `.tracking`), set by
/// whoever captures: the Python `ControlServer`, or a native child's hand-over (its
/// machine's Python view) through the `NativeMachine` handle, which shares it.
#[derive(Default)]
pub struct SnapshotStatus {
    /// `(tag, kind)`, newest first.
    pub bases: Vec<(Option<String>, String)>,
    pub tracking: Option<String>,
}

pub type SharedSnapshotStatus = Arc<Mutex<SnapshotStatus>>;

/// What `status` answers besides the loops' state.
struct Status {
    exit: Option<String>,
    snapshots: SharedSnapshotStatus,
}

struct Shared {
    vcpus: Vec<VcpuControl>,
    jailed: bool,
    /// The machine's balloon, whose counters `status` reports.
    balloon: Option<Arc<NativeTransport>>,
    /// The machine's counters for `exits` (a Python machine's hold it: let go at
    /// `close`, as the hand-over is).
    counters: Mutex<Option<Arc<dyn MachineCounters>>>,
    status: Mutex<Status>,
    /// Written by `close`: the thread ends at its next turn.
    wake: OwnedFd,
    /// A dup of the stop signal's write end (`vmmchild.StopSignal`).
    stop: OwnedFd,
    /// A `stop` was served here.
    stopped: AtomicBool,
    handover: Mutex<Option<Arc<dyn Handover>>>,
    done: Mutex<bool>,
    done_cond: Condvar,
    /// The thread's kernel id once it runs (0 before): a test watches it sleep.
    thread_id: AtomicI32,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    Status,
    Pause,
    Resume,
    Stop,
    Exits,
}

/// The op of a line that is exactly one JSON object with one member `"op"` whose value
/// is a plain string naming a natively served op (JSON whitespace anywhere between
/// tokens); None for every other line, which the handler then parses.
fn native_op(line: &[u8]) -> Option<Op> {
    let mut rest = line;
    fn ws(s: &mut &[u8]) {
        while let [b' ' | b'\t' | b'\n' | b'\r', tail @ ..] = *s {
            *s = tail;
        }
    }
    fn token(s: &mut &[u8], t: &[u8]) -> bool {
        ws(s);
        match s.strip_prefix(t) {
            Some(tail) => {
                *s = tail;
                true
            }
            None => false,
        }
    }
    if !(token(&mut rest, b"{") && token(&mut rest, b"\"op\"") && token(&mut rest, b":")) {
        return None;
    }
    if !token(&mut rest, b"\"") {
        return None;
    }
    let end = rest.iter().position(|&b| b == b'"')?;
    let (name, tail) = rest.split_at(end);
    rest = &tail[1..];
    if !token(&mut rest, b"}") {
        return None;
    }
    ws(&mut rest);
    if !rest.is_empty() {
        return None;
    }
    match name {
        b"status" => Some(Op::Status),
        b"pause" => Some(Op::Pause),
        b"resume" => Some(Op::Resume),
        b"stop" => Some(Op::Stop),
        b"exits" => Some(Op::Exits),
        _ => None,
    }
}

/// `s` as a JSON string the way Python's `json.dumps` writes it (ASCII only: other
/// characters as `\uXXXX`, surrogate pairs above the BMP), so a reply is the same
/// bytes whichever side wrote it.
fn json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
    out.push('"');
}

/// A finite non-negative `f64` the way Python's `json.dumps` (its `repr`) writes it:
/// Rust's `{:?}` picks the same shortest digits and the same switch to an exponent
/// (below 1e-4, from 1e16 on), but writes `1e-5` and `1e16` where Python writes
/// `1e-05` and `1e+16`.
fn json_f64(out: &mut String, x: f64) {
    let text = format!("{x:?}");
    match text.split_once('e') {
        None => out.push_str(&text),
        Some((mantissa, exponent)) => {
            let (sign, digits) = match exponent.strip_prefix('-') {
                Some(digits) => ('-', digits),
                None => ('+', exponent),
            };
            out.push_str(mantissa);
            out.push('e');
            out.push(sign);
            if digits.len() < 2 {
                out.push('0');
            }
            out.push_str(digits);
        }
    }
}

/// `control.FreePageReporting(...).to_wire()` of `balloon`, as `json.dumps` writes it.
fn free_page_reporting(out: &mut String, balloon: &NativeTransport) {
    let stats = balloon.stats();
    let c = stats.balloon;
    out.push_str("{\"active\": ");
    out.push_str(if balloon.active() { "true" } else { "false" });
    out.push_str(&format!(
        ", \"reports\": {}, \"bytes_discarded\": {}, \"discard_errors\": {}, \
         \"last_report_age_s\": ",
        c.reports, c.bytes_discarded, c.discard_errors
    ));
    match stats.last_report {
        Some(at) => json_f64(out, at.elapsed().as_secs_f64()),
        None => out.push_str("null"),
    }
    out.push('}');
}

fn json_opt_str(out: &mut String, s: Option<&str>) {
    match s {
        Some(s) => json_str(out, s),
        None => out.push_str("null"),
    }
}

/// `control.encode(control.ExitsReply(profile=machine.exit_profile_of(...)))` for
/// these counters: `by_reason` and `io` summed over the vCPUs, each listed by count,
/// most first, ties by key; the ten busiest I/O addresses; `irqs` as given.
pub(crate) fn exits_line(
    by_reason: &[(&str, u64)],
    io: &[((&str, u64), u64)],
    unclaimed: UnclaimedCounts,
    irqs: &[(u32, u64)],
) -> Vec<u8> {
    let mut by_reason = by_reason.to_vec();
    by_reason.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let mut io = io.to_vec();
    io.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut out = String::from("{\"ok\": true, \"profile\": {\"by_reason\": {");
    for (i, (reason, count)) in by_reason.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        json_str(&mut out, reason);
        out.push_str(&format!(": {count}"));
    }
    out.push_str("}, \"top_io\": [");
    for (i, ((bus, address), count)) in io.iter().take(TOP_IO).enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str("{\"bus\": ");
        json_str(&mut out, bus);
        out.push_str(&format!(
            ", \"address\": \"{address:#x}\", \"count\": {count}}}"
        ));
    }
    out.push_str(&format!(
        "], \"unmapped\": {{\"pio_reads\": {}, \"pio_writes\": {}, \"mmio_reads\": {}, \
         \"mmio_writes\": {}}}, \"irqs\": {{",
        unclaimed.pio_reads, unclaimed.pio_writes, unclaimed.mmio_reads, unclaimed.mmio_writes
    ));
    for (i, (gsi, count)) in irqs.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        // A JSON object's keys are strings: `json.dumps` writes an int key quoted.
        out.push_str(&format!("\"{gsi}\": {count}"));
    }
    out.push_str("}}}\n");
    out.into_bytes()
}

/// How many of the busiest I/O addresses `exits` lists (`machine.TOP_IO`).
const TOP_IO: usize = 10;

/// `control.encode(control.error_reply(message))`.
pub(crate) fn error_line(message: &str) -> Vec<u8> {
    let mut out = String::from("{\"ok\": false, \"error\": ");
    json_str(&mut out, message);
    out.push_str("}\n");
    out.into_bytes()
}

const ACK: &[u8] = b"{\"ok\": true}\n";
/// The reply to a line that came while the VMM stops serving.
pub(crate) const CLOSING: &str = "the VMM is closing its control socket";

impl Shared {
    fn serve_line(&self, line: &[u8], fd: RawFd) -> Vec<u8> {
        match native_op(line) {
            Some(Op::Pause) => self.pause(),
            Some(Op::Resume) => {
                for vcpu in &self.vcpus {
                    vcpu.resume();
                }
                ACK.to_vec()
            }
            Some(Op::Stop) => {
                self.signal_stop();
                ACK.to_vec()
            }
            Some(Op::Status) => self.status_line(),
            Some(Op::Exits) => self.exits_line(),
            None => self.hand_over(line, fd),
        }
    }

    fn pause(&self) -> Vec<u8> {
        for vcpu in &self.vcpus {
            if !vcpu.pause(PAUSE_TIMEOUT) {
                // `Machine.pause`'s StateError, as `ControlServer._handle` words it.
                return error_line(&format!(
                    "StateError: vcpu{} did not pause within {:.1} s",
                    vcpu.index(),
                    PAUSE_TIMEOUT.as_secs_f64()
                ));
            }
        }
        ACK.to_vec()
    }

    fn signal_stop(&self) {
        self.stopped.store(true, Ordering::Release);
        // Non-blocking: a full pipe is readable already, which is all a stop is.
        // SAFETY: a one-byte write from a live buffer to the descriptor we own.
        unsafe { libc::write(self.stop.as_raw_fd(), b"x".as_ptr().cast(), 1) };
    }

    /// `control.encode(control.StatusReply(...))`.
    fn status_line(&self) -> Vec<u8> {
        let paused = self.vcpus.iter().all(VcpuControl::is_paused);
        let status = lock(&self.status);
        let mut out = String::from("{\"ok\": true, \"paused\": ");
        out.push_str(if paused { "true" } else { "false" });
        out.push_str(", \"exit\": ");
        json_opt_str(&mut out, status.exit.as_deref());
        out.push_str(", \"snapshot_bases\": [");
        let snapshots = lock(&status.snapshots);
        for (i, (tag, kind)) in snapshots.bases.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            out.push_str("{\"tag\": ");
            json_opt_str(&mut out, tag.as_deref());
            out.push_str(", \"kind\": ");
            json_str(&mut out, kind);
            out.push('}');
        }
        out.push_str("], \"snapshot_tracking\": ");
        json_opt_str(&mut out, snapshots.tracking.as_deref());
        drop(snapshots);
        out.push_str(", \"jailed\": ");
        out.push_str(if self.jailed { "true" } else { "false" });
        out.push_str(", \"free_page_reporting\": ");
        match &self.balloon {
            None => out.push_str("null"),
            Some(balloon) => free_page_reporting(&mut out, balloon),
        }
        out.push_str("}\n");
        out.into_bytes()
    }

    /// `control.encode(control.ExitsReply(profile=Machine.exit_profile()))`.
    fn exits_line(&self) -> Vec<u8> {
        let mut by_reason: HashMap<&str, u64> = HashMap::new();
        let mut io: HashMap<(&str, u64), u64> = HashMap::new();
        for vcpu in &self.vcpus {
            let counters = vcpu.counters();
            for (reason, n) in counters.exits {
                *by_reason.entry(reason).or_insert(0) += n;
            }
            for (address, n) in counters.io {
                *io.entry(address).or_insert(0) += n;
            }
        }
        // Cloned out: no lock is held while a Python machine's are read with the GIL.
        let counters = lock(&self.counters).clone();
        let Some(counters) = counters else {
            return error_line(CLOSING);
        };
        match counters.counts() {
            Ok((unclaimed, irqs)) => exits_line(
                &by_reason.into_iter().collect::<Vec<_>>(),
                &io.into_iter().collect::<Vec<_>>(),
                unclaimed,
                &irqs,
            ),
            Err(err) => error_line(&err),
        }
    }

    fn hand_over(&self, line: &[u8], fd: RawFd) -> Vec<u8> {
        let handover = lock(&self.handover).clone();
        match handover {
            Some(h) => h.handle(line, fd),
            None => error_line(CLOSING),
        }
    }
}

/// One accepted connection and the bytes of its unfinished line.
struct Conn {
    fd: OwnedFd,
    buffer: Vec<u8>,
    /// Where the search for the next newline starts: bytes before it have none, so a
    /// line that arrives a byte at a time is scanned once, not once per byte.
    scanned: usize,
}

/// Send all of `data` on a blocking socket; false if the peer is gone.
fn send_all(fd: RawFd, mut data: &[u8]) -> bool {
    while !data.is_empty() {
        // SAFETY: sends from a live slice of the given length; MSG_NOSIGNAL: a peer
        // that went away is an EPIPE here, not a SIGPIPE for the process.
        let sent = unsafe { libc::send(fd, data.as_ptr().cast(), data.len(), libc::MSG_NOSIGNAL) };
        if sent < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return false;
        }
        data = &data[sent as usize..];
    }
    true
}

/// What a readable connection's turn left it: keep it or drop it.
enum Verdict {
    Keep,
    Drop,
}

fn serve_readable(shared: &Shared, conn: &mut Conn, chunk: &mut Vec<u8>) -> Verdict {
    // Into the chunk's capacity, never zeroed: an idle child's own memory counts every
    // page written, and a request line touches one page of the chunk, not sixteen.
    chunk.clear();
    // SAFETY: receives into the vector's allocation, at most its capacity.
    let got = unsafe {
        libc::recv(
            conn.fd.as_raw_fd(),
            chunk.as_mut_ptr().cast(),
            chunk.capacity(),
            0,
        )
    };
    if got < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
        return Verdict::Keep;
    }
    if got <= 0 {
        return Verdict::Drop;
    }
    // SAFETY: recv initialised the first `got` bytes, and `got` <= capacity.
    unsafe { chunk.set_len(got as usize) };
    conn.buffer.extend_from_slice(chunk);
    let mut start = 0;
    while let Some(at) = conn.buffer[conn.scanned..].iter().position(|&b| b == b'\n') {
        let end = conn.scanned + at;
        let reply = shared.serve_line(&conn.buffer[start..end], conn.fd.as_raw_fd());
        start = end + 1;
        conn.scanned = start;
        if !send_all(conn.fd.as_raw_fd(), &reply) {
            return Verdict::Drop;
        }
    }
    conn.buffer.drain(..start);
    conn.scanned = conn.buffer.len();
    if conn.buffer.len() > MAX_LINE_BYTES {
        // A line without end would grow without bound: refused, and the connection
        // dropped (nothing after it can be told from it).
        send_all(
            conn.fd.as_raw_fd(),
            &error_line(&format!(
                "a request line longer than {MAX_LINE_BYTES} bytes"
            )),
        );
        return Verdict::Drop;
    }
    Verdict::Keep
}

fn accept(listener: &OwnedFd, conns: &mut Vec<Conn>) {
    // SAFETY: accept4 with no address buffer; the descriptor returned is new and ours.
    let fd = unsafe {
        libc::accept4(
            listener.as_raw_fd(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_CLOEXEC,
        )
    };
    if fd < 0 {
        return; // the caller gave up before we took it, or a transient error
    }
    // SAFETY: accept4 returned a new descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = libc::timeval {
        tv_sec: SEND_TIMEOUT.as_secs() as libc::time_t,
        tv_usec: SEND_TIMEOUT.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: sets an option on our descriptor from a live timeval of the size given.
    let set = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            (&timeout as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if set != 0 {
        return; // a connection whose replies could block us forever is not served
    }
    if conns.len() >= MAX_CONNECTIONS {
        let refusal = error_line(&format!(
            "too many control connections (at most {MAX_CONNECTIONS}); close one and retry"
        ));
        // SAFETY: a send from a live slice; MSG_DONTWAIT: a refusal never waits.
        unsafe {
            libc::send(
                fd.as_raw_fd(),
                refusal.as_ptr().cast(),
                refusal.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        return; // closed as it drops
    }
    conns.push(Conn {
        fd,
        buffer: Vec::new(),
        scanned: 0,
    });
}

/// The thread: until `close` wakes it or a `stop` was served.
fn run(shared: Arc<Shared>, listener: OwnedFd) {
    // SAFETY: gettid has no arguments and cannot fail.
    let tid = unsafe { libc::gettid() };
    shared.thread_id.store(tid, Ordering::Release);
    let mut conns: Vec<Conn> = Vec::new();
    let mut chunk: Vec<u8> = Vec::with_capacity(RECV_CHUNK);
    let mut polled: Vec<libc::pollfd> = Vec::with_capacity(MAX_CONNECTIONS + 2);
    'serve: loop {
        polled.clear();
        for fd in [shared.wake.as_raw_fd(), listener.as_raw_fd()]
            .into_iter()
            .chain(conns.iter().map(|c| c.fd.as_raw_fd()))
        {
            polled.push(libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            });
        }
        // SAFETY: a live array of `polled.len()` pollfds; no timeout: an idle control
        // thread never wakes.
        let n = unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, -1) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            break;
        }
        if polled[0].revents != 0 {
            break;
        }
        // Connections first (their indices are the poll set's), then the listener.
        let mut keep = Vec::with_capacity(conns.len());
        for (conn, p) in conns.drain(..).zip(&polled[2..]) {
            keep.push((conn, p.revents));
        }
        for (mut conn, revents) in keep {
            if revents == 0 {
                conns.push(conn);
                continue;
            }
            match serve_readable(&shared, &mut conn, &mut chunk) {
                Verdict::Keep => conns.push(conn),
                Verdict::Drop => {}
            }
            if stop_served(&shared) {
                break 'serve;
            }
        }
        if polled[1].revents != 0 {
            accept(&listener, &mut conns);
        }
    }
    drop(conns);
    drop(listener);
    *lock(&shared.done) = true;
    shared.done_cond.notify_all();
}

/// A served `stop` ends the server, as it did in Python (its loop ran while the stop
/// was unset): the child is on its way out.
fn stop_served(shared: &Shared) -> bool {
    shared.stopped.load(Ordering::Acquire)
}

/// The server as Python holds it (`runtime.vmmchild.ControlServer`).
#[pyclass(frozen, module = "vmfork._core")]
pub struct ControlServe {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The Python hand-over: `handler(line: bytes, fd: int) -> bytes`, called with the GIL.
pub(crate) struct PyHandover(pub(crate) Py<PyAny>);

impl Handover for PyHandover {
    fn handle(&self, line: &[u8], fd: RawFd) -> Vec<u8> {
        Python::attach(|py| {
            let reply = self
                .0
                .call1(py, (PyBytes::new(py, line), fd))
                .and_then(|r| r.extract::<Vec<u8>>(py));
            match reply {
                Ok(bytes)
                    if bytes.ends_with(b"\n") && !bytes[..bytes.len() - 1].contains(&b'\n') =>
                {
                    bytes
                }
                Ok(_) => error_line("the VMM's handler did not answer with one line"),
                Err(err) => {
                    let kind = err
                        .get_type(py)
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_else(|_| "Exception".into());
                    let text = err.value(py).to_string();
                    error_line(&format!("{kind}: {text}"))
                }
            }
        })
    }
}

/// A Python machine's counters (`Machine.exit_counters`): `counters()` returns
/// `((pio_reads, pio_writes, mmio_reads, mmio_writes), [(gsi, count), ...])`, called
/// with the GIL (its buses and interrupt lines are Python objects).
struct PyMachineCounters(Py<PyAny>);

impl MachineCounters for PyMachineCounters {
    fn counts(&self) -> Result<(UnclaimedCounts, Vec<(u32, u64)>), String> {
        Python::attach(|py| {
            type Counts = ((u64, u64, u64, u64), Vec<(u32, u64)>);
            let counts = self.0.call0(py).and_then(|c| c.extract::<Counts>(py));
            match counts {
                Ok(((pio_reads, pio_writes, mmio_reads, mmio_writes), irqs)) => Ok((
                    UnclaimedCounts {
                        pio_reads,
                        pio_writes,
                        mmio_reads,
                        mmio_writes,
                    },
                    irqs,
                )),
                Err(err) => Err(format!("the machine's counters: {}", err.value(py))),
            }
        })
    }
}

fn dup(fd: RawFd) -> Result<OwnedFd, String> {
    // SAFETY: F_DUPFD_CLOEXEC makes a new descriptor, ours alone.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if new < 0 {
        return Err(format!(
            "control server: dup of fd {fd}: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

impl ControlServe {
    /// Serve `listener` (taken over: the server closes it) on a new thread, for a
    /// caller with or without Python: `stop_fd` is the stop signal's write end
    /// (duplicated), `vcpus` the machine's controls, `balloon` the machine's balloon
    /// (its counters in `status`), `counters` the machine's for `exits`, `snapshots`
    /// what `status` says of snapshots, `handover` where every line not served here
    /// goes. An error names the step that failed.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        listener: OwnedFd,
        stop_fd: RawFd,
        vcpus: Vec<VcpuControl>,
        jailed: bool,
        balloon: Option<Arc<NativeTransport>>,
        counters: Arc<dyn MachineCounters>,
        snapshots: SharedSnapshotStatus,
        handover: Arc<dyn Handover>,
    ) -> Result<Self, String> {
        let stop = dup(stop_fd)?;
        // SAFETY: eventfd makes a new descriptor, ours alone.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if wake < 0 {
            return Err(format!(
                "control server: eventfd: {}",
                std::io::Error::last_os_error()
            ));
        }
        let shared = Arc::new(Shared {
            vcpus,
            jailed,
            balloon,
            counters: Mutex::new(Some(counters)),
            status: Mutex::new(Status {
                exit: None,
                snapshots,
            }),
            // SAFETY: the new eventfd above.
            wake: unsafe { OwnedFd::from_raw_fd(wake) },
            stop,
            stopped: AtomicBool::new(false),
            handover: Mutex::new(Some(handover)),
            done: Mutex::new(false),
            done_cond: Condvar::new(),
            thread_id: AtomicI32::new(0),
        });
        let for_thread = shared.clone();
        let thread = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || run(for_thread, listener))
            .map_err(|e| format!("control server: thread: {e}"))?;
        Ok(ControlServe {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The guest's exit reason, for `status` (what `set_exit` does for Python).
    pub fn record_exit(&self, reason: &str) {
        lock(&self.shared.status).exit = Some(reason.to_owned());
    }
}

#[pymethods]
impl ControlServe {
    /// Serve `listener` (a listening Unix socket's fd, taken over: the server closes
    /// it) on a new thread. `stop_fd`: the stop signal's write end (duplicated);
    /// `vcpus`: the machine's loops; `balloon`: the machine's balloon, if it has one
    /// (`status` reports its counters); `counters() -> ((pio_reads, pio_writes,
    /// mmio_reads, mmio_writes), [(gsi, count), ...])`: the machine's, for `exits`;
    /// `handler(line, fd) -> bytes`: everything else.
    #[new]
    fn new(
        listener: RawFd,
        stop_fd: RawFd,
        vcpus: Vec<Bound<'_, VcpuLoop>>,
        jailed: bool,
        balloon: Option<Bound<'_, NativeDevice>>,
        counters: Py<PyAny>,
        handler: Py<PyAny>,
    ) -> PyResult<Self> {
        // SAFETY: the caller hands the descriptor over (`socket.detach()`).
        let listener = unsafe { OwnedFd::from_raw_fd(listener) };
        ControlServe::start(
            listener,
            stop_fd,
            vcpus.iter().map(|v| v.get().control()).collect(),
            jailed,
            balloon.map(|b| b.get().transport.clone()),
            Arc::new(PyMachineCounters(counters)),
            SharedSnapshotStatus::default(),
            Arc::new(PyHandover(handler)),
        )
        .map_err(PyOSError::new_err)
    }

    /// The guest's exit reason, once the machine has ended (`Machine.on_exit`).
    fn set_exit(&self, reason: &str) {
        self.record_exit(reason);
    }

    /// What `status` says of snapshots, after each capture: `bases` as `(tag, kind)`
    /// newest first, and the tracking in use.
    fn set_snapshot_status(&self, bases: Vec<(Option<String>, String)>, tracking: Option<String>) {
        let snapshots = lock(&self.shared.status).snapshots.clone();
        *lock(&snapshots) = SnapshotStatus { bases, tracking };
    }

    /// Stop serving: wake the thread and wait up to `timeout` seconds for it to close
    /// the listener and its connections (a snapshot in flight may hold it longer; it
    /// then ends on its own). Idempotent.
    #[pyo3(signature = (timeout = 2.0))]
    fn close(&self, py: Python<'_>, timeout: f64) -> bool {
        let one: u64 = 1;
        // SAFETY: an 8-byte write from a live u64 to our eventfd.
        unsafe { libc::write(self.shared.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        let shared = self.shared.clone();
        let limit = Duration::from_secs_f64(timeout.max(0.0));
        let ended = py.detach(move || {
            let done = lock(&shared.done);
            let (done, _) = shared
                .done_cond
                .wait_timeout_while(done, limit, |d| !*d)
                .unwrap_or_else(|p| p.into_inner());
            *done
        });
        if ended {
            if let Some(thread) = lock(&self.thread).take() {
                py.detach(move || drop(thread.join()));
            }
            // The handler and a Python machine's counters are bound methods of Python
            // objects that hold us: let go of them so each pair is freed without the
            // cycle collector.
            let handover = lock(&self.shared.handover).take();
            drop(handover);
            let counters = lock(&self.shared.counters).take();
            drop(counters);
        }
        ended
    }

    /// The serving thread's kernel id (0 until it has started).
    #[getter]
    fn thread_id(&self) -> i32 {
        self.shared.thread_id.load(Ordering::Acquire)
    }

    /// Whether the thread still serves.
    #[getter]
    fn serving(&self) -> bool {
        !*lock(&self.shared.done)
    }
}

/// `exits`' reply line for these counters, as the control server writes it: for
/// `test_control_serve.py`'s property that it is the bytes Python's `json.dumps`
/// writes of `Machine.exit_profile`'s dict (`machine.exit_profile_of`).
#[pyfunction]
pub fn exits_reply_line<'py>(
    py: Python<'py>,
    by_reason: HashMap<String, u64>,
    io: HashMap<(String, u64), u64>,
    unclaimed: (u64, u64, u64, u64),
    irqs: Vec<(u32, u64)>,
) -> Bound<'py, PyBytes> {
    let by_reason: Vec<(&str, u64)> = by_reason.iter().map(|(k, n)| (k.as_str(), *n)).collect();
    let io: Vec<((&str, u64), u64)> = io
        .iter()
        .map(|((bus, address), n)| ((bus.as_str(), *address), *n))
        .collect();
    let (pio_reads, pio_writes, mmio_reads, mmio_writes) = unclaimed;
    let unclaimed = UnclaimedCounts {
        pio_reads,
        pio_writes,
        mmio_reads,
        mmio_writes,
    };
    PyBytes::new(py, &exits_line(&by_reason, &io, unclaimed, &irqs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_plain_op_object_is_served_natively() {
        assert_eq!(native_op(b"{\"op\": \"status\"}"), Some(Op::Status));
        assert_eq!(native_op(b" {\"op\":\"pause\"} \r"), Some(Op::Pause));
        assert_eq!(native_op(b"{ \"op\" :\t\"resume\" }"), Some(Op::Resume));
        assert_eq!(native_op(b"{\"op\": \"stop\"}"), Some(Op::Stop));
        assert_eq!(native_op(b"{\"op\": \"exits\"}"), Some(Op::Exits));
        for other in [
            &b"{\"op\": \"snapshot\"}"[..],
            b"{\"op\": \"status\", \"x\": 1}",
            b"{\"op\": \"stat\\u0075s\"}",
            b"{\"op\": \"status\"} x",
            b"{\"op\": \"status\"",
            b"[\"op\", \"status\"]",
            b"",
            b"\xef\xbb\xbf{\"op\": \"status\"}",
        ] {
            assert_eq!(
                native_op(other),
                None,
                "{:?}",
                String::from_utf8_lossy(other)
            );
        }
    }

    #[test]
    fn seconds_are_written_as_pythons_json_writes_them() {
        // Each as `json.dumps(float(x))` writes it (Python 3.11).
        for (x, python) in [
            (0.0, "0.0"),
            (2.0, "2.0"),
            (1.5, "1.5"),
            (0.1, "0.1"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.2345e-7, "1.2345e-07"),
            (123456.789, "123456.789"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345678901234568e22, "1.2345678901234568e+22"),
            (1e100, "1e+100"),
            (3.0000000000000004, "3.0000000000000004"),
        ] {
            let mut out = String::new();
            json_f64(&mut out, x);
            assert_eq!(out, python, "{x}");
        }
    }

    #[test]
    fn exits_is_written_as_pythons_json_writes_it() {
        // `control.encode(control.ExitsReply(profile=machine.exit_profile_of(...)))`
        // of the same counters (Python 3.11): ties by key, ints as quoted keys.
        let line = exits_line(
            &[("io", 3), ("hlt", 3), ("mmio", 7), ("\u{e9}", 1)],
            &[
                (("pio", 0x80), 2),
                (("mmio", 0xD000_0000), 2),
                (("other", 0), 9),
            ],
            UnclaimedCounts {
                pio_reads: 1,
                pio_writes: 2,
                mmio_reads: 3,
                mmio_writes: 4,
            },
            &[(4, 0), (5, 12)],
        );
        assert_eq!(
            String::from_utf8(line).expect("ASCII"),
            "{\"ok\": true, \"profile\": {\"by_reason\": {\"mmio\": 7, \"hlt\": 3, \"io\": 3, \
             \"\\u00e9\": 1}, \"top_io\": [{\"bus\": \"other\", \"address\": \"0x0\", \"count\": 9}, \
             {\"bus\": \"mmio\", \"address\": \"0xd0000000\", \"count\": 2}, {\"bus\": \"pio\", \
             \"address\": \"0x80\", \"count\": 2}], \"unmapped\": {\"pio_reads\": 1, \"pio_writes\": 2, \
             \"mmio_reads\": 3, \"mmio_writes\": 4}, \"irqs\": {\"4\": 0, \"5\": 12}}}\n"
        );
        let empty = exits_line(&[], &[], UnclaimedCounts::default(), &[]);
        assert_eq!(
            String::from_utf8(empty).expect("ASCII"),
            "{\"ok\": true, \"profile\": {\"by_reason\": {}, \"top_io\": [], \"unmapped\": \
             {\"pio_reads\": 0, \"pio_writes\": 0, \"mmio_reads\": 0, \"mmio_writes\": 0}, \
             \"irqs\": {}}}\n"
        );
    }

    #[test]
    fn strings_are_written_as_pythons_json_writes_them() {
        let mut out = String::new();
        json_str(&mut out, "a\"b\\c\n\u{1}é😀");
        assert_eq!(out, "\"a\\\"b\\\\c\\n\\u0001\\u00e9\\ud83d\\ude00\"");
    }
}
