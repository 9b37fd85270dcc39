//! `_core.fork_native_batch`: the zygote's fork of children that never return into
//! Python, a batch's back to back (`NativeFork`, one a child, built before the first).
//!
//! The zygote forks each as `fork_single_threaded` does (`child::fork_checked`: one
//! thread, the GIL held, no after-fork work in the child). In the child, with no
//! Python: the `ChildPlan`'s set-up and jail (`child.rs`), then the life
//! (`child_life.rs`) of the machine the plan names, then `_exit` with its status.
//!
//! What the Python path's child did in Python, and where it went:
//! * `signal.set_wakeup_fd(-1)`: needless here. The wakeup fd is written only by
//!   Python's C-level signal handler, and the zygote's only Python handlers are
//!   SIGTERM's and SIGINT's, which the set-up replaces (`child.rs`, step 3) before
//!   the mask is emptied; the life then blocks SIGTERM for its signalfd.
//! * `jail.adopt`: the descriptors the jail opened are the machine's input (handed
//!   to its plan's build), not a Python registry's; Python's `os.environ` matters
//!   only to Python, which runs only for a hand-over: the plan's `prelude` (e.g.
//!   `functools.partial(jail.adopt, spec)`) is called with them first.
//!
//! **Python for a request only.** A line the control server hands over (`exits`,
//! `snapshot`) is answered on the main thread (the one that forked, `child_life`'s
//! relay): the first one runs `PyOS_AfterFork_Child` (valid: no Python ran in this
//! process since the fork, and this thread holds the GIL, as it did at the fork;
//! CPython then re-creates the GIL as this thread's and runs the at-fork hooks),
//! then the prelude, then resolves the handler `module:function` named in the plan;
//! every hand-over calls `handler(line, fd) -> bytes`, as `ControlServer.handle_line`.

use std::ffi::CString;
use std::os::fd::RawFd;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::agent_handshake::{AgentTarget, Mount, Target};
use crate::child::{exit_setup_failed, fork_checked, ChildPlan, Opened};
use crate::child_heap;
use crate::child_life::{self, Forked, LifePlan};
use crate::child_report::ChildReporter;
use crate::control_serve::{
    error_line, Handover, PyHandover, SharedSnapshotStatus, SnapshotStatus,
};
use crate::machine::{NativeMachine, PyNativeMachine};
use crate::machine_plan::ChildMachinePlan;
use crate::spawn_profile::SpawnProfile;
use crate::tiny_machine::TinyMachinePlan;
use crate::write_set;

/// `EXIT_ENTRY_RAISED` of `runtime/zygote_protocol.py`.
const EXIT_ENTRY_RAISED: i32 = 70;

/// A child's `LifePlan`, built by the zygote before the fork (`vmmchild.native_life`).
#[pyclass(frozen, module = "vmfork._core")]
pub struct ChildLife {
    plan: LifePlan,
}

/// `ChildLife`'s constructor arguments as plain values (its `new` says what each is),
/// `agent` as `AgentTarget`'s and `seccomp` in hex: what the forker (`forker.rs`)
/// reads from JSON. The PyO3 constructor fills the same record but for those two,
/// which it has as values already (`life_plan`).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChildLifeArgs {
    run_dir: String,
    vm_id: String,
    notify_path: Option<String>,
    start_gate: Option<String>,
    start_gate_timeout: f64,
    #[serde(default)]
    seccomp: Option<String>,
    jailed: bool,
    #[serde(default)]
    agent: Option<(String, Option<u32>, f64, f64)>,
    ready_timeout: f64,
    net_refresh: bool,
    #[serde(default)]
    mounts: Vec<(u32, String, bool, u64)>,
    #[serde(default)]
    profile: bool,
    #[serde(default)]
    snapshot_bases: Vec<(Option<String>, String)>,
    #[serde(default)]
    snapshot_tracking: Option<String>,
    #[serde(default)]
    learn_write_set: bool,
}

pub(crate) fn from_hex(text: &str) -> Result<Vec<u8>, String> {
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let bytes = text.as_bytes();
    if !bytes.len().is_multiple_of(2) {
        return Err("an odd number of hex digits".into());
    }
    bytes
        .chunks(2)
        .map(|pair| match (digit(pair[0]), digit(pair[1])) {
            (Some(high), Some(low)) => Ok(high << 4 | low),
            _ => Err("a character that is not a hex digit".into()),
        })
        .collect()
}

impl ChildLifeArgs {
    /// The life these arguments name (`ChildLife.new`'s checks).
    pub fn life(mut self) -> Result<LifePlan, String> {
        let (path, port, connect_timeout, io_timeout) =
            self.agent.take().ok_or("a life needs its agent")?;
        let agent = Target::new(&path, port, connect_timeout, io_timeout)?;
        let seccomp = self.seccomp.take().as_deref().map(from_hex).transpose()?;
        life_plan(self, agent, seccomp)
    }
}

fn c_string(s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{s:?} holds a NUL byte"))
}

fn duration(seconds: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(seconds).map_err(|_| format!("a timeout of {seconds} s"))
}

/// The life of `v`, with its `agent` and `seccomp` program as values.
fn life_plan(
    v: ChildLifeArgs,
    agent: Target,
    seccomp: Option<Vec<u8>>,
) -> Result<LifePlan, String> {
    let start_gate = match &v.start_gate {
        Some(gate) => Some((c_string(gate)?, duration(v.start_gate_timeout)?)),
        None => None,
    };
    Ok(LifePlan {
        reporter: ChildReporter::at(&v.run_dir, &v.vm_id, v.notify_path.as_deref())?,
        start_gate,
        seccomp,
        control_path: c_string(&format!("{}/control.sock", v.run_dir.trim_end_matches('/')))?,
        jailed: v.jailed,
        agent,
        ready_timeout: duration(v.ready_timeout)?,
        net_refresh: v.net_refresh,
        mounts: v
            .mounts
            .into_iter()
            .map(|(device, guest_path, read_only, sectors)| Mount {
                device,
                guest_path,
                read_only,
                sectors,
            })
            .collect(),
        profile: if v.profile {
            Some(SpawnProfile::at(&v.run_dir)?)
        } else {
            None
        },
        snapshots: Arc::new(Mutex::new(SnapshotStatus {
            bases: v.snapshot_bases,
            tracking: v.snapshot_tracking,
        })),
        learn_write_set: v
            .learn_write_set
            .then(|| Path::new(&v.run_dir).join(write_set::FILE_NAME)),
    })
}

#[pymethods]
impl ChildLife {
    /// `vmmchild.main`'s arguments, resolved: the reports' `run_dir`, `vm_id` and
    /// `notify_path`; `start_gate` and its timeout (seconds); `seccomp`, the
    /// program's bytes for a jailed child;
    /// `agent` and `ready_timeout` (seconds); `net_refresh`: the snapshot has a network;
    /// `mounts`: the new volumes the agent mounts after `after_fork`, each (virtio-mmio
    /// device, guest path, read-only, sectors), as `AgentClient.mount_volume` takes them;
    /// `profile`: record each phase's end in `run_dir/spawn-profile.json`
    /// (`runtime/spawnprofile.py`'s record, `spawn_profile.rs`); `snapshot_bases`
    /// (`(tag, kind)`, newest first) and `snapshot_tracking`: what `status` says of
    /// snapshots until a capture says otherwise (`SnapshotTaker.bases`);
    /// `learn_write_set`: at ready, save the guest pages written so far as
    /// `run_dir/write-set.json` (`write_set.rs`).
    #[new]
    #[pyo3(signature = (*, run_dir, vm_id, notify_path, start_gate, start_gate_timeout,
                        seccomp, jailed, agent, ready_timeout, net_refresh, mounts=Vec::new(),
                        profile=false, snapshot_bases=Vec::new(), snapshot_tracking=None,
                        learn_write_set=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        run_dir: &str,
        vm_id: &str,
        notify_path: Option<&str>,
        start_gate: Option<&str>,
        start_gate_timeout: f64,
        seccomp: Option<Vec<u8>>,
        jailed: bool,
        agent: &AgentTarget,
        ready_timeout: f64,
        net_refresh: bool,
        mounts: Vec<(u32, String, bool, u64)>,
        profile: bool,
        snapshot_bases: Vec<(Option<String>, String)>,
        snapshot_tracking: Option<String>,
        learn_write_set: bool,
    ) -> PyResult<Self> {
        let args = ChildLifeArgs {
            run_dir: run_dir.to_owned(),
            vm_id: vm_id.to_owned(),
            notify_path: notify_path.map(str::to_owned),
            start_gate: start_gate.map(str::to_owned),
            start_gate_timeout,
            seccomp: None,
            jailed,
            agent: None,
            ready_timeout,
            net_refresh,
            mounts,
            profile,
            snapshot_bases,
            snapshot_tracking,
            learn_write_set,
        };
        let plan =
            life_plan(args, agent.target().clone(), seccomp).map_err(PyValueError::new_err)?;
        Ok(ChildLife { plan })
    }
}

/// What a child's first hand-over calls before its handler (`NativeFork`'s prelude).
pub enum Prelude {
    /// A Python callable of the zygote's, called with the jail's descriptors.
    Object(Py<PyAny>),
    /// `module:function`, called with the JSON list `args` decoded, then the jail's
    /// descriptors: a forker's child, whose zygote built no object for it.
    Named { function: String, args: String },
}

/// The hand-over of a child whose Python has not run since the fork (module comment).
/// It borrows its names and prelude from the child's `ForkPlan`: the child holds
/// the zygote's objects by reference and writes none of them.
struct AfterForkPython<'a> {
    module: &'a str,
    function: &'a str,
    prelude: Option<&'a Prelude>,
    opened: Option<Opened>,
    /// The handler, or why there is none, resolved at the first hand-over.
    handler: OnceLock<Result<PyHandover, String>>,
}

fn resolve_function(py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
    let (module, function) = name
        .split_once(':')
        .ok_or_else(|| PyValueError::new_err(format!("{name:?} is not 'module:function'")))?;
    Ok(py.import(module)?.getattr(function)?.unbind())
}

impl AfterForkPython<'_> {
    fn resolve(&self) -> Result<PyHandover, String> {
        // SAFETY: on the thread that forked (the relay runs hand-overs there), which
        // holds the GIL as it did at the fork, in a child that has run no Python since:
        // what `PyOS_AfterFork_Child` requires. Called once (the OnceLock).
        unsafe { pyo3::ffi::PyOS_AfterFork_Child() };
        Python::attach(|py| {
            let shown = |err: PyErr| err.to_string();
            match self.prelude {
                None => {}
                Some(Prelude::Object(prelude)) => {
                    prelude.call1(py, (self.opened.clone(),)).map_err(shown)?;
                }
                Some(Prelude::Named { function, args }) => {
                    let function = resolve_function(py, function).map_err(shown)?;
                    let args = py
                        .import("json")
                        .and_then(|json| json.getattr("loads")?.call1((args.as_str(),)))
                        .and_then(|decoded| {
                            let mut args: Vec<Bound<'_, PyAny>> =
                                decoded.try_iter()?.collect::<PyResult<_>>()?;
                            args.push(self.opened.clone().into_pyobject(py)?.into_any());
                            PyTuple::new(py, args)
                        })
                        .map_err(shown)?;
                    function.call1(py, args).map_err(shown)?;
                }
            }
            let function = py
                .import(self.module)
                .and_then(|m| m.getattr(self.function))
                .map_err(shown)?;
            Ok(PyHandover(function.unbind()))
        })
    }
}

impl Handover for AfterForkPython<'_> {
    fn handle(&self, line: &[u8], fd: RawFd) -> Vec<u8> {
        match self.handler.get_or_init(|| self.resolve()) {
            Ok(handler) => handler.handle(line, fd),
            Err(err) => error_line(&format!("the VMM's hand-over is not available: {err}")),
        }
    }
}

/// A value a fork plan holds: the zygote's Python object, or one a forker built.
pub enum Held<T: pyo3::PyClass<Frozen = pyo3::pyclass::boolean_struct::True> + Sync> {
    Object(Py<T>),
    Own(T),
}

impl<T: pyo3::PyClass<Frozen = pyo3::pyclass::boolean_struct::True> + Sync> Held<T> {
    fn get(&self) -> &T {
        match self {
            Held::Object(object) => object.get(),
            Held::Own(value) => value,
        }
    }
}

/// The machine a native child builds after its set-up and jail.
pub enum ForkedMachine {
    /// A snapshot's (`machine_plan.rs`).
    Restored(Held<ChildMachinePlan>),
    /// The tests' real-mode program (`tiny_machine.rs`).
    Tiny(TinyMachinePlan),
}

impl ForkedMachine {
    fn from_py(machine: &Bound<'_, PyAny>) -> PyResult<Self> {
        if let Ok(restored) = machine.cast::<ChildMachinePlan>() {
            return Ok(ForkedMachine::Restored(Held::Object(
                restored.clone().unbind(),
            )));
        }
        Ok(ForkedMachine::Tiny(
            machine.cast::<TinyMachinePlan>()?.get().clone(),
        ))
    }

    /// The life of this machine; in the child, with no Python.
    fn live(&self, life: &LifePlan, forked: Forked, after_fork: &AfterForkPython<'_>) -> i32 {
        let opened = after_fork.opened.as_ref();
        match self {
            ForkedMachine::Restored(plan) => {
                let build = || {
                    let machine = Arc::new(plan.get().build(opened, &|phase| life.mark(phase))?);
                    // Built once per process (`live` never returns): set exactly once.
                    let _ = FORKED_MACHINE.set((machine.clone(), life.snapshots.clone()));
                    Ok(machine)
                };
                child_life::live(life, forked, build, after_fork)
            }
            ForkedMachine::Tiny(plan) => {
                child_life::live(life, forked, || plan.build(), after_fork)
            }
        }
    }
}

/// A native child's machine and its `status`'s snapshot record, for its hand-over's
/// Python view (`forked_machine`); set in the child once its machine is built, never
/// in the zygote.
static FORKED_MACHINE: OnceLock<(Arc<NativeMachine>, SharedSnapshotStatus)> = OnceLock::new();

/// `_core.forked_machine()`: in a native child, its machine (`_core.NativeMachine`,
/// sharing the status's snapshot record with the control server), for the Python view
/// a hand-over builds (`vmm/native_view.py`); None in any other process.
#[pyfunction]
pub fn forked_machine() -> Option<PyNativeMachine> {
    FORKED_MACHINE
        .get()
        .map(|(machine, snapshots)| PyNativeMachine::shared(machine.clone(), snapshots.clone()))
}

/// Let every thread of this child allocate from glibc's main arena. Left to itself,
/// glibc gives each thread that allocates an arena of its own (up to 8 per core), and
/// a native child's vCPU, I/O loop, control and handshake threads each dirtied one
/// (its header, its thread cache, its top chunk): 26-48 KiB of a 1.7 MiB idle child
/// (design notes, "Where an idle native child's memory goes"). Its threads allocate
/// at set-up and rarely after, so they hardly contend for the one lock. Before the
/// first thread starts: a thread's arena is chosen at its first `malloc`.
fn one_malloc_arena() {
    // SAFETY: mallopt sets an allocator parameter; this process has one thread.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
}

/// One child of a native batch: `plan`'s set-up and jail, then `life` with `machine`;
/// `module:function`, the Python handler of handed-over control lines; `prelude`:
/// called with the jail's descriptors before the first; `own_pid_namespace`: given,
/// the child is the first process of a new PID namespace (`jail.PidNamespaces`), and
/// this descriptor of the forking process's own is where it returns after the fork.
/// Built by the zygote (`NativeFork`) or by a forker from a recipe (`forker.rs`).
pub struct ForkPlan {
    pub plan: Held<ChildPlan>,
    pub life: Held<ChildLife>,
    pub machine: ForkedMachine,
    pub module: String,
    pub function: String,
    pub prelude: Option<Prelude>,
    pub own_pid_namespace: Option<RawFd>,
}

/// `handover` split into its module and function.
pub fn handover_names(handover: &str) -> Result<(String, String), String> {
    let (module, function) = handover
        .split_once(':')
        .ok_or_else(|| format!("handover must be 'module:function', got {handover:?}"))?;
    Ok((module.to_owned(), function.to_owned()))
}

impl ChildLife {
    /// A life a forker built (`ChildLifeArgs`).
    pub fn own(plan: LifePlan) -> Self {
        ChildLife { plan }
    }
}

/// One child of `fork_native_batch`, built by the zygote before the batch (`ForkPlan`:
/// `machine` a `ChildMachinePlan` or a `TinyMachinePlan`, `handover` its
/// `module:function`).
#[pyclass(frozen, module = "vmfork._core")]
pub struct NativeFork {
    fork: ForkPlan,
}

#[pymethods]
impl NativeFork {
    #[new]
    #[pyo3(signature = (plan, life, machine, handover, prelude=None, own_pid_namespace=None))]
    fn new(
        plan: Py<ChildPlan>,
        life: Py<ChildLife>,
        machine: &Bound<'_, PyAny>,
        handover: &str,
        prelude: Option<Py<PyAny>>,
        own_pid_namespace: Option<RawFd>,
    ) -> PyResult<Self> {
        let (module, function) = handover_names(handover).map_err(PyValueError::new_err)?;
        Ok(NativeFork {
            fork: ForkPlan {
                plan: Held::Object(plan),
                life: Held::Object(life),
                machine: ForkedMachine::from_py(machine)?,
                module,
                function,
                prelude: prelude.map(Prelude::Object),
                own_pid_namespace,
            },
        })
    }
}

impl ForkPlan {
    /// The child's side of the fork: its set-up, jail and life; never returns.
    pub fn live(&self, forked_ns: i64) -> ! {
        // Nothing below returns, and nothing runs Python but a hand-over.
        // First, before anything allocates: the child's own allocations on fresh pages.
        if let Err(why) = child_heap::use_fresh_pages() {
            eprintln!("vmfork child: allocating from the zygote's heap: {why}");
        }
        let life = &self.life.get().plan;
        if let Some(profile) = &life.profile {
            profile.start(forked_ns);
        }
        one_malloc_arena();
        let plan = self.plan.get();
        plan.set_up();
        life.mark("set_up");
        let opened = match plan.enter_jail_native(&|phase| life.mark(phase)) {
            Ok(opened) => opened,
            Err(message) => exit_setup_failed(Some(&message)),
        };
        if opened.is_some() {
            life.mark("jailed");
        }
        let after_fork = AfterForkPython {
            module: &self.module,
            function: &self.function,
            prelude: self.prelude.as_ref(),
            opened,
            handler: OnceLock::new(),
        };
        let forked = Forked {
            forked_ns,
            entry_ns: child_life::monotonic_ns(),
        };
        // A panic must not unwind into the forking process's frames either (pyo3 would
        // turn it into a Python exception, in a child running the zygote's loop): it
        // exits as an entry that raised (`zygote_protocol.EXIT_ENTRY_RAISED`), its
        // message on stderr.
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.machine.live(life, forked, &after_fork)
        }))
        .unwrap_or(EXIT_ENTRY_RAISED);
        // SAFETY: _exit ends the process without unwinding into the forker's frames.
        unsafe { libc::_exit(code) }
    }
}

/// Why a native batch stopped: a failed call (its errno and what it was) or a
/// process that may not fork (another thread).
pub enum BatchStop {
    Os(i32, String),
    NotForkSafe(String),
}

/// Fork every child of `forks`, in order and back to back, with `fork` (0 in the
/// child, the child's pid here): nothing runs between two forks but each child's
/// PID-namespace bracket, so the forking process writes no page its earlier children
/// share while it forks the later ones (design notes, "A native batch forked back to
/// back"). Each child lives as `ForkPlan::live` says; its `forked_ns` is this
/// process's CLOCK_MONOTONIC just before its fork. Returns the pids and what stopped
/// the batch (None: all forked); a child forked before its `setns` back failed is in
/// the pids.
pub fn fork_batch(
    forks: &[&ForkPlan],
    fork: &mut dyn FnMut() -> Result<i32, BatchStop>,
) -> (Vec<i32>, Option<BatchStop>) {
    // Room for every pid first: a reallocation between two forks would write pages
    // the earlier children share.
    let mut pids = Vec::with_capacity(forks.len());
    for plan in forks {
        if plan.own_pid_namespace.is_some() {
            // SAFETY: unshare takes no pointer; it moves this process's next children
            // into a new PID namespace, not this process.
            if unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
                return (pids, Some(os_stop("unshare(CLONE_NEWPID)")));
            }
        }
        let forked_ns = child_life::monotonic_ns();
        let outcome = fork();
        if let Ok(0) = outcome {
            plan.live(forked_ns);
        }
        // Back to this process's own namespace even when the fork failed: the next
        // jailed fork needs a fresh one (a second unshare is refused while one is
        // pending) and an unjailed one none.
        let returned = match plan.own_pid_namespace {
            // SAFETY: setns takes a descriptor the caller keeps open and no pointer.
            Some(own) if unsafe { libc::setns(own, libc::CLONE_NEWPID) } != 0 => {
                Err(os_stop("setns back to the forking process's PID namespace"))
            }
            _ => Ok(()),
        };
        match outcome {
            Ok(pid) => pids.push(pid),
            Err(stop) => return (pids, Some(stop)),
        }
        if let Err(stop) = returned {
            return (pids, Some(stop));
        }
    }
    (pids, None)
}

fn os_stop(what: &str) -> BatchStop {
    let err = std::io::Error::last_os_error();
    BatchStop::Os(err.raw_os_error().unwrap_or(0), format!("{what}: {err}"))
}

/// Fork every child of `forks` back to back (`fork_batch`), each as
/// `fork_single_threaded` forks (`child::fork_checked`).
///
/// Returns `(pids, error)`: the pids of the children forked, in order, and the error
/// that stopped the batch (`RuntimeError`/`OSError` as `fork_single_threaded`, or the
/// namespace's `OSError`), None if all were forked; the children from `len(pids)` on
/// were not forked. A child forked before its `setns` back failed is in `pids`.
#[pyfunction]
pub fn fork_native_batch(
    py: Python<'_>,
    forks: Vec<PyRef<'_, NativeFork>>,
) -> (Vec<i32>, Option<PyErr>) {
    let mut failed: Option<PyErr> = None;
    let plans: Vec<&ForkPlan> = forks.iter().map(|f| &f.fork).collect();
    let (pids, stop) = fork_batch(&plans, &mut || {
        fork_checked(py).map_err(|err| {
            let stop = BatchStop::NotForkSafe(err.to_string());
            failed = Some(err);
            stop
        })
    });
    let error = stop.map(|stop| match (failed, stop) {
        (Some(err), _) => err,
        (None, BatchStop::Os(errno, what)) => PyOSError::new_err((errno, what)),
        (None, BatchStop::NotForkSafe(what)) => pyo3::exceptions::PyRuntimeError::new_err(what),
    });
    (pids, error)
}
