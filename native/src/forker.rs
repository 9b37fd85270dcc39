//! The forker: a copy of the zygote that forks native children and runs no Python
//! (`_core.start_forker`; `runtime/forker.py` drives it).
//!
//! Why. A lone child's own memory is the set of pages its forker writes while the
//! child lives, and a Python zygote writes its request loop's working set on every
//! request (~1.2 MiB in the test host: docs/native.md, "A forker smaller than the
//! Python zygote"). A forker whose memory stays as it was across spawns leaves its
//! children sharing those pages. And the zygote's own Python no longer meets pages
//! its last fork write-protected (~100 copy-on-write faults before a fork, ~240 after
//! it, each ~12 us in the emulated test host).
//!
//! How. The zygote clones the forker once its snapshot plans are built (its prefork),
//! with `CLONE_FILES`: the two share one descriptor table, so every descriptor the
//! zygote opens for a later batch (cgroup and jail-base descriptors, taps, FIFOs'
//! neighbours) has the same number in the forker. What the forker needs of a batch
//! comes as plain values, one JSON record per child (`Recipe`): the constructor
//! arguments of its `ChildPlan`, `ChildLife` and `ChildMachinePlan`, which the forker
//! builds with the functions the PyO3 constructors use; the `SnapshotMachinePlan`
//! (the restore's buffers, the devices' plans) by its number, which the forker finds
//! in its image, at the address the zygote had at the clone (`machine_plan::kept_plan`);
//! a hand-over's prelude as `module:function` and its JSON arguments. A plan the
//! forker's image does not have (a snapshot first spawned after the clone) makes the
//! zygote clone another forker.
//!
//! After a lone batch, once its channel is quiet, the forker forks the next lone child
//! ahead, a spare, and the next lone batch is given to it instead of forked
//! (`forker_spare.rs`).
//!
//! The children are cloned with `CLONE_PARENT`: the zygote is their parent, so it reaps
//! them and holds their pidfds as it does for the children it forks itself, and a
//! forker's exit loses none of them. Once the batch is forked the forker tells each
//! pid, then the batch's end, one JSON line each (a forker that dies before it told
//! them leaves children the zygote finds among its own and kills); it blocks every signal (the zygote's Python
//! handlers write into the zygote's wakeup socket, which the table shares), dies with
//! the zygote (`PR_SET_PDEATHSIG`) and exits at the end of its channel.
//!
//! The wire (the zygote trusts its forker and the forker its zygote: both are the
//! same program, and a record is bounded all the same): zygote to forker, a u32
//! length (little-endian, at most `MAX_BATCH_BYTES`) and a JSON object `{"children":
//! [Recipe, ...]}`; forker to zygote, `{"pid": N}` per child forked, then `{"done":
//! true, "error": null | text, "errno": N | null}`.

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;

use pyo3::exceptions::{PyOSError, PyRuntimeError};
use pyo3::prelude::*;

use crate::child::{one_thread, ChildPlan, ChildPlanArgs};
use crate::forker_spare::{SpareChannel, Spares};
use crate::machine_plan::{kept_plan, ForChildArgs, SnapshotMachinePlan};
use crate::native_fork::{
    fork_batch, handover_names, BatchStop, ChildLife, ChildLifeArgs, ForkPlan, ForkedMachine, Held,
    Prelude,
};
use crate::tiny_machine::TinyMachinePlan;

/// The largest batch record a forker reads (~2 KiB a child).
const MAX_BATCH_BYTES: usize = 64 << 20;

/// One child of a forker's batch, as plain values (module comment).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Recipe {
    plan: ChildPlanArgs,
    life: ChildLifeArgs,
    machine: MachineRecipe,
    /// `module:function`, the hand-over's handler.
    handover: String,
    /// `module:function` and its arguments, a JSON list.
    #[serde(default)]
    prelude: Option<(String, String)>,
    #[serde(default)]
    own_pid_namespace: Option<RawFd>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
enum MachineRecipe {
    /// A snapshot's: the `SnapshotMachinePlan`'s number and `for_child`'s arguments.
    Restored { snapshot: u64, child: ForChildArgs },
    /// The tests' real-mode program, in hex.
    Tiny { code: String },
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Batch {
    children: Vec<Recipe>,
}

impl Recipe {
    /// The zygote's descriptors the child uses by number.
    fn descriptors(&self) -> Vec<RawFd> {
        let mut fds = self.plan.descriptors();
        fds.extend(self.own_pid_namespace);
        fds.sort_unstable();
        fds.dedup();
        fds
    }
}

fn hex_bytes(text: &str) -> Result<Vec<u8>, String> {
    crate::native_fork::from_hex(text)
}

/// The child `recipe` names, built as the zygote's constructors build it.
fn fork_plan(py: Python<'_>, recipe: Recipe) -> Result<ForkPlan, String> {
    let machine = match recipe.machine {
        MachineRecipe::Restored { snapshot, child } => {
            let plan: Py<SnapshotMachinePlan> = kept_plan(py, snapshot).ok_or_else(|| {
                format!("snapshot plan {snapshot} is not in this forker (cloned before it)")
            })?;
            ForkedMachine::Restored(Held::Own(SnapshotMachinePlan::child_plan(plan, child)?))
        }
        MachineRecipe::Tiny { code } => {
            ForkedMachine::Tiny(TinyMachinePlan::new(hex_bytes(&code)?)?)
        }
    };
    let (module, function) = handover_names(&recipe.handover)?;
    Ok(ForkPlan {
        plan: Held::Own(ChildPlan::from_args(recipe.plan, None)?),
        life: Held::Own(ChildLife::own(recipe.life.life()?)),
        machine,
        module,
        function,
        prelude: recipe
            .prelude
            .map(|(function, args)| Prelude::Named { function, args }),
        own_pid_namespace: recipe.own_pid_namespace,
    })
}

/// A raw `clone` with `flags` and no stack: fork's semantics otherwise (the child
/// runs on a copy of this stack). Raw, since glibc has no wrapper that forks with
/// these flags; the caller has one thread and holds no lock, which is what a raw
/// clone leaves the child.
fn clone_with(flags: libc::c_int) -> std::io::Result<i32> {
    // SAFETY: clone without CLONE_VM and with no stack and no pointer arguments: the
    // child runs on a copy of this stack, as after fork.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            flags | libc::SIGCHLD,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(pid as i32)
}

/// `clone(CLONE_PARENT)`: a child of this process's parent (the zygote).
pub(crate) fn clone_parent_raw() -> std::io::Result<i32> {
    clone_with(libc::CLONE_PARENT)
}

fn clone_parent() -> Result<i32, BatchStop> {
    clone_parent_raw().map_err(|err| {
        BatchStop::Os(
            err.raw_os_error().unwrap_or(0),
            format!("clone(CLONE_PARENT): {err}"),
        )
    })
}

fn json_text(out: &mut String, text: &str) {
    // serde_json writes a string as JSON does; a String never fails to serialise.
    out.push_str(&serde_json::to_string(text).unwrap_or_else(|_| "\"?\"".into()));
}

/// A batch: its children built (every one, before the first fork: a batch that cannot
/// be built forks none) and forked; returns what to tell the zygote: a line per pid
/// forked, then the end line.
fn serve_batch(py: Python<'_>, body: &[u8], spares: &mut Spares) -> String {
    let batch: Batch = match serde_json::from_slice(body) {
        Ok(batch) => batch,
        Err(err) => return end_line(Some(&format!("the batch record: {err}")), None),
    };
    // A lone child goes to the spare of its kind, if there is one (`forker_spare.rs`),
    // which builds its plan and says so; any other end forks it, as without a spare.
    if let [child] = &batch.children[..] {
        if let Some(pid) = spares.give(child.own_pid_namespace, body, &child.descriptors()) {
            return format!("{{\"pid\": {pid}}}\n") + &end_line(None, None);
        }
    }
    let mut plans = Vec::with_capacity(batch.children.len());
    for (index, recipe) in batch.children.into_iter().enumerate() {
        match fork_plan(py, recipe) {
            Ok(plan) => plans.push(plan),
            Err(err) => return end_line(Some(&format!("child {index}: {err}")), None),
        }
    }
    let refs: Vec<&ForkPlan> = plans.iter().collect();
    let (pids, stop) = fork_batch(&refs, &mut clone_parent);
    // Told once the batch is forked, not between two forks: what this process writes
    // there is a page copied for every child forked before it. The pids and the end
    // line go in one write: one wake-up of the zygote, not two.
    let mut told: String = pids
        .iter()
        .map(|pid| format!("{{\"pid\": {pid}}}\n"))
        .collect();
    told.push_str(&match stop {
        None => end_line(None, None),
        Some(BatchStop::Os(errno, what)) => end_line(Some(&what), Some(errno)),
        Some(BatchStop::NotForkSafe(what)) => end_line(Some(&what), None),
    });
    told
}

fn end_line(error: Option<&str>, errno: Option<i32>) -> String {
    let mut out = String::from("{\"done\": true, \"error\": ");
    match error {
        Some(text) => json_text(&mut out, text),
        None => out.push_str("null"),
    }
    out.push_str(", \"errno\": ");
    match errno {
        Some(errno) => out.push_str(&errno.to_string()),
        None => out.push_str("null"),
    }
    out.push_str("}\n");
    out
}

/// The child of a batch record of one child, built: a spare's (`forker_spare.rs`).
pub(crate) fn lone_plan(py: Python<'_>, body: &[u8]) -> Result<ForkPlan, String> {
    let batch: Batch =
        serde_json::from_slice(body).map_err(|err| format!("the batch record: {err}"))?;
    let mut children = batch.children.into_iter();
    match (children.next(), children.next()) {
        (Some(recipe), None) => fork_plan(py, recipe),
        _ => Err("a spare's batch is one child".into()),
    }
}

/// The forker's life: batches read from `channel` until it ends; never returns.
fn forker_main(channel: RawFd, zygote: libc::pid_t, mut spares: Spares) -> ! {
    // SAFETY: plain libc calls on a signal set of our own; this process has one
    // thread. Every signal blocked: the zygote's Python handlers write into the
    // zygote's wakeup socket (the descriptor table is shared), and none may run here.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::sigprocmask(libc::SIG_SETMASK, &all, std::ptr::null_mut());
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
        if libc::getppid() != zygote {
            libc::_exit(0);
        }
    }
    // SAFETY: the zygote gave this end to this forker and never closes it while the
    // forker lives (`runtime/forker.py`); the forker owns its use from here.
    let mut stream = unsafe { UnixStream::from_raw_fd(channel) };
    // SAFETY: this is the thread that held the GIL in the zygote when it cloned this
    // process (inside `start_forker`, a Python call), and the only thread here: it
    // holds it still. No Python code runs here; Python objects are only referred to
    // (the snapshot plans, by `kept_plan`).
    let py = unsafe { Python::assume_attached() };
    loop {
        spares.wait_for(channel, py);
        let mut length = [0u8; 4];
        if stream.read_exact(&mut length).is_err() {
            // SAFETY: _exit ends the process without unwinding: the channel ended.
            unsafe { libc::_exit(0) };
        }
        let length = u32::from_le_bytes(length) as usize;
        let line = if length > MAX_BATCH_BYTES {
            // The rest of the record cannot be skipped safely: the channel is done.
            let line = end_line(Some(&format!("a batch of {length} bytes")), None);
            let _ = stream.write_all(line.as_bytes());
            // SAFETY: as above.
            unsafe { libc::_exit(0) };
        } else {
            let mut body = vec![0u8; length];
            if stream.read_exact(&mut body).is_err() {
                // SAFETY: as above.
                unsafe { libc::_exit(0) };
            }
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                serve_batch(py, &body, &mut spares)
            }))
            .unwrap_or_else(|_| end_line(Some("the forker panicked serving the batch"), None))
        };
        spares.batch_served();
        if stream.write_all(line.as_bytes()).is_err() {
            // SAFETY: as above.
            unsafe { libc::_exit(0) };
        }
    }
}

/// `_core.start_forker(channel, spare_channel=None, spare_quiet_ms=None)`: clone this
/// process (a zygote, one thread, after its prefork) into a forker that reads batches
/// from `channel` (one end of a socket pair the caller keeps open, and never closes
/// while the forker lives: the two share their descriptor table). `spare_channel`:
/// both ends of another such pair, the forker's and its spares'; `spare_quiet_ms`:
/// after a lone batch, how long the channel stays quiet before the forker forks a
/// spare for the next (`forker_spare.rs`); either None: no spares. Returns the
/// forker's pid; `RuntimeError` if this process has another thread, `OSError` if the
/// clone fails.
#[pyfunction]
#[pyo3(signature = (channel, spare_channel=None, spare_quiet_ms=None))]
pub fn start_forker(
    py: Python<'_>,
    channel: RawFd,
    spare_channel: Option<(RawFd, RawFd)>,
    spare_quiet_ms: Option<u64>,
) -> PyResult<i32> {
    one_thread("start_forker").map_err(PyRuntimeError::new_err)?;
    py.check_signals()?;
    // SAFETY: getpid takes nothing.
    let zygote = unsafe { libc::getpid() };
    // The copy shares this process's descriptor table (CLONE_FILES); this process has
    // one thread (checked above), so no lock is held in the copy.
    let pid = clone_with(libc::CLONE_FILES).map_err(|err| {
        PyOSError::new_err((
            err.raw_os_error().unwrap_or(0),
            format!("clone(CLONE_FILES) of the forker: {err}"),
        ))
    })?;
    if pid == 0 {
        let spares = Spares::new(
            spare_quiet_ms.map(std::time::Duration::from_millis),
            spare_channel.map(|(forker, spare)| SpareChannel { forker, spare }),
        );
        forker_main(channel, zygote, spares);
    }
    Ok(pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recipe(extra: &str) -> String {
        format!(
            r#"{{"children": [{{"plan": {{"set_up": [1, null, [], null, 10]}},
                "life": {{"run_dir": "/r", "vm_id": "vm0", "notify_path": null,
                          "start_gate": null, "start_gate_timeout": 60.0, "jailed": false,
                          "agent": ["/r/a.sock", null, 5.0, 30.0], "ready_timeout": 60.0,
                          "net_refresh": false{extra}}},
                "machine": {{"tiny": {{"code": "f4ebfd"}}}}, "handover": "json:dumps",
                "prelude": ["m:f", "[1]"]}}]}}"#
        )
    }

    #[test]
    fn a_batch_record_reads_into_each_childs_constructor_arguments() {
        let batch: Batch = serde_json::from_str(&recipe("")).expect("parses");
        let child = batch.children.into_iter().next().unwrap();
        let life = child.life.life().expect("a life");
        assert_eq!(life.agent.path.to_str().unwrap(), "/r/a.sock");
        assert!(matches!(child.machine, MachineRecipe::Tiny { ref code } if code == "f4ebfd"));
        assert_eq!(child.prelude, Some(("m:f".into(), "[1]".into())));
        // A field no constructor has is refused, not ignored.
        let typo = recipe(r#", "readytimeout": 1.0"#);
        let err = serde_json::from_str::<Batch>(&typo).err().expect("refused");
        assert!(err.to_string().contains("readytimeout"), "{err}");
        assert_eq!(hex_bytes("f4ebfd").unwrap(), vec![0xf4, 0xeb, 0xfd]);
        assert!(hex_bytes("f4e").is_err() && hex_bytes("zz").is_err());
    }
}
