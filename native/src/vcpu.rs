//! The vCPU run loop: one native thread per vCPU on `KVM_RUN`, with pause and kick.
//!
//! The thread runs the guest until an exit needs the VMM. HLT, interrupt-window and
//! signal exits are handled here without Python, and so are COM1/i8042 (`console.rs`)
//! and the virtio-mmio register files (`mmio_py.rs`); other port and MMIO exits are handed to
//! the Python buses (`vmfork.vmm.bus.Bus.read`/`write`), the GIL taken only for
//! them; an exit that ends the vCPU (shutdown, system event, internal error, failed
//! entry, an exit we do not serve) is reported once to the Python `on_exit`.
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
use std::os::fd::RawFd;
use std::os::unix::thread::JoinHandleExt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use kvm_ioctls::{VcpuExit, VcpuFd};

use crate::console::{Console, Served};
use crate::mmio_py::{self, MmioWindows};
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

fn install_kick_handler() -> PyResult<()> {
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
        Some(err) => Err(PyOSError::new_err(format!(
            "sigaction for the vCPU kick: {err}"
        ))),
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

#[derive(Default)]
struct Counters {
    exits: HashMap<&'static str, u64>,
    io: HashMap<(&'static str, u64), u64>,
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
    error: Mutex<Option<Py<PyAny>>>,
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

/// What the Python side gave the loop: the buses and the exit callback.
struct Callbacks {
    pio: Py<PyAny>,
    mmio: Py<PyAny>,
    on_exit: Py<PyAny>,
    /// COM1 and the i8042, served without Python, when the machine has them native.
    console: Option<Py<Console>>,
    /// The virtio-mmio register files, served without Python (`mmio_py.rs`).
    windows: Option<Py<MmioWindows>>,
}

/// One vCPU's run loop (`vmfork.vmm.native_vcpu.NativeVcpu` wraps it).
#[pyclass(frozen, module = "vmfork._core")]
pub struct VcpuLoop {
    index: u32,
    shared: Arc<Shared>,
    /// Until `start`: the vCPU and the callbacks, then moved into the thread.
    pending: Mutex<Option<(VcpuFd, Callbacks)>>,
    handle: Mutex<Option<JoinHandle<()>>>,
}

impl VcpuLoop {
    fn with_vcpu(index: u32, vcpu: VcpuFd, callbacks: Callbacks) -> Self {
        VcpuLoop {
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
                error: Mutex::new(None),
            }),
            pending: Mutex::new(Some((vcpu, callbacks))),
            handle: Mutex::new(None),
        }
    }

    fn join_if_stopped(&self, py: Python<'_>) {
        let stopped = lock(&self.shared.ctl).state == RunState::Stopped;
        // Taken in a statement of its own: no lock may be held across `detach`,
        // since reattaching waits for the GIL that another caller may hold while it
        // waits for that lock.
        let handle = if stopped {
            lock(&self.handle).take()
        } else {
            None
        };
        if let Some(handle) = handle {
            // The thread has set Stopped as its last step: this returns at once.
            py.detach(|| {
                let _ = handle.join();
            });
        }
    }
}

#[pymethods]
impl VcpuLoop {
    /// A loop for the vCPU `vcpu_fd` (index `index`) of the VM `vm_fd`. Port exits
    /// call `pio.read(port, size)`/`pio.write(port, data)`, MMIO exits the same on
    /// `mmio`; an exit that ends the vCPU calls `on_exit(reason, detail)` once, on
    /// the vCPU's thread. With `console`, its ports (COM1, the i8042) never reach
    /// `pio`. With `windows`, MMIO exits in its register files' windows are served
    /// there, and reach Python only for what needs the device model (the transport's
    /// `read` for a config read, `apply_events` for what a write caused). The
    /// descriptors stay the caller's (the loop uses copies).
    #[new]
    #[pyo3(signature = (kvm_fd, vm_fd, vcpu_fd, index, pio, mmio, on_exit, console = None,
                        windows = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        kvm_fd: RawFd,
        vm_fd: RawFd,
        vcpu_fd: RawFd,
        index: u32,
        pio: Py<PyAny>,
        mmio: Py<PyAny>,
        on_exit: Py<PyAny>,
        console: Option<Py<Console>>,
        windows: Option<Py<MmioWindows>>,
    ) -> PyResult<Self> {
        let vm = crate::open_vm(kvm_fd, vm_fd)?;
        let mut vcpus = crate::open_vcpus(&vm, &[(vcpu_fd, index)])?;
        let vcpu = vcpus.pop().expect("one vCPU asked, one opened");
        Ok(VcpuLoop::with_vcpu(
            index,
            vcpu,
            Callbacks {
                pio,
                mmio,
                on_exit,
                console,
                windows,
            },
        ))
    }

    /// Start the thread; with `paused`, it parks before entering the guest.
    #[pyo3(signature = (paused = false))]
    fn start(&self, paused: bool) -> PyResult<()> {
        install_kick_handler()?;
        let (vcpu, callbacks) = lock(&self.pending).take().ok_or_else(|| {
            PyRuntimeError::new_err(format!("vcpu{} already started", self.index))
        })?;
        lock(&self.shared.ctl).want_pause = paused;
        let shared = self.shared.clone();
        let index = self.index;
        // The new thread inherits the blocked kick signal (see the module comment).
        let old = mask_kick(libc::SIG_BLOCK);
        let spawned = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || run_thread(vcpu, callbacks, shared));
        restore_mask(&old);
        let handle =
            spawned.map_err(|e| PyOSError::new_err(format!("vcpu{index}: thread: {e}")))?;
        lock(&self.shared.ctl).thread = Some((handle.as_pthread_t(), handle.thread().id()));
        *lock(&self.handle) = Some(handle);
        Ok(())
    }

    /// Ask the vCPU to park and wait until it has (kicking it out of the guest);
    /// false if it did not within `timeout` seconds.
    #[pyo3(signature = (timeout = 5.0))]
    fn pause(&self, py: Python<'_>, timeout: f64) -> bool {
        {
            let mut ctl = lock(&self.shared.ctl);
            // Asked first: a vCPU still Paused after a resume it has not woken up
            // for yet then stays parked (its wait loop sees the request again).
            ctl.want_pause = true;
            if matches!(ctl.state, RunState::Paused | RunState::Stopped) {
                return true;
            }
        }
        let shared = self.shared.clone();
        py.detach(move || {
            shared.wait_for(Some(Duration::from_secs_f64(timeout.max(0.0))), |s| {
                matches!(s, RunState::Paused | RunState::Stopped)
            })
        })
    }

    fn resume(&self) {
        let mut ctl = lock(&self.shared.ctl);
        ctl.want_pause = false;
        self.shared.cond.notify_all();
    }

    /// Ask the loop to end and wait (kicking) up to `timeout` seconds; on the
    /// vCPU's own thread (an exit callback), only ask.
    #[pyo3(signature = (timeout = 5.0))]
    fn stop(&self, py: Python<'_>, timeout: f64) {
        {
            let mut ctl = lock(&self.shared.ctl);
            ctl.want_stop = true;
            self.shared.cond.notify_all();
            match ctl.thread {
                None => return,
                Some((_, id)) if id == std::thread::current().id() => return,
                Some(_) => {}
            }
        }
        let shared = self.shared.clone();
        py.detach(move || {
            shared.wait_for(Some(Duration::from_secs_f64(timeout.max(0.0))), |s| {
                s == RunState::Stopped
            })
        });
        self.join_if_stopped(py);
    }

    /// Wait for the loop to end (at most `timeout` seconds, or for ever).
    #[pyo3(signature = (timeout = None))]
    fn join(&self, py: Python<'_>, timeout: Option<f64>) {
        if lock(&self.shared.ctl).thread.is_none() {
            return;
        }
        let shared = self.shared.clone();
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
    /// and the callbacks. Idempotent.
    fn close(&self, py: Python<'_>) {
        self.stop(py, 5.0);
        lock(&self.pending).take();
    }

    #[getter]
    fn state(&self) -> &'static str {
        lock(&self.shared.ctl).state.name()
    }

    #[getter]
    fn index(&self) -> u32 {
        self.index
    }

    /// The exception that ended the loop (a bus handler's), if one did.
    #[getter]
    fn error(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        lock(&self.shared.error).as_ref().map(|e| e.clone_ref(py))
    }

    /// VM exits by reason name (KVM's names, lower case), and "intr" for kicks.
    fn exits(&self) -> HashMap<&'static str, u64> {
        lock(&self.shared.counters).exits.clone()
    }

    /// Port and MMIO exits by (bus, port or 4 KiB page).
    fn io_exits(&self) -> HashMap<(&'static str, u64), u64> {
        lock(&self.shared.counters).io.clone()
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // Only a loop that never started holds callbacks (a running one moved them
        // into its thread, which drops them when it ends).
        if let Ok(pending) = self.pending.try_lock() {
            if let Some((_, cb)) = pending.as_ref() {
                visit.call(&cb.pio)?;
                visit.call(&cb.mmio)?;
                visit.call(&cb.on_exit)?;
                if let Some(console) = cb.console.as_ref() {
                    visit.call(console)?;
                }
                if let Some(windows) = cb.windows.as_ref() {
                    visit.call(windows)?;
                }
            }
        }
        Ok(())
    }

    fn __clear__(&self) {
        if let Ok(mut pending) = self.pending.try_lock() {
            pending.take();
        }
    }
}

/// How the loop ended: asked to stop (None), or an exit to report.
type Ended = Option<(&'static str, String, Option<PyErr>)>;

fn run_thread(mut vcpu: VcpuFd, callbacks: Callbacks, shared: Arc<Shared>) {
    let flag: *mut u8 = &mut vcpu.get_kvm_run().immediate_exit;
    IMMEDIATE_EXIT.with(|f| f.set(flag));
    mask_kick(libc::SIG_UNBLOCK);
    // One Python thread state for the thread's whole life, the GIL released: each
    // exit's `Python::attach` is then a GIL take and release, not a thread state
    // created and destroyed per exit (PyGILState_Ensure/Release on a thread without
    // one).
    // SAFETY: the interpreter is initialised (we were started from Python); the
    // Ensure is balanced by the Release below, on this thread, after the matching
    // RestoreThread; atexit stops every loop before the interpreter finalises.
    let (gil, saved) = unsafe {
        let gil = pyo3::ffi::PyGILState_Ensure();
        (gil, pyo3::ffi::PyEval_SaveThread())
    };
    {
        let mut ctl = lock(&shared.ctl);
        ctl.state = RunState::Running;
        shared.cond.notify_all();
    }
    let ended = run_loop(&mut vcpu, &callbacks, &shared);
    // No kick may touch the run page from here on (it is unmapped with `vcpu`).
    IMMEDIATE_EXIT.with(|f| f.set(std::ptr::null_mut()));
    Python::attach(|py| {
        if let Some((reason, detail, err)) = ended {
            if let Some(err) = err {
                *lock(&shared.error) = Some(err.value(py).clone().into_any().unbind());
            }
            if let Err(err) = callbacks.on_exit.call1(py, (reason, detail)) {
                err.write_unraisable(py, Some(callbacks.on_exit.bind(py)));
            }
        }
        drop(callbacks);
    });
    drop(vcpu);
    // SAFETY: the state saved above, on this thread, with the GIL released since.
    unsafe {
        pyo3::ffi::PyEval_RestoreThread(saved);
        pyo3::ffi::PyGILState_Release(gil);
    }
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

fn run_loop(vcpu: &mut VcpuFd, cb: &Callbacks, shared: &Shared) -> Ended {
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
                return Some(("vmm_error", format!("KVM_RUN: {err}"), None));
            }
            Ok(VcpuExit::IoIn(port, data)) => (Io::In, port, data.as_mut_ptr(), data.len()),
            Ok(VcpuExit::IoOut(port, data)) => {
                (Io::Out, port, data.as_ptr().cast_mut(), data.len())
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                count_io(shared, "mmio", addr & !0xFFF);
                let native = cb.windows.as_ref().and_then(|w| w.get().read(addr, data));
                let served = match native {
                    Some(mmio_py::ReadServed::Done) => Ok(()),
                    Some(mmio_py::ReadServed::Device(handler, offset)) => Python::attach(|py| {
                        let value = handler.call_method1(py, "read", (offset, data.len()));
                        drop(handler);
                        fill(data, value?.bind(py).extract::<&[u8]>()?);
                        Ok(())
                    }),
                    None => Python::attach(|py| mmio_read(py, &cb.mmio, addr, data)),
                };
                match served {
                    Ok(()) => continue,
                    Err(err) => return Some(bus_error(err)),
                }
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                count_io(shared, "mmio", addr & !0xFFF);
                let native = cb.windows.as_ref().and_then(|w| w.get().write(addr, data));
                let written = match native {
                    Some(mmio_py::WriteServed::Done) => Ok(()),
                    Some(mmio_py::WriteServed::Events(handler, events)) => Python::attach(|py| {
                        let applied = handler
                            .call_method1(py, "apply_events", (mmio_py::events_to_py(events),))
                            .map(drop);
                        drop(handler);
                        applied
                    }),
                    None => Python::attach(|py| {
                        cb.mmio
                            .call_method1(py, "write", (addr, PyBytes::new(py, data)))
                            .map(drop)
                    }),
                };
                match written {
                    Ok(()) => continue,
                    Err(err) => return Some(bus_error(err)),
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
                return Some(("shutdown", "triple fault".to_string(), None));
            }
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                lock(&shared.counters).exit("system_event");
                let reason = match kind {
                    SYSTEM_EVENT_SHUTDOWN => "poweroff",
                    SYSTEM_EVENT_RESET => "reset",
                    SYSTEM_EVENT_CRASH => "crash",
                    _ => "system_event",
                };
                return Some((reason, format!("system event {kind}"), None));
            }
            Ok(VcpuExit::FailEntry(reason, _cpu)) => {
                lock(&shared.counters).exit("fail_entry");
                return Some((
                    "fail_entry",
                    format!("hardware entry failure {reason:#x}"),
                    None,
                ));
            }
            Ok(VcpuExit::InternalError) => {
                lock(&shared.counters).exit("internal_error");
                return Some(("internal_error", internal_error_detail(vcpu), None));
            }
            Ok(other) => {
                let name = exit_name(&other);
                lock(&shared.counters).exit(name);
                return Some(("unhandled_exit", format!("exit reason {name}"), None));
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
                None,
            ));
        }
        if let Some(console) = cb.console.as_ref() {
            match console
                .get()
                .pio(port, data, size, matches!(direction, Io::Out))
            {
                Some(Served::Done) => continue,
                Some(Served::Reset) => {
                    return Some((
                        "reset",
                        "the guest pulsed the i8042 reset line".into(),
                        None,
                    ))
                }
                None => {}
            }
        }
        let served = Python::attach(|py| -> PyResult<()> {
            for chunk in data.chunks_exact_mut(size) {
                match direction {
                    Io::Out => {
                        cb.pio
                            .call_method1(py, "write", (port, PyBytes::new(py, chunk)))?;
                    }
                    Io::In => {
                        let value = cb.pio.call_method1(py, "read", (port, size))?;
                        fill(chunk, value.bind(py).extract::<&[u8]>()?);
                    }
                }
            }
            Ok(())
        });
        if let Err(err) = served {
            return Some(bus_error(err));
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

fn mmio_read(py: Python<'_>, mmio: &Py<PyAny>, addr: u64, data: &mut [u8]) -> PyResult<()> {
    let value = mmio.call_method1(py, "read", (addr, data.len()))?;
    fill(data, value.bind(py).extract::<&[u8]>()?);
    Ok(())
}

fn bus_error(err: PyErr) -> (&'static str, String, Option<PyErr>) {
    let detail = Python::attach(|py| {
        err.value(py)
            .repr()
            .map(|r| r.to_string())
            .unwrap_or_else(|_| "an exception".to_string())
    });
    ("vmm_error", detail, Some(err))
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
