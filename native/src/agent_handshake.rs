//! A restored child's first talk with its guest agent, natively: the `after_fork` op
//! (`agent/protocol.py`) with its clock exchange, retried while the guest cannot
//! answer yet, as `vmmchild.make_unique` did through `AgentClient.after_fork`.
//!
//! The child calls it once, with the GIL released for the whole of it: at N = 100
//! the retries every 50 ms and the JSON of the replies ran in each child's Python,
//! and every page that touched became the child's own.
//!
//! The contract is `AgentClient.after_fork`'s, held to it by
//! `tests/unit/test_agent_handshake_native.py` against the real agent:
//!
//! * connect through the VMM's vsock Unix socket (`CONNECT <port>\n` -> `OK <n>\n`,
//!   the reply read up to its newline and no further) within `connect_timeout`;
//! * the same request frame byte for byte (`{"op":"after_fork","ns":..,
//!   "net_refresh":..,"clock_exchange":true}` and 64 bytes from `getrandom`);
//! * the agent's `clock` frame answered with a `clock_step` (NTP arithmetic,
//!   `clock_exchange_step`; no step within `clock_tolerance_ns`; none, and a
//!   bracketed correction on fresh connections, when half the round trip is over
//!   `CLOCK_EXCHANGE_MAX_BOUND_NS` or the agent took no step: an older agent's
//!   `result`, a late step, a broken send of it);
//! * every call bounded by `io_timeout` in all, the retries (every 50 ms while the
//!   agent is unavailable or silent) by the caller's deadline;
//! * the reply's fields checked as the Python client checks them, each refusal an
//!   error of the same class with the same message.
//!
//! Everything the agent sends is hostile: a frame's header is at most `MAX_HEADER`
//! bytes and its payload `MAX_PAYLOAD` (checked before anything is allocated), a
//! call reads at most two frames, and the deadline bounds a peer that trickles.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde_json::{Map, Value};

use crate::agent_frame::{
    check_reseed, check_result, clock_exchange_step, frame_lengths, int, net_counts, parse_header,
    quoted, record, shown, Refusal, CLOCK_EXCHANGE_MAX_BOUND_NS, MAX_CLOCK_STEP_NS,
};

/// The host randomness a restored guest is reseeded with.
pub const RESEED_BYTES: usize = 64;
const RETRY_INTERVAL: Duration = Duration::from_millis(50);
/// The CONNECT reply line is at most this long (`vsock_uds_connector`).
const CONNECT_LINE_MAX: usize = 64;

/// How a call failed, as the Python client's exception classes say it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// `AgentUnavailable`: no connection, or it closed before any reply. Retried.
    Unavailable(String),
    /// `AgentTimeout`: nothing, or not all of it, within the deadline; or an error
    /// frame with code `timeout`. Retried.
    Timeout { op: &'static str, message: String },
    /// `AgentProtocolError`: a malformed reply, or one cut short.
    Protocol { op: &'static str, message: String },
    /// `AgentError`: the agent's own `error` frame (`code`, `message`).
    Agent {
        op: &'static str,
        code: String,
        message: String,
    },
}

impl From<Refusal> for Failure {
    fn from(r: Refusal) -> Self {
        Failure::Protocol {
            op: r.op,
            message: r.message,
        }
    }
}

impl Failure {
    fn retried(&self) -> bool {
        matches!(self, Failure::Unavailable(_) | Failure::Timeout { .. })
    }

    fn protocol(op: &'static str, message: impl Into<String>) -> Self {
        Failure::Protocol {
            op,
            message: message.into(),
        }
    }
}

/// Where the agent is: the VMM's vsock Unix socket and the agent's port, or (`port`
/// None) an agent served on a Unix socket itself (`unix_connector`: the unit tests).
#[derive(Debug, Clone)]
pub struct Target {
    pub path: CString,
    pub port: Option<u32>,
    pub connect_timeout: Duration,
    pub io_timeout: Duration,
}

/// What `make_unique` reports: `AfterForkResult`'s parts the child keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handshake {
    /// The agent is older than `after_fork`: the steps were one call each
    /// (`op_by_op`), and `timing` is theirs.
    pub op_by_op: bool,
    pub clock_error_bound_ns: i128,
    pub clock_step_ns: i128,
    /// `(connections_aborted, neighbours_flushed)` when the guest refreshed.
    pub net: Option<(u64, u64)>,
    /// Calls that found the agent unavailable or silent and were tried again.
    pub retries: u32,
    /// Where the answering call's time went (the others are in `retries`).
    pub timing: CallTiming,
}

/// The answering `after_fork` call, from its start: the VMM's `OK` to the `CONNECT`
/// (the guest's kernel accepted the connection), then the agent's first frame (its
/// `clock`, or an older agent's `result`), then its `result` (and any clock
/// correction after it). For an agent older than `after_fork` (`op_by_op`), from the
/// first step's start: the reseed answered, the clock set, all done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallTiming {
    pub connected: Duration,
    pub first_frame: Duration,
    pub done: Duration,
}

impl Handshake {
    /// A handshake done on its first try (`make_unique` counts the retries).
    fn first_try(
        op_by_op: bool,
        clock_error_bound_ns: i128,
        clock_step_ns: i128,
        net: Option<(u64, u64)>,
        timing: CallTiming,
    ) -> Self {
        Handshake {
            op_by_op,
            clock_error_bound_ns,
            clock_step_ns,
            net,
            retries: 0,
            timing,
        }
    }
}

impl CallTiming {
    /// Its two marks, and done now, each since `started`.
    fn since(started: Instant, connected: Duration, first_frame: Duration) -> Self {
        CallTiming {
            connected,
            first_frame,
            done: started.elapsed(),
        }
    }
}

type Outcome<T> = Result<T, Failure>;

fn realtime_ns() -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_REALTIME always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
}

/// `os.urandom`'s source: `getrandom`, which blocks only before the host's pool is
/// initialised.
fn random_bytes() -> io::Result<[u8; RESEED_BYTES]> {
    let mut buf = [0u8; RESEED_BYTES];
    let mut got = 0;
    while got < buf.len() {
        // SAFETY: the pointer and length describe the unfilled part of `buf`.
        let n = unsafe { libc::getrandom(buf[got..].as_mut_ptr().cast(), buf.len() - got, 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        got += n as usize;
    }
    Ok(buf)
}

/// Python's `str(OSError)`: `[Errno N] text`.
fn os_error_text(err: &io::Error) -> String {
    match err.raw_os_error() {
        Some(errno) => {
            // SAFETY: strerror returns a pointer to a static (or thread-local) string.
            let text = unsafe { std::ffi::CStr::from_ptr(libc::strerror(errno)) };
            format!("[Errno {errno}] {}", text.to_string_lossy())
        }
        None if err.kind() == io::ErrorKind::TimedOut => "timed out".to_owned(),
        None => err.to_string(),
    }
}

/// Python's `repr` of bytes, for the CONNECT reply a VMM sent instead of `OK`.
fn bytes_repr(b: &[u8]) -> String {
    let mut out = String::from("b'");
    for &c in b {
        match c {
            b'\\' => out.push_str("\\\\"),
            b'\'' => out.push_str("\\'"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\t' => out.push_str("\\t"),
            0x20..=0x7e => out.push(c as char),
            _ => out.push_str(&format!("\\x{c:02x}")),
        }
    }
    out.push('\'');
    out
}

/// A connection, non-blocking, every wait a `poll` bounded by a deadline.
struct Conn {
    fd: OwnedFd,
}

enum IoFailure {
    TimedOut,
    Os(io::Error),
}

impl IoFailure {
    fn text(&self) -> String {
        match self {
            IoFailure::TimedOut => "timed out".to_owned(),
            IoFailure::Os(err) => os_error_text(err),
        }
    }
}

impl Conn {
    fn connect(path: &CString) -> io::Result<Conn> {
        // SAFETY: plain socket(2); the result is checked.
        let fd = unsafe {
            libc::socket(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                0,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created here and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_un is plain data; all zeros is a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let bytes = path.as_bytes();
        if bytes.len() >= addr.sun_path.len() {
            return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
        }
        for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
            *dst = src as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
        // SAFETY: `addr` is an initialised sockaddr_un and `len` within its size.
        let rc = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                len as libc::socklen_t,
            )
        };
        // A Unix socket connects at once or not at all (a full backlog is EAGAIN,
        // which Python's connect raised too): nothing to wait for.
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Conn { fd })
    }

    fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Wait until `events` or the deadline.
    fn wait(&self, events: libc::c_short, deadline: Instant) -> Result<(), IoFailure> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(IoFailure::TimedOut);
            }
            let mut pfd = libc::pollfd {
                fd: self.raw(),
                events,
                revents: 0,
            };
            // Rounded up: a deadline a fraction of a millisecond away is not 0 (busy).
            let ms = left.as_millis().saturating_add(1).min(i32::MAX as u128) as i32;
            // SAFETY: one valid pollfd.
            let n = unsafe { libc::poll(&mut pfd, 1, ms) };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(IoFailure::Os(err));
            }
            if n > 0 {
                return Ok(());
            }
        }
    }

    fn send_all(&self, mut data: &[u8], deadline: Instant) -> Result<(), IoFailure> {
        while !data.is_empty() {
            // SAFETY: `data` is a live slice; send reads at most its length.
            let n = unsafe {
                libc::send(
                    self.raw(),
                    data.as_ptr().cast(),
                    data.len(),
                    libc::MSG_NOSIGNAL,
                )
            };
            if n < 0 {
                let err = io::Error::last_os_error();
                match err.kind() {
                    io::ErrorKind::Interrupted => continue,
                    io::ErrorKind::WouldBlock => {
                        self.wait(libc::POLLOUT, deadline)?;
                        continue;
                    }
                    _ => return Err(IoFailure::Os(err)),
                }
            }
            data = &data[n as usize..];
        }
        Ok(())
    }

    /// Some bytes into `buf` (0: the peer closed), `flags` as for recv(2).
    fn recv_some(
        &self,
        buf: &mut [u8],
        flags: libc::c_int,
        deadline: Instant,
    ) -> Result<usize, IoFailure> {
        loop {
            // SAFETY: `buf` is a live, writable slice of the length given.
            let n = unsafe { libc::recv(self.raw(), buf.as_mut_ptr().cast(), buf.len(), flags) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let err = io::Error::last_os_error();
            match err.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => self.wait(libc::POLLIN, deadline)?,
                _ => return Err(IoFailure::Os(err)),
            }
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // `_Call.close`: shut down both ways, then close (OwnedFd).
        // SAFETY: shutdown on an fd this struct owns.
        unsafe { libc::shutdown(self.raw(), libc::SHUT_RDWR) };
    }
}

/// `vsock_uds_connector` (or `unix_connector` without a port): a connection on which
/// the agent's frames start.
fn open(target: &Target) -> Outcome<Conn> {
    let shown = quoted(&target.path.to_string_lossy());
    let Some(port) = target.port else {
        return Conn::connect(&target.path).map_err(|err| {
            Failure::Unavailable(format!(
                "connect to agent socket {shown}: {}",
                os_error_text(&err)
            ))
        });
    };
    let conn = Conn::connect(&target.path).map_err(|err| {
        Failure::Unavailable(format!(
            "connect to the VMM's vsock socket {shown}: {}",
            os_error_text(&err)
        ))
    })?;
    let deadline = Instant::now() + target.connect_timeout;
    let handshake_failed = |err: IoFailure| {
        Failure::Unavailable(format!(
            "vsock handshake on {shown} for port {port}: {}",
            err.text()
        ))
    };
    conn.send_all(format!("CONNECT {port}\n").as_bytes(), deadline)
        .map_err(handshake_failed)?;
    // Up to the '\n' and no further (what follows is the agent's): peek at what has
    // come, then take the line's part of it.
    let mut line: Vec<u8> = Vec::with_capacity(CONNECT_LINE_MAX);
    let mut peek = [0u8; CONNECT_LINE_MAX];
    while !line.ends_with(b"\n") && line.len() < CONNECT_LINE_MAX {
        let want = CONNECT_LINE_MAX - line.len();
        let n = conn
            .recv_some(&mut peek[..want], libc::MSG_PEEK, deadline)
            .map_err(handshake_failed)?;
        if n == 0 {
            break;
        }
        let take = peek[..n]
            .iter()
            .position(|&b| b == b'\n')
            .map_or(n, |i| i + 1);
        let got = conn
            .recv_some(&mut peek[..take], 0, deadline)
            .map_err(handshake_failed)?;
        if got == 0 {
            break;
        }
        line.extend_from_slice(&peek[..got]);
    }
    if !(line.starts_with(b"OK ") && line.ends_with(b"\n")) {
        let why = if line.is_empty() {
            "closed the connection (nothing listening on the port yet?)".to_owned()
        } else {
            format!("replied {}", bytes_repr(&line))
        };
        return Err(Failure::Unavailable(format!(
            "vsock CONNECT {port} via {shown}: the VMM {why}; expected 'OK <port>'"
        )));
    }
    Ok(conn)
}

/// A frame as the agent sent it: its header (a JSON object); the payload is read and
/// dropped (no frame of these ops carries one the host needs).
struct Frame {
    header: Map<String, Value>,
}

impl Frame {
    fn kind(&self) -> &str {
        self.header
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("")
    }
}

/// Why `read_frame` failed, as `protocol.recv_frame` raises it.
enum FrameFailure {
    /// `ConnectionClosed`: `clean` between frames; its message.
    Closed {
        clean: bool,
        message: String,
    },
    /// `ProtocolError`: the frame broke the protocol.
    Malformed(String),
    TimedOut,
}

fn read_exact(
    conn: &Conn,
    buf: &mut [u8],
    what: &str,
    started: bool,
    deadline: Instant,
) -> Result<(), FrameFailure> {
    let n = buf.len();
    let mut got = 0;
    while got < n {
        match conn.recv_some(&mut buf[got..], 0, deadline) {
            Ok(0) => {
                let clean = !started && got == 0;
                return Err(FrameFailure::Closed {
                    clean,
                    message: if clean {
                        "connection closed".to_owned()
                    } else {
                        format!(
                            "connection closed in the middle of a frame ({what}: {got} of {n} bytes)"
                        )
                    },
                });
            }
            Ok(k) => got += k,
            Err(IoFailure::TimedOut) => return Err(FrameFailure::TimedOut),
            Err(IoFailure::Os(err)) => {
                return Err(FrameFailure::Closed {
                    clean: false,
                    message: format!("connection lost ({what}: {})", strerror(&err)),
                })
            }
        }
    }
    Ok(())
}

fn strerror(err: &io::Error) -> String {
    match err.raw_os_error() {
        // SAFETY: strerror returns a pointer to a static (or thread-local) string.
        Some(errno) => unsafe { std::ffi::CStr::from_ptr(libc::strerror(errno)) }
            .to_string_lossy()
            .into_owned(),
        None => err.to_string(),
    }
}

fn read_frame(conn: &Conn, deadline: Instant) -> Result<Frame, FrameFailure> {
    let mut prefix = [0u8; 8];
    read_exact(conn, &mut prefix, "length prefix", false, deadline)?;
    let (header_len, payload_len) = frame_lengths(&prefix).map_err(FrameFailure::Malformed)?;
    let mut raw = vec![0u8; header_len];
    read_exact(conn, &mut raw, "header", true, deadline)?;
    let mut left = payload_len;
    let mut sink = [0u8; 4096];
    while left > 0 {
        let chunk = left.min(sink.len());
        read_exact(conn, &mut sink[..chunk], "payload", true, deadline)?;
        left -= chunk;
    }
    parse_header(&raw)
        .map(|header| Frame { header })
        .map_err(FrameFailure::Malformed)
}

/// One op on one connection (`client._Call`).
struct Call {
    op: &'static str,
    conn: Conn,
    deadline: Instant,
    frames: u32,
}

impl Call {
    /// `AgentClient._open`: connect, send the request.
    fn open(target: &Target, op: &'static str, request: &[u8], payload: &[u8]) -> Outcome<Call> {
        let conn = open(target)?;
        let deadline = Instant::now() + target.io_timeout;
        let mut frame = Vec::with_capacity(8 + request.len() + payload.len());
        frame.extend_from_slice(&(request.len() as u32).to_be_bytes());
        frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        frame.extend_from_slice(request);
        frame.extend_from_slice(payload);
        conn.send_all(&frame, deadline).map_err(|err| {
            Failure::Unavailable(format!("{op}: sending the request: {}", err.text()))
        })?;
        Ok(Call {
            op,
            conn,
            deadline,
            frames: 0,
        })
    }

    /// `_Call.recv`: the next frame; an `error` frame is the agent's failure.
    fn recv(&mut self) -> Outcome<Frame> {
        let op = self.op;
        let frame = match read_frame(&self.conn, self.deadline) {
            Ok(frame) => frame,
            Err(FrameFailure::Closed { clean, message }) => {
                if clean && self.frames == 0 {
                    return Err(Failure::Unavailable(format!(
                        "{op}: the connection closed before the agent replied (agent not \
                         listening yet, or gone)"
                    )));
                }
                return Err(Failure::protocol(
                    op,
                    format!("the agent closed the connection before its final frame ({message})"),
                ));
            }
            Err(FrameFailure::Malformed(message)) => {
                return Err(Failure::protocol(
                    op,
                    format!("malformed frame from the agent: {message}"),
                ))
            }
            Err(FrameFailure::TimedOut) => {
                return Err(Failure::Timeout {
                    op,
                    message: "the agent did not finish the call within its deadline".to_owned(),
                })
            }
        };
        self.frames += 1;
        if frame.kind() == "error" {
            let text = |key: &str, absent: &str| match frame.header.get(key) {
                None => absent.to_owned(),
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
            };
            let code = text("error", "unknown");
            let message = text("message", "(no message)");
            return Err(if code == "timeout" {
                Failure::Timeout { op, message }
            } else {
                Failure::Agent { op, code, message }
            });
        }
        Ok(frame)
    }

    fn expect(&mut self, kind: &str) -> Outcome<Frame> {
        let frame = self.recv()?;
        if frame.kind() != kind {
            return Err(Failure::protocol(
                self.op,
                format!(
                    "expected a '{kind}' frame, got {}",
                    shown(&Value::Object(frame.header), 200)
                ),
            ));
        }
        Ok(frame)
    }
}

// -- the clock -------------------------------------------------------------------------

/// `AgentClient.step_time`: a `set_time offset_ns` call; the guest's clock before.
fn step_time(target: &Target, offset_ns: i128) -> Outcome<i128> {
    let request = format!("{{\"op\":\"set_time\",\"offset_ns\":{offset_ns}}}");
    let mut call = Call::open(target, "set_time", request.as_bytes(), b"")?;
    let reply = call.expect("result")?;
    Ok(int(&reply.header, "previous_ns", "set_time", None)?)
}

/// `AgentClient._sync_clock(1)`: the guest's clock read between two host readings,
/// then stepped to the bracket's midpoint; `(round trip, step)`.
fn sync_clock(target: &Target) -> Outcome<(i128, i128)> {
    let before = realtime_ns();
    let guest = step_time(target, 0)?;
    let after = realtime_ns();
    let best = (after - before, (before + after).div_euclid(2) - guest);
    step_time(target, best.1)?;
    Ok(best)
}

/// One `after_fork` call (`AgentClient.after_fork`), its clock exchange and, when the
/// exchange could not correct the clock, the bracketed correction.
pub fn after_fork(
    target: &Target,
    data: &[u8],
    net_refresh: bool,
    clock_tolerance_ns: i128,
) -> Outcome<Handshake> {
    let op = "after_fork";
    let started = Instant::now();
    let sent = realtime_ns();
    let request = format!(
        "{{\"op\":\"after_fork\",\"ns\":{sent},\"net_refresh\":{net_refresh},\"clock_exchange\":true}}"
    );
    let mut call = Call::open(target, op, request.as_bytes(), data)?;
    let connected = started.elapsed();
    let frame = call.recv()?;
    let received = realtime_ns();
    let first_frame = started.elapsed();
    let (r, step, bound) = match frame.kind() {
        "result" => {
            // An agent without the exchange.
            let round_trip = received - sent;
            let (step, bound) = if round_trip > clock_tolerance_ns {
                let (correction_round_trip, step) = sync_clock(target)?;
                (step, round_trip.min(correction_round_trip.div_euclid(2)))
            } else {
                (0, round_trip)
            };
            (frame.header, step, bound)
        }
        "clock" => {
            let (mut step, round_trip) = clock_exchange_step(
                sent,
                int(&frame.header, "ns", op, None)?,
                int(&frame.header, "processing_ns", op, None)?,
                received,
            );
            if step.abs() > MAX_CLOCK_STEP_NS {
                return Err(Failure::protocol(
                    op,
                    format!(
                        "the agent's clock reads {step} ns off the time it was just set to, \
                         beyond any transit time"
                    ),
                ));
            }
            // Split in two, a round trip is only as good as its halves are even: a
            // long one is bracketed again on fresh connections (client.after_fork).
            let uneven = round_trip.div_euclid(2) > CLOCK_EXCHANGE_MAX_BOUND_NS;
            if round_trip <= clock_tolerance_ns || uneven {
                step = 0;
            }
            let step_frame = format!("{{\"type\":\"clock_step\",\"offset_ns\":{step}}}");
            let mut bytes = Vec::with_capacity(8 + step_frame.len());
            bytes.extend_from_slice(&(step_frame.len() as u32).to_be_bytes());
            bytes.extend_from_slice(&0u32.to_be_bytes());
            bytes.extend_from_slice(step_frame.as_bytes());
            // A broken send: the agent stopped waiting for the step (a starved VMM
            // answered late) and hung up after its result, which is still here to
            // read; the step then counts as too late, below.
            let _ = call.conn.send_all(&bytes, call.deadline);
            let r = call.expect("result")?.header;
            let mut bound = if step != 0 {
                round_trip.div_euclid(2)
            } else {
                round_trip
            };
            let taken = !matches!(r.get("clock_step"), None | Some(Value::Null));
            if !taken || uneven {
                step = 0;
                if round_trip > clock_tolerance_ns {
                    let (correction_round_trip, correction) = sync_clock(target)?;
                    step = correction;
                    bound = round_trip.min(correction_round_trip.div_euclid(2));
                }
            } else {
                step = int(record(&r, "clock_step", op)?, "offset_ns", op, None)?;
            }
            (r, step, bound)
        }
        _ => {
            return Err(Failure::protocol(
                op,
                format!(
                    "expected a 'clock' or 'result' frame, got {}",
                    shown(&Value::Object(frame.header), 200)
                ),
            ))
        }
    };
    drop(call);
    let net = check_result(&r)?;
    let timing = CallTiming::since(started, connected, first_frame);
    Ok(Handshake::first_try(false, bound, step, net, timing))
}

/// `make_unique`'s loop: `after_fork`, again every 50 ms while the agent is
/// unavailable or silent, until `deadline`. An agent older than that op (its
/// `unknown_op`) gets the same steps one call each (`op_by_op`).
pub fn make_unique(
    target: &Target,
    deadline: Instant,
    net_refresh: bool,
    clock_tolerance_ns: i128,
) -> Outcome<Handshake> {
    let mut retries = 0u32;
    loop {
        let data = random_bytes()
            .map_err(|err| Failure::Unavailable(format!("getrandom: {}", os_error_text(&err))))?;
        match after_fork(target, &data, net_refresh, clock_tolerance_ns) {
            Ok(mut done) => {
                done.retries = retries;
                return Ok(done);
            }
            Err(Failure::Agent { code, .. }) if code == "unknown_op" => {
                let mut done = op_by_op(target, &data, deadline, net_refresh)?;
                done.retries = retries;
                return Ok(done);
            }
            Err(failure) if failure.retried() => {
                if Instant::now() > deadline {
                    return Err(failure);
                }
                retries = retries.saturating_add(1);
                std::thread::sleep(RETRY_INTERVAL);
            }
            Err(failure) => return Err(failure),
        }
    }
}

/// `after_fork`'s steps for an agent older than it, one call (and one connection)
/// each, as `AgentClient`'s `reseed`, `sync_clock` and `net_refresh`: the guest reseeded
/// with `data`, its clock bracketed and stepped to the host's (its error at most half
/// the bracket's round trip), its network refreshed when asked. The agent has just
/// answered (its `unknown_op`); each step is tried again while it is unavailable or
/// silent, until `deadline`.
fn op_by_op(
    target: &Target,
    data: &[u8],
    deadline: Instant,
    net_refresh: bool,
) -> Outcome<Handshake> {
    let started = Instant::now();
    retry_until(deadline, || {
        let mut call = Call::open(target, "reseed", br#"{"op":"reseed"}"#, data)?;
        Ok(check_reseed(&call.expect("result")?.header)?)
    })?;
    let connected = started.elapsed();
    let (round_trip, step) = retry_until(deadline, || sync_clock(target))?;
    let first_frame = started.elapsed();
    let net = if net_refresh {
        Some(retry_until(deadline, || {
            let mut call = Call::open(target, "net_refresh", br#"{"op":"net_refresh"}"#, b"")?;
            Ok(net_counts(&call.expect("result")?.header)?)
        })?)
    } else {
        None
    };
    let timing = CallTiming::since(started, connected, first_frame);
    Ok(Handshake::first_try(
        true,
        round_trip.div_euclid(2),
        step,
        net,
        timing,
    ))
}

/// `step()`, again every 50 ms while the agent is unavailable or silent, until
/// `deadline` (`vmmchild._retry_until`).
fn retry_until<T>(deadline: Instant, mut step: impl FnMut() -> Outcome<T>) -> Outcome<T> {
    loop {
        match step() {
            Err(failure) if failure.retried() && Instant::now() <= deadline => {
                std::thread::sleep(RETRY_INTERVAL);
            }
            done => return done,
        }
    }
}

/// A volume the guest's agent mounts (`AgentClient.mount_volume`'s arguments): the
/// disk of virtio-mmio device `device`, `sectors` 512-byte sectors, at `guest_path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub device: u32,
    pub guest_path: String,
    pub read_only: bool,
    pub sectors: u64,
}

/// `vmmchild.attach_volumes`' mount: `AgentClient.mount_volume`, again every 50 ms
/// while the agent is unavailable or silent, until `deadline` (the agent waits in the
/// guest until the disk shows up, and answers with a `result`).
pub fn mount_volume(target: &Target, mount: &Mount, deadline: Instant) -> Outcome<()> {
    let op = "mount_volume";
    let request = serde_json::json!({
        "op": op,
        "device": mount.device,
        "guest_path": mount.guest_path,
        "read_only": mount.read_only,
        "sectors": mount.sectors,
    })
    .to_string();
    retry_until(deadline, || {
        Call::open(target, op, request.as_bytes(), b"")
            .and_then(|mut call| call.expect("result").map(drop))
    })
}

// -- Python ----------------------------------------------------------------------------

/// Where a child's agent is, built once (before the fork, where the zygote can).
#[pyclass(frozen, module = "vmfork._core")]
pub struct AgentTarget {
    target: Target,
}

impl AgentTarget {
    /// Where the agent is, for a native caller.
    pub fn target(&self) -> &Target {
        &self.target
    }
}

impl Target {
    /// The agent at `path`, on vsock `port` behind it (None: served on the Unix socket
    /// itself, no CONNECT line), with its timeouts in seconds.
    pub fn new(
        path: &str,
        port: Option<u32>,
        connect_timeout: f64,
        io_timeout: f64,
    ) -> Result<Self, String> {
        let seconds =
            |s: f64| Duration::try_from_secs_f64(s).map_err(|_| format!("a timeout of {s} s"));
        Ok(Target {
            path: CString::new(path).map_err(|_| "a NUL byte in the socket path".to_owned())?,
            port,
            connect_timeout: seconds(connect_timeout)?,
            io_timeout: seconds(io_timeout)?,
        })
    }
}

#[pymethods]
impl AgentTarget {
    /// `port` None: an agent served on the Unix socket `path` itself (no CONNECT line).
    #[new]
    #[pyo3(signature = (path, port, connect_timeout, io_timeout))]
    fn new(path: &str, port: Option<u32>, connect_timeout: f64, io_timeout: f64) -> PyResult<Self> {
        Ok(Self {
            target: Target::new(path, port, connect_timeout, io_timeout)
                .map_err(PyValueError::new_err)?,
        })
    }
}

/// `(kind, op, code, message)` of a failure, for `vmmchild` to raise as the client's
/// class (`AgentUnavailable`, `AgentTimeout`, `AgentProtocolError`, `AgentError`).
type FailureTuple = (&'static str, Option<&'static str>, String, String);

fn failure_tuple(f: Failure) -> FailureTuple {
    match f {
        Failure::Unavailable(message) => ("unavailable", None, "unavailable".to_owned(), message),
        Failure::Timeout { op, message } => ("timeout", Some(op), "timeout".to_owned(), message),
        Failure::Protocol { op, message } => ("protocol", Some(op), "protocol".to_owned(), message),
        Failure::Agent { op, code, message } => ("agent", Some(op), code, message),
    }
}

/// `((clock_error_bound_ns, clock_step_ns, net, retries, (connected_ns,
/// first_frame_ns, done_ns), op_by_op), None)` (`CallTiming`; `op_by_op`: an agent
/// older than `after_fork`, its steps one call each) or `(None, failure)`.
type HandshakeResult = (
    Option<(i128, i128, Option<(u64, u64)>, u32, (u64, u64, u64), bool)>,
    Option<FailureTuple>,
);

/// The after_fork handshake with the GIL released throughout; `timeout` seconds bound
/// the retries (`make_unique`'s deadline).
#[pyfunction]
#[pyo3(signature = (target, timeout, net_refresh, clock_tolerance_ns=50_000_000))]
pub fn agent_after_fork(
    py: Python<'_>,
    target: &AgentTarget,
    timeout: f64,
    net_refresh: bool,
    clock_tolerance_ns: i64,
) -> PyResult<HandshakeResult> {
    let window = Duration::try_from_secs_f64(timeout.max(0.0))
        .map_err(|_| PyValueError::new_err(format!("a timeout of {timeout} s")))?;
    let target = &target.target;
    let outcome = py.detach(|| {
        make_unique(
            target,
            Instant::now() + window,
            net_refresh,
            i128::from(clock_tolerance_ns),
        )
    });
    let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    Ok(match outcome {
        Ok(h) => (
            Some((
                h.clock_error_bound_ns,
                h.clock_step_ns,
                h.net,
                h.retries,
                (
                    ns(h.timing.connected),
                    ns(h.timing.first_frame),
                    ns(h.timing.done),
                ),
                h.op_by_op,
            )),
            None,
        ),
        Err(f) => (None, Some(failure_tuple(f))),
    })
}

/// `clock_exchange_step` for the tests that hold the two arithmetics to each other.
#[pyfunction(name = "clock_exchange_step")]
pub fn py_clock_exchange_step(
    sent: i128,
    guest: i128,
    processing: i128,
    received: i128,
) -> (i128, i128) {
    clock_exchange_step(sent, guest, processing, received)
}
