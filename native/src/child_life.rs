//! A spawned VMM child's life after its set-up and jail, with no Python: what
//! `runtime/vmmchild.py`'s `main` does from the seccomp filter to the exit, step for
//! step, for a machine built natively (`ChildMachine`, which `NativeMachine`
//! implements) in a child forked by `_core.fork_native_batch` (`native_fork.rs`).
//!
//! The steps, each `main`'s, with the same reports (`child_report.rs`: the same
//! status.json fields and FIFO lines the spawner, `runtime/spawn.py`, parses):
//!
//! 1. SIGTERM blocked and read from a signalfd, before any thread starts (every
//!    thread inherits the mask, so a SIGTERM stays pending for the signalfd: no
//!    handler, no Python). A control `stop` writes to a pipe; the waits below poll
//!    both, so a stop is seen without looking for it every so often.
//! 2. The machine built (the caller's closure); a failure reports `failed` with
//!    `restore: <error>` and exits 1.
//! 3. The seccomp program (built in the zygote: `seccomp.vmm_filter()`) installed,
//!    for a jailed child; from here the process does only what a running VMM does.
//! 4. Started paused behind a start gate: `prepared`, then the gate's wait (a byte,
//!    the gate closed or gone, the timeout, or SIGTERM, which ends the child with 0
//!    and no `restored`), then resumed; `restored` with its timings.
//! 5. The control socket served natively (`control_serve.rs`); a line it hands over
//!    (`exits`, `snapshot`) is relayed to this thread, which runs the plan's handler
//!    (Python, made valid for that request: `native_fork.rs`).
//! 6. The agent's `after_fork` (`agent_handshake.rs`), on a thread of its own while
//!    this one answers hand-overs; its failure reports `failed` with
//!    `guest not ready: ...` and the console's tail and exits 3. (An agent older than
//!    `after_fork` gets its steps one call each, `agent_handshake::make_unique`.)
//! 7. `ready`, `malloc_trim`, then idle until SIGTERM, a `stop` (both exit 0) or the
//!    guest's end (`exited` with its reason; 0 for a clean end, 3 when it died).
//!
//! Bounds: every wait has its deadline or an fd that ends it; the relay holds one
//! line at a time (the control server serves one line at a time); nothing here
//! allocates in a loop a guest or a client drives.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use crate::agent_handshake::{self, Failure as AgentFailure, Handshake, Target};
use crate::child_report::ChildReporter;
use crate::control_serve::{
    error_line, ControlServe, Handover, MachineCounters, SharedSnapshotStatus, CLOSING,
};
use crate::spawn_profile::SpawnProfile;
use crate::transport::NativeTransport;
use crate::vcpu::VcpuControl;
use crate::write_set::WriteAhead;

/// `vmmchild.EXIT_GUEST_DIED`: the guest panicked, faulted or never answered.
pub const EXIT_GUEST_DIED: i32 = 3;
/// What `vmmchild.main` returns when its machine could not be made.
pub const EXIT_NOT_STARTED: i32 = 1;
/// `make_unique`'s clock tolerance (`agent_after_fork`'s default).
const CLOCK_TOLERANCE_NS: i128 = 50_000_000;
/// `ControlServer`'s listen backlog.
const CONTROL_BACKLOG: libc::c_int = 8;

/// The machine a child runs, as its life drives it. `NativeMachine` implements it.
pub trait ChildMachine {
    /// Start every vCPU thread; `paused`: parked before the guest's first instruction.
    fn start(&self, paused: bool) -> Result<(), String>;
    /// Wake every parked vCPU.
    fn resume(&self);
    /// Park every vCPU; false if one did not within `timeout`. (The life itself
    /// pauses only through the control server's handles; a hand-over's machine view
    /// pauses through this.)
    #[allow(dead_code)]
    fn pause(&self, timeout: Duration) -> bool;
    /// The handles the control server pauses and resumes the vCPUs through.
    fn vcpu_controls(&self) -> Vec<VcpuControl>;
    /// Readable once the guest has ended (`exit` then says how).
    fn exit_fd(&self) -> RawFd;
    /// How the guest ended, once it has: (reason, detail).
    fn exit(&self) -> Option<(&'static str, String)>;
    /// The console's last lines.
    fn console_tail(&self) -> String;
    /// The balloon, whose counters `status` reports, if the machine has one.
    fn balloon(&self) -> Option<Arc<NativeTransport>>;
    /// The counters `exits` reports besides the vCPU loops' own.
    fn counters(&self) -> Arc<dyn MachineCounters>;
    /// Stop the vCPUs (the process is about to exit).
    fn stop(&self);
    /// The copy of its snapshot's write set (`write_set.rs`), if it makes one.
    fn write_ahead(&self) -> Option<&WriteAhead> {
        None
    }
    /// Save the guest pages written so far as `path`, a write set; the pages saved.
    fn save_write_set(&self, _path: &Path) -> Result<u64, String> {
        Err("this machine keeps no write set".into())
    }
}

/// Everything the life needs but the machine, built in the zygote before the fork.
pub struct LifePlan {
    pub reporter: ChildReporter,
    /// The start gate FIFO and how long to wait at it.
    pub start_gate: Option<(CString, Duration)>,
    /// The seccomp program (`struct sock_filter`s), for a jailed child.
    pub seccomp: Option<Vec<u8>>,
    /// `run_dir/control.sock`.
    pub control_path: CString,
    pub jailed: bool,
    pub agent: Target,
    pub ready_timeout: Duration,
    /// The snapshot has a network device: the guest is told it was forked.
    pub net_refresh: bool,
    /// The new volumes the agent mounts after `after_fork` (their disks went into
    /// the snapshot's empty slots at the restore: `machine_plan.rs`'s `ChildVolume`).
    pub mounts: Vec<agent_handshake::Mount>,
    /// Each phase's end recorded (`VMFORK_SPAWN_PROFILE` in the zygote), or None.
    pub profile: Option<SpawnProfile>,
    /// What `status` says of snapshots: the restore base from the start, then what
    /// each capture of a hand-over sets.
    pub snapshots: SharedSnapshotStatus,
    /// Where a learner saves its write set at ready (`write_set.rs`); None for a
    /// child that is not one.
    pub learn_write_set: Option<PathBuf>,
}

impl LifePlan {
    /// The end of `phase`, when the child's phases are recorded.
    pub fn mark(&self, phase: &'static str) {
        if let Some(profile) = &self.profile {
            profile.mark(phase);
        }
    }
}

/// When the child was forked and when its entry started (CLOCK_MONOTONIC ns).
#[derive(Clone, Copy)]
pub struct Forked {
    pub forked_ns: i64,
    pub entry_ns: i64,
}

pub fn monotonic_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a live timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn os_error(step: &str) -> String {
    format!("{step}: {}", std::io::Error::last_os_error())
}

fn owned(fd: libc::c_int, step: &str) -> Result<OwnedFd, String> {
    if fd < 0 {
        return Err(os_error(step));
    }
    // SAFETY: a descriptor the call just made, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// What ends a wait: SIGTERM (a signalfd) or a control `stop` (a pipe).
struct StopSources {
    sigterm: OwnedFd,
    stop_read: OwnedFd,
    stop_write: OwnedFd,
}

impl StopSources {
    /// Block SIGTERM in this thread (inherited by every thread started after) and
    /// read it from a signalfd instead.
    fn new() -> Result<Self, String> {
        // SAFETY: a zeroed sigset is a valid argument for sigemptyset, which fills it.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is live for both calls.
        unsafe {
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGTERM);
        }
        // SAFETY: `set` is a valid sigset; the old mask is not asked for.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(format!("block SIGTERM: errno {rc}"));
        }
        // SAFETY: -1 makes a new signalfd for the valid `set`.
        let sigterm = owned(
            unsafe { libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK) },
            "signalfd",
        )?;
        let mut pipe = [0; 2];
        // SAFETY: `pipe` has room for the two descriptors pipe2 writes.
        let rc = unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if rc != 0 {
            return Err(os_error("pipe2"));
        }
        Ok(StopSources {
            sigterm,
            // SAFETY: pipe2 made both, ours alone.
            stop_read: unsafe { OwnedFd::from_raw_fd(pipe[0]) },
            // SAFETY: as above.
            stop_write: unsafe { OwnedFd::from_raw_fd(pipe[1]) },
        })
    }

    fn fds(&self) -> [RawFd; 2] {
        [self.sigterm.as_raw_fd(), self.stop_read.as_raw_fd()]
    }

    /// SIGTERM pending or a stop written (neither is consumed: once set, set).
    fn is_set(&self) -> bool {
        poll_readable(&self.fds(), 0).is_some()
    }
}

/// The first of `fds` readable (or hung up) within `timeout_ms` (-1: no timeout).
fn poll_readable(fds: &[RawFd], timeout_ms: libc::c_int) -> Option<RawFd> {
    let mut polled = [libc::pollfd {
        fd: -1,
        events: 0,
        revents: 0,
    }; 4];
    let n = fds.len().min(polled.len());
    for (p, &fd) in polled.iter_mut().zip(fds) {
        p.fd = fd;
        p.events = libc::POLLIN;
    }
    // SAFETY: `n` live pollfds.
    let ready = unsafe { libc::poll(polled.as_mut_ptr(), n as libc::nfds_t, timeout_ms) };
    if ready <= 0 {
        return None;
    }
    polled[..n].iter().find(|p| p.revents != 0).map(|p| p.fd)
}

/// Block until a byte is taken from the gate FIFO, the gate is closed or gone, a
/// stop comes or `timeout` passes (`vmmchild._wait_for_start_gate`).
fn wait_for_start_gate(path: &CString, timeout: Duration, stop: &StopSources) {
    // SAFETY: a NUL-terminated path live for the call.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    let Ok(gate) = owned(fd, "open") else {
        return; // gone: a guest is never held back for a spawner that went away
    };
    let deadline = Instant::now() + timeout;
    let fds = [gate.as_raw_fd(), stop.fds()[0], stop.fds()[1]];
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() || stop.is_set() {
            return;
        }
        let ms = remaining.as_millis().clamp(1, libc::c_int::MAX as u128) as libc::c_int;
        if poll_readable(&fds, ms) != Some(gate.as_raw_fd()) {
            continue;
        }
        let mut byte = 0u8;
        // SAFETY: a one-byte read into a live local.
        let got = unsafe { libc::read(gate.as_raw_fd(), (&mut byte as *mut u8).cast(), 1) };
        if got >= 0 {
            return; // a byte: our turn; 0: the spawner closed it
        }
        // EAGAIN: a sibling took the byte that woke us.
    }
}

/// `seccomp.install`: no new privileges, then the program on every thread (TSYNC).
fn install_seccomp(program: &[u8]) -> Result<(), String> {
    const SOCK_FILTER_SIZE: usize = 8;
    if program.is_empty() || !program.len().is_multiple_of(SOCK_FILTER_SIZE) {
        return Err(format!(
            "a seccomp program of {} bytes is not whole instructions",
            program.len()
        ));
    }
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(os_error("prctl(PR_SET_NO_NEW_PRIVS)"));
    }
    let prog = libc::sock_fprog {
        len: (program.len() / SOCK_FILTER_SIZE) as libc::c_ushort,
        filter: program.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: `prog` points at `program`, whole sock_filters, live for the call; the
    // kernel copies the program.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_TSYNC,
            &prog as *const libc::sock_fprog,
        )
    };
    match rc {
        0 => Ok(()),
        rc if rc > 0 => Err(format!(
            "seccomp(SET_MODE_FILTER): thread {rc} could not be synchronised"
        )),
        _ => Err(os_error("seccomp(SET_MODE_FILTER)")),
    }
}

/// A handed-over line waiting for this (the main) thread, and its reply.
#[derive(Default)]
struct RelaySlot {
    line: Option<(Vec<u8>, RawFd)>,
    reply: Option<Vec<u8>>,
    /// The main thread no longer serves (the child is on its way out).
    closed: bool,
}

/// The control server's hand-over, relayed to the main thread: the one thread a
/// forked child's Python can be made valid on (`PyOS_AfterFork_Child` must run on
/// the thread that forked). The control thread waits for the reply, as it waits for
/// Python's today.
struct MainThreadRelay {
    slot: Mutex<RelaySlot>,
    done: Condvar,
    wake: OwnedFd,
}

impl MainThreadRelay {
    fn new() -> Result<Arc<Self>, String> {
        // SAFETY: eventfd makes a new descriptor, ours alone.
        let wake = owned(
            unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) },
            "eventfd",
        )?;
        Ok(Arc::new(MainThreadRelay {
            slot: Mutex::new(RelaySlot::default()),
            done: Condvar::new(),
            wake,
        }))
    }

    /// On the main thread, once `wake` is readable: answer the waiting line.
    fn serve(&self, handler: &dyn Handover) {
        let mut count = 0u64;
        // SAFETY: an 8-byte read into a live u64 from our eventfd.
        unsafe { libc::read(self.wake.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
        let pending = lock(&self.slot).line.take();
        if let Some((line, fd)) = pending {
            let reply = handler.handle(&line, fd);
            lock(&self.slot).reply = Some(reply);
            self.done.notify_all();
        }
    }

    fn close(&self) {
        lock(&self.slot).closed = true;
        self.done.notify_all();
    }
}

impl Handover for MainThreadRelay {
    fn handle(&self, line: &[u8], fd: RawFd) -> Vec<u8> {
        let mut slot = lock(&self.slot);
        if slot.closed {
            return closing_reply();
        }
        slot.line = Some((line.to_vec(), fd));
        slot.reply = None;
        let one: u64 = 1;
        // SAFETY: an 8-byte write from a live u64 to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        let mut slot = self
            .done
            .wait_while(slot, |s| s.reply.is_none() && !s.closed)
            .unwrap_or_else(|p| p.into_inner());
        slot.line = None;
        slot.reply.take().unwrap_or_else(closing_reply)
    }
}

fn closing_reply() -> Vec<u8> {
    error_line(CLOSING)
}

/// A listening Unix socket at `path` (`ControlServer.__init__`).
fn listen_at(path: &CString) -> Result<OwnedFd, String> {
    // SAFETY: socket with constant arguments.
    let sock = owned(
        unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) },
        "control socket",
    )?;
    // SAFETY: a zeroed sockaddr_un is valid; the path is copied in below.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(format!(
            "control socket: {} is too long for a Unix socket",
            path.to_string_lossy()
        ));
    }
    for (to, &from) in addr.sun_path.iter_mut().zip(bytes) {
        *to = from as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: `addr` is a valid sockaddr_un of at least `len` bytes.
    let rc = unsafe {
        libc::bind(
            sock.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(os_error(&format!("bind {}", path.to_string_lossy())));
    }
    // SAFETY: listen on our socket.
    if unsafe { libc::listen(sock.as_raw_fd(), CONTROL_BACKLOG) } != 0 {
        return Err(os_error("listen"));
    }
    Ok(sock)
}

/// `str()` of the client's exception for a failed handshake (`AgentError.__init__`).
fn agent_failure_text(failure: &AgentFailure) -> String {
    let (op, message) = match failure {
        AgentFailure::Unavailable(message) => (None, message),
        AgentFailure::Timeout { op, message }
        | AgentFailure::Protocol { op, message }
        | AgentFailure::Agent { op, message, .. } => (Some(*op), message),
    };
    match op {
        Some(op) if !message.starts_with(op) => format!("{op}: {message}"),
        _ => message.clone(),
    }
}

fn seconds(ns: i64) -> Value {
    Value::from(ns as f64 / 1e9)
}

fn object(pairs: Vec<(&str, Value)>) -> Map<String, Value> {
    pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

/// One child's life: its reports, in order, and its exit status.
struct Life<'a> {
    plan: &'a LifePlan,
    forked: Forked,
    pid: u32,
}

impl Life<'_> {
    /// Write a report; a status.json that cannot be written is said on stderr (the
    /// log), as an exception out of `report` would be, and the life goes on.
    fn report(&self, mut fields: Map<String, Value>) {
        // Which child this is, in every report: a Python child says "python" (and,
        // when the zygote could not give its spawn a native one, why: `native_refused`).
        fields.insert("child".into(), "native".into());
        let state = fields
            .get("state")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let failure = (state == "failed").then(|| {
            let reason = fields.get("reason").and_then(Value::as_str);
            self.plan.reporter.failure_line(reason.unwrap_or_default())
        });
        let json = Value::Object(fields).to_string();
        if let Err(err) = self
            .plan
            .reporter
            .write(&state, json.as_bytes(), failure.as_deref())
        {
            let line = format!("vmfork vmm: status.json not written: {err}\n");
            // SAFETY: fd 2 borrowed for one write of a live buffer.
            unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
        }
    }

    fn failed(&self, reason: String) -> i32 {
        self.report(object(vec![
            ("state", "failed".into()),
            ("reason", reason.into()),
        ]));
        EXIT_NOT_STARTED
    }

    fn timings(&self, start_wait_ns: i64) -> Vec<(&'static str, Value)> {
        let now = monotonic_ns();
        vec![
            ("pid", self.pid.into()),
            (
                "restore_s",
                seconds(now - self.forked.entry_ns - start_wait_ns),
            ),
            ("start_wait_s", seconds(start_wait_ns)),
            (
                "fork_to_entry_s",
                seconds(self.forked.entry_ns - self.forked.forked_ns),
            ),
        ]
    }
}

/// The life of a child whose set-up is done: build the machine with `build`, run it
/// through every step of the module comment, and return the exit status. Lines the
/// control server hands over are answered by `handler` on this thread.
pub fn live<M: ChildMachine>(
    plan: &LifePlan,
    forked: Forked,
    build: impl FnOnce() -> Result<M, String>,
    handler: &dyn Handover,
) -> i32 {
    let life = Life {
        plan,
        forked,
        pid: std::process::id(),
    };
    let stop = match StopSources::new() {
        Ok(stop) => stop,
        Err(err) => return life.failed(format!("restore: {err}")),
    };
    let machine = match build() {
        Ok(machine) => machine,
        Err(err) => return life.failed(format!("restore: {err}")),
    };
    plan.mark("machine");
    let code = run(&life, &machine, &stop, handler);
    machine.stop();
    code
}

fn run<M: ChildMachine>(
    life: &Life<'_>,
    machine: &M,
    stop: &StopSources,
    handler: &dyn Handover,
) -> i32 {
    let plan = life.plan;
    if let Some(program) = &plan.seccomp {
        if let Err(err) = install_seccomp(program) {
            return life.failed(format!("seccomp: {err}"));
        }
        plan.mark("seccomp");
    }
    if let Err(err) = machine.start(plan.start_gate.is_some()) {
        return life.failed(format!("start: {err}"));
    }
    plan.mark("vcpu_start");
    let mut start_wait_ns = 0;
    if let Some((gate, timeout)) = &plan.start_gate {
        if let Some(copy) = machine.write_ahead().filter(|copy| copy.planned() > 0) {
            // Before the batch's guests run, not beside them (`WriteAhead`).
            copy.copy_here();
            plan.mark("write_set_copied");
        }
        life.report(object(vec![
            ("state", "prepared".into()),
            ("pid", life.pid.into()),
        ]));
        plan.mark("prepared_report");
        let waited_from = monotonic_ns();
        wait_for_start_gate(gate, *timeout, stop);
        start_wait_ns = monotonic_ns() - waited_from;
        plan.mark("start_gate");
        if stop.is_set() {
            return 0;
        }
        machine.resume();
        plan.mark("resumed");
    }
    let mut timings = life.timings(start_wait_ns);
    let planned = machine.write_ahead().map_or(0, WriteAhead::planned);
    timings.push(("write_ahead_pages", planned.into()));
    let mut restored = object(vec![("state", "restored".into())]);
    restored.extend(timings.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    life.report(restored);
    plan.mark("restored_report");

    let relay = match MainThreadRelay::new() {
        Ok(relay) => relay,
        Err(err) => return life.failed(format!("control: {err}")),
    };
    let control = match listen_at(&plan.control_path).and_then(|listener| {
        ControlServe::start(
            listener,
            stop.stop_write.as_raw_fd(),
            machine.vcpu_controls(),
            plan.jailed,
            machine.balloon(),
            machine.counters(),
            plan.snapshots.clone(),
            relay.clone(),
        )
    }) {
        Ok(control) => control,
        Err(err) => return life.failed(format!("control: {err}")),
    };
    plan.mark("control_server");
    let code = serve(life, machine, stop, handler, &relay, &control, timings);
    relay.close();
    code
}

/// The agent's `after_fork` on a thread of its own, while this (the main) thread
/// answers the lines the control server hands over: a hand-over waits for no guest.
fn handshake_serving(
    plan: &LifePlan,
    relay: &MainThreadRelay,
    handler: &dyn Handover,
) -> Result<Handshake, AgentFailure> {
    // SAFETY: eventfd makes a new descriptor, ours alone.
    let done = owned(
        unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) },
        "eventfd",
    )
    .map_err(AgentFailure::Unavailable)?;
    let deadline = Instant::now() + plan.ready_timeout;
    std::thread::scope(|scope| {
        let worker = std::thread::Builder::new()
            .name("handshake".into())
            .spawn_scoped(scope, || {
                let outcome = agent_handshake::make_unique(
                    &plan.agent,
                    deadline,
                    plan.net_refresh,
                    CLOCK_TOLERANCE_NS,
                )
                .and_then(|done| {
                    for mount in &plan.mounts {
                        agent_handshake::mount_volume(&plan.agent, mount, deadline)?;
                    }
                    Ok(done)
                });
                let one: u64 = 1;
                // SAFETY: an 8-byte write from a live u64 to the eventfd above.
                unsafe { libc::write(done.as_raw_fd(), (&one as *const u64).cast(), 8) };
                outcome
            })
            .map_err(|e| AgentFailure::Unavailable(format!("handshake thread: {e}")))?;
        let fds = [relay.wake.as_raw_fd(), done.as_raw_fd()];
        loop {
            match poll_readable(&fds, -1) {
                Some(fd) if fd == relay.wake.as_raw_fd() => relay.serve(handler),
                Some(_) => break,
                None => continue, // EINTR
            }
        }
        worker.join().unwrap_or_else(|_| {
            Err(AgentFailure::Unavailable(
                "the handshake thread panicked".into(),
            ))
        })
    })
}

fn serve<M: ChildMachine>(
    life: &Life<'_>,
    machine: &M,
    stop: &StopSources,
    handler: &dyn Handover,
    relay: &MainThreadRelay,
    control: &ControlServe,
    timings: Vec<(&'static str, Value)>,
) -> i32 {
    let plan = life.plan;
    let asked = Instant::now();
    let handshake = handshake_serving(plan, relay, handler);
    let agent_ready = asked.elapsed().as_secs_f64();
    plan.mark("agent_answered");
    let done: Handshake = match handshake {
        Ok(done) => done,
        Err(failure) => {
            let mut reason = format!("guest not ready: {}", agent_failure_text(&failure));
            if let Some((exit, _)) = machine.exit() {
                reason.push_str(&format!(" ({exit})"));
            }
            life.report(object(vec![
                ("state", "failed".into()),
                ("reason", reason.into()),
                ("console_tail", machine.console_tail().into()),
            ]));
            return EXIT_GUEST_DIED;
        }
    };
    let mut ready = object(vec![("state", "ready".into())]);
    ready.extend(timings.into_iter().map(|(k, v)| (k.to_owned(), v)));
    ready.insert(
        "ready_s".into(),
        seconds(monotonic_ns() - life.forked.entry_ns),
    );
    ready.insert("agent_ready".into(), agent_ready.into());
    let (copied, copy_ns) = machine.write_ahead().map_or((0, 0), WriteAhead::finish);
    ready.insert("prefaulted_pages".into(), copied.into());
    ready.insert("write_ahead_cpu_s".into(), seconds(copy_ns));
    if let Some(path) = &plan.learn_write_set {
        match machine.save_write_set(path) {
            Ok(pages) => ready.insert("write_set_pages".into(), pages.into()),
            Err(err) => ready.insert("write_set_error".into(), err.into()),
        };
        plan.mark("write_set_saved");
    }
    ready.insert("agent_retries".into(), done.retries.into());
    ready.insert("agent_op_by_op".into(), done.op_by_op.into());
    let call = done.timing;
    ready.insert(
        "agent_connected".into(),
        call.connected.as_secs_f64().into(),
    );
    ready.insert(
        "agent_first_frame".into(),
        call.first_frame.as_secs_f64().into(),
    );
    ready.insert("agent_call".into(), call.done.as_secs_f64().into());
    ready.insert(
        "clock_error_bound_s".into(),
        Value::from(done.clock_error_bound_ns as f64 / 1e9),
    );
    if let Some((aborted, flushed)) = done.net {
        ready.insert(
            "net_refresh".into(),
            Value::Object(object(vec![
                ("connections_aborted", aborted.into()),
                ("neighbours_flushed", flushed.into()),
            ])),
        );
    }
    life.report(ready);
    plan.mark("ready_report");
    if let Some(profile) = &plan.profile {
        profile.finish();
    }
    // What the set-up allocated and freed goes back to the kernel: an idle child's
    // every written page is its own.
    // SAFETY: malloc_trim takes a pad size and touches only the allocator's state.
    unsafe { libc::malloc_trim(0) };
    let [sigterm, stop_read] = stop.fds();
    let waited = [
        sigterm,
        stop_read,
        machine.exit_fd(),
        relay.wake.as_raw_fd(),
    ];
    loop {
        match poll_readable(&waited, -1) {
            Some(fd) if fd == relay.wake.as_raw_fd() => relay.serve(handler),
            Some(fd) if fd == machine.exit_fd() => {
                let Some((reason, detail)) = machine.exit() else {
                    continue;
                };
                control.record_exit(reason);
                let console_tail = machine.console_tail();
                let panicked = console_tail.contains("Kernel panic");
                life.report(object(vec![
                    ("state", "exited".into()),
                    ("reason", reason.into()),
                    ("detail", detail.into()),
                    ("panicked", panicked.into()),
                    ("console_tail", console_tail.into()),
                ]));
                let clean = matches!(reason, "reset" | "stopped") && !panicked;
                return if clean { 0 } else { EXIT_GUEST_DIED };
            }
            Some(_) => return 0,
            None => continue, // EINTR
        }
    }
}

/// A machine shared with its hand-over (a native child's, whose Python view reads it).
impl<M: ChildMachine> ChildMachine for Arc<M> {
    fn start(&self, paused: bool) -> Result<(), String> {
        M::start(self, paused)
    }

    fn resume(&self) {
        M::resume(self)
    }

    fn pause(&self, timeout: Duration) -> bool {
        M::pause(self, timeout)
    }

    fn vcpu_controls(&self) -> Vec<VcpuControl> {
        M::vcpu_controls(self)
    }

    fn exit_fd(&self) -> RawFd {
        M::exit_fd(self)
    }

    fn exit(&self) -> Option<(&'static str, String)> {
        M::exit(self)
    }

    fn console_tail(&self) -> String {
        M::console_tail(self)
    }

    fn balloon(&self) -> Option<Arc<NativeTransport>> {
        M::balloon(self)
    }

    fn counters(&self) -> Arc<dyn MachineCounters> {
        M::counters(self)
    }

    fn stop(&self) {
        M::stop(self)
    }

    fn write_ahead(&self) -> Option<&WriteAhead> {
        M::write_ahead(self)
    }

    fn save_write_set(&self, path: &Path) -> Result<u64, String> {
        M::save_write_set(self, path)
    }
}

/// The machine a spawn restores (`machine.rs`): its own methods are the trait's.
impl ChildMachine for crate::machine::NativeMachine {
    fn start(&self, paused: bool) -> Result<(), String> {
        crate::machine::NativeMachine::start(self, paused)
    }

    fn resume(&self) {
        crate::machine::NativeMachine::resume(self)
    }

    fn pause(&self, timeout: Duration) -> bool {
        crate::machine::NativeMachine::pause(self, timeout)
    }

    fn vcpu_controls(&self) -> Vec<VcpuControl> {
        crate::machine::NativeMachine::vcpu_controls(self)
    }

    fn exit_fd(&self) -> RawFd {
        crate::machine::NativeMachine::exit_fd(self)
    }

    fn exit(&self) -> Option<(&'static str, String)> {
        crate::machine::NativeMachine::exit(self)
    }

    fn console_tail(&self) -> String {
        crate::machine::NativeMachine::console_tail(self)
    }

    fn balloon(&self) -> Option<Arc<NativeTransport>> {
        crate::machine::NativeMachine::balloon(self)
    }

    fn counters(&self) -> Arc<dyn MachineCounters> {
        crate::machine::NativeMachine::counters(self)
    }

    fn stop(&self) {
        crate::machine::NativeMachine::stop(self)
    }

    fn write_ahead(&self) -> Option<&WriteAhead> {
        Some(crate::machine::NativeMachine::write_ahead(self))
    }

    fn save_write_set(&self, path: &Path) -> Result<u64, String> {
        crate::machine::NativeMachine::save_write_set(self, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny_machine::TinyMachinePlan;
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixStream;
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

    /// Real mode: mov al,0xfe; out 0x64,al (the i8042's reset); hlt.
    const RESET_NOW: [u8; 5] = [0xB0, 0xFE, 0xE6, 0x64, 0xF4];
    /// Real mode, interrupts off: hlt; jmp back to it. Runs until stopped.
    const HALT_FOREVER: [u8; 3] = [0xF4, 0xEB, 0xFD];
    /// Real mode: out 0x80,al (a port no device claims); then `HALT_FOREVER`.
    const UNCLAIMED_OUT_THEN_HALT: [u8; 5] = [0xE6, 0x80, 0xF4, 0xEB, 0xFD];
    const WAIT: Duration = Duration::from_secs(30);

    fn kvm_usable() -> bool {
        let usable = kvm_ioctls::Kvm::new().is_ok();
        if !usable {
            eprintln!("skipped: no usable /dev/kvm");
        }
        usable
    }

    /// A fresh run directory with the spawner's notify FIFO, opened for reading.
    struct RunDir {
        path: PathBuf,
        notify: OwnedFd,
    }

    fn c(path: &Path) -> CString {
        CString::new(path.to_str().expect("a UTF-8 path")).expect("no NUL")
    }

    fn mkfifo(path: &Path) {
        // SAFETY: a NUL-terminated path live for the call.
        assert_eq!(unsafe { libc::mkfifo(c(path).as_ptr(), 0o600) }, 0);
    }

    fn open_fifo(path: &Path, flags: libc::c_int) -> OwnedFd {
        // SAFETY: a NUL-terminated path live for the call; checked by `owned`.
        owned(
            unsafe { libc::open(c(path).as_ptr(), flags | libc::O_NONBLOCK | libc::O_CLOEXEC) },
            "open fifo",
        )
        .expect("the FIFO opens")
    }

    impl RunDir {
        fn new(name: &str) -> RunDir {
            static COUNT: AtomicUsize = AtomicUsize::new(0);
            let path = std::env::temp_dir().join(format!(
                "vmfork-life-{}-{}-{name}",
                std::process::id(),
                COUNT.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&path).expect("a run directory");
            mkfifo(&path.join("notify"));
            let notify = open_fifo(&path.join("notify"), libc::O_RDONLY);
            RunDir { path, notify }
        }

        fn plan(&self, gate: bool, ready_timeout: Duration) -> LifePlan {
            let dir = self.path.to_str().expect("UTF-8");
            let notify = self.path.join("notify");
            LifePlan {
                reporter: ChildReporter::at(dir, "vm1", notify.to_str()).expect("paths"),
                start_gate: gate.then(|| (c(&self.path.join("gate")), WAIT)),
                seccomp: None,
                control_path: c(&self.path.join("control.sock")),
                jailed: false,
                agent: Target {
                    path: c(&self.path.join("no-agent.sock")),
                    port: Some(1024),
                    connect_timeout: Duration::from_millis(200),
                    io_timeout: Duration::from_millis(200),
                },
                ready_timeout,
                net_refresh: false,
                mounts: Vec::new(),
                profile: None,
                snapshots: SharedSnapshotStatus::default(),
                learn_write_set: None,
            }
        }

        fn status(&self) -> Value {
            let text = std::fs::read_to_string(self.path.join("status.json")).unwrap_or_default();
            serde_json::from_str(&text).unwrap_or(Value::Null)
        }

        fn wait_for_state(&self, state: &str) -> Value {
            let deadline = Instant::now() + WAIT;
            loop {
                let status = self.status();
                if status["state"] == state {
                    return status;
                }
                assert!(Instant::now() < deadline, "no {state} report: {status}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }

        /// Every line the FIFO got so far.
        fn notified(&self) -> String {
            let mut buf = [0u8; 4096];
            // SAFETY: a read into a live local buffer from our FIFO descriptor.
            let n = unsafe { libc::read(self.notify.as_raw_fd(), buf.as_mut_ptr().cast(), 4096) };
            String::from_utf8_lossy(&buf[..n.max(0) as usize]).into_owned()
        }
    }

    impl Drop for RunDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }

    /// A hand-over that says which thread answered.
    struct ThreadTelling(AtomicI32);

    impl Handover for ThreadTelling {
        fn handle(&self, line: &[u8], _fd: RawFd) -> Vec<u8> {
            // SAFETY: gettid has no arguments and cannot fail.
            let tid = unsafe { libc::gettid() };
            self.0.store(tid, Ordering::Release);
            format!(
                "{{\"ok\": true, \"line\": {}, \"tid\": {tid}}}\n",
                Value::from(String::from_utf8_lossy(line).into_owned())
            )
            .into_bytes()
        }
    }

    /// The life on a thread of its own (its SIGTERM is that thread's to read): the
    /// thread's kernel id once its machine is being built, and the exit status.
    fn spawn_life(
        plan: LifePlan,
        code: &'static [u8],
        handler: Arc<ThreadTelling>,
    ) -> (Arc<AtomicI32>, std::thread::JoinHandle<i32>) {
        let tid = Arc::new(AtomicI32::new(0));
        let told = tid.clone();
        let life = std::thread::spawn(move || {
            let forked = Forked {
                forked_ns: monotonic_ns(),
                entry_ns: monotonic_ns(),
            };
            let build = || {
                // SAFETY: gettid has no arguments and cannot fail.
                told.store(unsafe { libc::gettid() }, Ordering::Release);
                TinyMachinePlan::new(code.to_vec())?.build()
            };
            live(&plan, forked, build, &*handler)
        });
        (tid, life)
    }

    #[test]
    fn a_sigterm_at_the_start_gate_ends_the_child_with_0_and_no_restored() {
        if !kvm_usable() {
            return;
        }
        let run = RunDir::new("sigterm");
        mkfifo(&run.path.join("gate"));
        // The spawner holds the gate open and writes no byte.
        let _gate = open_fifo(&run.path.join("gate"), libc::O_RDWR);
        let handler = Arc::new(ThreadTelling(AtomicI32::new(0)));
        let (tid, life) = spawn_life(run.plan(true, WAIT), &HALT_FOREVER, handler);
        let prepared = run.wait_for_state("prepared");
        assert_eq!(prepared["pid"], std::process::id());
        // SAFETY: a signal to the life's own thread of this process.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_tgkill,
                std::process::id(),
                tid.load(Ordering::Acquire),
                libc::SIGTERM,
            )
        };
        assert_eq!(rc, 0);
        assert_eq!(life.join().expect("the life ends"), 0);
        assert_eq!(
            run.status()["state"],
            "prepared",
            "no restored after a SIGTERM"
        );
        assert_eq!(run.notified(), "vm1 prepared\n");
        assert!(!run.path.join("control.sock").exists());
    }

    #[test]
    fn a_gate_byte_resumes_and_a_guest_that_never_answers_fails_with_3() {
        if !kvm_usable() {
            return;
        }
        let run = RunDir::new("gate");
        mkfifo(&run.path.join("gate"));
        let gate = open_fifo(&run.path.join("gate"), libc::O_RDWR);
        let handler = Arc::new(ThreadTelling(AtomicI32::new(0)));
        let (_, life) = spawn_life(
            run.plan(true, Duration::from_millis(500)),
            &RESET_NOW,
            handler,
        );
        run.wait_for_state("prepared");
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(run.status()["state"], "prepared", "the gate holds it");
        // SAFETY: a one-byte write from a live buffer to the gate we hold.
        assert_eq!(
            unsafe { libc::write(gate.as_raw_fd(), b"x".as_ptr().cast(), 1) },
            1
        );
        assert_eq!(life.join().expect("the life ends"), EXIT_GUEST_DIED);
        assert_eq!(run.notified(), "vm1 prepared\nvm1 restored\nvm1 failed\n");
        let failed = run.status();
        let reason = failed["reason"].as_str().expect("a reason");
        assert!(
            reason.starts_with("guest not ready: ") && reason.ends_with(" (reset)"),
            "{reason}"
        );
        assert!(failed["console_tail"].is_string(), "{failed}");
    }

    #[test]
    fn control_is_answered_natively_and_a_hand_over_on_the_lifes_thread() {
        if !kvm_usable() {
            return;
        }
        let run = RunDir::new("control");
        let handler = Arc::new(ThreadTelling(AtomicI32::new(0)));
        let (tid, life) = spawn_life(
            run.plan(false, Duration::from_secs(3)),
            &UNCLAIMED_OUT_THEN_HALT,
            handler.clone(),
        );
        let restored = run.wait_for_state("restored");
        for key in ["restore_s", "start_wait_s", "fork_to_entry_s"] {
            assert!(restored[key].is_f64(), "{key}: {restored}");
        }
        assert_eq!(restored["start_wait_s"], 0.0);
        assert_eq!(restored["child"], "native", "{restored}");
        let control = UnixStream::connect(run.path.join("control.sock")).expect("control");
        control.set_read_timeout(Some(WAIT)).expect("a timeout");
        let mut replies = BufReader::new(control.try_clone().expect("a second handle"));
        let mut ask = |line: &str| {
            (&control)
                .write_all(format!("{line}\n").as_bytes())
                .expect("sent");
            let mut reply = String::new();
            replies.read_line(&mut reply).expect("a reply");
            serde_json::from_str::<Value>(&reply).expect("JSON")
        };
        assert_eq!(ask("{\"op\": \"pause\"}")["ok"], true);
        assert_eq!(ask("{\"op\": \"status\"}")["paused"], true);
        assert_eq!(ask("{\"op\": \"resume\"}")["ok"], true);
        // `exits` natively: the guest's one port write, unclaimed, once it is done.
        let deadline = Instant::now() + WAIT;
        let exits = loop {
            let exits = ask("{\"op\": \"exits\"}");
            if exits["profile"]["by_reason"]["io"] == 1 || Instant::now() > deadline {
                break exits;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(exits["ok"], true, "{exits}");
        assert_eq!(exits["profile"]["by_reason"]["io"], 1, "{exits}");
        assert_eq!(
            exits["profile"]["top_io"],
            serde_json::json!([{"bus": "pio", "address": "0x80", "count": 1}])
        );
        assert_eq!(exits["profile"]["unmapped"]["pio_writes"], 1, "{exits}");
        assert_eq!(exits["profile"]["irqs"], serde_json::json!({}));
        assert_eq!(
            handler.0.load(Ordering::Acquire),
            0,
            "exits is not handed over"
        );
        let snapshot = ask("{\"op\": \"snapshot\"}");
        assert_eq!(snapshot["line"], "{\"op\": \"snapshot\"}");
        assert_eq!(
            handler.0.load(Ordering::Acquire),
            tid.load(Ordering::Acquire),
            "a hand-over runs on the life's (the forking) thread"
        );
        assert_eq!(ask("{\"op\": \"stop\"}")["ok"], true);
        // The handshake still runs out (as vmmchild's does), then the child fails.
        assert_eq!(life.join().expect("the life ends"), EXIT_GUEST_DIED);
        assert_eq!(run.notified(), "vm1 restored\nvm1 failed\n");
    }
}
