//! A VMM child's set-up and jail, run natively between `fork()` and its entry.
//!
//! Every step here used to be Python (`zygote_child._setup`, `jail.enter`), and every
//! Python object those steps touched was a copy-on-write page the child made its own
//! (design notes, "Where an idle jailed child's ~5.5 MiB goes"). The zygote now builds
//! a `ChildPlan` per spawn, before the fork, from the `JailSpec` and the set-up
//! arguments (every path already a C string, every list already in the order the steps
//! want); the child makes two calls on it, `set_up` and `enter_jail`, and touches no
//! other Python object until its entry. A parent VMM (`runtime/parent.py`) builds a
//! plan without set-up and calls `enter_jail` on it: one implementation for both.
//!
//! **Set-up** (`set_up`, a zygote child only), in this order:
//!
//! 0. *The network namespace*: for a jailed child, the held empty one (the zygote's
//!    descriptor, `jail.hold_empty_netns`) or the sandbox's (`/run/netns/<name>`,
//!    looked up from the host's root the zygote keeps, `jail.host_root`); for an
//!    unjailed one, its sandbox's if it has one (`/run/netns/<name>`, looked up the
//!    same way, where its VMM attaches to the tap). First, since step 6 closes both descriptors, and before any
//!    thread: threads started later inherit it.
//! 1. *Die with the zygote*: `PR_SET_PDEATHSIG` SIGKILL, then the check that closes the
//!    race with a zygote that died before the prctl: `getppid()` still the zygote, or,
//!    for the first process of a PID namespace (where `getppid()` is 0), the zygote's
//!    inherited pidfd not readable yet. A zygote already gone: exit 71 in silence.
//! 2. *Own session* (`setsid`): one `killpg` reaches the child and what it started.
//! 3. *Signals.* SIGTERM's default action, except for the first process of a PID
//!    namespace, which the kernel spares signals it has no handler for: there a native
//!    handler exits 128 + 15 until the entry installs its own. SIGINT: the default
//!    action too (a VMM has no terminal; terminate is right, and a namespace's first
//!    process ignores it, as before). These replace the C-level handlers the zygote's
//!    Python installed; Python's own table keeps naming the zygote's handlers until
//!    the entry calls `signal.signal` (it never runs them: no C handler trips them).
//!    The zygote's wakeup fd is switched off in Python before this call
//!    (`signal.set_wakeup_fd(-1)`: Python's state, not the kernel's). Then the mask is
//!    emptied: signals sent since the fork are delivered here, to these dispositions.
//! 4. *OOM order*: `oom_score_adj` 1000, the first process the OOM killer takes.
//!    *CPU order*: the plan's nice value (`zygote_child.VMM_NICE`), which every thread
//!    the VMM starts later inherits: when guests keep the CPUs busy, the control plane
//!    (the daemon, the zygote, a spawner waiting for its batch) still runs.
//! 5. *Cgroup*: the child's pid into each of its groups' `cgroup.procs`, before it
//!    allocates anything of its own (v1 charges do not follow a process that moves).
//! 6. *Fds*: stdin `/dev/null`, stdout and stderr the log (append, created 0644), then
//!    `close_range(3, ~0)`: the zygote's sockets, pidfds, epoll and the host's root.
//!
//! **The jail** (`enter_jail`), the order and reasons of `runtime/jail.py`'s docstring:
//! the files, devices and tap opened while the process may (their descriptors handed
//! back to Python's registries); the network namespace joined if set-up did not; the
//! host's root let go of; `unshare`; a tmpfs root with the binds, the shared tree and
//! `/proc`; `pivot_root`; capabilities, groups, ids, `NO_NEW_PRIVS`, not dumpable;
//! the limits. A failed step raises the `error` type the plan was built with
//! (`jail.JailError(step, errno)`); a zygote child then exits 71 with its message.
//!
//! Every syscall here runs before the VMM installs its seccomp filter (its entry does,
//! once the machine is set up), so none needs to be on `runtime/seccomp.py`'s list.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyType;

/// `EXIT_SETUP_FAILED` of `runtime/zygote_protocol.py`.
const EXIT_SETUP_FAILED: i32 = 71;
const OOM_SCORE_ADJ: &[u8] = b"1000";
/// Where a jail sees its zygote's `SharedTree` (`jail.SHARED_AT`).
const SHARED_AT: &str = "/.vmfork-shared";
const TUNSETIFF: libc::c_ulong = 0x4004_54CA;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54D8;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
/// `struct virtio_net_hdr_mrg_rxbuf`, what VERSION_1 always uses (`net.VNET_HDR_SIZE`).
const VNET_HDR_SIZE: libc::c_int = 12;

/// Set once this process joined the network namespace its plan names (set-up does it,
/// before it closes the descriptors the join needs), so the jail does not join again.
/// A process-wide fact, like the namespace itself.
static NET_JOINED: AtomicBool = AtomicBool::new(false);

/// A step that failed: its name (the words of the Python steps it replaced) and errno.
#[derive(Debug)]
pub struct Failure {
    pub step: String,
    pub errno: i32,
}

type Step<T> = Result<T, Failure>;

fn last_errno() -> i32 {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn fail<T>(step: impl Into<String>) -> Step<T> {
    Err(Failure {
        step: step.into(),
        errno: last_errno(),
    })
}

fn check(rc: libc::c_long, step: impl FnOnce() -> String) -> Step<()> {
    if rc < 0 {
        fail(step())
    } else {
        Ok(())
    }
}

fn cstring(s: &str) -> Step<CString> {
    CString::new(s).map_err(|_| Failure {
        step: format!("path {s:?} holds a NUL byte"),
        errno: libc::EINVAL,
    })
}

pub(crate) fn strerror(errno: i32) -> String {
    io::Error::from_raw_os_error(errno)
        .to_string()
        .split(" (os error")
        .next()
        .unwrap_or_default()
        .to_string()
}

fn open(path: &CStr, flags: libc::c_int, mode: libc::mode_t) -> Result<RawFd, i32> {
    // SAFETY: `path` is a NUL-terminated string that outlives the call.
    let fd = unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC, mode) };
    if fd < 0 {
        Err(last_errno())
    } else {
        Ok(fd)
    }
}

fn close(fd: RawFd) {
    // SAFETY: closing a descriptor this process owns (or one that is already closed:
    // EBADF, harmless); nothing else holds it as an owned Rust handle.
    unsafe { libc::close(fd) };
}

/// `(st_dev, st_ino, st_mode)` of `fd`, or None if it is not open.
fn fstat(fd: RawFd) -> Option<(u64, u64, u32)> {
    // SAFETY: an all-zero `stat` is a valid buffer for fstat to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable stat buffer for the duration of the call.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return None;
    }
    Some((st.st_dev, st.st_ino, st.st_mode))
}

/// Whether `path` is a directory; None if it cannot be looked up (missing).
fn is_dir(path: &CStr) -> Option<bool> {
    // SAFETY: an all-zero `stat` is a valid buffer for stat to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and `st` a valid, writable stat buffer.
    if unsafe { libc::stat(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.st_mode & libc::S_IFMT == libc::S_IFDIR)
}

/// Close `fd` if it still is the host's root (`dev`, `ino`, a directory): a jail must
/// not hold it, since `openat` from it walks the host's tree past any `pivot_root`. A
/// zygote child closed it already with every inherited descriptor, and its number may
/// be another file's by now: only a descriptor that still is the host's root is closed.
pub fn let_go_of_host_root(fd: RawFd, dev: u64, ino: u64) {
    if let Some((d, i, mode)) = fstat(fd) {
        if d == dev && i == ino && mode & libc::S_IFMT == libc::S_IFDIR {
            close(fd);
        }
    }
}

/// Attach to tap `name` in this thread's network namespace (non-blocking,
/// close-on-exec, vnet header on): the one implementation, for a jail before its drop,
/// an unjailed native child's machine (`machine_plan.rs`) and `net.open_tap`. `name` is checked by the caller (a Linux interface name).
pub fn open_tap(name: &str) -> Step<RawFd> {
    let fd =
        open(c"/dev/net/tun", libc::O_RDWR | libc::O_NONBLOCK, 0).map_err(|errno| Failure {
            step: "open /dev/net/tun".into(),
            errno,
        })?;
    // SAFETY: an all-zero ifreq is a valid "no name, no flags" request.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (slot, byte) in ifr
        .ifr_name
        .iter_mut()
        .zip(name.bytes().take(libc::IFNAMSIZ - 1))
    {
        *slot = byte as libc::c_char;
    }
    ifr.ifr_ifru.ifru_flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;
    let hdr: libc::c_int = VNET_HDR_SIZE;
    // SAFETY: `fd` is the tun device opened above; TUNSETIFF reads one ifreq and
    // TUNSETVNETHDRSZ one int, both valid for the duration of each call.
    let ok = unsafe {
        libc::ioctl(fd, TUNSETIFF as _, &ifr) == 0
            && libc::ioctl(fd, TUNSETVNETHDRSZ as _, &hdr) == 0
    };
    if !ok {
        let errno = last_errno();
        close(fd);
        return Err(Failure {
            step: "TUNSETIFF/TUNSETVNETHDRSZ".into(),
            errno,
        });
    }
    Ok(fd)
}

/// Which network namespace the process ends in.
enum Net {
    /// One of its own, unshared with the jail's other namespaces (no held one: a parent
    /// VMM; an unjailed child without a sandbox namespace stays in the zygote's).
    Own,
    /// The zygote's held empty namespace (an inherited descriptor).
    Held(RawFd),
    /// The sandbox's `/run/netns/<name>`, looked up from the host's root if given.
    Sandbox {
        name: String,
        relative: CString,
        absolute: CString,
        host_root: Option<RawFd>,
    },
}

impl Net {
    fn join(&self) -> Step<()> {
        let (fd, step) = match self {
            Net::Own => return Ok(()),
            Net::Held(fd) => (*fd, "join the empty network namespace".to_string()),
            Net::Sandbox {
                name,
                relative,
                absolute,
                host_root,
            } => {
                let step = format!("join network namespace {name}");
                let fd = match host_root {
                    // SAFETY: `root` is the host root's O_PATH descriptor and `relative`
                    // a NUL-terminated path below it.
                    Some(root) => unsafe {
                        libc::openat(*root, relative.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC)
                    },
                    None => open(absolute, libc::O_RDONLY, 0).unwrap_or(-1),
                };
                if fd < 0 {
                    return fail(step);
                }
                (fd, step)
            }
        };
        // SAFETY: `fd` refers to a network namespace file (or the kernel says EINVAL).
        let rc = unsafe { libc::setns(fd, libc::CLONE_NEWNET) };
        let errno = last_errno();
        // The held descriptor is not needed again either: close it in both cases.
        close(fd);
        if rc != 0 {
            return Err(Failure { step, errno });
        }
        NET_JOINED.store(true, Ordering::SeqCst);
        Ok(())
    }
}

/// The set-up half of a plan (a zygote child's).
struct SetUp {
    zygote_pid: libc::pid_t,
    /// The zygote's pidfd, for the first process of a PID namespace.
    zygote_pidfd: Option<RawFd>,
    cgroup_procs: Vec<CString>,
    log_path: Option<CString>,
    /// The nice value (0-19; checked by the caller) the VMM runs at.
    nice: i32,
    /// Descriptors the close of every inherited one keeps: the jail base's, which the
    /// jail joins after the set-up.
    keep: Vec<RawFd>,
}

/// Another process's SIGTERM to the first process of a PID namespace: exit as the
/// default action would (the kernel ignores default-action signals sent to it).
extern "C" fn exit_on_sigterm(_signum: libc::c_int) {
    // SAFETY: _exit is async-signal-safe and ends the process at once.
    unsafe { libc::_exit(128 + libc::SIGTERM) };
}

fn set_disposition(sig: libc::c_int, handler: libc::sighandler_t) -> Step<()> {
    // SAFETY: an all-zero sigaction with an empty mask and no flags is valid.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = handler;
    // SAFETY: `act` is a valid sigaction; the old one is not asked for.
    let rc = unsafe { libc::sigaction(sig, &act, std::ptr::null_mut()) };
    check(rc as libc::c_long, || format!("sigaction({sig})"))
}

fn write_file(path: &CStr, value: &[u8]) -> Result<(), i32> {
    let fd = open(path, libc::O_WRONLY, 0)?;
    // SAFETY: `value` is a valid buffer of its length for the duration of the call.
    let n = unsafe { libc::write(fd, value.as_ptr().cast(), value.len()) };
    let errno = last_errno();
    close(fd);
    if n < 0 {
        Err(errno)
    } else {
        Ok(())
    }
}

impl SetUp {
    /// Steps 1-6 of the module comment. `Ok(false)`: the zygote died before the prctl.
    fn run(&self) -> Result<bool, String> {
        let text = |step: &str, errno: i32| format!("{step}: {}", strerror(errno));
        // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and unused zeros.
        if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) } != 0 {
            return Err(text("prctl(PR_SET_PDEATHSIG) failed", last_errno()));
        }
        let alive = match self.zygote_pidfd {
            Some(pidfd) => {
                let mut poll = libc::pollfd {
                    fd: pidfd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, no timeout.
                let ready = unsafe { libc::poll(&mut poll, 1, 0) };
                ready == 0
            }
            // SAFETY: getppid cannot fail.
            None => (unsafe { libc::getppid() }) == self.zygote_pid,
        };
        if !alive {
            return Ok(false);
        }
        // SAFETY: setsid has no arguments; a failure is reported.
        if unsafe { libc::setsid() } < 0 {
            return Err(text("setsid", last_errno()));
        }
        let sigterm = if self.zygote_pidfd.is_some() {
            exit_on_sigterm as extern "C" fn(libc::c_int) as libc::sighandler_t
        } else {
            libc::SIG_DFL
        };
        set_disposition(libc::SIGTERM, sigterm)
            .and_then(|()| set_disposition(libc::SIGINT, libc::SIG_DFL))
            .map_err(|f| text(&f.step, f.errno))?;
        // SAFETY: an empty set, built by sigemptyset, replaces the mask.
        let rc = unsafe {
            let mut empty: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut empty);
            libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(text("sigprocmask", last_errno()));
        }
        write_file(c"/proc/self/oom_score_adj", OOM_SCORE_ADJ)
            .map_err(|errno| text("cannot set oom_score_adj", errno))?;
        // Linux keeps a nice value per thread; this process has one thread yet, and
        // the threads it starts inherit it. Lowering one's own priority needs no
        // privilege.
        // SAFETY: setpriority takes a selector, an id (0: this thread) and the value.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, self.nice) } != 0 {
            return Err(text(&format!("setpriority({})", self.nice), last_errno()));
        }
        if !self.cgroup_procs.is_empty() {
            // SAFETY: getpid cannot fail.
            let pid = unsafe { libc::getpid() }.to_string();
            for procs in &self.cgroup_procs {
                write_file(procs, pid.as_bytes()).map_err(|errno| {
                    format!(
                        "cgroup join: writing '{pid}' to {} failed: {}",
                        procs.to_string_lossy(),
                        strerror(errno)
                    )
                })?;
            }
        }
        let null = open(c"/dev/null", libc::O_RDONLY, 0).map_err(|e| text("open /dev/null", e))?;
        dup_onto(null, &[0]).map_err(|e| text("dup2 /dev/null", e))?;
        if let Some(log_path) = &self.log_path {
            let log = open(
                log_path,
                libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND,
                0o644,
            )
            .map_err(|e| {
                text(
                    &format!("cannot open log_path {}", log_path.to_string_lossy()),
                    e,
                )
            })?;
            dup_onto(log, &[1, 2]).map_err(|e| text("dup2 the log", e))?;
        }
        close_all_but(&self.keep);
        Ok(true)
    }
}

/// Close every descriptor from 3 up but those of `keep`.
pub(crate) fn close_all_but(keep: &[RawFd]) {
    let mut first = 3u32;
    let mut keep: Vec<u32> = keep
        .iter()
        .filter(|&&fd| fd >= 3)
        .map(|&fd| fd as u32)
        .collect();
    keep.sort_unstable();
    for fd in keep {
        if fd > first {
            close_range(first, fd - 1);
        }
        first = first.max(fd + 1);
    }
    close_from(first);
}

/// Duplicate `fd` onto each of `targets` (inheritable, as stdio is), then close it.
fn dup_onto(fd: RawFd, targets: &[RawFd]) -> Result<(), i32> {
    for &target in targets {
        // SAFETY: both are descriptor numbers; dup2 replaces `target` atomically.
        if unsafe { libc::dup2(fd, target) } < 0 {
            return Err(last_errno());
        }
    }
    if !targets.contains(&fd) {
        close(fd);
    }
    Ok(())
}

/// Close every descriptor from `first` up (`close_range`).
fn close_from(first: u32) {
    close_range(first, u32::MAX);
}

/// Close every descriptor from `first` to `last`: close_range(2), or one by one up
/// to 2^20 (the bound `os.closerange` used) on a kernel without it.
fn close_range(first: u32, last: u32) {
    if first > last {
        return;
    }
    // SAFETY: close_range takes two descriptor numbers and flags; it only closes.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, first, last, 0u32) };
    if rc != 0 {
        for fd in first..=last.min(1 << 20) {
            close(fd as RawFd);
        }
    }
}

/// The jail half of a plan: `JailSpec`, with the paths as the steps use them.
struct Jail {
    uid: libc::uid_t,
    gid: libc::gid_t,
    devices: Vec<String>,
    limits: [(libc::__rlimit_resource_t, u64, &'static str); 4],
    hostname: String,
    preopen: Vec<CString>,
    preopen_rw: Vec<CString>,
    tap: Option<String>,
    host_root: Option<(RawFd, u64, u64)>,
    last_cap: u32,
    /// The new root: `JailSpec`'s read-only paths (sorted by length, parents before
    /// children, duplicates removed), writable paths and shared tree, laid out; or
    /// the batch's jail base that holds all of it but the run directory.
    root: Root,
}

/// The descriptors a jail opened before its drop, for Python's registries: `-1` where
/// a path was missing (the VMM reports it when it needs it).
pub(crate) type Opened = (
    Vec<RawFd>,
    Vec<RawFd>,
    (RawFd, RawFd),
    Vec<RawFd>,
    Option<RawFd>,
);

fn mount(
    source: Option<&CStr>,
    target: &CStr,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
    step: impl FnOnce() -> String,
) -> Step<()> {
    let ptr = |s: Option<&CStr>| s.map_or(std::ptr::null(), CStr::as_ptr);
    // SAFETY: every pointer is NUL-terminated or null and outlives the call.
    let rc = unsafe {
        libc::mount(
            ptr(source),
            target.as_ptr(),
            ptr(fstype),
            flags,
            ptr(data).cast(),
        )
    };
    check(rc as libc::c_long, step)
}

/// Bind `host` at `inside`, then remount the bind with its flags (a bind mount ignores
/// them on the first call). Not MS_REC: mounts below `host` (the jail's own root when it
/// sits in the run directory, anything a host mounted there) stay out of the jail.
fn bind_at(host: &CStr, inside: &CStr, read_only: bool) -> Step<()> {
    let name = || host.to_string_lossy();
    mount(Some(host), inside, None, libc::MS_BIND, None, || {
        format!("bind {}", name())
    })?;
    let flags = libc::MS_REMOUNT
        | libc::MS_BIND
        | libc::MS_NOSUID
        | libc::MS_NODEV
        | if read_only { libc::MS_RDONLY } else { 0 };
    mount(None, inside, None, flags, None, || {
        format!("remount {}", name())
    })
}

/// `mkdir` of a directory that may exist already.
fn mkdir(dir: &CStr) -> Step<()> {
    // SAFETY: `dir` is NUL-terminated.
    if unsafe { libc::mkdir(dir.as_ptr(), 0o755) } != 0 && last_errno() != libc::EEXIST {
        return fail(format!("mkdir {}", dir.to_string_lossy()));
    }
    Ok(())
}

/// `path` is `dir` or lies under it.
fn holds(dir: &str, path: &str) -> bool {
    path.strip_prefix(dir.trim_end_matches('/'))
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// Where a shared path shows in the jail: its shallowest ancestor (itself at the
/// deepest) under which the jail holds nothing but shared paths, so that one link there
/// shows the shared tree's copy of that whole directory, whose only entries are shared
/// paths and the directories above them (`SharedTree.build`). Each directory it saves
/// is a `mkdir` every child made on its fresh root. `others`: every path the jail
/// holds that is not seen through the shared tree.
fn link_point<'a>(shared: &'a str, others: &[&str]) -> &'a str {
    let mut cut = 0;
    while let Some(next) = shared[cut + 1..].find('/').map(|i| cut + 1 + i) {
        let at = &shared[..next];
        if !others.iter().any(|other| holds(at, other)) {
            return at;
        }
        cut = next;
    }
    shared
}

/// A mount point of the new root: a host path bound at the same path inside.
struct MountPoint {
    host: CString,
    inside: CString,
    /// The directories above `inside` (`RootPlan::dirs`), outermost first.
    parents: Vec<usize>,
    /// `inside` itself in `RootPlan::dirs`, made when the host path is a directory.
    own: usize,
    writable: bool,
    /// The earlier mount points whose directory holds this path (or is it): a bind
    /// there shows it already (and a mount point cannot be made inside it).
    under: Vec<usize>,
}

/// The zygote's shared tree in a jail: bound whole at `at` (inside the new root) from
/// `tree`, and shown through `links`.
struct SharedLinks {
    at: CString,
    tree: CString,
    links: Vec<Link>,
}

/// A symbolic link into the shared tree: made after the directories above it.
struct Link {
    /// The directories above the link (`RootPlan::dirs`), outermost first.
    parents: Vec<usize>,
    target: CString,
    link: CString,
}

/// The jail's new root worked out once per plan in the zygote (`ChildPlan::new`):
/// every path inside it a C string, each directory once with its ancestors by index,
/// so the child that fills its fresh tmpfs formats no path (each allocation there is
/// a page of the zygote's heap copied) and makes each directory once. Which host paths
/// exist, and which are directories, the child still asks.
struct RootPlan {
    root: CString,
    /// Every directory a step may make under the root, parents before children.
    dirs: Vec<CString>,
    shared: Option<SharedLinks>,
    /// The read-only paths (parents first), then the writable ones.
    mounts: Vec<MountPoint>,
    /// Empty directories (`RootPlan::dirs`, each after the directories above it) a
    /// jail base leaves for each child's own mount: the parent of a child's run
    /// directory (`Base`).
    mount_points: Vec<usize>,
    proc: CString,
    old_root: CString,
}

impl RootPlan {
    /// `mount_points`: empty directories to leave in the root (a jail base's, for the
    /// per-child mounts); nothing else of the root may be at, under or above one.
    fn new(
        root: &str,
        read_only: &[String],
        writable: &[String],
        shared: Option<&(CString, Vec<String>)>,
        mount_points: &[String],
    ) -> Step<Self> {
        let mut dirs: Vec<CString> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        // The directories from the root down to `path` (inside), each registered once.
        let mut chain = |path: &str, dirs: &mut Vec<CString>| -> Step<Vec<usize>> {
            let mut out = Vec::new();
            let mut cut = root.len();
            loop {
                let next = path[cut + 1..].find('/').map(|i| cut + 1 + i);
                let at = &path[..next.unwrap_or(path.len())];
                let i = match index.get(at) {
                    Some(&i) => i,
                    None => {
                        dirs.push(cstring(at)?);
                        index.insert(at.to_string(), dirs.len() - 1);
                        dirs.len() - 1
                    }
                };
                out.push(i);
                match next {
                    Some(next) => cut = next,
                    None => return Ok(out),
                }
            }
        };
        let shared_paths: &[String] = shared.map_or(&[], |(_, paths)| paths);
        let seen_through = |path: &str| shared_paths.iter().any(|parent| holds(parent, path));
        let others: Vec<&str> = read_only
            .iter()
            .map(String::as_str)
            .filter(|path| !seen_through(path))
            .chain(writable.iter().map(String::as_str))
            .chain(mount_points.iter().map(String::as_str))
            .chain(["/proc", "/.old-root", SHARED_AT])
            .collect();
        let shared = match shared {
            None => None,
            Some((tree, paths)) => {
                let mut links = Vec::new();
                let mut linked: Vec<&str> = Vec::new();
                for path in paths {
                    let at = link_point(path, &others);
                    if linked.iter().any(|l| holds(l, at)) {
                        continue;
                    }
                    linked.push(at);
                    let link = format!("{root}{at}");
                    let parents = match link.rfind('/') {
                        Some(cut) if cut > root.len() => chain(&link[..cut], &mut dirs)?,
                        _ => Vec::new(),
                    };
                    links.push(Link {
                        parents,
                        target: cstring(&format!("{SHARED_AT}{at}"))?,
                        link: cstring(&link)?,
                    });
                }
                Some(SharedLinks {
                    at: cstring(&format!("{root}{SHARED_AT}"))?,
                    tree: tree.clone(),
                    links,
                })
            }
        };
        let mut mounts: Vec<MountPoint> = Vec::new();
        let mut hosts: Vec<&str> = Vec::new();
        for (path, writable) in read_only
            .iter()
            .filter(|path| !seen_through(path))
            .map(|p| (p, false))
            .chain(writable.iter().map(|p| (p, true)))
        {
            let inside = format!("{root}{path}");
            let mut parents = chain(&inside, &mut dirs)?;
            let own = parents.pop().unwrap_or_default();
            let under = if writable {
                Vec::new()
            } else {
                hosts
                    .iter()
                    .enumerate()
                    .filter(|(_, parent)| holds(parent, path))
                    .map(|(i, _)| i)
                    .collect()
            };
            hosts.push(path);
            mounts.push(MountPoint {
                host: cstring(path)?,
                inside: cstring(&inside)?,
                parents,
                own,
                writable,
                under,
            });
        }
        let mut empty = Vec::new();
        for point in mount_points {
            // A per-child mount there would hide, or show through, the base's own: a
            // bind or link of the base at, below or above it is refused. A file or
            // directory right in it is no clash (a child's tmpfs covers it; the
            // spawner's FIFOs are each child's to bind, `Base::carried`, and
            // `jail.KeptBases` leaves them out of a base); anything deeper is.
            let in_point = |h: &str| run_dir_parent(h) == Some(point.trim_end_matches('/'));
            let clash = hosts
                .iter()
                .any(|h| holds(h, point) || (holds(point, h) && !in_point(h)))
                || shared.as_ref().is_some_and(|s| {
                    s.links.iter().any(|l| {
                        let at = &l.link.to_str().unwrap_or_default()[root.len()..];
                        holds(at, point) || holds(point, at)
                    })
                })
                || [SHARED_AT, "/proc", "/.old-root"]
                    .iter()
                    .any(|own| holds(own, point) || holds(point, own))
                || !point.starts_with('/')
                || point.trim_end_matches('/').is_empty();
            if clash {
                return Err(Failure {
                    step: format!(
                        "{point:?} cannot hold a child's own mount: the jail's root \
                         has something of its own at, under or above it"
                    ),
                    errno: libc::EINVAL,
                });
            }
            empty.extend(chain(&format!("{root}{point}"), &mut dirs)?);
        }
        Ok(RootPlan {
            root: cstring(root)?,
            dirs,
            shared,
            mounts,
            mount_points: empty,
            proc: cstring(&format!("{root}/proc"))?,
            old_root: cstring(&format!("{root}/.old-root"))?,
        })
    }

    /// The new root's directories, the shared tree and its links, and the binds, as
    /// this plan lists them (and its empty mount points); a host path that is missing is skipped (whoever needs
    /// it reports it, as outside a jail).
    fn fill(&self, uid: libc::uid_t, gid: libc::gid_t) -> Step<()> {
        let plan = self;
        let mut made = vec![false; plan.dirs.len()];
        let make = |dirs: &[usize], made: &mut Vec<bool>| -> Step<()> {
            for &i in dirs {
                if !made[i] {
                    mkdir(&plan.dirs[i])?;
                    made[i] = true;
                }
            }
            Ok(())
        };
        if let Some(shared) = &plan.shared {
            mkdir(&shared.at)?;
            mount(
                Some(&shared.tree),
                &shared.at,
                None,
                libc::MS_BIND | libc::MS_REC,
                None,
                || "bind the shared tree".into(),
            )?;
            for Link {
                parents,
                target,
                link,
            } in &shared.links
            {
                make(parents, &mut made)?;
                // SAFETY: both are NUL-terminated.
                if unsafe { libc::symlink(target.as_ptr(), link.as_ptr()) } != 0 {
                    return fail(format!("symlink {}", link.to_string_lossy()));
                }
            }
        }
        // Read-only first, parents before children, then the writable paths: a later
        // bind covers what an earlier one showed at the same place, never the reverse.
        let mut bound_dir = vec![false; plan.mounts.len()];
        for (i, point) in plan.mounts.iter().enumerate() {
            if point.under.iter().any(|&j| bound_dir[j]) {
                continue;
            }
            let dir = match is_dir(&point.host) {
                Some(dir) => dir,
                None if point.writable => false,
                None => continue,
            };
            make(&point.parents, &mut made)?;
            if dir {
                make(&[point.own], &mut made)?;
            } else {
                // SAFETY: `inside` is NUL-terminated; a regular file needs no device.
                if unsafe { libc::mknod(point.inside.as_ptr(), libc::S_IFREG | 0o600, 0) } != 0
                    && last_errno() != libc::EEXIST
                {
                    return fail(format!("mknod {}", point.inside.to_string_lossy()));
                }
            }
            bind_at(&point.host, &point.inside, !point.writable)?;
            if point.writable {
                // SAFETY: `host` is NUL-terminated.
                if unsafe { libc::chown(point.host.as_ptr(), uid, gid) } != 0 {
                    return fail(format!("chown {}", point.host.to_string_lossy()));
                }
            }
            bound_dir[i] = dir;
        }
        make(&plan.mount_points, &mut made)
    }
}

/// Make `plan`'s root and pivot into it, in a mount namespace of the caller's own
/// (unshared already): every mount private first, so nothing propagates back; a tmpfs
/// root filled (`RootPlan::fill`); `/proc` mounted there when `proc` (a jail base
/// leaves it an empty directory: a proc shows the PID namespace of whoever mounts it,
/// so each child mounts its own); `pivot_root`, the old root detached, the new root
/// read-only. `mark`: `Jail::enter`'s.
fn make_root(
    plan: &RootPlan,
    uid: libc::uid_t,
    gid: libc::gid_t,
    proc: bool,
    mark: &dyn Fn(&'static str),
) -> Step<()> {
    mount(
        None,
        c"/",
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
        || "make / private".into(),
    )?;
    // nodev: the jail holds no device node, its devices are descriptors (above).
    mount(
        Some(c"tmpfs"),
        &plan.root,
        Some(c"tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some(c"size=1m,mode=0755"),
        || "tmpfs root".into(),
    )?;
    mark("jail_tmpfs");
    plan.fill(uid, gid)?;
    mark("jail_binds");
    mkdir(&plan.proc)?;
    if proc {
        mount_proc(&plan.proc)?;
    }
    mark("jail_proc");
    mkdir(&plan.old_root)?;
    // SAFETY: both paths are NUL-terminated; pivot_root only reads them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pivot_root,
            plan.root.as_ptr(),
            plan.old_root.as_ptr(),
        )
    };
    check(rc, || "pivot_root".into())?;
    // SAFETY: a static NUL-terminated path.
    check(
        unsafe { libc::chdir(c"/".as_ptr()) } as libc::c_long,
        || "chdir /".into(),
    )?;
    mark("jail_pivoted");
    // SAFETY: a static NUL-terminated path.
    let rc = unsafe { libc::umount2(c"/.old-root".as_ptr(), libc::MNT_DETACH) };
    check(rc as libc::c_long, || "detach the old root".into())?;
    // SAFETY: a static NUL-terminated path.
    check(
        unsafe { libc::rmdir(c"/.old-root".as_ptr()) } as libc::c_long,
        || "remove the old root's mount point".into(),
    )?;
    mark("jail_old_root_detached");
    mount(
        None,
        c"/",
        None,
        libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
        None,
        || "remount / read-only".into(),
    )
}

/// A `/proc` of the caller's PID namespace at `at`; hidepid=invisible matters for a
/// jail without a PID namespace of its own.
fn mount_proc(at: &CStr) -> Step<()> {
    mount(
        Some(c"proc"),
        at,
        Some(c"proc"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        Some(c"hidepid=invisible"),
        || "mount /proc".into(),
    )
}

const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x04;

/// A detached clone of the mount at `path` (`open_tree(OPEN_TREE_CLONE)`), -1 with
/// errno set if it cannot be made. Not AT_RECURSIVE: mounts below `path` stay out, as
/// a bind's do.
fn clone_mount(path: &CStr) -> RawFd {
    // SAFETY: open_tree takes a directory fd, a NUL-terminated path and flags.
    (unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            path.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
        )
    }) as RawFd
}

/// A jail base's mount namespace (`jail_base`), which a child joins instead of copying
/// its zygote's whole mount tree into a root of its own: what every child of a batch
/// would lay out alike (the tmpfs root, the shared tree and its links, the read-only
/// binds, an empty `/proc`, the run directories' parent) is laid out, pivoted into and
/// detached from once. The child (`Jail::join_base`) clones its own run directory's
/// mount and the spawn's files beside it while it still sees the host's tree
/// (`open_tree`), `setns`es into the base, `unshare`s a copy of that small tree (every
/// mount in it private: nothing it mounts reaches the base or a sibling), mounts a
/// tmpfs of its own over the run directories' parent (a sibling's directory, its name
/// included, is not in it), moves its clones there and mounts a `/proc` of its own PID
/// namespace. Nothing of one spawn's is in the base, so the zygote keeps a base for
/// the next batches of the same jail (`jail.KeptBases`).
struct Base {
    /// The base namespace's descriptor and its root's, inherited from the zygote
    /// (kept by the set-up's close of every other descriptor; closed once joined).
    fd: RawFd,
    root: RawFd,
    /// The run directory (host and jail path alike), the base's empty directory the
    /// child mounts its tmpfs on (the run directories' parent, or a directory above it
    /// that holds every spawn's: `jail.runs_in`), and the directories from there down
    /// to the run directory's parent, made on that tmpfs.
    run_dir: CString,
    mount_point: CString,
    between: Vec<CString>,
    /// The read-only paths right in the run directory's parent (the spawner's FIFOs
    /// beside the run directories, new for every batch): not in the base; each child
    /// clones them from the host's tree, as its run directory, onto its own tmpfs,
    /// read-only.
    carried: Vec<CString>,
}

/// Where a jail's root comes from.
enum Root {
    /// Laid out, pivoted into and detached from by the child itself.
    Own(RootPlan),
    /// A jail base's namespace, joined.
    Base(Base),
}

/// The jail base of `plan` (its mount points: the run directories' parents): a mount
/// namespace built on a thread of its own, since `unshare(CLONE_NEWNS)` and
/// `pivot_root` there change only that thread's view (`CLONE_FS` is unshared with it),
/// held by the descriptor returned and by nothing else: it goes away, mounts and all,
/// once that descriptor is closed and the last child that joined it has moved on to
/// its own copy. The caller waits until the thread is gone (a fork checks that the
/// process has one thread).
fn build_base(plan: RootPlan) -> Step<(RawFd, RawFd)> {
    let built = std::thread::spawn(move || -> Step<(RawFd, RawFd)> {
        // SAFETY: unshare takes flags only; with CLONE_NEWNS it also gives this thread
        // a filesystem context of its own, so the process's other threads keep theirs.
        check(
            unsafe { libc::unshare(libc::CLONE_NEWNS) } as libc::c_long,
            || "unshare the jail base's mount namespace".into(),
        )?;
        let ns = open(c"/proc/thread-self/ns/mnt", libc::O_RDONLY, 0).map_err(|errno| Failure {
            step: "open the jail base's mount namespace".into(),
            errno,
        })?;
        // The base's root as a descriptor too: `setns` puts a joiner at the root of
        // the namespace's first mount, which is the base's root only where the
        // zygote's root was that mount's top (not under a chroot of a bind mount, as
        // in an initramfs that bound its new root onto itself): the joiner goes there.
        let root = make_root(&plan, 0, 0, false, &|_| {}).and_then(|()| {
            open(c"/", libc::O_PATH | libc::O_DIRECTORY, 0).map_err(|errno| Failure {
                step: "open the jail base's root".into(),
                errno,
            })
        });
        match root {
            Ok(root) => Ok((ns, root)),
            Err(failure) => {
                close(ns);
                Err(failure)
            }
        }
    })
    .join()
    .unwrap_or_else(|_| {
        Err(Failure {
            step: "the jail base's thread panicked".into(),
            errno: libc::EIO,
        })
    });
    // A joined thread may still count in the process's threads for a moment (it is
    // released after it wakes the joiner): wait, bounded, until it no longer does.
    for _ in 0..10_000 {
        if thread_count() == Some(1) {
            break;
        }
        std::thread::yield_now();
    }
    built
}

impl Jail {
    fn open_files(&self) -> Step<Opened> {
        // Missing (or a directory, for read-write) is skipped: the VMM reports it.
        let optional = |path: &CString, flags| match open(path, flags, 0) {
            Ok(fd) => Ok(fd),
            Err(libc::ENOENT | libc::EISDIR) => Ok(-1),
            Err(errno) => Err(Failure {
                step: format!("open {}", path.to_string_lossy()),
                errno,
            }),
        };
        let ro = self
            .preopen
            .iter()
            .map(|p| optional(p, libc::O_RDONLY))
            .collect::<Step<Vec<_>>>()?;
        let rw = self
            .preopen_rw
            .iter()
            .map(|p| optional(p, libc::O_RDWR))
            .collect::<Step<Vec<_>>>()?;
        // A process whose uid changed is not dumpable, so its own /proc/self files
        // become root's: BRANCH's dirty-page tracking opens them now.
        let proc_self = |path: &CStr, flags| {
            open(path, flags, 0).map_err(|errno| Failure {
                step: format!("open {}", path.to_string_lossy()),
                errno,
            })
        };
        let pagemap = proc_self(c"/proc/self/pagemap", libc::O_RDONLY)?;
        let clear_refs = proc_self(c"/proc/self/clear_refs", libc::O_WRONLY)?;
        let mut devices = Vec::with_capacity(self.devices.len());
        for device in &self.devices {
            let step = || format!("open device {device}");
            let fd = open(&cstring(device)?, libc::O_RDWR, 0).map_err(|errno| Failure {
                step: step(),
                errno,
            })?;
            if !matches!(fstat(fd), Some((_, _, mode)) if mode & libc::S_IFMT == libc::S_IFCHR) {
                close(fd);
                return Err(Failure {
                    step: step(),
                    errno: libc::ENODEV,
                });
            }
            devices.push(fd);
        }
        Ok((ro, rw, (pagemap, clear_refs), devices, None))
    }

    /// The jail's steps (module comment); returns the descriptors opened before the drop.
    /// `mark` is told the end of each group of steps (`jail_*`: a native child's phase
    /// record, `spawn_profile.rs`, where the jail's wall time is the largest of its
    /// set-up's; a no-op elsewhere).
    fn enter(&self, net: &Net, mark: &dyn Fn(&'static str)) -> Step<Opened> {
        if self.uid == 0 || self.gid == 0 {
            return Err(Failure {
                step: format!(
                    "uid {}/gid {}: a jail never runs as root",
                    self.uid, self.gid
                ),
                errno: libc::EINVAL,
            });
        }
        let mut opened = self.open_files()?;
        // setns needs CAP_SYS_ADMIN and TUNSETIFF on a tap the jail's uid does not own
        // needs CAP_NET_ADMIN: both happen here, as root, and only the tap's descriptor
        // crosses into the jail.
        if !NET_JOINED.load(Ordering::SeqCst) {
            net.join()?;
        }
        if let (Net::Sandbox { name, .. }, Some(tap)) = (net, &self.tap) {
            opened.4 = Some(open_tap(tap).map_err(|f| Failure {
                step: format!("tap {tap} in {name}: {}", f.step),
                errno: f.errno,
            })?);
        }
        if let Some((fd, dev, ino)) = self.host_root {
            let_go_of_host_root(fd, dev, ino);
        }
        mark("jail_opened");
        let mut flags = libc::CLONE_NEWNS | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS;
        if matches!(net, Net::Own) {
            flags |= libc::CLONE_NEWNET; // no held namespace to join: one of its own
        }
        match &self.root {
            Root::Own(plan) => {
                // SAFETY: unshare takes flags only.
                check(unsafe { libc::unshare(flags) } as libc::c_long, || {
                    "unshare".into()
                })?;
                mark("jail_unshared");
                make_root(plan, self.uid, self.gid, true, mark)?;
            }
            Root::Base(base) => self.join_base(base, flags, mark)?,
        }
        let name = self.hostname.as_bytes();
        // SAFETY: `name` is valid for its length.
        let rc = unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) };
        check(rc as libc::c_long, || "sethostname".into())?;
        self.drop_identity()?;
        for (resource, value, what) in self.limits {
            let limit = libc::rlimit {
                rlim_cur: value,
                rlim_max: value,
            };
            // SAFETY: `limit` is a valid rlimit for the duration of the call.
            let rc = unsafe { libc::setrlimit(resource, &limit) };
            check(rc as libc::c_long, || format!("setrlimit {what}"))?;
        }
        Ok(opened)
    }

    /// Join `base` (`Base`'s steps): the run directory's clone attached at its own path
    /// on a tmpfs of the child's own over its parent, `/proc` of its PID namespace.
    fn join_base(&self, base: &Base, flags: libc::c_int, mark: &dyn Fn(&'static str)) -> Step<()> {
        let Base {
            fd,
            root,
            run_dir,
            mount_point,
            between,
            carried,
        } = base;
        // SAFETY: `run_dir` is NUL-terminated.
        if unsafe { libc::chown(run_dir.as_ptr(), self.uid, self.gid) } != 0 {
            return fail(format!("chown {}", run_dir.to_string_lossy()));
        }
        let tree = clone_mount(run_dir);
        if tree < 0 {
            return fail(format!("clone the mount of {}", run_dir.to_string_lossy()));
        }
        // The spawn's files beside the run directory, cloned from the host's tree too;
        // one missing on the host is skipped (whoever needs it reports it).
        let mut clones = Vec::new();
        for path in carried {
            let fd = clone_mount(path);
            if fd >= 0 {
                clones.push((fd, path));
            } else if last_errno() != libc::ENOENT {
                let failure = fail(format!("clone the mount of {}", path.to_string_lossy()));
                close(tree);
                clones.iter().for_each(|&(fd, _)| close(fd));
                return failure;
            }
        }
        let joined = self.attach_in_base(
            (*fd, *root),
            tree,
            (run_dir, mount_point, between),
            &clones,
            flags,
            mark,
        );
        close(tree);
        clones.iter().for_each(|&(fd, _)| close(fd));
        joined
    }

    fn attach_in_base(
        &self,
        (base, root): (RawFd, RawFd),
        tree: RawFd,
        places: (&CStr, &CStr, &[CString]),
        carried: &[(RawFd, &CString)],
        flags: libc::c_int,
        mark: &dyn Fn(&'static str),
    ) -> Step<()> {
        // SAFETY: `base` is the inherited mount namespace descriptor (or the kernel
        // says EINVAL); setns takes it and a namespace type.
        let rc = unsafe { libc::setns(base, libc::CLONE_NEWNS) };
        let errno = last_errno();
        close(base);
        // SAFETY: `root` is the base root's O_PATH descriptor; fchdir and chroot take a
        // descriptor and a static NUL-terminated path.
        let rooted = rc == 0
            && unsafe { libc::fchdir(root) } == 0
            && unsafe { libc::chroot(c".".as_ptr()) } == 0
            && unsafe { libc::chdir(c"/".as_ptr()) } == 0;
        let errno = if rc != 0 { errno } else { last_errno() };
        close(root);
        if !rooted {
            return Err(Failure {
                step: "join the jail base".into(),
                errno,
            });
        }
        // SAFETY: unshare takes flags only.
        check(unsafe { libc::unshare(flags) } as libc::c_long, || {
            "unshare".into()
        })?;
        mark("jail_unshared");
        self.attach_own(tree, places, carried, mark)
    }

    /// The tmpfs of the child's own at `mount_point`, the directories down to its run
    /// directory's parent, its run directory and the carried mounts moved there, then
    /// `/proc`.
    fn attach_own(
        &self,
        tree: RawFd,
        (run_dir, mount_point, between): (&CStr, &CStr, &[CString]),
        carried: &[(RawFd, &CString)],
        mark: &dyn Fn(&'static str),
    ) -> Step<()> {
        mount(
            Some(c"tmpfs"),
            mount_point,
            Some(c"tmpfs"),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            Some(c"size=16k,mode=0755"),
            || format!("tmpfs at {}", mount_point.to_string_lossy()),
        )?;
        mark("jail_tmpfs");
        for dir in between {
            mkdir(dir)?;
        }
        mkdir(run_dir)?;
        // SAFETY: `tree` is open_tree's detached mount, `run_dir` NUL-terminated; an
        // empty source path names `tree` itself.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_move_mount,
                tree,
                c"".as_ptr(),
                libc::AT_FDCWD,
                run_dir.as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH,
            )
        };
        check(rc, || format!("bind {}", run_dir.to_string_lossy()))?;
        let bind_flags = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_NOSUID | libc::MS_NODEV;
        for &(fd, path) in carried {
            let dir =
                matches!(fstat(fd), Some((_, _, mode)) if mode & libc::S_IFMT == libc::S_IFDIR);
            if dir {
                mkdir(path)?;
            // SAFETY: `path` is NUL-terminated; a regular file needs no device.
            } else if unsafe { libc::mknod(path.as_ptr(), libc::S_IFREG | 0o600, 0) } != 0 {
                return fail(format!("mknod {}", path.to_string_lossy()));
            }
            // SAFETY: `fd` is open_tree's detached mount, `path` NUL-terminated.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_move_mount,
                    fd,
                    c"".as_ptr(),
                    libc::AT_FDCWD,
                    path.as_ptr(),
                    MOVE_MOUNT_F_EMPTY_PATH,
                )
            };
            check(rc, || format!("bind {}", path.to_string_lossy()))?;
            // A clone of the host's mount keeps the host's flags: read-only here, as the
            // root's binds are.
            mount(None, path, None, bind_flags | libc::MS_RDONLY, None, || {
                format!("remount {} read-only", path.to_string_lossy())
            })?;
        }
        mount(None, run_dir, None, bind_flags, None, || {
            format!("remount {}", run_dir.to_string_lossy())
        })?;
        mount(
            None,
            mount_point,
            None,
            bind_flags | libc::MS_RDONLY | libc::MS_NOEXEC,
            None,
            || format!("remount {} read-only", mount_point.to_string_lossy()),
        )?;
        mark("jail_binds");
        mount_proc(c"/proc")?;
        mark("jail_proc");
        Ok(())
    }

    /// Capability bounding set and ambient set emptied, no supplementary groups, then
    /// the jail's ids (the kernel clears every capability at that change); no new
    /// privileges, not dumpable (no ptrace or /proc/<pid>/mem by a peer of the same uid).
    fn drop_identity(&self) -> Step<()> {
        for cap in 0..=self.last_cap {
            // SAFETY: prctl(PR_CAPBSET_DROP) takes a capability number and unused zeros.
            let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
            check(rc as libc::c_long, || format!("drop capability {cap}"))?;
        }
        // SAFETY: prctl(PR_CAP_AMBIENT, CLEAR_ALL) takes no pointer.
        let rc = unsafe {
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
                0,
                0,
                0,
            )
        };
        check(rc as libc::c_long, || "clear ambient".into())?;
        // SAFETY: an empty group list: the pointer is not read.
        check(
            unsafe { libc::setgroups(0, std::ptr::null()) } as libc::c_long,
            || "setgroups".into(),
        )?;
        let (uid, gid) = (self.uid, self.gid);
        // SAFETY: setresgid/setresuid take ids only.
        check(
            unsafe { libc::setresgid(gid, gid, gid) } as libc::c_long,
            || "setresgid".into(),
        )?;
        // SAFETY: as above.
        check(
            unsafe { libc::setresuid(uid, uid, uid) } as libc::c_long,
            || "setresuid".into(),
        )?;
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
        check(rc as libc::c_long, || "no_new_privs".into())?;
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
        check(rc as libc::c_long, || "not dumpable".into())
    }
}

/// Everything a forked child's set-up and jail need, built once per spawn by the
/// zygote (`jail.plan`), before the fork; a parent VMM builds one without set-up.
#[pyclass(frozen, module = "vmfork._core")]
pub struct ChildPlan {
    set_up: Option<SetUp>,
    jail: Option<Jail>,
    net: Net,
    /// `jail.JailError`, built as `error(step, errno)` when a jail step fails (None: a
    /// plan the forker built, whose child enters its jail natively only).
    error: Option<Py<PyType>>,
}

/// `ChildPlan`'s constructor arguments as plain values (its `new` says what each is):
/// what the zygote's Python passes, and what the forker (`forker.rs`) reads from JSON.
#[derive(Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
#[allow(clippy::type_complexity)]
pub struct ChildPlanArgs {
    set_up: Option<(i32, Option<RawFd>, Vec<String>, Option<String>, i32)>,
    jail: Option<(String, u32, u32, String, (u64, u64, u64), u32)>,
    paths: Option<(
        Vec<String>,
        Vec<String>,
        Vec<String>,
        Option<(String, Vec<String>)>,
        Vec<String>,
        Vec<String>,
    )>,
    tap: Option<String>,
    host_root: Option<(RawFd, u64, u64)>,
    held_netns: Option<RawFd>,
    netns: Option<String>,
    base: Option<(RawFd, RawFd, String)>,
}

fn cstrings(paths: &[String]) -> Result<Vec<CString>, String> {
    paths.iter().map(|p| arg_cstring(p)).collect()
}

fn arg_cstring(s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{s:?} holds a NUL byte"))
}

fn cstr_arg(s: &str) -> PyResult<CString> {
    arg_cstring(s).map_err(PyValueError::new_err)
}

impl ChildPlanArgs {
    /// The descriptors these arguments name by number (the zygote's, open while the
    /// batch is forked): what a forker's spare is sent at its activation
    /// (`forker_spare.rs`), since it was forked before the zygote opened some of them.
    pub fn descriptors(&self) -> Vec<RawFd> {
        let mut fds: Vec<RawFd> = Vec::new();
        if let Some((_, Some(zygote_pidfd), _, _, _)) = &self.set_up {
            fds.push(*zygote_pidfd);
        }
        if let Some((root, _, _)) = &self.host_root {
            fds.push(*root);
        }
        fds.extend(self.held_netns);
        if let Some((ns, root, _)) = &self.base {
            fds.extend([*ns, *root]);
        }
        fds
    }
}

impl ChildPlan {
    /// The plan of `args` (`ChildPlan.new`'s), its refusals as text.
    pub fn from_args(args: ChildPlanArgs, error: Option<Py<PyType>>) -> Result<Self, String> {
        let ChildPlanArgs {
            set_up,
            jail,
            paths,
            tap,
            host_root,
            held_netns,
            netns,
            base,
        } = args;
        if base.is_some() && jail.is_none() {
            return Err("a jail base is for a jail".into());
        }
        let set_up = match set_up {
            None => None,
            Some((zygote_pid, zygote_pidfd, procs, log_path, nice)) => Some(SetUp {
                zygote_pid,
                zygote_pidfd,
                cgroup_procs: cstrings(&procs)?,
                log_path: log_path.as_deref().map(arg_cstring).transpose()?,
                nice,
                keep: base
                    .as_ref()
                    .map_or_else(Vec::new, |(ns, root, _)| vec![*ns, *root]),
            }),
        };
        let net = match (netns, held_netns) {
            (Some(name), _) => Net::Sandbox {
                relative: arg_cstring(&format!("run/netns/{name}"))?,
                absolute: arg_cstring(&format!("/run/netns/{name}"))?,
                name,
                host_root: host_root.map(|(fd, _, _)| fd),
            },
            (None, Some(fd)) => Net::Held(fd),
            (None, None) => Net::Own,
        };
        let jail = match (jail, paths) {
            (None, _) => None,
            (Some(_), None) => return Err("a jail needs its paths".into()),
            (
                Some((root, uid, gid, hostname, (nofile, nproc, fsize), last_cap)),
                Some((read_only, writable, devices, shared, preopen, preopen_rw)),
            ) => {
                let shared = shared
                    .map(|(tree, paths)| Ok::<_, String>((arg_cstring(&tree)?, paths)))
                    .transpose()?;
                let root = match (base, writable.as_slice()) {
                    (None, _) => Root::Own(
                        RootPlan::new(&root, &read_only, &writable, shared.as_ref(), &[])
                            .map_err(|f| f.step.to_string())?,
                    ),
                    (Some((fd, base_root, mount_point)), [run_dir]) => {
                        let (between, carried) = base_places(run_dir, &mount_point, &read_only)?;
                        Root::Base(Base {
                            fd,
                            root: base_root,
                            run_dir: arg_cstring(run_dir)?,
                            mount_point: arg_cstring(&mount_point)?,
                            between,
                            carried,
                        })
                    }
                    (Some(_), _) => {
                        return Err("a jail that joins a base has one writable path, its run \
                                    directory"
                            .into())
                    }
                };
                Some(Jail {
                    uid,
                    gid,
                    devices,
                    root,
                    limits: [
                        (libc::RLIMIT_NOFILE, nofile, "RLIMIT_NOFILE"),
                        (libc::RLIMIT_NPROC, nproc, "RLIMIT_NPROC"),
                        (libc::RLIMIT_FSIZE, fsize, "RLIMIT_FSIZE"),
                        (libc::RLIMIT_CORE, 0, "RLIMIT_CORE"),
                    ],
                    hostname,
                    preopen: cstrings(&preopen)?,
                    preopen_rw: cstrings(&preopen_rw)?,
                    tap,
                    host_root,
                    last_cap,
                })
            }
        };
        Ok(ChildPlan {
            set_up,
            jail,
            net,
            error,
        })
    }
}

#[pymethods]
impl ChildPlan {
    /// `set_up`: `(zygote_pid, zygote_pidfd or None, [cgroup.procs paths], log_path or
    /// None, nice)`, for a zygote child. `jail`: `(root, uid, gid, hostname, (nofile, nproc,
    /// fsize), last capability)` and `paths`: `(read_only sorted by length, writable,
    /// devices, (shared tree path, its paths) or None, preopen, preopen_rw)`, the
    /// `JailSpec` resolved by `jail.plan`; `tap`; `host_root`: `(fd, dev, ino)` of the
    /// zygote's descriptor of the host's root, let go of. `held_netns`: the zygote's
    /// empty namespace's descriptor; `netns`: the sandbox's namespace name (checked by
    /// the caller), looked up from `host_root` when given. `base`: a jail base's
    /// descriptor (`jail_base`, built with this jail's read-only paths, shared tree and
    /// its run directory's parent), joined instead of building a root of its own; the
    /// jail then has one writable path, its run directory.
    #[new]
    #[pyo3(signature = (*, error, set_up=None, jail=None, paths=None, tap=None,
                        host_root=None, held_netns=None, netns=None, base=None))]
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn new(
        error: Bound<'_, PyType>,
        set_up: Option<(i32, Option<RawFd>, Vec<String>, Option<String>, i32)>,
        jail: Option<(String, u32, u32, String, (u64, u64, u64), u32)>,
        paths: Option<(
            Vec<String>,
            Vec<String>,
            Vec<String>,
            Option<(String, Vec<String>)>,
            Vec<String>,
            Vec<String>,
        )>,
        tap: Option<String>,
        host_root: Option<(RawFd, u64, u64)>,
        held_netns: Option<RawFd>,
        netns: Option<String>,
        base: Option<(RawFd, RawFd, String)>,
    ) -> PyResult<Self> {
        let args = ChildPlanArgs {
            set_up,
            jail,
            paths,
            tap,
            host_root,
            held_netns,
            netns,
            base,
        };
        ChildPlan::from_args(args, Some(error.unbind())).map_err(PyValueError::new_err)
    }

    /// The child's set-up (steps 0-6 of the module comment), right after `fork()`.
    /// Never fails: a failed step writes `vmfork child: <step>: <error>` to stderr and
    /// exits 71 (`EXIT_SETUP_FAILED`), as does a child whose zygote is already gone
    /// (silently: nobody is left to tell). Nothing here runs Python.
    pub fn set_up(&self) {
        let Some(set_up) = &self.set_up else {
            return;
        };
        // A jailed child's namespace (its own, the held empty one or the sandbox's), or
        // an unjailed child's sandbox namespace, where its VMM attaches to the tap.
        let outcome = self
            .net
            .join()
            .map_err(|f| jail_failure_text(&f))
            .and_then(|()| set_up.run());
        match outcome {
            Ok(true) => {}
            Ok(false) => exit_setup_failed(None),
            Err(message) => exit_setup_failed(Some(&message)),
        }
    }

    /// Build the jail and move this process into it. Returns the descriptors opened
    /// before the drop, for `jail.adopt`: (read-only files in `preopen`'s order, -1 for
    /// a missing one; read-write files likewise; (pagemap, clear_refs); devices; the
    /// tap's or None). Raises the plan's `error(step, errno)`.
    fn enter_jail(&self, py: Python<'_>) -> PyResult<Opened> {
        let Some(jail) = &self.jail else {
            return Err(PyValueError::new_err("this plan has no jail"));
        };
        jail.enter(&self.net, &|_| {})
            .map_err(|f| match &self.error {
                Some(error) => match error.bind(py).call1((f.step, f.errno)) {
                    Ok(err) => PyErr::from_value(err),
                    Err(err) => err,
                },
                None => PyOSError::new_err((f.errno, jail_failure_text(&f))),
            })
    }
}

impl ChildPlan {
    /// `enter_jail` for a child that runs no Python: None without a jail; a failed
    /// step says what `str(JailError)` says. `mark`: `Jail::enter`'s.
    pub fn enter_jail_native(&self, mark: &dyn Fn(&'static str)) -> Result<Option<Opened>, String> {
        match &self.jail {
            None => Ok(None),
            Some(jail) => jail
                .enter(&self.net, mark)
                .map(Some)
                .map_err(|f| jail_failure_text(&f)),
        }
    }
}

/// The directory a jail base leaves empty for a run directory: its parent, if that is
/// below `/` (the run directory is an absolute path without `..`: the zygote's check).
fn run_dir_parent(run_dir: &str) -> Option<&str> {
    let parent = &run_dir[..run_dir.trim_end_matches('/').rfind('/')?];
    (!parent.is_empty() && run_dir.starts_with('/')).then_some(parent)
}

/// Where a child of a jail base puts its own mounts (`Base`): the directories from
/// `mount_point` (excluded) down to `run_dir`'s parent, and the read-only paths right
/// in that parent (the spawner's FIFOs), each the child's to bind. A read-only path
/// anywhere else under `mount_point` has no place in the base (it leaves out
/// everything under it) nor in the child's tree: refused.
fn base_places(
    run_dir: &str,
    mount_point: &str,
    read_only: &[String],
) -> Result<(Vec<CString>, Vec<CString>), String> {
    let mount_point = mount_point.trim_end_matches('/');
    let parent = run_dir_parent(run_dir)
        .ok_or_else(|| format!("run directory {run_dir:?} has no parent below / to hold it"))?;
    if !holds(mount_point, parent) || mount_point.is_empty() {
        return Err(format!(
            "run directory {run_dir:?} is not under {mount_point:?}, where its jail base \
             holds the run directories"
        ));
    }
    let c = |path: &str| CString::new(path).map_err(|_| format!("a NUL byte in {path:?}"));
    let mut between = Vec::new();
    let mut at = mount_point.len();
    while at < parent.len() {
        at = parent[at + 1..]
            .find('/')
            .map_or(parent.len(), |i| at + 1 + i);
        between.push(c(&parent[..at])?);
    }
    let mut carried = Vec::new();
    for path in read_only {
        if run_dir_parent(path) == Some(parent) {
            carried.push(c(path)?);
        } else if holds(mount_point, path) || holds(path, mount_point) {
            return Err(format!(
                "read-only path {path:?} is at, above or under {mount_point:?}, where a \
                 jail base holds each child's run directory: bind it elsewhere, or \
                 beside the run directories"
            ));
        }
    }
    Ok((between, carried))
}

/// A jail base (`Base`) for the jails whose root would hold `read_only` (sorted by
/// length; what is under a mount point is each child's to bind, and `jail.KeptBases`
/// leaves it out), the zygote's `shared` tree (its path and paths) and an empty
/// directory at each of `mount_points` (where children mount their run directories'
/// tmpfs), built on the empty directory `mount_at` (in a mount namespace of its own:
/// the host sees nothing of it). Returns the namespace's descriptor and its root's (close-on-exec); raises
/// `error(step, errno)` with nothing left behind.
#[pyfunction]
pub fn jail_base(
    error: Bound<'_, PyType>,
    mount_at: &str,
    read_only: Vec<String>,
    shared: Option<(String, Vec<String>)>,
    mount_points: Vec<String>,
) -> PyResult<(RawFd, RawFd)> {
    let shared = shared
        .map(|(tree, paths)| Ok::<_, PyErr>((cstr_arg(&tree)?, paths)))
        .transpose()?;
    let raise = |f: Failure| match error.call1((f.step, f.errno)) {
        Ok(err) => PyErr::from_value(err),
        Err(err) => err,
    };
    let plan =
        RootPlan::new(mount_at, &read_only, &[], shared.as_ref(), &mount_points).map_err(raise)?;
    // The thread touches no Python object; the GIL stays held (the zygote has no
    // other thread that could run meanwhile).
    build_base(plan).map_err(raise)
}

/// `str(jail.JailError(step, errno))`.
fn jail_failure_text(f: &Failure) -> String {
    format!(
        "[Errno {}] jail: {}: {}",
        f.errno,
        f.step,
        strerror(f.errno)
    )
}

pub(crate) fn exit_setup_failed(message: Option<&str>) -> ! {
    if let Some(message) = message {
        let line = format!("vmfork child: {message}\n");
        // SAFETY: `line` is valid for its length; a short or failed write is all
        // there is left to do before exiting.
        unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
    }
    // SAFETY: _exit ends the process without running anything of Python's.
    unsafe { libc::_exit(EXIT_SETUP_FAILED) }
}

/// `let_go_of_host_root` for Python (`jail._let_go_of_host_root`).
#[pyfunction(name = "let_go_of_host_root")]
pub fn py_let_go_of_host_root(fd: RawFd, dev: u64, ino: u64) {
    let_go_of_host_root(fd, dev, ino);
}

/// `open_tap` for Python (`net.open_tap`): raises `OSError(errno, step)`.
#[pyfunction(name = "open_tap")]
pub fn py_open_tap(name: &str) -> PyResult<RawFd> {
    open_tap(name).map_err(|f| PyOSError::new_err((f.errno, f.step)))
}

/// `PR_SET_PDEATHSIG` SIGKILL, then whether the parent `parent_pid` is still there
/// (the zygote itself, under `--parent-pid`). Raises `OSError` if the prctl fails.
#[pyfunction]
pub fn die_with_parent(parent_pid: i32) -> PyResult<bool> {
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and unused zeros.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) } != 0 {
        return Err(PyOSError::new_err((
            last_errno(),
            "prctl(PR_SET_PDEATHSIG) failed",
        )));
    }
    // SAFETY: getppid cannot fail.
    Ok(unsafe { libc::getppid() } == parent_pid)
}

/// The number of threads of this process, None if it cannot be read.
fn thread_count() -> Option<u64> {
    num_threads(&std::fs::read("/proc/self/stat").ok()?)
}

/// Ok if this process has one thread: what a fork or clone that runs none of
/// CPython's after-fork work needs (`fork_single_threaded`). `what` names the caller
/// in the refusal.
pub(crate) fn one_thread(what: &str) -> Result<(), String> {
    match thread_count() {
        Some(1) => Ok(()),
        Some(n) => Err(format!(
            "{what}: this process has {n} threads; a child forked without CPython's \
             after-fork work needs the forking thread to be the only one"
        )),
        None => Err(format!(
            "{what}: /proc/self/stat cannot be read, so this process cannot be known \
             to have one thread"
        )),
    }
}

/// The 20th field (`num_threads`) of a `/proc/<pid>/stat` line.
fn num_threads(stat: &[u8]) -> Option<u64> {
    // The command name (field 2) is in parentheses and may hold anything, spaces and
    // parentheses included: the fields after it start after its last `)`.
    let after = stat.iter().rposition(|&b| b == b')')? + 1;
    let rest = std::str::from_utf8(&stat[after..]).ok()?;
    // state is field 3, so num_threads (field 20) is the 18th after the name.
    rest.split_ascii_whitespace().nth(17)?.parse().ok()
}

/// `fork()` for the zygote, which runs none of CPython's after-fork work in the child.
///
/// `os.fork()` calls `PyOS_AfterFork_Child` in the child: it re-creates the GIL and the
/// runtime's locks, deletes the other threads' states, and runs every Python-level
/// `os.register_at_fork` hook (`threading`'s, `logging`'s, `random`'s reseed, ...),
/// ~53 Python calls. Every object they touch is a page the child copies: measured
/// natively, a child of the preloaded zygote owned ~0.9 MiB after `os.fork()` against
/// ~0.15 MiB after a bare `fork()` (design notes, "Where an idle jailed child's ~5.5
/// MiB goes"). That work exists to repair what other threads held at the fork. The
/// zygote forks with one thread, from its own loop, holding no lock but the GIL, which
/// the one thread of the child holds too: nothing is left to repair, so the child
/// runs Python as the zygote left it. That precondition is checked here, at every
/// fork, not assumed: another thread raises `RuntimeError` and nothing is forked.
///
/// What the child does without: `random`'s module-level generator is the zygote's,
/// not reseeded (a VMM draws its secrets from `os.urandom`, never from `random`);
/// `threading.get_native_id()` of its main thread still names the zygote's. Python
/// signal handlers tripped in the zygote but not yet run are run here, before the
/// fork (the caller has blocked every signal, so none can trip between that and the
/// fork): a flag left set would run the zygote's handler in the child.
///
/// Returns 0 in the child and the child's pid in the zygote; `OSError` if fork fails.
#[pyfunction]
pub fn fork_single_threaded(py: Python<'_>) -> PyResult<i32> {
    fork_checked(py)
}

/// `fork()` once the process is checked to have one thread (`fork_single_threaded`'s
/// reasons), with the GIL held: the native fork (`native_fork.rs`) forks the same way.
pub(crate) fn fork_checked(py: Python<'_>) -> PyResult<i32> {
    one_thread("fork_single_threaded").map_err(PyRuntimeError::new_err)?;
    py.check_signals()?;
    // SAFETY: the process has one thread (checked above; a thread can only be started
    // by this one, which is here), so the child's only thread is this one, holding the
    // GIL as it does here, and no lock of the allocator, of libc or of CPython is held
    // by a thread that does not exist in the child.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(PyOSError::new_err((last_errno(), "fork failed")));
    }
    Ok(pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_thread_count_is_read_past_the_command_name() {
        let line = b"4242 (a) b (c) 1 2 3) S 1 4242 4242 0 -1 4194560 100 0 0 0 \
                     1 2 0 0 20 0 7 0 12345 1000000 50";
        assert_eq!(num_threads(line), Some(7));
        assert_eq!(num_threads(b"4242 (python3) S 1 2 3"), None);
        assert_eq!(num_threads(b"no parenthesis at all"), None);
        // This process's own line parses (the harness runs tests on threads of its own).
        assert!(thread_count().is_some_and(|n| n >= 1));
    }

    #[test]
    fn a_base_child_makes_the_way_down_to_its_run_directory_and_binds_what_is_beside_it() {
        let strings = |v: Vec<CString>| -> Vec<String> {
            v.into_iter().map(|c| c.into_string().unwrap()).collect()
        };
        let ro = |paths: &[&str]| paths.iter().map(|p| p.to_string()).collect::<Vec<_>>();
        // The daemon's layout: a directory per spawn in `run/`, its FIFOs beside the
        // run directories; the snapshot's files elsewhere are the base's.
        let (between, carried) = base_places(
            "/state/run/spawn-ab/vm1",
            "/state/run/",
            &ro(&[
                "/state/snapshots/s/memory.bin",
                "/state/run/spawn-ab/.notify-1",
            ]),
        )
        .unwrap();
        assert_eq!(strings(between), ["/state/run/spawn-ab"]);
        assert_eq!(strings(carried), ["/state/run/spawn-ab/.notify-1"]);
        // The run directories' parent itself: nothing to make.
        let (between, carried) =
            base_places("/run/vms/vm1", "/run/vms", &ro(&["/run/vms/.start-2"])).unwrap();
        assert!(between.is_empty());
        assert_eq!(strings(carried), ["/run/vms/.start-2"]);
        let (between, _) = base_places("/r/a/b/vm", "/r", &[]).unwrap();
        assert_eq!(strings(between), ["/r/a", "/r/a/b"]);
        // A run directory elsewhere, a name that only extends the mount point's, and a
        // read-only path under it but not beside the run directory are refused.
        assert!(base_places("/elsewhere/vm1", "/state/run", &[]).is_err());
        assert!(base_places("/state/runx/vm1", "/state/run", &[]).is_err());
        let deeper = ro(&["/state/run/other/file"]);
        assert!(
            base_places("/state/run/spawn-ab/vm1", "/state/run", &deeper)
                .unwrap_err()
                .contains("/state/run/other/file")
        );
        assert!(base_places("/state/run/spawn-ab/vm1", "/state/run", &ro(&["/state"])).is_err());
    }

    #[test]
    fn a_shared_path_is_linked_where_the_jail_holds_nothing_else() {
        // Nothing else under /usr or /work: one link each. /root/.cache also holds a
        // disk: the venv's link sits just below what they share.
        let others = ["/root/.cache/vmfork/disks/d1", "/run/vm1", "/proc"];
        assert_eq!(link_point("/usr/lib/python3.11", &others), "/usr");
        assert_eq!(link_point("/work/wt/src", &others), "/work");
        assert_eq!(
            link_point("/root/.cache/vmfork/venv/lib/site-packages", &others),
            "/root/.cache/vmfork/venv"
        );
        // A path the jail binds itself right below: linked at the path.
        assert_eq!(link_point("/a/b", &["/a/b/c"]), "/a/b");
        // A sibling whose name extends the candidate's does not block it.
        assert_eq!(link_point("/usr/lib", &["/usrx"]), "/usr");
    }

    #[test]
    fn the_root_plan_makes_each_directory_once_and_skips_what_the_tree_shows() {
        let shared = (
            c"/tree".to_owned(),
            vec![
                "/usr/lib/python3.11".to_string(),
                "/usr/bin".to_string(),
                "/root/.cache/venv/lib".to_string(),
            ],
        );
        let read_only = [
            "/usr/lib/python3.11/os.py".to_string(), // seen through the tree
            "/root/.cache/disks/d1".to_string(),
            "/root/.cache/disks/d1/inner".to_string(),
        ];
        let writable = ["/root/run/vm1".to_string()];
        let plan = RootPlan::new("/j", &read_only, &writable, Some(&shared), &[]).unwrap();
        let text = |c: &CString| c.to_str().unwrap().to_string();
        let shared = plan.shared.as_ref().unwrap();
        assert_eq!(
            (text(&shared.at), text(&shared.tree)),
            ("/j/.vmfork-shared".into(), "/tree".into())
        );
        let links: Vec<(Vec<String>, String, String)> = shared
            .links
            .iter()
            .map(|l| {
                let parents = l.parents.iter().map(|&i| text(&plan.dirs[i])).collect();
                (parents, text(&l.target), text(&l.link))
            })
            .collect();
        assert_eq!(
            links,
            [
                (vec![], "/.vmfork-shared/usr".into(), "/j/usr".into()),
                (
                    vec!["/j/root".into(), "/j/root/.cache".into()],
                    "/.vmfork-shared/root/.cache/venv".into(),
                    "/j/root/.cache/venv".into()
                ),
            ],
            "/usr/bin is seen through /usr's link"
        );
        type Seen = (String, Vec<String>, String, bool, Vec<usize>);
        let mounts: Vec<Seen> = plan
            .mounts
            .iter()
            .map(|m| {
                let parents = m.parents.iter().map(|&i| text(&plan.dirs[i])).collect();
                (
                    text(&m.host),
                    parents,
                    text(&plan.dirs[m.own]),
                    m.writable,
                    m.under.clone(),
                )
            })
            .collect();
        assert_eq!(
            mounts,
            [
                (
                    "/root/.cache/disks/d1".into(),
                    vec![
                        "/j/root".into(),
                        "/j/root/.cache".into(),
                        "/j/root/.cache/disks".into()
                    ],
                    "/j/root/.cache/disks/d1".into(),
                    false,
                    vec![]
                ),
                (
                    "/root/.cache/disks/d1/inner".into(),
                    vec![
                        "/j/root".into(),
                        "/j/root/.cache".into(),
                        "/j/root/.cache/disks".into(),
                        "/j/root/.cache/disks/d1".into()
                    ],
                    "/j/root/.cache/disks/d1/inner".into(),
                    false,
                    vec![0]
                ),
                (
                    "/root/run/vm1".into(),
                    vec!["/j/root".into(), "/j/root/run".into()],
                    "/j/root/run/vm1".into(),
                    true,
                    vec![]
                ),
            ]
        );
        let mut dirs: Vec<String> = plan.dirs.iter().map(text).collect();
        let count = dirs.len();
        dirs.dedup();
        assert_eq!(dirs.len(), count, "each directory listed once");
        assert_eq!(
            (text(&plan.proc), text(&plan.old_root)),
            ("/j/proc".into(), "/j/.old-root".into())
        );
    }

    #[test]
    fn a_base_leaves_the_run_directories_parent_empty_and_refuses_a_clash() {
        let shared = (
            c"/tree".to_owned(),
            vec!["/root/.cache/venv/lib".to_string()],
        );
        let read_only = ["/root/.cache/disks/d1".to_string()];
        let parents = ["/root/run".to_string()];
        let plan = RootPlan::new("/j", &read_only, &[], Some(&shared), &parents).unwrap();
        let text = |c: &CString| c.to_str().unwrap().to_string();
        let points: Vec<String> = plan
            .mount_points
            .iter()
            .map(|&i| text(&plan.dirs[i]))
            .collect();
        assert_eq!(points, ["/j/root", "/j/root/run"]);
        // The venv's link stops above /root, which holds the run directories' parent.
        let links: Vec<String> = plan
            .shared
            .as_ref()
            .unwrap()
            .links
            .iter()
            .map(|l| text(&l.link))
            .collect();
        assert_eq!(links, ["/j/root/.cache/venv"]);
        for clash in [
            "/root/.cache",
            "/root/.cache/disks/d1/x",
            "/root/.cache/venv/lib",
            "/proc",
            "/",
        ] {
            let refused = RootPlan::new("/j", &read_only, &[], Some(&shared), &[clash.to_string()]);
            assert!(refused.is_err(), "{clash} was taken as a mount point");
        }
        // A read-only path right in the point (the spawner's FIFOs) is each child's to
        // carry over: no clash.
        let carried = RootPlan::new("/j", &read_only, &[], None, &["/root/.cache/disks".into()]);
        assert!(carried.is_ok());
        assert_eq!(run_dir_parent("/srv/run/vm1"), Some("/srv/run"));
        assert_eq!(run_dir_parent("/srv/vm1/"), Some("/srv"));
        assert_eq!(run_dir_parent("/vm1"), None);
    }

    #[test]
    fn a_path_with_a_nul_is_refused_not_truncated() {
        let err = cstring("/a\0b").unwrap_err();
        assert_eq!(err.errno, libc::EINVAL);
    }

    #[test]
    fn strerror_has_no_os_error_suffix() {
        assert_eq!(strerror(libc::ENOENT), "No such file or directory");
    }

    #[test]
    fn the_host_root_is_closed_only_while_it_still_is_the_host_root() {
        let dir = open(c"/", libc::O_PATH | libc::O_DIRECTORY, 0).unwrap();
        let (dev, ino, _) = fstat(dir).unwrap();
        let other = open(c"/dev/null", libc::O_RDONLY, 0).unwrap();
        let_go_of_host_root(other, dev, ino);
        assert!(
            fstat(other).is_some(),
            "another file's descriptor was closed"
        );
        let_go_of_host_root(dir, dev, ino);
        // The number may be reused at once by another test's thread: only the host's
        // root itself must be gone from it.
        let now = fstat(dir).map(|(d, i, _)| (d, i));
        assert_ne!(
            now,
            Some((dev, ino)),
            "the host root's descriptor is still open"
        );
        close(other);
    }
}
