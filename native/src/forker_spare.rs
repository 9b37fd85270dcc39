//! A forker's spare: a child forked ahead of the spawn that will be it.
//!
//! Why. A lone spawn's fork is the largest single step between the zygote's request
//! and the child's first step that the child does not do itself: the forker is the
//! zygote's image (~17 MiB of its own memory), and copying its page tables took ~5 ms
//! of a lone spawn's ~40 in the emulated test host (docs/native.md, "The forker's
//! spare"). A spare is that fork made while nothing waits for it.
//!
//! When. After a batch of one child (a lone spawn) the forker wants a spare like that
//! child: in a PID namespace of its own if the child had one (a jailed child), else
//! in the forker's. It forks it once its channel has been quiet for the quiet time
//! the zygote gave (`VMFORK_FORKER_SPARE`, `runtime/forker.py`): not at once, since on
//! a host with few CPUs the fork would take them from the child just spawned. Batches
//! of more children are forked as before: their children wait at a start gate for each
//! other anyway. A forker holds at most one spare.
//!
//! How. The spare is cloned with `CLONE_PARENT`, as every child of the forker: the
//! zygote is its parent. At its birth it closes every descriptor but stdio, its end of
//! a socket pair and a pidfd of the forker, and waits. The next lone batch whose child
//! is its kind goes to it: the forker sends it the batch record with the descriptors
//! the recipe names (`SCM_RIGHTS`: the zygote may have opened them after the spare was
//! forked, and the spare closed its copies of the others). The spare builds the
//! child's plan (the same `fork_plan` a fork runs) and answers one byte: built, or
//! not, and then the forker forks the child instead, whose build says why. Built, it
//! puts each descriptor at the number the recipe says and lives the child's life, as
//! a child forked at that moment would. The forker tells the zygote the spare's pid as
//! a forked child's. A spare whose forker ends (the zygote retired it, or died) exits;
//! the zygote reaps every child of its own it does not know when it retires a forker.
//!
//! The wire, forker to spare: one `Header` (with the descriptors attached), then the
//! batch record's bytes; spare to forker, `BUILT` or another byte.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::child::close_all_but;
use crate::child_heap;

/// The most descriptors a recipe names (`Recipe::descriptors`: six at most).
const MAX_DESCRIPTORS: usize = 8;

/// What precedes the batch record on a spare's channel.
#[derive(Clone, Debug, PartialEq)]
struct Header {
    /// The forker's CLOCK_MONOTONIC when it sent the batch: the child's `forked_ns`.
    sent_ns: i64,
    body_len: u32,
    /// The number each attached descriptor takes in the spare, in order.
    targets: Vec<RawFd>,
}

const HEADER_BYTES: usize = 8 + 4 + 4 + 4 * MAX_DESCRIPTORS;

impl Header {
    fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[..8].copy_from_slice(&self.sent_ns.to_le_bytes());
        out[8..12].copy_from_slice(&self.body_len.to_le_bytes());
        out[12..16].copy_from_slice(&(self.targets.len() as u32).to_le_bytes());
        for (i, fd) in self.targets.iter().enumerate() {
            out[16 + 4 * i..20 + 4 * i].copy_from_slice(&fd.to_le_bytes());
        }
        out
    }

    fn decode(bytes: &[u8; HEADER_BYTES]) -> Result<Self, String> {
        let word = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let count = word(12) as usize;
        if count > MAX_DESCRIPTORS {
            return Err(format!("{count} descriptors"));
        }
        let mut sent = [0u8; 8];
        sent.copy_from_slice(&bytes[..8]);
        Ok(Header {
            sent_ns: i64::from_le_bytes(sent),
            body_len: word(8),
            targets: (0..count).map(|i| word(16 + 4 * i) as RawFd).collect(),
        })
    }
}

/// One spare: its pid (the zygote's child) and its kind.
struct Spare {
    pid: libc::pid_t,
    own_pid_namespace: bool,
}

/// The spare a forker wants: like its last lone child (a PID namespace of its own or
/// not, and the descriptor of the forker's own namespace to return to).
#[derive(Clone, Copy)]
struct Kind {
    pid_namespace: Option<RawFd>,
}

/// The two ends of the spares' channel, a socket pair the zygote made and keeps open
/// for the forker's life (`runtime/forker.py`): every descriptor a forker opens is in
/// the zygote's table too (`CLONE_FILES`), and one the forker left open when it died
/// would stay there, so the forker opens none that outlives a call. One spare waits at
/// a time, and reads one batch from it.
#[derive(Clone, Copy)]
pub struct SpareChannel {
    pub forker: RawFd,
    pub spare: RawFd,
}

impl SpareChannel {
    /// The forker's end as a stream, left open when dropped.
    fn forker_end(&self) -> std::mem::ManuallyDrop<UnixStream> {
        // SAFETY: the zygote keeps this descriptor open while the forker lives; the
        // stream is never dropped, so it never closes it.
        std::mem::ManuallyDrop::new(unsafe { UnixStream::from_raw_fd(self.forker) })
    }
}

/// A forker's spare, and when to fork the next one.
pub struct Spares {
    /// The quiet time before a spare is forked, and the spares' channel; None: no
    /// spares (none asked for, or they stopped).
    on: Option<(Duration, SpareChannel)>,
    wanted: Option<Kind>,
    spare: Option<Spare>,
    quiet_since: Instant,
}

impl Spares {
    /// `quiet`: how long the channel stays quiet before a spare is forked; None, or no
    /// `channel`: never.
    pub fn new(quiet: Option<Duration>, channel: Option<SpareChannel>) -> Self {
        Spares {
            on: quiet.zip(channel),
            wanted: None,
            spare: None,
            quiet_since: Instant::now(),
        }
    }

    /// No more spares: what broke may have left the channel holding half a batch.
    fn stop(&mut self, why: &str) {
        eprintln!("vmfork forker: no more spares ({why}); lone children are forked");
        self.on = None;
    }

    /// Wait until `channel` is readable; a spare wanted and not there yet is forked
    /// once the channel has been quiet long enough.
    pub fn wait_for(&mut self, channel: RawFd, py: Python<'_>) {
        loop {
            let timeout = match (self.on, self.wanted, &self.spare) {
                (Some((quiet, _)), Some(_), None) => {
                    let left = quiet.saturating_sub(self.quiet_since.elapsed());
                    left.as_millis().min(i32::MAX as u128) as i32
                }
                _ => -1,
            };
            let mut poll = libc::pollfd {
                fd: channel,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd of ours, its count given.
            let ready = unsafe { libc::poll(&mut poll, 1, timeout) };
            if ready != 0 {
                return; // readable, closed or an error: the caller's read says which
            }
            if let Some(kind) = self.wanted {
                if let Err(why) = self.fork_spare(kind, py) {
                    self.stop(&why); // a refusal now is one later too
                }
            }
        }
    }

    /// A batch was served: the quiet time starts again.
    pub fn batch_served(&mut self) {
        self.quiet_since = Instant::now();
    }

    /// A lone batch's child (`own_pid_namespace` its recipe's): its spare, if there is
    /// one of its kind, is sent `body` (the batch record) with the descriptors the
    /// recipe names, `descriptors`, and becomes the child once it built the child's
    /// plan; returns its pid. None: fork it (no spare, or the spare could not build it,
    /// and the fork's build says why).
    pub fn give(
        &mut self,
        own_pid_namespace: Option<RawFd>,
        body: &[u8],
        descriptors: &[RawFd],
    ) -> Option<i32> {
        let (_, channel) = self.on?; // no spares: every child forked
        self.wanted = Some(Kind {
            pid_namespace: own_pid_namespace,
        });
        let spare = self.spare.take()?;
        if spare.own_pid_namespace != own_pid_namespace.is_some()
            || descriptors.len() > MAX_DESCRIPTORS
            || u32::try_from(body.len()).is_err()
        {
            end_spare(spare); // nothing sent: the channel is clean for the next
            return None;
        }
        let stream = channel.forker_end();
        let header = Header {
            sent_ns: crate::child_life::monotonic_ns(),
            body_len: body.len() as u32,
            targets: descriptors.to_vec(),
        };
        let sent = stream
            .send_with_fds(&[&header.encode()[..]], descriptors)
            .map_err(|err| err.to_string())
            .and_then(|n| {
                if n == HEADER_BYTES {
                    Ok(())
                } else {
                    Err(format!("{n} bytes of the header"))
                }
            })
            .and_then(|()| (&*stream).write_all(body).map_err(|err| err.to_string()))
            .and_then(|()| built(&stream));
        match sent {
            Ok(()) => Some(spare.pid),
            Err(why) => {
                // A spare that died, cannot be told or could not build the child: the
                // child is forked instead, and the fork's build says what is wrong.
                end_spare(spare);
                self.stop(&why);
                None
            }
        }
    }

    fn fork_spare(&mut self, kind: Kind, py: Python<'_>) -> Result<(), String> {
        let (_, channel) = self.on.ok_or("spares are off")?;
        // A pidfd of this forker, for the spare to learn it ended; closed here once the
        // spare has its copy (module comment on `SpareChannel`).
        // SAFETY: pidfd_open of this process; no pointer.
        let forker_pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0) };
        if forker_pidfd < 0 {
            return Err(format!("pidfd_open: {}", std::io::Error::last_os_error()));
        }
        let forker_pidfd = forker_pidfd as RawFd;
        let close_pidfd = || {
            // SAFETY: the descriptor opened above, used by no one else here.
            unsafe { libc::close(forker_pidfd) };
        };
        if kind.pid_namespace.is_some() {
            // SAFETY: unshare takes no pointer; it moves this process's next child into
            // a new PID namespace, as `fork_batch` does for a jailed child.
            if unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
                close_pidfd();
                return Err(format!("unshare: {}", std::io::Error::last_os_error()));
            }
        }
        let pid = crate::forker::clone_parent_raw();
        if let Ok(0) = pid {
            spare_main(channel.spare, forker_pidfd, py);
        }
        close_pidfd();
        let back = match kind.pid_namespace {
            // SAFETY: setns takes a descriptor the zygote keeps open and no pointer.
            Some(own) if unsafe { libc::setns(own, libc::CLONE_NEWPID) } != 0 => {
                Err(std::io::Error::last_os_error().to_string())
            }
            _ => Ok(()),
        };
        let pid = pid.map_err(|err| err.to_string())?;
        let spare = Spare {
            pid,
            own_pid_namespace: kind.pid_namespace.is_some(),
        };
        if let Err(err) = back {
            end_spare(spare);
            return Err(err);
        }
        self.spare = Some(spare);
        Ok(())
    }
}

/// How long a forker waits for its spare to say it built the child it was sent.
const BUILT_TIMEOUT_MS: i32 = 10_000;

/// The spare's answer to a batch: `BUILT` once it built the child's plan, anything
/// else (its reason, its end) if it could not.
const BUILT: u8 = b'+';

fn built(channel: &UnixStream) -> Result<(), String> {
    let mut poll = libc::pollfd {
        fd: channel.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd of ours, its count given.
    if unsafe { libc::poll(&mut poll, 1, BUILT_TIMEOUT_MS) } != 1 {
        return Err("the spare did not answer".into());
    }
    let mut answer = [0u8; 1];
    match (&*channel).read(&mut answer) {
        Ok(1) if answer[0] == BUILT => Ok(()),
        _ => Err("the spare could not build the child".into()),
    }
}

/// Kill a spare that will not be used; the zygote reaps it (it is its child) when it
/// retires this forker.
fn end_spare(spare: Spare) {
    // SAFETY: kill takes a pid of this forker's making and a signal.
    unsafe { libc::kill(spare.pid, libc::SIGKILL) };
}

/// The spare's life: wait for a batch of one, then be its child; never returns.
fn spare_main(channel: RawFd, forker_pidfd: RawFd, py: Python<'_>) -> ! {
    // Its allocations on pages of its own from here on, as a forked child's are.
    if let Err(why) = child_heap::use_fresh_pages() {
        eprintln!("vmfork spare: allocating from the forker's heap: {why}");
    }
    // SAFETY: prctl with integer arguments. The zygote is the parent (CLONE_PARENT); a
    // zygote gone before this line took the forker with it, which the poll below sees.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
    // Copies of the zygote's descriptors as they were at the fork: held for as long as
    // the spare waits, they would keep a closed connection, a tap or a namespace alive.
    close_all_but(&[channel, forker_pidfd]);
    let message = match receive(channel, forker_pidfd) {
        Ok(Some(message)) => message,
        // SAFETY: _exit ends the process without unwinding.
        Ok(None) => unsafe { libc::_exit(0) },
        Err(why) => {
            eprintln!("vmfork spare: {why}");
            // SAFETY: as above.
            unsafe { libc::_exit(1) }
        }
    };
    let (stream, header, received, body) = message;
    // The plan first (it names descriptors by number, opening none), and the forker
    // told: a recipe it cannot build, the forker forks instead, and its build says why.
    let plan = match crate::forker::lone_plan(py, &body) {
        Ok(plan) => plan,
        Err(why) => {
            let _ = (&stream).write_all(b"-");
            eprintln!("vmfork spare: {why}");
            // SAFETY: as above.
            unsafe { libc::_exit(1) }
        }
    };
    if (&stream).write_all(&[BUILT]).is_err() {
        // SAFETY: as above: the forker is gone and forks nothing more.
        unsafe { libc::_exit(0) }
    }
    drop(stream);
    close_all_but(&received);
    if let Err(why) = place(&received, &header.targets) {
        eprintln!("vmfork spare: {why}");
        // SAFETY: as above.
        unsafe { libc::_exit(1) }
    }
    plan.live(header.sent_ns)
}

type Message = (UnixStream, Header, Vec<RawFd>, Vec<u8>);

/// The batch a spare is given, with its descriptors as received; None if the forker
/// ended first.
fn receive(channel: RawFd, forker_pidfd: RawFd) -> Result<Option<Message>, String> {
    let mut fds = [
        libc::pollfd {
            fd: channel,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: forker_pidfd,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: two pollfds of ours, their count given.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if ready > 0 {
            break;
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(format!("poll: {err}"));
        }
    }
    if fds[0].revents & libc::POLLIN == 0 {
        return Ok(None); // the forker ended (or the channel did) with nothing sent
    }
    // SAFETY: the forker made this end for this spare, which owns it from here.
    let stream = unsafe { UnixStream::from_raw_fd(channel) };
    let mut head = [0u8; HEADER_BYTES];
    let mut received = [-1 as RawFd; MAX_DESCRIPTORS];
    let mut iov = [libc::iovec {
        iov_base: head.as_mut_ptr().cast(),
        iov_len: HEADER_BYTES,
    }];
    // SAFETY: the iovec points at `head`, which lives across the call.
    let (got, count) = unsafe { stream.recv_with_fds(&mut iov, &mut received) }
        .map_err(|err| format!("the batch's header: {err}"))?;
    if got == 0 {
        return Ok(None);
    }
    let received = received[..count].to_vec();
    (&stream)
        .read_exact(&mut head[got..])
        .map_err(|err| format!("the batch's header: {err}"))?;
    let header = Header::decode(&head)?;
    if header.targets.len() != received.len() {
        return Err(format!(
            "{} descriptors for {} numbers",
            received.len(),
            header.targets.len()
        ));
    }
    let mut body = vec![0u8; header.body_len as usize];
    (&stream)
        .read_exact(&mut body)
        .map_err(|err| format!("the batch: {err}"))?;
    Ok(Some((stream, header, received, body)))
}

/// Put each of `received` at the number of `targets` at the same place, and close
/// the received ones: every received descriptor first moved above every target, so no
/// `dup2` replaces one still to be placed.
fn place(received: &[RawFd], targets: &[RawFd]) -> Result<(), String> {
    let above = targets.iter().copied().max().unwrap_or(2).max(2) + 1;
    let mut moved = Vec::with_capacity(received.len());
    for &fd in received {
        // SAFETY: fcntl duplicates a descriptor this process holds.
        let high = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, above) };
        if high < 0 {
            return Err(format!("F_DUPFD: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: ours, just duplicated.
        unsafe { libc::close(fd) };
        moved.push(high);
    }
    for (&high, &target) in moved.iter().zip(targets) {
        // SAFETY: dup3 replaces `target` atomically with a descriptor this process holds.
        if unsafe { libc::dup3(high, target, libc::O_CLOEXEC) } < 0 {
            return Err(format!(
                "dup3 onto {target}: {}",
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: ours, now also at `target`.
        unsafe { libc::close(high) };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_reads_back_as_written_and_a_hostile_count_is_refused() {
        let header = Header {
            sent_ns: -5,
            body_len: 4096,
            targets: vec![7, 3, 1000],
        };
        assert_eq!(Header::decode(&header.encode()).unwrap(), header);
        let mut bytes = header.encode();
        bytes[12..16].copy_from_slice(&9u32.to_le_bytes());
        assert!(Header::decode(&bytes).is_err());
    }

    fn inode(fd: RawFd) -> u64 {
        // SAFETY: fstat into a stat of ours.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0, "fd {fd} open");
        st.st_ino
    }

    #[test]
    fn descriptors_land_on_their_numbers_even_where_a_number_is_taken_by_another() {
        // Three pipes' read ends, each sent to where another one is now: a rotation, so
        // a naive dup2 in order would replace one before it is placed.
        let mut ends = Vec::new();
        for _ in 0..3 {
            let mut pair = [0 as RawFd; 2];
            // SAFETY: pipe into an array of two.
            assert_eq!(unsafe { libc::pipe(pair.as_mut_ptr()) }, 0);
            ends.push(pair);
        }
        let reads: Vec<RawFd> = ends.iter().map(|p| p[0]).collect();
        let inodes: Vec<u64> = reads.iter().map(|&fd| inode(fd)).collect();
        let targets = vec![reads[1], reads[2], reads[0]];
        place(&reads, &targets).expect("placed");
        for (i, &target) in targets.iter().enumerate() {
            assert_eq!(inode(target), inodes[i], "descriptor {i} at {target}");
            // SAFETY: F_GETFD of a descriptor just placed.
            let flags = unsafe { libc::fcntl(target, libc::F_GETFD) };
            assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        }
        for pair in ends {
            // SAFETY: closing this test's own descriptors.
            unsafe {
                libc::close(pair[0]);
                libc::close(pair[1]);
            }
        }
    }
}
