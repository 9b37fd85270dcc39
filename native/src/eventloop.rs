//! The VMM's I/O event loop: one epoll on a native thread (`_core.EventLoop`).
//!
//! The VMM's only I/O loop (the Python selector loop it replaced is deleted), behind
//! `vmm/eventloop.py`'s `EventLoop` interface (the Python wrapper `NativeEventLoop`
//! keeps the error accounting): readers on file
//! descriptors (queue ioeventfds, sockets, taps), `call_soon` from any thread (woken
//! through an eventfd) and `call_later` timers. The difference is where the thread
//! waits: in `epoll_wait` with the GIL released and, when no timer is due, with no
//! timeout at all, so an idle VMM's loop thread neither wakes nor runs Python. The GIL
//! is taken only to run a Python callback.
//!
//! A device's native server (a `NativeReader`: `rng_serve.rs`, `net_serve.rs`) can take
//! an fd instead of a Python callback: the loop thread serves it without the GIL, and
//! takes the GIL after the turn's native work only for what the server hands back
//! (`Deferred`: a guest fault, a line to log). A server may take one of its own fds out
//! of the epoll set and put it back (`LoopLink::watch`), keeping its reader.
//!
//! The loop is generic over its host (`LoopHost`): `PyHost`, the VMM's loop behind
//! `_core.EventLoop`, runs Python callbacks, `call_soon`, `call_later` and the
//! servers' `Deferred` work with the GIL; `NoPython` (`NativeLoop`) serves native readers
//! only, in a process with no interpreter: a machine wired in Rust. The loop's code is
//! the same for both; the host decides only what a turn's non-native work is and what
//! the thread does around its body.
//!
//! Order of one turn: the ready readers' callbacks, then every queued `call_soon`
//! (including those queued meanwhile), then the due timers. A reader removed by an
//! earlier callback of the same turn is not called.
//!
//! Locks (docs/native.md): `state` is taken with the GIL held or by the loop thread
//! without it only for plain values; it is never held across taking or releasing the
//! GIL, and no Python code runs under it (callbacks are cloned out, then called).
//! Python objects are dropped with the GIL held (`clear`).
//!
//! The epoll and the wake eventfd are `vmm-sys-util`'s wrappers (already a dependency
//! of `kvm-ioctls`): thin, owned, close on drop. They are closed when the loop stops,
//! not when the last reference to it goes: a stopped loop still referenced from a cycle (a device's callback, a machine kept for
//! its stats) would otherwise keep two fds open (the zygote's warm-up restore did).
//! They sit behind a read-write lock for that: the loop thread holds it shared around
//! `epoll_wait`, `add_reader`/`call_soon` briefly, and only the close, when the loop
//! thread is gone, takes it exclusively. `event-manager` was not taken: its
//! subscribers are `Send` Rust objects called with `&mut self`, which would put each
//! Python callback behind a second registry and its own lock for no gain here.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, Weak};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Events taken from one `epoll_wait`; more ready fds are served on the next turn.
const MAX_EVENTS: usize = 64;
/// The epoll data of the wake eventfd (fds are non-negative, so it names none).
const WAKE_TOKEN: u64 = u64::MAX;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic under the lock leaves plain values behind; the loop keeps going.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Work a native handler leaves for Python (a guest fault to report, a line to log),
/// run by the loop thread once it holds the GIL.
pub type Deferred = Box<dyn FnOnce(Python<'_>) + Send>;

/// A device queue served on the loop thread without the GIL (`rng_serve.rs`,
/// `net_serve.rs`).
pub trait NativeReader: Send + Sync {
    /// `fd` (one the handler was added for) is readable: serve it, without the GIL. An
    /// eventfd is the handler's to drain (a tap is not drained: it is read). What needs
    /// Python comes back, to be run with the GIL after this turn's native work.
    fn ready(self: Arc<Self>, fd: RawFd) -> Option<Deferred>;

    /// The loop it was added to, for a handler that turns its own fds' interest on and
    /// off (`LoopLink::watch`). Called at every `Loop::add_native`.
    fn bind(&self, _link: LoopLink) {}
}

/// What serves a readable fd: the host's callback (a Python callable, with the GIL), or
/// a native handler (without it).
enum Reader<C> {
    Callback(C),
    Native(Arc<dyn NativeReader>),
}

/// What a loop runs besides its native readers, and what its thread does around its
/// body.
pub trait LoopHost: Send + Sync + Sized + 'static {
    /// A callback the host registers for an fd, queues or times.
    type Callback: Send;

    /// Run the loop thread's body.
    fn run_thread(body: impl FnOnce());

    /// A turn's work for the host, after its native work: what the native readers
    /// handed back, then the ready callbacks of `fds`, the queued calls, the due timers.
    fn serve(shared: &Shared<Self>, fds: &[RawFd], deferred: Vec<Deferred>);

    /// Drop what is left when the loop ends (on the loop thread, in `run_thread`).
    fn drop_callbacks(callbacks: Vec<Self::Callback>);
}

/// The VMM's loop: Python callbacks, each run as `dispatch(callback)` with the GIL.
pub struct PyHost {
    /// The Python function each callback is passed to (`NativeEventLoop._call`, which
    /// logs and counts what a callback raises).
    dispatch: Py<PyAny>,
}

impl LoopHost for PyHost {
    type Callback = Py<PyAny>;

    fn run_thread(body: impl FnOnce()) {
        // One Python thread state for the thread's life, the GIL released (see vcpu.rs):
        // each turn's `Python::attach` is then a GIL take, not a thread state made anew.
        // SAFETY: the interpreter is initialised (we were started from Python); the
        // Ensure is balanced by the Release below, on this thread, after the matching
        // RestoreThread; the Python wrapper's atexit hook stops every loop before the
        // interpreter finalises.
        let (gil, saved) = unsafe {
            let gil = pyo3::ffi::PyGILState_Ensure();
            (gil, pyo3::ffi::PyEval_SaveThread())
        };
        body();
        // SAFETY: the state saved above, on this thread; then the Ensure's Release.
        unsafe {
            pyo3::ffi::PyEval_RestoreThread(saved);
            pyo3::ffi::PyGILState_Release(gil);
        }
    }

    fn serve(shared: &Shared<Self>, fds: &[RawFd], deferred: Vec<Deferred>) {
        Python::attach(|py| {
            for work in deferred {
                work(py);
            }
            serve_python(py, shared, fds);
        });
    }

    fn drop_callbacks(callbacks: Vec<Py<PyAny>>) {
        Python::attach(|_py| drop(callbacks));
    }
}

/// A callback that cannot exist: a loop without Python registers none.
pub enum NoCallback {}

/// A loop for a machine wired in Rust: native readers only, no interpreter needed.
pub struct NoPython;

impl LoopHost for NoPython {
    type Callback = NoCallback;

    fn run_thread(body: impl FnOnce()) {
        body();
    }

    fn serve(_shared: &Shared<Self>, _fds: &[RawFd], deferred: Vec<Deferred>) {
        // Only a server given a Python sink hands work back, and a machine wired in Rust
        // gives its servers native ones (`queue_server::NativeEvents`): a wiring bug,
        // said rather than run (there is no interpreter to run it with).
        if !deferred.is_empty() {
            eprintln!(
                "vmfork event loop: {} report(s) for Python dropped: a server on a loop \
                 without Python reports to Python",
                deferred.len()
            );
        }
    }

    fn drop_callbacks(callbacks: Vec<NoCallback>) {
        drop(callbacks);
    }
}

/// What `LoopLink` reaches: the loop's fd interest, whatever its host.
trait Watch: Send + Sync {
    fn watch(&self, fd: RawFd, on: bool) -> bool;
}

/// A native handler's weak link to the loop it is registered with (weak: the loop
/// holds the handler, and a strong link back would be a cycle never freed).
#[derive(Clone)]
pub struct LoopLink(Weak<dyn Watch>);

impl LoopLink {
    /// Watch `fd` for readability (`on`) or stop watching it, keeping its reader: a
    /// device parks an fd it cannot serve now (a tap with no rx buffers posted, which
    /// level-triggered would wake the loop at every turn) and watches it again when it
    /// can. Only an fd registered with a native reader is touched, so a handler can never
    /// make the loop watch an fd that has no reader (which would spin the loop); false if
    /// it is not (or the loop is gone).
    pub fn watch(&self, fd: RawFd, on: bool) -> bool {
        match self.0.upgrade() {
            Some(shared) => shared.watch(fd, on),
            None => false,
        }
    }
}

impl<H: LoopHost> Watch for Shared<H> {
    fn watch(&self, fd: RawFd, on: bool) -> bool {
        let state = lock(&self.state);
        if !matches!(state.readers.get(&fd), Some(Reader::Native(_))) {
            return false;
        }
        let io = self.io();
        let Some(io) = io.as_ref() else {
            return false;
        };
        let (op, event) = if on {
            (
                ControlOperation::Add,
                EpollEvent::new(EventSet::IN, fd as u64),
            )
        } else {
            (ControlOperation::Delete, EpollEvent::default())
        };
        match io.epoll.ctl(op, fd, event) {
            Ok(()) => true,
            // Already in the state asked for.
            Err(e) => matches!(e.raw_os_error(), Some(libc::EEXIST) | Some(libc::ENOENT)),
        }
    }
}

struct State<C> {
    readers: HashMap<RawFd, Reader<C>>,
    pending: VecDeque<C>,
    /// Due time and sequence number (ties run in `call_later` order); the callback is
    /// in `timer_callbacks` under the sequence number.
    timers: TimerHeap,
    timer_callbacks: HashMap<u64, C>,
    next_seq: u64,
    stopping: bool,
    started: bool,
    finished: bool,
    thread: Option<ThreadId>,
    /// A caller holds the native readers still (`Loop::hold`): no turn starts.
    held: bool,
    /// The loop thread is serving native readers.
    in_turn: bool,
}

impl<C> Default for State<C> {
    fn default() -> Self {
        State {
            readers: HashMap::new(),
            pending: VecDeque::new(),
            timers: TimerHeap::new(),
            timer_callbacks: HashMap::new(),
            next_seq: 0,
            stopping: false,
            started: false,
            finished: false,
            thread: None,
            held: false,
            in_turn: false,
        }
    }
}

impl<C> State<C> {
    fn epoll_timeout(&self, now: Instant) -> i32 {
        epoll_timeout(&self.timers, now)
    }

    fn pop_due_timer(&mut self, now: Instant) -> Option<C> {
        match self.timers.peek() {
            Some(Reverse((due, _))) if *due <= now => {
                let Reverse((_, seq)) = self.timers.pop()?;
                self.timer_callbacks.remove(&seq)
            }
            _ => None,
        }
    }

    /// Take every callback out, to be dropped as the host drops them (Python's with
    /// the GIL held).
    fn take_objects(&mut self) -> Vec<C> {
        let mut out: Vec<C> = Vec::new();
        for (_, reader) in self.readers.drain() {
            match reader {
                Reader::Callback(cb) => out.push(cb),
                // Its Python references go when the last Arc does; the loop thread
                // drops its clones right after serving.
                Reader::Native(handler) => drop(handler),
            }
        }
        out.extend(self.pending.drain(..));
        out.extend(self.timer_callbacks.drain().map(|(_, cb)| cb));
        self.timers.clear();
        out
    }
}

/// The loop's own fds; `None` once the loop stopped.
struct Io {
    epoll: Epoll,
    wake: EventFd,
}

pub struct Shared<H: LoopHost> {
    io: RwLock<Option<Io>>,
    state: Mutex<State<H::Callback>>,
    /// Signalled when a turn's native work ends and when a hold is let go (`hold`).
    turns: Condvar,
    host: H,
}

impl<H: LoopHost> Shared<H> {
    fn io(&self) -> RwLockReadGuard<'_, Option<Io>> {
        self.io.read().unwrap_or_else(|p| p.into_inner())
    }

    fn wake(&self) {
        if let Some(io) = self.io().as_ref() {
            // A full counter (2^64 - 2 wake-ups unread) still leaves the loop woken.
            let _ = io.wake.write(1);
        }
    }

    /// Close the epoll and the wake eventfd; only once the loop thread is gone (or was
    /// never started), or from the loop thread itself as it ends.
    fn close_io(&self) {
        let io = self.io.write().unwrap_or_else(|p| p.into_inner()).take();
        drop(io);
    }
}

/// Why a reader was not added.
#[derive(Debug)]
pub enum AddError {
    InvalidFd(RawFd),
    AlreadyRegistered(RawFd),
    Stopped,
    Epoll(RawFd, std::io::Error),
}

/// Why the loop's thread was not started.
#[derive(Debug)]
pub enum StartError {
    AlreadyStarted,
    Spawn(std::io::Error),
}

/// One loop and its thread, for either host (`_core.EventLoop` wraps a `PyHost` one;
/// `NativeLoop` is the one without Python).
pub struct Loop<H: LoopHost> {
    name: String,
    shared: Arc<Shared<H>>,
    handle: Mutex<Option<JoinHandle<()>>>,
}

/// A loop that serves native readers in a process with no interpreter.
pub type NativeLoop = Loop<NoPython>;

impl NativeLoop {
    pub fn new(name: String) -> std::io::Result<Self> {
        Loop::with_host(name, NoPython)
    }

    /// End the loop and wait for its thread (from the loop thread itself: only ask).
    pub fn stop(&self) {
        if !self.request_stop() {
            self.join();
        }
        NoPython::drop_callbacks(self.take_callbacks());
    }
}

impl<H: LoopHost> Loop<H> {
    fn with_host(name: String, host: H) -> std::io::Result<Self> {
        let epoll = Epoll::new()?;
        let wake = EventFd::new(EFD_NONBLOCK | libc::EFD_CLOEXEC)?;
        epoll.ctl(
            ControlOperation::Add,
            wake.as_raw_fd(),
            EpollEvent::new(EventSet::IN, WAKE_TOKEN),
        )?;
        Ok(Loop {
            name,
            shared: Arc::new(Shared {
                io: RwLock::new(Some(Io { epoll, wake })),
                state: Mutex::new(State::default()),
                turns: Condvar::new(),
                host,
            }),
            handle: Mutex::new(None),
        })
    }

    /// Serve `fd` natively, without the GIL, whenever it is readable: `handler` is a
    /// device's native server, which knows what each of its fds is.
    pub fn add_native(&self, fd: RawFd, handler: Arc<dyn NativeReader>) -> Result<(), AddError> {
        let shared: Weak<dyn Watch> = Arc::downgrade(&self.shared) as Weak<Shared<H>>;
        handler.bind(LoopLink(shared));
        self.add(fd, Reader::Native(handler))
    }

    fn add(&self, fd: RawFd, reader: Reader<H::Callback>) -> Result<(), AddError> {
        if fd < 0 {
            return Err(AddError::InvalidFd(fd));
        }
        let mut state = lock(&self.shared.state);
        {
            if state.readers.contains_key(&fd) {
                // As selectors does: a second registration of one fd is a caller's bug.
                return Err(AddError::AlreadyRegistered(fd));
            }
            let io = self.shared.io();
            let Some(io) = io.as_ref() else {
                return Err(AddError::Stopped);
            };
            io.epoll
                .ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::IN, fd as u64),
                )
                .map_err(|e| AddError::Epoll(fd, e))?;
        }
        state.readers.insert(fd, reader);
        Ok(())
    }

    /// Stop serving `fd` if a native reader serves it (a device transport dropping its
    /// server at a reset); a host callback on `fd` is left alone. True if one was removed.
    /// A turn that picked the reader up before the removal may still run it once: the
    /// caller waits that out on the server's own lock.
    pub fn remove_native(&self, fd: RawFd) -> bool {
        let native = matches!(
            lock(&self.shared.state).readers.get(&fd),
            Some(Reader::Native(_))
        );
        // Only native readers, whose drop needs no host: dropped right here.
        native && self.remove(fd).is_some()
    }

    /// Stop watching `fd`; its reader comes back, to be dropped as the host drops it.
    fn remove(&self, fd: RawFd) -> Option<Reader<H::Callback>> {
        let mut state = lock(&self.shared.state);
        let old = state.readers.remove(&fd);
        if old.is_some() {
            if let Some(io) = self.shared.io().as_ref() {
                // The fd may be closed already (then epoll dropped it itself).
                let _ = io
                    .epoll
                    .ctl(ControlOperation::Delete, fd, EpollEvent::default());
            }
        }
        old
    }

    /// Start the loop's thread.
    pub fn start(&self) -> Result<(), StartError> {
        {
            let mut state = lock(&self.shared.state);
            if state.started {
                return Err(StartError::AlreadyStarted);
            }
            state.started = true;
        }
        let shared = self.shared.clone();
        let spawned = std::thread::Builder::new()
            .name(self.name.chars().take(15).collect())
            .spawn(move || H::run_thread(|| run_turns(&shared)));
        let handle = match spawned {
            Ok(h) => h,
            Err(e) => {
                lock(&self.shared.state).started = false;
                return Err(StartError::Spawn(e));
            }
        };
        lock(&self.shared.state).thread = Some(handle.thread().id());
        *lock(&self.handle) = Some(handle);
        Ok(())
    }

    /// Ask the loop to end; true if called from the loop thread itself (which then
    /// closes the loop's fds as it ends: nothing to wait for).
    fn request_stop(&self) -> bool {
        let own_thread = {
            let mut state = lock(&self.shared.state);
            state.stopping = true;
            state.thread == Some(std::thread::current().id())
        };
        self.shared.turns.notify_all();
        self.shared.wake();
        own_thread
    }

    /// Wait for the loop thread (not from itself), then close the loop's fds: the
    /// thread is gone (or never ran).
    fn join(&self) {
        let handle = lock(&self.handle).take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
        self.shared.close_io();
    }

    /// The callbacks still held (after a stop: queued ones are never run).
    fn take_callbacks(&self) -> Vec<H::Callback> {
        lock(&self.shared.state).take_objects()
    }

    fn in_loop_thread(&self) -> bool {
        lock(&self.shared.state).thread == Some(std::thread::current().id())
    }

    /// Keep every native reader still until `release`: wait (at most `timeout`) for a
    /// turn in progress to end; no later turn starts meanwhile (ready fds wait in the
    /// epoll, level-triggered). A capture holds a machine's loop so that no device
    /// touches guest RAM or changes its state between the two (`vmm/capture.py`).
    /// False if a turn did not end in time (the hold is let go again). Never from the
    /// loop thread itself, and, for a loop with Python callbacks, without the GIL.
    pub fn hold(&self, timeout: Duration) -> bool {
        let mut state = lock(&self.shared.state);
        state.held = true;
        let (mut state, waited) = self
            .shared
            .turns
            .wait_timeout_while(state, timeout, |s| s.in_turn)
            .unwrap_or_else(|p| p.into_inner());
        if waited.timed_out() && state.in_turn {
            state.held = false;
            return false;
        }
        true
    }

    /// Let the native readers run again after `hold`.
    pub fn release(&self) {
        lock(&self.shared.state).held = false;
        self.shared.turns.notify_all();
    }

    pub fn running(&self) -> bool {
        let state = lock(&self.shared.state);
        state.started && !state.finished && !state.stopping
    }

    /// How many readers, queued calls and timers there are (tests, stats).
    pub fn counts(&self) -> (usize, usize, usize) {
        let state = lock(&self.shared.state);
        (state.readers.len(), state.pending.len(), state.timers.len())
    }
}

#[pyclass(frozen, module = "vmfork._core")]
pub struct EventLoop {
    /// In an `Arc`: a native transport holds it to add and remove its server's readers.
    pub(crate) inner: Arc<Loop<PyHost>>,
}

fn os_error(what: &str, err: std::io::Error) -> PyErr {
    PyOSError::new_err((err.raw_os_error().unwrap_or(0), format!("{what}: {err}")))
}

impl EventLoop {
    fn add(&self, fd: RawFd, reader: Reader<Py<PyAny>>) -> PyResult<()> {
        self.inner.add(fd, reader).map_err(|e| self.add_error(e))
    }

    fn add_error(&self, e: AddError) -> PyErr {
        match e {
            AddError::InvalidFd(fd) => {
                PyValueError::new_err(format!("invalid file descriptor {fd}"))
            }
            AddError::AlreadyRegistered(fd) => {
                PyValueError::new_err(format!("{fd} is already registered"))
            }
            AddError::Stopped => {
                PyRuntimeError::new_err(format!("{}: the loop is stopped", self.inner.name))
            }
            AddError::Epoll(fd, e) => os_error(&format!("epoll_ctl(add {fd})"), e),
        }
    }
}

#[pymethods]
impl EventLoop {
    /// A loop named `name` (its thread's name) that runs each callback as
    /// `dispatch(callback)`.
    #[new]
    fn new(name: String, dispatch: Py<PyAny>) -> PyResult<Self> {
        let inner = Loop::with_host(name, PyHost { dispatch })
            .map_err(|e| os_error("event loop set-up", e))?;
        Ok(EventLoop {
            inner: Arc::new(inner),
        })
    }

    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }

    /// Call `callback()` on the loop thread whenever `fd` is readable (level-triggered).
    fn add_reader(&self, fd: RawFd, callback: Py<PyAny>) -> PyResult<()> {
        self.add(fd, Reader::Callback(callback))
    }

    /// Stop watching `fd` (nothing happens if it is not watched).
    fn remove_reader(&self, _py: Python<'_>, fd: RawFd) {
        // Dropped here, with the GIL (`_py`) held.
        drop(self.inner.remove(fd));
    }

    /// Run `callback()` on the loop thread (safe from any thread). After a stop it is
    /// dropped: nothing runs it.
    fn call_soon(&self, callback: Py<PyAny>) {
        let shared = &self.inner.shared;
        {
            let mut state = lock(&shared.state);
            if state.stopping || state.finished {
                return;
            }
            state.pending.push_back(callback);
        }
        shared.wake();
    }

    /// Run `callback()` on the loop thread `delay` seconds from now (or later).
    fn call_later(&self, delay: f64, callback: Py<PyAny>) -> PyResult<()> {
        if delay.is_nan() {
            return Err(PyValueError::new_err("call_later delay is NaN"));
        }
        // A delay beyond any machine's life is capped rather than overflowing Instant.
        let delay = Duration::from_secs_f64(delay.clamp(0.0, 1e9));
        let shared = &self.inner.shared;
        {
            let mut state = lock(&shared.state);
            if state.stopping || state.finished {
                return Ok(()); // never run: the loop is stopping
            }
            let seq = state.next_seq;
            state.next_seq += 1;
            state.timers.push(Reverse((Instant::now() + delay, seq)));
            state.timer_callbacks.insert(seq, callback);
        }
        // The loop may be waiting with a longer (or no) timeout.
        shared.wake();
        Ok(())
    }

    fn in_loop_thread(&self) -> bool {
        self.inner.in_loop_thread()
    }

    #[getter]
    fn running(&self) -> bool {
        self.inner.running()
    }

    fn start(&self) -> PyResult<()> {
        self.inner.start().map_err(|e| match e {
            StartError::AlreadyStarted => {
                PyRuntimeError::new_err(format!("{} already started", self.inner.name))
            }
            StartError::Spawn(e) => os_error(&format!("{}: thread", self.inner.name), e),
        })
    }

    /// End the loop and wait for its thread (from the loop thread itself: only ask).
    /// Callbacks still queued are dropped.
    fn stop(&self, py: Python<'_>) {
        if !self.inner.request_stop() {
            // The loop thread may be waiting for the GIL to run a callback.
            py.detach(|| self.inner.join());
        }
        // Dropped here, with the GIL held.
        drop(self.inner.take_callbacks());
    }

    /// How many readers, queued calls and timers there are (tests, stats).
    fn counts(&self) -> (usize, usize, usize) {
        self.inner.counts()
    }
}

/// What one `epoll_wait` found for Python, collected without the GIL.
struct Ready {
    fds: Vec<RawFd>,
    woken: bool,
}

/// The loop thread's body (inside `LoopHost::run_thread`).
fn run_turns<H: LoopHost>(shared: &Arc<Shared<H>>) {
    let mut events = [EpollEvent::default(); MAX_EVENTS];
    loop {
        let timeout = {
            let state = lock(&shared.state);
            if state.stopping {
                break;
            }
            state.epoll_timeout(Instant::now())
        };
        let waited = match shared.io().as_ref() {
            Some(io) => io.epoll.wait(timeout, &mut events),
            None => break,
        };
        let count = match waited {
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => {
                // Cannot happen with a valid epoll fd and buffer; say it and end.
                eprintln!("vmfork event loop: epoll_wait: {e}");
                break;
            }
        };
        let mut ready = Ready {
            fds: Vec::with_capacity(count),
            woken: false,
        };
        for ev in &events[..count] {
            if ev.data() == WAKE_TOKEN {
                ready.woken = true;
            } else {
                ready.fds.push(ev.data() as RawFd);
            }
        }
        if ready.woken {
            if let Some(io) = shared.io().as_ref() {
                // Non-blocking: a concurrent reader cannot exist, EAGAIN means drained.
                let _ = io.wake.read();
            }
        }
        {
            let state = lock(&shared.state);
            let mut state = shared
                .turns
                .wait_while(state, |s| s.held && !s.stopping)
                .unwrap_or_else(|p| p.into_inner());
            if state.stopping {
                break;
            }
            state.in_turn = true;
        }
        let mut python_fds = Vec::with_capacity(ready.fds.len());
        let mut deferred: Vec<Deferred> = Vec::new();
        for fd in ready.fds {
            let native = match lock(&shared.state).readers.get(&fd) {
                Some(Reader::Native(handler)) => Some(handler.clone()),
                Some(Reader::Callback(_)) => None,
                None => continue, // removed meanwhile
            };
            match native {
                Some(handler) => deferred.extend(handler.ready(fd)),
                None => python_fds.push(fd),
            }
        }
        lock(&shared.state).in_turn = false;
        shared.turns.notify_all();
        let python_work = {
            let state = lock(&shared.state);
            if state.stopping {
                break;
            }
            !python_fds.is_empty()
                || !deferred.is_empty()
                || !state.pending.is_empty()
                || state.pop_due_check(Instant::now())
        };
        if python_work {
            H::serve(shared, &python_fds, deferred);
        }
    }
    let objects = {
        let mut state = lock(&shared.state);
        state.finished = true;
        state.take_objects()
    };
    H::drop_callbacks(objects);
    shared.close_io();
}

impl<C> State<C> {
    fn pop_due_check(&self, now: Instant) -> bool {
        timer_due(&self.timers, now)
    }
}

type TimerHeap = BinaryHeap<Reverse<(Instant, u64)>>;

/// Milliseconds until the first timer, rounded up (never early), or -1 (none).
fn epoll_timeout(timers: &TimerHeap, now: Instant) -> i32 {
    match timers.peek() {
        None => -1,
        Some(Reverse((due, _))) => {
            let left = due.saturating_duration_since(now);
            let ms = left.as_nanos().div_ceil(1_000_000);
            i32::try_from(ms).unwrap_or(i32::MAX)
        }
    }
}

fn timer_due(timers: &TimerHeap, now: Instant) -> bool {
    matches!(timers.peek(), Some(Reverse((due, _))) if *due <= now)
}

/// Read an eventfd's counter to zero (non-blocking: EAGAIN means it was zero).
pub(crate) fn drain_eventfd(fd: RawFd) {
    let mut buf = [0u8; 8];
    // SAFETY: 8 bytes into a live buffer; `fd` is an eventfd registered with a loop
    // (so open: its owner removes it from the loop before closing it), or one the
    // caller owns.
    let _ = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
}

fn call(py: Python<'_>, shared: &Shared<PyHost>, callback: Py<PyAny>) {
    let dispatch = &shared.host.dispatch;
    if let Err(err) = dispatch.call1(py, (callback,)) {
        // `dispatch` catches what callbacks raise; this is a BaseException it let
        // through (or its own failure): reported, and the loop goes on.
        err.write_unraisable(py, Some(dispatch.bind(py)));
    }
}

fn serve_python(py: Python<'_>, shared: &Shared<PyHost>, fds: &[RawFd]) {
    for fd in fds {
        let callback = match lock(&shared.state).readers.get(fd) {
            Some(Reader::Callback(cb)) => Some(cb.clone_ref(py)),
            _ => None,
        };
        if let Some(callback) = callback {
            call(py, shared, callback);
        }
    }
    loop {
        let next = {
            let mut state = lock(&shared.state);
            if state.stopping {
                return;
            }
            state.pending.pop_front()
        };
        match next {
            Some(callback) => call(py, shared, callback),
            None => break,
        }
    }
    let now = Instant::now();
    loop {
        let next = lock(&shared.state).pop_due_timer(now);
        match next {
            Some(callback) => call(py, shared, callback),
            None => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_epoll_timeout_is_never_early_and_none_without_timers() {
        let mut timers = TimerHeap::new();
        let now = Instant::now();
        assert_eq!(epoll_timeout(&timers, now), -1);
        timers.push(Reverse((now + Duration::from_micros(1500), 0)));
        assert_eq!(epoll_timeout(&timers, now), 2); // 1.5 ms rounds up, not down
        timers.push(Reverse((now + Duration::from_nanos(1), 1)));
        assert_eq!(epoll_timeout(&timers, now), 1);
        assert_eq!(epoll_timeout(&timers, now + Duration::from_secs(1)), 0); // overdue
        assert!(timer_due(&timers, now + Duration::from_millis(2)));
        assert!(!timer_due(&timers, now));
    }

    /// Counts its wakes, each taking `serve_for`: a device server's turn.
    struct Counting {
        served: std::sync::atomic::AtomicUsize,
        serve_for: Duration,
    }

    impl NativeReader for Counting {
        fn ready(self: Arc<Self>, fd: RawFd) -> Option<Deferred> {
            drain_eventfd(fd);
            std::thread::sleep(self.serve_for);
            self.served
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            None
        }
    }

    fn served(reader: &Counting) -> usize {
        reader.served.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn wait_until(what: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !what() {
            assert!(Instant::now() < deadline, "timed out");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A started loop serving one eventfd with a `Counting` reader, the eventfd
    /// written once (its first turn has begun when this returns).
    fn serving(serve_for: Duration) -> (NativeLoop, EventFd, Arc<Counting>) {
        let event_loop = NativeLoop::new("held".into()).expect("loop");
        let fd = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let reader = Arc::new(Counting {
            served: 0.into(),
            serve_for,
        });
        event_loop
            .add_native(fd.as_raw_fd(), reader.clone())
            .expect("add");
        event_loop.start().expect("start");
        fd.write(1).expect("write");
        std::thread::sleep(Duration::from_millis(50));
        (event_loop, fd, reader)
    }

    #[test]
    fn a_held_loop_serves_no_native_reader_until_released() {
        let (event_loop, fd, reader) = serving(Duration::from_millis(200));
        // Held in the middle of a turn: the hold waits for the turn to end.
        assert!(event_loop.hold(Duration::from_secs(5)));
        assert_eq!(served(&reader), 1);
        fd.write(1).expect("write");
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(served(&reader), 1, "a held loop served a reader");
        event_loop.release();
        wait_until(|| served(&reader) == 2);
        event_loop.stop();
    }

    #[test]
    fn a_hold_gives_up_on_a_turn_that_does_not_end_and_a_stop_ends_a_held_loop() {
        let (event_loop, fd, reader) = serving(Duration::from_millis(500));
        assert!(!event_loop.hold(Duration::from_millis(10)));
        wait_until(|| served(&reader) == 1);
        assert!(event_loop.hold(Duration::from_secs(5)));
        fd.write(1).expect("write");
        // Stopped while held: the loop ends without serving again.
        event_loop.stop();
        assert_eq!(served(&reader), 1);
    }

    #[test]
    fn a_far_deadline_is_capped_not_overflowed() {
        let mut timers = TimerHeap::new();
        let now = Instant::now();
        timers.push(Reverse((now + Duration::from_secs(1_000_000_000), 0)));
        assert_eq!(epoll_timeout(&timers, now), i32::MAX);
    }
}
