//! The vCPU run loop: one native thread per vCPU on `KVM_RUN`, with pause and kick.
//!
//! The thread runs the guest until an exit needs the VMM. HLT, interrupt-window and
//! signal exits are handled here, and so are COM1/i8042 (`console.rs`, held as a
//! Rust value); other port and MMIO exits go to the loop's host (`VcpuHost`), and
//! an exit that ends the vCPU (shutdown, system event, internal error, failed
//! entry, an exit we do not serve) is reported to it once. The host is either
//! Python's (`PyHost`: the virtio-mmio register files of `mmio_py.rs` served
//! without Python, the rest handed to the Python buses `vmfork.vmm.bus.Bus.read`/
//! `write` and `on_exit`, the GIL taken only inside) or native (`NativeHost`: no
//! Python object at all: the machine's virtio-mmio `transport::Windows` served on
//! the vCPU's thread, the exit recorded in an `ExitSink` and its eventfd signalled),
//! so a loop can be built and run from Rust alone (`VcpuThread::build`, on a
//! `vm::VmCore`, whose descriptors it keeps open until its thread ends; `machine.rs`
//! assembles a whole machine of them).
//!
//! Getting a vCPU back from the guest (pause for a snapshot, stop):
//!
//! * A signal sent to the thread (`pthread_kill`) makes a blocked `KVM_RUN` return
//!   `EINTR`. Its handler is ours (installed once, without `SA_RESTART`, on a
//!   real-time signal Python does not use), and it sets `kvm_run.immediate_exit` of
//!   the vCPU that runs on the interrupted thread (a thread-local pointer): a
//!   signal that lands just *before* `KVM_RUN` is then not lost, KVM returns
//!   `EINTR` at once on entry. Only the vCPU's own thread ever writes its run
//!   page. The kicker still re-kicks every 20 ms until the vCPU acknowledges.
//! * The thread starts with the signal blocked and unblocks it only once its
//!   thread-local pointer is set, so the handler never touches thread-local
//!   storage a thread has not yet allocated (which is not async-signal-safe).
//! * An exit for port or MMIO *input* is completed by KVM on the next `KVM_RUN`,
//!   and string I/O advances RIP only then: before acknowledging a pause the
//!   thread enters `KVM_RUN` once more with `immediate_exit = 1`, so captured
//!   state never holds a half-done I/O instruction that a restored VM would replay.
//!
//! Everything a guest can drive is bounded: the exit counters have fixed keys
//! (KVM's exit reasons), and the per-address I/O counters keep at most
//! `MAX_IO_KEYS` addresses (the rest are counted under one `("other", 0)` key).

use std::cell::Cell;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::thread::JoinHandleExt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use kvm_ioctls::{VcpuExit, VcpuFd};

use crate::console::{Console, ConsoleDevices, Served};
use crate::mmio_py::MmioWindows;
use crate::restore::Failure;
use crate::transport::{ReadServed, TransportFailure, TransportHost, Windows, WriteServed};
use crate::vm::{PyVmCore, VmCore};
use pyo3::exceptions::{PyOSError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use pyo3::{PyTraverseError, PyVisit};

const KICK_RETRY: Duration = Duration::from_millis(20);
const MAX_IO_KEYS: usize = 4096;
const EINTR: i32 = libc::EINTR;

const SYSTEM_EVENT_SHUTDOWN: u32 = 1;
const SYSTEM_EVENT_RESET: u32 = 2;
const SYSTEM_EVENT_CRASH: u32 = 3;

/// The kick signal: `SIGRTMIN + 3`, a real-time signal nothing else in the VMM uses.
fn kick_signal() -> libc::c_int {
    libc::SIGRTMIN() + 3
}

thread_local! {
    /// This thread's vCPU `kvm_run.immediate_exit`, while its loop runs.
    static IMMEDIATE_EXIT: Cell<*mut u8> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn on_kick(_signal: libc::c_int) {
    let flag = IMMEDIATE_EXIT.with(|f| f.get());
    if !flag.is_null() {
        // SAFETY: a non-null pointer is this thread's own vCPU's `immediate_exit`
        // byte in its mapped run page, set by `run_thread` and cleared before the
        // page is unmapped; the handler runs on that thread, so nothing else writes
        // it concurrently. A volatile store of one byte is async-signal-safe.
        unsafe { std::ptr::write_volatile(flag, 1) };
    }
}

static INSTALL_KICK: Once = Once::new();

fn install_kick_handler() -> std::io::Result<()> {
    let mut failed = None;
    INSTALL_KICK.call_once(|| {
        // SAFETY: a zeroed sigaction is valid (no flags, empty mask, no handler)
        // before we fill it; `on_kick` is an `extern "C" fn(c_int)`, which is what
        // `sa_sigaction` holds without SA_SIGINFO; no SA_RESTART, so KVM_RUN
        // returns EINTR.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_kick as *const () as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(kick_signal(), &action, std::ptr::null_mut()) != 0 {
                failed = Some(std::io::Error::last_os_error());
            }
        }
    });
    match failed {
        Some(err) => Err(err),
        None => Ok(()),
    }
}

/// Block (`how = SIG_BLOCK`) or unblock (`SIG_UNBLOCK`) the kick signal on this
/// thread; returns the previous mask.
fn mask_kick(how: libc::c_int) -> libc::sigset_t {
    // SAFETY: the sets are initialised by sigemptyset/sigaddset before use, and
    // pthread_sigmask only reads `set` and writes `old`.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, kick_signal());
        libc::pthread_sigmask(how, &set, &mut old);
        old
    }
}

fn restore_mask(old: &libc::sigset_t) {
    // SAFETY: `old` is a mask pthread_sigmask returned.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, old, std::ptr::null_mut()) };
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum RunState {
    Created,
    Running,
    Paused,
    Stopped,
}

impl RunState {
    fn name(self) -> &'static str {
        match self {
            RunState::Created => "created",
            RunState::Running => "running",
            RunState::Paused => "paused",
            RunState::Stopped => "stopped",
        }
    }
}

struct Control {
    want_pause: bool,
    want_stop: bool,
    state: RunState,
    thread: Option<(libc::pthread_t, ThreadId)>,
}

/// A loop's exit counters: by reason, and port and MMIO exits by (bus, port or
/// 4 KiB page).
#[derive(Clone, Default)]
pub struct Counters {
    pub exits: HashMap<&'static str, u64>,
    pub io: HashMap<(&'static str, u64), u64>,
}

impl Counters {
    fn exit(&mut self, name: &'static str) {
        *self.exits.entry(name).or_insert(0) += 1;
    }

    fn io(&mut self, bus: &'static str, addr: u64) {
        let key = if self.io.len() < MAX_IO_KEYS || self.io.contains_key(&(bus, addr)) {
            (bus, addr)
        } else {
            ("other", 0)
        };
        *self.io.entry(key).or_insert(0) += 1;
    }
}

struct Shared {
    ctl: Mutex<Control>,
    cond: Condvar,
    counters: Mutex<Counters>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shared {
    fn kick(ctl: &Control) {
        if ctl.state == RunState::Stopped {
            return;
        }
        if let Some((thread, _)) = ctl.thread {
            // SAFETY: the thread is not joined: it is joined only once its state is
            // Stopped, and we hold the lock that state changes under.
            unsafe { libc::pthread_kill(thread, kick_signal()) };
        }
    }

    /// Wait (kicking) until `done(state)`, at most `timeout`; false on timeout.
    fn wait_for(&self, timeout: Option<Duration>, done: impl Fn(RunState) -> bool) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut ctl = lock(&self.ctl);
        while !done(ctl.state) {
            Shared::kick(&ctl);
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return false;
            }
            ctl = self
                .cond
                .wait_timeout(ctl, KICK_RETRY)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }
}

/// A port or MMIO access the host could not serve, ending the vCPU as a
/// `vmm_error` with this detail.
pub struct HostFailure(pub String);

/// What a vCPU loop hands to the VMM around it: the port and MMIO accesses it does
/// not serve itself (COM1, the i8042 and the register files are served before
/// these are asked), and the one exit that ends it. Called on the vCPU's thread.
///
/// Two hosts: [`PyHost`] (the Python buses and `on_exit`, the GIL taken only
/// inside its methods) and [`NativeHost`] (no Python object: unclaimed accesses
/// read as all ones and are dropped, the exit is recorded in an [`ExitSink`]).
pub trait VcpuHost: Send + 'static {
    /// Fill `data` (`size`-byte elements, string I/O has several) read at `port`.
    fn pio_read(&self, port: u16, data: &mut [u8], size: usize) -> Result<(), HostFailure>;
    /// Take `data` (`size`-byte elements) written at `port`.
    fn pio_write(&self, port: u16, data: &[u8], size: usize) -> Result<(), HostFailure>;
    /// Fill `data` read at guest-physical `addr`.
    fn mmio_read(&self, addr: u64, data: &mut [u8]) -> Result<(), HostFailure>;
    /// Take `data` written at guest-physical `addr`.
    fn mmio_write(&self, addr: u64, data: &[u8]) -> Result<(), HostFailure>;
    /// The vCPU ended for good (`reason` is one of the loop's reasons); called once,
    /// as the loop's last step before its thread lets go of the vCPU.
    fn exited(&self, reason: &'static str, detail: &str);
    /// Run the vCPU thread's `body` (the loop, then the exit report) in the thread
    /// state this host needs, and let go of the host there.
    fn host_thread(self: Box<Self>, body: &mut dyn FnMut(&dyn VcpuHost));
    /// The host as `Any`, for the Python wrapper's garbage-collector support.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// The exception a Python bus handler raised, for `VcpuLoop.error`.
type ErrorSlot = Arc<Mutex<Option<Py<PyAny>>>>;

/// The Python host: today's buses, register files and exit callback.
pub struct PyHost {
    pio: Py<PyAny>,
    mmio: Py<PyAny>,
    on_exit: Py<PyAny>,
    /// The virtio-mmio register files, served without Python (`mmio_py.rs`); only
    /// what needs the device model takes the GIL. Held as the Python handle the
    /// machine registers its windows through (`MmioWindows` owns its `Windows`).
    windows: Option<Py<MmioWindows>>,
    error: ErrorSlot,
}

impl PyHost {
    fn failed(&self, py: Python<'_>, err: PyErr) -> HostFailure {
        let detail = err
            .value(py)
            .repr()
            .map(|r| r.to_string())
            .unwrap_or_else(|_| "an exception".to_string());
        *lock(&self.error) = Some(err.value(py).clone().into_any().unbind());
        HostFailure(detail)
    }
}

impl PyHost {
    /// A transport host's answer: what the Python transport raised goes to
    /// `VcpuLoop.error`, as a bus handler's does. The host's `Arc` is let go with the
    /// GIL held when it is the last one (a Python transport's handler).
    fn transport_result(
        &self,
        host: Arc<dyn TransportHost>,
        result: Result<(), TransportFailure>,
    ) -> Result<(), HostFailure> {
        if Arc::strong_count(&host) == 1 {
            // The windows were cleared meanwhile: this is the last reference.
            Python::attach(|_py| drop(host));
        }
        let failure = match result {
            Ok(()) => return Ok(()),
            Err(failure) => failure,
        };
        if let Some(raised) = failure.raised {
            if let Ok(raised) = raised.downcast::<Py<PyAny>>() {
                // Moved into the slot: no reference count changes, no GIL needed.
                *lock(&self.error) = Some(*raised);
            }
        }
        Err(HostFailure(failure.detail))
    }
}

impl VcpuHost for PyHost {
    fn pio_read(&self, port: u16, data: &mut [u8], size: usize) -> Result<(), HostFailure> {
        Python::attach(|py| {
            for chunk in data.chunks_exact_mut(size) {
                let read = self
                    .pio
                    .call_method1(py, "read", (port, size))
                    .and_then(|value| {
                        fill(chunk, value.bind(py).extract::<&[u8]>()?);
                        Ok(())
                    });
                read.map_err(|err| self.failed(py, err))?;
            }
            Ok(())
        })
    }

    fn pio_write(&self, port: u16, data: &[u8], size: usize) -> Result<(), HostFailure> {
        Python::attach(|py| {
            for chunk in data.chunks_exact(size) {
                self.pio
                    .call_method1(py, "write", (port, PyBytes::new(py, chunk)))
                    .map_err(|err| self.failed(py, err))?;
            }
            Ok(())
        })
    }

    fn mmio_read(&self, addr: u64, data: &mut [u8]) -> Result<(), HostFailure> {
        let native = self
            .windows
            .as_ref()
            .and_then(|w| w.get().windows.read(addr, data));
        match native {
            Some(ReadServed::Done) => Ok(()),
            Some(ReadServed::Device(host, offset)) => {
                let read = host.read_config(offset, data);
                self.transport_result(host, read)
            }
            None => Python::attach(|py| {
                self.mmio
                    .call_method1(py, "read", (addr, data.len()))
                    .and_then(|value| {
                        fill(data, value.bind(py).extract::<&[u8]>()?);
                        Ok(())
                    })
                    .map_err(|err| self.failed(py, err))
            }),
        }
    }

    fn mmio_write(&self, addr: u64, data: &[u8]) -> Result<(), HostFailure> {
        let native = self
            .windows
            .as_ref()
            .and_then(|w| w.get().windows.write(addr, data));
        match native {
            Some(WriteServed::Done) => Ok(()),
            Some(WriteServed::Events(host, events)) => {
                let applied = host.apply(events);
                self.transport_result(host, applied)
            }
            None => Python::attach(|py| {
                self.mmio
                    .call_method1(py, "write", (addr, PyBytes::new(py, data)))
                    .map(drop)
                    .map_err(|err| self.failed(py, err))
            }),
        }
    }

    fn exited(&self, reason: &'static str, detail: &str) {
        Python::attach(|py| {
            if let Err(err) = self.on_exit.call1(py, (reason, detail)) {
                err.write_unraisable(py, Some(self.on_exit.bind(py)));
            }
        });
    }

    fn host_thread(self: Box<Self>, body: &mut dyn FnMut(&dyn VcpuHost)) {
        // One Python thread state for the thread's whole life, the GIL released: each
        // exit's `Python::attach` is then a GIL take and release, not a thread state
        // created and destroyed per exit (PyGILState_Ensure/Release on a thread
        // without one).
        // SAFETY: the interpreter is initialised (this host was made from Python);
        // the Ensure is balanced by the Release below, on this thread, after the
        // matching RestoreThread; atexit stops every loop before the interpreter
        // finalises.
        let (gil, saved) = unsafe {
            let gil = pyo3::ffi::PyGILState_Ensure();
            (gil, pyo3::ffi::PyEval_SaveThread())
        };
        body(&*self);
        // Its Python references are released with the GIL held.
        Python::attach(|_py| drop(self));
        // SAFETY: the state saved above, on this thread, with the GIL released since.
        unsafe {
            pyo3::ffi::PyEval_RestoreThread(saved);
            pyo3::ffi::PyGILState_Release(gil);
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Where a vCPU run with no Python object reports how it ended: the first exit is
/// recorded, and an eventfd (counter semantics, non-blocking) becomes readable.
pub struct ExitSink {
    exit: Mutex<Option<(&'static str, String)>>,
    event: OwnedFd,
}

impl ExitSink {
    pub fn new() -> std::io::Result<Arc<Self>> {
        // SAFETY: eventfd2 with constant flags; the result is checked below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Arc::new(ExitSink {
            exit: Mutex::new(None),
            // SAFETY: a new descriptor nothing else owns.
            event: unsafe { OwnedFd::from_raw_fd(fd) },
        }))
    }

    /// How the vCPU ended, once it has: (reason, detail).
    pub fn exit(&self) -> Option<(&'static str, String)> {
        lock(&self.exit).clone()
    }

    /// Readable once an exit is recorded (and stays so until read).
    pub fn event_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    fn record(&self, reason: &'static str, detail: &str) {
        let mut exit = lock(&self.exit);
        if exit.is_some() {
            return;
        }
        *exit = Some((reason, detail.to_string()));
        let one = 1u64.to_ne_bytes();
        // SAFETY: 8 bytes from a live local buffer to the eventfd this sink owns.
        // EAGAIN (the counter at its maximum) leaves it readable, which is all a
        // waiter needs.
        unsafe { libc::write(self.event.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

/// A host with no Python object: MMIO in the machine's virtio-mmio windows served
/// there (`transport::Windows`, the device's host called on this thread for what
/// needs the device), everything else unclaimed (reads all ones, writes dropped, as
/// an unclaimed address on a real bus; counted), the exit recorded.
pub struct NativeHost {
    sink: Arc<ExitSink>,
    unclaimed: Arc<Mutex<UnclaimedCounts>>,
    windows: Option<Arc<Windows>>,
}

/// Accesses nobody served, by kind.
#[derive(Clone, Copy, Default)]
pub struct UnclaimedCounts {
    pub pio_reads: u64,
    pub pio_writes: u64,
    pub mmio_reads: u64,
    pub mmio_writes: u64,
}

impl NativeHost {
    /// A host reporting to `sink`, serving `windows` if given; with the counts of
    /// the accesses nobody served.
    pub fn new(
        sink: Arc<ExitSink>,
        windows: Option<Arc<Windows>>,
    ) -> (Self, Arc<Mutex<UnclaimedCounts>>) {
        let unclaimed = Arc::new(Mutex::new(UnclaimedCounts::default()));
        (
            NativeHost {
                sink,
                unclaimed: unclaimed.clone(),
                windows,
            },
            unclaimed,
        )
    }
}

/// A transport's failure ends the vCPU as the Python host's does: a `vmm_error`
/// with the transport's detail (a native transport raises nothing to keep).
fn transport_failure(served: Result<(), TransportFailure>) -> Result<(), HostFailure> {
    served.map_err(|failure| HostFailure(failure.detail))
}

impl VcpuHost for NativeHost {
    fn pio_read(&self, _port: u16, data: &mut [u8], _size: usize) -> Result<(), HostFailure> {
        lock(&self.unclaimed).pio_reads += 1;
        data.fill(0xFF);
        Ok(())
    }

    fn pio_write(&self, _port: u16, _data: &[u8], _size: usize) -> Result<(), HostFailure> {
        lock(&self.unclaimed).pio_writes += 1;
        Ok(())
    }

    fn mmio_read(&self, addr: u64, data: &mut [u8]) -> Result<(), HostFailure> {
        let served = self.windows.as_ref().and_then(|w| w.serve_read(addr, data));
        if let Some(served) = served {
            return transport_failure(served);
        }
        lock(&self.unclaimed).mmio_reads += 1;
        data.fill(0xFF);
        Ok(())
    }

    fn mmio_write(&self, addr: u64, data: &[u8]) -> Result<(), HostFailure> {
        let served = self
            .windows
            .as_ref()
            .and_then(|w| w.serve_write(addr, data));
        if let Some(served) = served {
            return transport_failure(served);
        }
        lock(&self.unclaimed).mmio_writes += 1;
        Ok(())
    }

    fn exited(&self, reason: &'static str, detail: &str) {
        self.sink.record(reason, detail);
    }

    fn host_thread(self: Box<Self>, body: &mut dyn FnMut(&dyn VcpuHost)) {
        body(&*self);
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// What a loop's thread runs on: the vCPU, its host, the console it serves, and
/// the VM core whose descriptors must outlive it.
struct Parts {
    vcpu: VcpuFd,
    host: Box<dyn VcpuHost>,
    /// COM1 and the i8042, served without the host.
    console: Option<Arc<ConsoleDevices>>,
    /// Held, not used: the VM's descriptors stay open until this thread ends.
    _core: Arc<VmCore>,
}

/// Pause, resume and the paused state of one vCPU loop, for a thread that holds no
/// Python object (the control server, `control_serve.rs`): the loop's own methods
/// run through it, so both paths are one.
#[derive(Clone)]
pub struct VcpuControl {
    index: u32,
    shared: Arc<Shared>,
}

impl VcpuControl {
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Ask the vCPU to park and wait until it has (kicking it out of the guest);
    /// false if it did not within `timeout`. Blocks: call without the GIL.
    pub fn pause(&self, timeout: Duration) -> bool {
        {
            let mut ctl = lock(&self.shared.ctl);
            // Asked first: a vCPU still Paused after a resume it has not woken up
            // for yet then stays parked (its wait loop sees the request again).
            ctl.want_pause = true;
            if matches!(ctl.state, RunState::Paused | RunState::Stopped) {
                return true;
            }
        }
        self.shared.wait_for(Some(timeout), |s| {
            matches!(s, RunState::Paused | RunState::Stopped)
        })
    }

    pub fn resume(&self) {
        let mut ctl = lock(&self.shared.ctl);
        ctl.want_pause = false;
        self.shared.cond.notify_all();
    }

    /// Parked and still asked to be (what `Machine.paused` reads as the state
    /// "paused"): a vCPU a `resume` released but not yet scheduled is not paused, so a
    /// `status` right after a `resume`'s reply does not contradict it.
    pub fn is_paused(&self) -> bool {
        let ctl = lock(&self.shared.ctl);
        ctl.state == RunState::Paused && ctl.want_pause
    }

    /// The loop's exit counters as they are now (a control server's `exits`).
    pub fn counters(&self) -> Counters {
        lock(&self.shared.counters).clone()
    }
}

/// One vCPU's thread and what it runs on, with no Python object: what a machine
/// assembled in Rust holds (`machine.rs`), and what `VcpuLoop` wraps for Python.
pub struct VcpuThread {
    index: u32,
    shared: Arc<Shared>,
    /// Until `start`: what the thread runs on, then moved into it.
    pending: Mutex<Option<Parts>>,
    handle: Mutex<Option<JoinHandle<()>>>,
}

/// One vCPU's run loop (`vmfork.vmm.vcpu.Vcpu` wraps it).
#[pyclass(frozen, module = "vmfork._core")]
pub struct VcpuLoop {
    thread: VcpuThread,
    /// The Python host's bus error, if it ended the loop.
    error: ErrorSlot,
    /// A native host's exit and unclaimed accesses.
    sink: Option<(Arc<ExitSink>, Arc<Mutex<UnclaimedCounts>>)>,
}

impl VcpuThread {
    /// A handle that pauses and resumes this loop from any thread.
    pub fn control(&self) -> VcpuControl {
        VcpuControl {
            index: self.index,
            shared: self.shared.clone(),
        }
    }

    /// A loop for the vCPU at `position` of `core`, reporting to `host`, serving
    /// `console`: what a machine built with no Python object runs.
    pub fn build(
        core: Arc<VmCore>,
        position: usize,
        host: Box<dyn VcpuHost>,
        console: Option<Arc<ConsoleDevices>>,
    ) -> Result<Self, Failure> {
        let (index, vcpu) = core.vcpu_for_loop(position)?;
        Ok(VcpuThread {
            index,
            shared: Arc::new(Shared {
                ctl: Mutex::new(Control {
                    want_pause: false,
                    want_stop: false,
                    state: RunState::Created,
                    thread: None,
                }),
                cond: Condvar::new(),
                counters: Mutex::new(Counters::default()),
            }),
            pending: Mutex::new(Some(Parts {
                vcpu,
                host,
                console,
                _core: core,
            })),
            handle: Mutex::new(None),
        })
    }

    /// Start the thread; with `paused`, it parks before entering the guest.
    pub fn start(&self, paused: bool) -> Result<(), String> {
        install_kick_handler().map_err(|e| format!("sigaction for the vCPU kick: {e}"))?;
        let parts = lock(&self.pending)
            .take()
            .ok_or_else(|| format!("vcpu{} already started", self.index))?;
        lock(&self.shared.ctl).want_pause = paused;
        let shared = self.shared.clone();
        let index = self.index;
        // The new thread inherits the blocked kick signal (see the module comment).
        let old = mask_kick(libc::SIG_BLOCK);
        let spawned = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || run_thread(parts, shared));
        restore_mask(&old);
        let handle = spawned.map_err(|e| format!("vcpu{index}: thread: {e}"))?;
        lock(&self.shared.ctl).thread = Some((handle.as_pthread_t(), handle.thread().id()));
        *lock(&self.handle) = Some(handle);
        Ok(())
    }

    /// Ask the loop to end and wait (kicking) up to `timeout`; on the vCPU's own
    /// thread, only ask. True once it has ended (or never started).
    pub fn stop(&self, timeout: Duration) -> bool {
        {
            let mut ctl = lock(&self.shared.ctl);
            ctl.want_stop = true;
            self.shared.cond.notify_all();
            match ctl.thread {
                None => return true,
                Some((_, id)) if id == std::thread::current().id() => return false,
                Some(_) => {}
            }
        }
        self.shared
            .wait_for(Some(timeout), |s| s == RunState::Stopped)
    }

    /// The thread's handle once it has ended (it set Stopped as its last step, so a
    /// join returns at once); None while it runs, or once taken.
    fn stopped_handle(&self) -> Option<JoinHandle<()>> {
        if lock(&self.shared.ctl).state == RunState::Stopped {
            lock(&self.handle).take()
        } else {
            None
        }
    }

    /// Join the thread if it has ended; true if it has (or never started).
    pub fn join_if_stopped(&self) -> bool {
        if let Some(handle) = self.stopped_handle() {
            let _ = handle.join();
        }
        lock(&self.handle).is_none()
    }

    /// Let go of what a thread that never started would have run on (its vCPU's
    /// descriptor and run mapping, its host).
    pub fn release(&self) {
        let parts = lock(&self.pending).take();
        drop(parts);
    }

    /// "created", "running", "paused" or "stopped".
    pub fn state(&self) -> &'static str {
        lock(&self.shared.ctl).state.name()
    }

    /// VM exits by reason name (KVM's names, lower case), and "intr" for kicks.
    pub fn exits(&self) -> HashMap<&'static str, u64> {
        lock(&self.shared.counters).exits.clone()
    }
}

impl VcpuLoop {
    /// A handle that pauses and resumes this loop from any thread.
    pub fn control(&self) -> VcpuControl {
        self.thread.control()
    }

    fn join_if_stopped(&self, py: Python<'_>) {
        // Taken in a statement of its own: no lock may be held across `detach`,
        // since reattaching waits for the GIL that another caller may hold while it
        // waits for that lock.
        let handle = self.thread.stopped_handle();
        if let Some(handle) = handle {
            py.detach(|| {
                let _ = handle.join();
            });
        }
    }
}

fn failure_to_py(f: Failure) -> PyErr {
    crate::ioctl_error(f)
}

#[pymethods]
impl VcpuLoop {
    /// A loop for the vCPU at `position` of the VM core `core` (`_core.VmCore`).
    /// Port exits call `pio.read(port, size)`/`pio.write(port, data)`, MMIO exits
    /// the same on `mmio`; an exit that ends the vCPU calls `on_exit(reason,
    /// detail)` once, on the vCPU's thread. With `console`, its ports (COM1, the
    /// i8042) never reach `pio`. With `windows`, MMIO exits in its register files'
    /// windows are served there, and reach Python only for what needs the device
    /// model (the transport's `read` for a config read, `apply_events` for what a
    /// write caused). The loop runs on its own copy of the vCPU's descriptor.
    #[new]
    #[pyo3(signature = (core, position, pio, mmio, on_exit, console = None, windows = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        core: &Bound<'_, PyVmCore>,
        position: usize,
        pio: Py<PyAny>,
        mmio: Py<PyAny>,
        on_exit: Py<PyAny>,
        console: Option<&Bound<'_, Console>>,
        windows: Option<Py<MmioWindows>>,
    ) -> PyResult<Self> {
        let error: ErrorSlot = Arc::new(Mutex::new(None));
        let host = PyHost {
            pio,
            mmio,
            on_exit,
            windows,
            error: error.clone(),
        };
        let devices = console.map(|c| c.get().devices());
        let thread = VcpuThread::build(core.get().get()?, position, Box::new(host), devices)
            .map_err(failure_to_py)?;
        Ok(VcpuLoop {
            thread,
            error,
            sink: None,
        })
    }

    /// A loop for the vCPU at `position` of `core` with no Python object behind
    /// it: unclaimed port and MMIO accesses read as all ones and are dropped
    /// (`unclaimed` counts them), and the exit is recorded (`exit`) with `exit_fd`
    /// made readable. With `console`, COM1 and the i8042 are served.
    #[staticmethod]
    #[pyo3(signature = (core, position, console = None))]
    fn native(
        core: &Bound<'_, PyVmCore>,
        position: usize,
        console: Option<&Bound<'_, Console>>,
    ) -> PyResult<Self> {
        let sink = ExitSink::new().map_err(|e| PyOSError::new_err(format!("eventfd: {e}")))?;
        let (host, unclaimed) = NativeHost::new(sink.clone(), None);
        let devices = console.map(|c| c.get().devices());
        let thread = VcpuThread::build(core.get().get()?, position, Box::new(host), devices)
            .map_err(failure_to_py)?;
        Ok(VcpuLoop {
            thread,
            error: Arc::new(Mutex::new(None)),
            sink: Some((sink, unclaimed)),
        })
    }

    /// Start the thread; with `paused`, it parks before entering the guest.
    #[pyo3(signature = (paused = false))]
    fn start(&self, paused: bool) -> PyResult<()> {
        self.thread.start(paused).map_err(PyRuntimeError::new_err)
    }

    /// Ask the vCPU to park and wait until it has (kicking it out of the guest);
    /// false if it did not within `timeout` seconds.
    #[pyo3(signature = (timeout = 5.0))]
    fn pause(&self, py: Python<'_>, timeout: f64) -> bool {
        let control = self.control();
        py.detach(move || control.pause(Duration::from_secs_f64(timeout.max(0.0))))
    }

    fn resume(&self) {
        self.control().resume();
    }

    /// Ask the loop to end and wait (kicking) up to `timeout` seconds; on the
    /// vCPU's own thread (an exit callback), only ask.
    #[pyo3(signature = (timeout = 5.0))]
    fn stop(&self, py: Python<'_>, timeout: f64) {
        let timeout = Duration::from_secs_f64(timeout.max(0.0));
        py.detach(|| self.thread.stop(timeout));
        self.join_if_stopped(py);
    }

    /// Wait for the loop to end (at most `timeout` seconds, or for ever).
    #[pyo3(signature = (timeout = None))]
    fn join(&self, py: Python<'_>, timeout: Option<f64>) {
        if lock(&self.thread.shared.ctl).thread.is_none() {
            return;
        }
        let shared = self.thread.shared.clone();
        let limit = timeout.map(|t| Duration::from_secs_f64(t.max(0.0)));
        // Waiting, not kicking: a join does not ask the vCPU to stop.
        py.detach(move || {
            let deadline = limit.map(|t| Instant::now() + t);
            let mut ctl = lock(&shared.ctl);
            while ctl.state != RunState::Stopped {
                let wait = match deadline {
                    Some(d) => match d.checked_duration_since(Instant::now()) {
                        Some(left) => left.min(KICK_RETRY),
                        None => break,
                    },
                    None => KICK_RETRY,
                };
                ctl = shared
                    .cond
                    .wait_timeout(ctl, wait)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        });
        self.join_if_stopped(py);
    }

    /// Stop the loop (if it runs) and release the vCPU's run mapping and descriptor
    /// and the host. Idempotent.
    fn close(&self, py: Python<'_>) {
        self.stop(py, 5.0);
        self.thread.release();
    }

    #[getter]
    fn state(&self) -> &'static str {
        self.thread.state()
    }

    #[getter]
    fn index(&self) -> u32 {
        self.thread.index
    }

    /// The exception that ended the loop (a bus handler's), if one did.
    #[getter]
    fn error(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        lock(&self.error).as_ref().map(|e| e.clone_ref(py))
    }

    /// A native loop's exit, once it has ended: (reason, detail); None before, or
    /// for a loop with a Python host (which reports to `on_exit`).
    #[getter]
    fn exit(&self) -> Option<(&'static str, String)> {
        self.sink.as_ref().and_then(|(sink, _)| sink.exit())
    }

    /// A native loop's eventfd, readable once `exit` is set (the loop's: not to be
    /// closed by the caller); None for a loop with a Python host.
    #[getter]
    fn exit_fd(&self) -> Option<RawFd> {
        self.sink.as_ref().map(|(sink, _)| sink.event_fd())
    }

    /// A native loop's accesses nobody served: {"pio_reads", "pio_writes",
    /// "mmio_reads", "mmio_writes"}; None for a loop with a Python host.
    fn unclaimed(&self) -> Option<HashMap<&'static str, u64>> {
        self.sink.as_ref().map(|(_, counts)| {
            let c = *lock(counts);
            HashMap::from([
                ("pio_reads", c.pio_reads),
                ("pio_writes", c.pio_writes),
                ("mmio_reads", c.mmio_reads),
                ("mmio_writes", c.mmio_writes),
            ])
        })
    }

    /// VM exits by reason name (KVM's names, lower case), and "intr" for kicks.
    fn exits(&self) -> HashMap<&'static str, u64> {
        self.thread.exits()
    }

    /// Port and MMIO exits by (bus, port or 4 KiB page).
    fn io_exits(&self) -> HashMap<(&'static str, u64), u64> {
        lock(&self.thread.shared.counters).io.clone()
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // Only a loop that never started holds its host (a running one moved it
        // into its thread, which drops it when it ends).
        if let Ok(pending) = self.thread.pending.try_lock() {
            let host = pending
                .as_ref()
                .and_then(|parts| parts.host.as_any().downcast_ref::<PyHost>());
            if let Some(host) = host {
                visit.call(&host.pio)?;
                visit.call(&host.mmio)?;
                visit.call(&host.on_exit)?;
                if let Some(windows) = host.windows.as_ref() {
                    visit.call(windows)?;
                }
            }
        }
        Ok(())
    }

    fn __clear__(&self) {
        if let Ok(mut pending) = self.thread.pending.try_lock() {
            pending.take();
        }
    }
}

/// How the loop ended: asked to stop (None), or an exit to report.
type Ended = Option<(&'static str, String)>;

fn run_thread(parts: Parts, shared: Arc<Shared>) {
    let Parts {
        mut vcpu,
        host,
        console,
        _core: core,
    } = parts;
    let flag: *mut u8 = &mut vcpu.get_kvm_run().immediate_exit;
    IMMEDIATE_EXIT.with(|f| f.set(flag));
    mask_kick(libc::SIG_UNBLOCK);
    host.host_thread(&mut |host| {
        {
            let mut ctl = lock(&shared.ctl);
            ctl.state = RunState::Running;
            shared.cond.notify_all();
        }
        let ended = run_loop(&mut vcpu, host, console.as_deref(), &shared);
        // No kick may touch the run page from here on (it is unmapped with `vcpu`).
        IMMEDIATE_EXIT.with(|f| f.set(std::ptr::null_mut()));
        if let Some((reason, detail)) = ended {
            host.exited(reason, &detail);
        }
    });
    drop(console);
    drop(vcpu);
    drop(core);
    let mut ctl = lock(&shared.ctl);
    ctl.state = RunState::Stopped;
    shared.cond.notify_all();
}

/// Park while a pause is asked; false when the loop must end.
fn park_if_asked(vcpu: &mut VcpuFd, shared: &Shared) -> bool {
    let mut ctl = lock(&shared.ctl);
    if ctl.want_stop {
        return false;
    }
    if !ctl.want_pause {
        return true;
    }
    // Complete any pending I/O instruction without running guest code.
    vcpu.set_kvm_immediate_exit(1);
    let _ = vcpu.run();
    vcpu.set_kvm_immediate_exit(0);
    ctl.state = RunState::Paused;
    shared.cond.notify_all();
    while ctl.want_pause && !ctl.want_stop {
        ctl = shared.cond.wait(ctl).unwrap_or_else(|p| p.into_inner());
    }
    if ctl.want_stop {
        return false;
    }
    ctl.state = RunState::Running;
    true
}

enum Io {
    In,
    Out,
}

fn bus_error(failure: HostFailure) -> Ended {
    Some(("vmm_error", failure.0))
}

fn run_loop(
    vcpu: &mut VcpuFd,
    host: &dyn VcpuHost,
    console: Option<&ConsoleDevices>,
    shared: &Shared,
) -> Ended {
    loop {
        if !park_if_asked(vcpu, shared) {
            return None;
        }
        // Port I/O is served after the exit's borrow of the vCPU ends: its element
        // size is in `kvm_run`, which kvm-ioctls' IoIn/IoOut do not carry.
        let io = match vcpu.run() {
            // EAGAIN: an application processor still waiting for its SIPI (KVM returns
            // it from a KVM_RUN that blocked and woke without one), retried like EINTR.
            Err(e) if e.errno() == EINTR || e.errno() == libc::EAGAIN => {
                lock(&shared.counters).exit("intr");
                vcpu.set_kvm_immediate_exit(0);
                continue;
            }
            Err(e) => {
                let err = std::io::Error::from_raw_os_error(e.errno());
                return Some(("vmm_error", format!("KVM_RUN: {err}")));
            }
            Ok(VcpuExit::IoIn(port, data)) => (Io::In, port, data.as_mut_ptr(), data.len()),
            Ok(VcpuExit::IoOut(port, data)) => {
                (Io::Out, port, data.as_ptr().cast_mut(), data.len())
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                count_io(shared, "mmio", addr & !0xFFF);
                match host.mmio_read(addr, data) {
                    Ok(()) => continue,
                    Err(failure) => return bus_error(failure),
                }
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                count_io(shared, "mmio", addr & !0xFFF);
                match host.mmio_write(addr, data) {
                    Ok(()) => continue,
                    Err(failure) => return bus_error(failure),
                }
            }
            Ok(VcpuExit::Hlt) => {
                lock(&shared.counters).exit("hlt");
                continue;
            }
            Ok(VcpuExit::IrqWindowOpen) => {
                lock(&shared.counters).exit("irq_window_open");
                continue;
            }
            Ok(VcpuExit::Intr) => {
                lock(&shared.counters).exit("intr");
                continue;
            }
            Ok(VcpuExit::Shutdown) => {
                lock(&shared.counters).exit("shutdown");
                return Some(("shutdown", "triple fault".to_string()));
            }
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                lock(&shared.counters).exit("system_event");
                let reason = match kind {
                    SYSTEM_EVENT_SHUTDOWN => "poweroff",
                    SYSTEM_EVENT_RESET => "reset",
                    SYSTEM_EVENT_CRASH => "crash",
                    _ => "system_event",
                };
                return Some((reason, format!("system event {kind}")));
            }
            Ok(VcpuExit::FailEntry(reason, _cpu)) => {
                lock(&shared.counters).exit("fail_entry");
                return Some(("fail_entry", format!("hardware entry failure {reason:#x}")));
            }
            Ok(VcpuExit::InternalError) => {
                lock(&shared.counters).exit("internal_error");
                return Some(("internal_error", internal_error_detail(vcpu)));
            }
            Ok(other) => {
                let name = exit_name(&other);
                lock(&shared.counters).exit(name);
                return Some(("unhandled_exit", format!("exit reason {name}")));
            }
        };
        let (direction, port, ptr, len) = io;
        // SAFETY: the exit reason is KVM_EXIT_IO (kvm-ioctls returned IoIn/IoOut for
        // it), so `io` is the union's active member; it is Copy and read by value.
        let size = usize::from(unsafe { vcpu.get_kvm_run().__bindgen_anon_1.io }.size);
        // SAFETY: `ptr`/`len` are the data kvm-ioctls sliced for this exit out of
        // the vCPU's run mapping, which lives as long as `vcpu`; the data sits at
        // the kernel's `data_offset`, past the `kvm_run` struct the reference above
        // covered (and dropped), and nothing else touches it until the next KVM_RUN.
        let data = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
        count_io(shared, "pio", u64::from(port));
        if size == 0 || len % size != 0 {
            return Some((
                "vmm_error",
                format!("port I/O exit at {port:#x}: {len} bytes of {size}-byte elements"),
            ));
        }
        if let Some(console) = console {
            match console.pio(port, data, size, matches!(direction, Io::Out)) {
                Some(Served::Done) => continue,
                Some(Served::Reset) => {
                    return Some(("reset", "the guest pulsed the i8042 reset line".into()))
                }
                None => {}
            }
        }
        let served = match direction {
            Io::Out => host.pio_write(port, data, size),
            Io::In => host.pio_read(port, data, size),
        };
        if let Err(failure) = served {
            return bus_error(failure);
        }
    }
}

fn count_io(shared: &Shared, bus: &'static str, addr: u64) {
    let mut counters = lock(&shared.counters);
    counters.exit(if bus == "pio" { "io" } else { "mmio" });
    counters.io(bus, addr);
}

/// Copy a device's answer; bytes it did not give read as all ones (open bus).
fn fill(dest: &mut [u8], value: &[u8]) {
    let n = dest.len().min(value.len());
    dest[..n].copy_from_slice(&value[..n]);
    dest[n..].fill(0xFF);
}

fn internal_error_detail(vcpu: &mut VcpuFd) -> String {
    // SAFETY: the exit reason is KVM_EXIT_INTERNAL_ERROR, so `internal` is the
    // union's active member; it is Copy and read by value.
    let internal = unsafe { vcpu.get_kvm_run().__bindgen_anon_1.internal };
    let n = (internal.ndata as usize).min(internal.data.len());
    let words: Vec<String> = internal.data[..n]
        .iter()
        .map(|w| format!("'{w:#x}'"))
        .collect();
    format!("suberror {} data [{}]", internal.suberror, words.join(", "))
}

fn exit_name(exit: &VcpuExit<'_>) -> &'static str {
    match exit {
        VcpuExit::Unknown => "unknown",
        VcpuExit::Exception => "exception",
        VcpuExit::Hypercall(_) => "hypercall",
        VcpuExit::Debug(_) => "debug",
        VcpuExit::SetTpr => "set_tpr",
        VcpuExit::TprAccess => "tpr_access",
        VcpuExit::Nmi => "nmi",
        VcpuExit::IoapicEoi(_) => "ioapic_eoi",
        VcpuExit::Hyperv => "hyperv",
        VcpuExit::X86Rdmsr(_) => "x86_rdmsr",
        VcpuExit::X86Wrmsr(_) => "x86_wrmsr",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::console::IrqFd;
    use crate::log_budget::LogBudget;
    use crate::vm::{test_ram_with, Layout};
    use kvm_ioctls::Kvm;

    // Real mode at 0x1000: in al,0xe9; inc al; jnz 1f; out 0xe9,al;
    // 1: mov al,0xfe; out 0x64,al (the i8042's reset); hlt. The write to 0xe9 happens
    // only if the unclaimed read gave all ones.
    const READ_E9_THEN_RESET: [u8; 13] = [
        0xE4, 0xE9, 0xFE, 0xC0, 0x75, 0x02, 0xE6, 0xE9, 0xB0, 0xFE, 0xE6, 0x64, 0xF4,
    ];
    const ENTRY: usize = 0x1000;

    fn eventfd() -> OwnedFd {
        // SAFETY: eventfd2 with constant flags, checked; a new descriptor we own.
        unsafe {
            let fd = libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK);
            assert!(fd >= 0);
            OwnedFd::from_raw_fd(fd)
        }
    }

    /// A machine wired in Rust alone: the VM core, the console devices and a loop
    /// with the native host; no Python object is made and the interpreter is never
    /// entered (this test binary does not even link libpython).
    #[test]
    fn a_vcpu_runs_to_its_exit_with_no_python_object() {
        let Ok(kvm) = Kvm::new() else {
            eprintln!("skipped: no usable /dev/kvm");
            return;
        };
        let region = test_ram_with(1 << 20, ENTRY, &READ_E9_THEN_RESET);
        let layout = Layout {
            tss_addr: 0xFFFB_D000,
            identity_map_addr: 0xFFFB_C000,
        };
        // SAFETY: the mapping stays for the test process's life.
        let (core, _) = unsafe { VmCore::create(&kvm, &[region], layout, &[0], None) }
            .expect("a VM on this host's KVM");
        let (_, vcpu) = core.vcpu(0).expect("vCPU 0");
        let mut sregs = vcpu.get_sregs().expect("sregs");
        sregs.cs.base = 0;
        sregs.cs.selector = 0;
        vcpu.set_sregs(&sregs).expect("sregs");
        let mut regs = vcpu.get_regs().expect("regs");
        regs.rip = ENTRY as u64;
        regs.rflags = 2;
        vcpu.set_regs(&regs).expect("regs");

        let console = Arc::new(ConsoleDevices::new(
            IrqFd::new(eventfd()),
            None,
            LogBudget::new("console", 0, 0.0, 0),
        ));
        let sink = ExitSink::new().expect("eventfd");
        let (host, unclaimed) = NativeHost::new(sink.clone(), None);
        // The thread, not its Python wrapper (whose slot for a Python host's exception
        // is a Python reference, and whose drop would link libpython into this binary).
        let vloop = VcpuThread::build(Arc::new(core), 0, Box::new(host), Some(console))
            .expect("a loop on the core");
        vloop.start(false).expect("a thread");
        let mut ready = libc::pollfd {
            fd: sink.event_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, live for the call.
        let n = unsafe { libc::poll(&mut ready, 1, 60_000) };
        assert_eq!(n, 1, "no exit within 60 s");
        assert_eq!(
            sink.exit(),
            Some(("reset", "the guest pulsed the i8042 reset line".to_string()))
        );
        let counts = *lock(&unclaimed);
        assert_eq!((counts.pio_reads, counts.pio_writes), (1, 1));
        assert_eq!((counts.mmio_reads, counts.mmio_writes), (0, 0));
        assert!(vloop.stop(Duration::from_secs(5)));
        assert_eq!(vloop.state(), "stopped");
        assert!(vloop.join_if_stopped());
    }
}
