//! `_core.fork_native`: the zygote's fork of a child that never returns into Python.
//!
//! The zygote forks as `fork_single_threaded` does (`child::fork_checked`: one
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
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::agent_handshake::AgentTarget;
use crate::child::{exit_setup_failed, fork_checked, ChildPlan, Opened};
use crate::child_life::{self, Forked, LifePlan};
use crate::child_report::ChildReporter;
use crate::control_serve::{error_line, Handover, PyHandover};
use crate::machine_plan::ChildMachinePlan;
use crate::tiny_machine::TinyMachinePlan;

/// `EXIT_ENTRY_RAISED` of `runtime/zygote_protocol.py`.
const EXIT_ENTRY_RAISED: i32 = 70;

/// A child's `LifePlan`, built by the zygote before the fork (`vmmchild.native_life`).
#[pyclass(frozen, module = "vmfork._core")]
pub struct ChildLife {
    plan: LifePlan,
}

fn c_string(s: &str) -> PyResult<CString> {
    CString::new(s).map_err(|_| PyValueError::new_err(format!("{s:?} holds a NUL byte")))
}

fn duration(seconds: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| PyValueError::new_err(format!("a timeout of {seconds} s")))
}

#[pymethods]
impl ChildLife {
    /// `vmmchild.main`'s arguments, resolved: the reports' `run_dir`, `vm_id` and
    /// `notify_path`; `start_gate` and its timeout (seconds); `seccomp`, the
    /// program's bytes for a jailed child;
    /// `agent` and `ready_timeout` (seconds); `net_refresh`: the snapshot has a network.
    #[new]
    #[pyo3(signature = (*, run_dir, vm_id, notify_path, start_gate, start_gate_timeout,
                        seccomp, jailed, agent, ready_timeout, net_refresh))]
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
    ) -> PyResult<Self> {
        let start_gate = match start_gate {
            Some(gate) => Some((c_string(gate)?, duration(start_gate_timeout)?)),
            None => None,
        };
        Ok(ChildLife {
            plan: LifePlan {
                reporter: ChildReporter::at(run_dir, vm_id, notify_path)
                    .map_err(PyValueError::new_err)?,
                start_gate,
                seccomp,
                control_path: c_string(&format!("{}/control.sock", run_dir.trim_end_matches('/')))?,
                jailed,
                agent: agent.target().clone(),
                ready_timeout: duration(ready_timeout)?,
                net_refresh,
            },
        })
    }
}

/// The hand-over of a child whose Python has not run since the fork (module comment).
struct AfterForkPython {
    module: String,
    function: String,
    prelude: Option<Py<PyAny>>,
    opened: Option<Opened>,
    /// The handler, or why there is none, resolved at the first hand-over.
    handler: OnceLock<Result<PyHandover, String>>,
}

impl AfterForkPython {
    fn resolve(&self) -> Result<PyHandover, String> {
        // SAFETY: on the thread that forked (the relay runs hand-overs there), which
        // holds the GIL as it did at the fork, in a child that has run no Python since:
        // what `PyOS_AfterFork_Child` requires. Called once (the OnceLock).
        unsafe { pyo3::ffi::PyOS_AfterFork_Child() };
        Python::attach(|py| {
            let shown = |err: PyErr| err.to_string();
            if let Some(prelude) = &self.prelude {
                prelude.call1(py, (self.opened.clone(),)).map_err(shown)?;
            }
            let function = py
                .import(self.module.as_str())
                .and_then(|m| m.getattr(self.function.as_str()))
                .map_err(shown)?;
            Ok(PyHandover(function.unbind()))
        })
    }
}

impl Handover for AfterForkPython {
    fn handle(&self, line: &[u8], fd: RawFd) -> Vec<u8> {
        match self.handler.get_or_init(|| self.resolve()) {
            Ok(handler) => handler.handle(line, fd),
            Err(err) => error_line(&format!("the VMM's hand-over is not available: {err}")),
        }
    }
}

/// The machine a native child builds after its set-up and jail.
enum ForkedMachine {
    /// A snapshot's (`machine_plan.rs`).
    Restored(Py<ChildMachinePlan>),
    /// The tests' real-mode program (`tiny_machine.rs`).
    Tiny(TinyMachinePlan),
}

impl ForkedMachine {
    fn from_py(machine: &Bound<'_, PyAny>) -> PyResult<Self> {
        if let Ok(restored) = machine.cast::<ChildMachinePlan>() {
            return Ok(ForkedMachine::Restored(restored.clone().unbind()));
        }
        Ok(ForkedMachine::Tiny(
            machine.cast::<TinyMachinePlan>()?.get().clone(),
        ))
    }

    /// The life of this machine; in the child, with no Python.
    fn live(&self, life: &LifePlan, forked: Forked, after_fork: &AfterForkPython) -> i32 {
        let opened = after_fork.opened.as_ref();
        match self {
            ForkedMachine::Restored(plan) => {
                child_life::live(life, forked, || plan.get().build(opened), after_fork)
            }
            ForkedMachine::Tiny(plan) => {
                child_life::live(life, forked, || plan.build(), after_fork)
            }
        }
    }
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

/// Fork a child that runs `plan`'s set-up and jail, then `life` with `machine` (a
/// `ChildMachinePlan` or a `TinyMachinePlan`), and never returns into Python (it
/// `_exit`s with the life's status). `forked_ns`: the
/// zygote's CLOCK_MONOTONIC at the fork, for `fork_to_entry_s`; `handover`:
/// `module:function`, the Python handler of handed-over control lines; `prelude`:
/// called with the jail's descriptors before the first. Returns the child's pid;
/// `RuntimeError`/`OSError` as `fork_single_threaded`.
#[pyfunction]
#[pyo3(signature = (plan, life, machine, forked_ns, handover, prelude=None))]
pub fn fork_native(
    py: Python<'_>,
    plan: &ChildPlan,
    life: &ChildLife,
    machine: &Bound<'_, PyAny>,
    forked_ns: i64,
    handover: &str,
    prelude: Option<Py<PyAny>>,
) -> PyResult<i32> {
    let (module, function) = handover.split_once(':').ok_or_else(|| {
        PyValueError::new_err(format!(
            "handover must be 'module:function', got {handover:?}"
        ))
    })?;
    let machine = ForkedMachine::from_py(machine)?;
    let mut after_fork = AfterForkPython {
        module: module.to_owned(),
        function: function.to_owned(),
        prelude,
        opened: None,
        handler: OnceLock::new(),
    };
    let pid = fork_checked(py)?;
    if pid != 0 {
        return Ok(pid);
    }
    // The child: nothing below returns, and nothing runs Python but a hand-over.
    one_malloc_arena();
    plan.set_up();
    after_fork.opened = match plan.enter_jail_native() {
        Ok(opened) => opened,
        Err(message) => exit_setup_failed(Some(&message)),
    };
    let forked = Forked {
        forked_ns,
        entry_ns: child_life::monotonic_ns(),
    };
    // A panic must not unwind into the zygote's frames either (pyo3 would turn it into
    // a Python exception, in a child running the zygote's loop): it exits as an entry
    // that raised (`zygote_protocol.EXIT_ENTRY_RAISED`), its message on stderr.
    let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        machine.live(&life.plan, forked, &after_fork)
    }))
    .unwrap_or(EXIT_ENTRY_RAISED);
    // SAFETY: _exit ends the process without unwinding into the zygote's frames.
    unsafe { libc::_exit(code) }
}
