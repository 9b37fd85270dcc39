//! A snapshot's write set: the guest pages its children write on the way to ready,
//! learnt from one child and written ahead, by the host, in the next ones.
//!
//! Why. A child's guest RAM is its snapshot's file mapped `MAP_PRIVATE`. A guest page
//! first read then written costs the guest three exits: the read's stage-2 fault
//! (KVM maps the file's page read-only), the write's fault, whose copy on write
//! invalidates the mapping it faulted on, so KVM retries it, and the retry's. Measured
//! in the emulated test host, a lone child to ready takes ~2,700 exits, ~550 of them
//! such retries (KVM's `pf_taken` less its `pf_fixed`), and its ~600 written pages
//! are nearly the same pages in every child of a snapshot (the restore, `after_fork`'s
//! clock and reseed, the agent's answer). A page the host has already copied is mapped
//! writable at the guest's first touch, read or write: one exit.
//!
//! How. The zygote marks one child of a snapshot that has no write set a learner
//! (`vmmchild.native_child`). At ready, before its report, the learner reads its own
//! `pagemap` over its guest RAM: a present page that is not the file's (bit 61 clear)
//! is a copy the guest wrote. It writes their runs, as guest addresses, to
//! `write-set.json` in its run directory. At a later batch the zygote has the
//! snapshot's plan read the file (`SnapshotMachinePlan.learn_write_set`, checks and
//! bounds below), and each child forked after that populates the runs for writing
//! (`MADV_POPULATE_WRITE`) on a thread of its own from the moment its guest runs
//! (`WriteAhead`): the copy is off the child's way to `restored`, and mostly ahead of
//! the guest's own touches on its way to ready.
//!
//! The file is the learner's, and a learner is a VMM that serves a guest: both are
//! hostile. Read with bounds (`MAX_FILE_BYTES`, `MAX_RUNS`, at most a quarter of the
//! RAM); a set that asks for more is cut. What a lie can cost is the pages each later
//! child copies that its guest would not have written, charged to that child's own
//! memory cgroup, and at most the cap.

use std::ffi::CString;
use std::fs::File;
use std::io::Read;
use std::os::fd::RawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};

use crate::child_report::replace_file;

const PAGE_SIZE: u64 = 4096;

/// The name of the learner's file in its run directory.
pub const FILE_NAME: &str = "write-set.json";

/// The longest file read (~30 bytes a run).
const MAX_FILE_BYTES: u64 = 1 << 20;

/// The most runs a set holds: the populating child makes one `madvise` call a run.
pub const MAX_RUNS: usize = 16 << 10;

/// Pagemap entries read per `pread` (8 bytes each).
const PAGEMAP_CHUNK: usize = 4096;

const PM_PRESENT: u64 = 1 << 63;
/// A file page or a shared anonymous one (not a private copy).
const PM_FILE: u64 = 1 << 61;

/// The most bytes a set may populate: a quarter of the RAM.
pub fn max_bytes(mem_size: u64) -> u64 {
    mem_size / 4
}

/// The pages `runs` cover.
pub fn pages(runs: &[(u64, u64)]) -> u64 {
    runs.iter().map(|r| r.1 / PAGE_SIZE).sum()
}

/// Guest RAM as (guest address, size, host address) per region.
pub type Regions = [(u64, u64, u64)];

/// The runs (guest address, bytes) of `entries`, the pagemap entries of one region
/// starting at guest address `gpa`, whose pages are private copies, appended to
/// `runs` (merged with the last one where they touch); stops at `MAX_RUNS`.
fn collect_runs(entries: &[u64], gpa: u64, runs: &mut Vec<(u64, u64)>) {
    for (i, &entry) in entries.iter().enumerate() {
        if entry & PM_PRESENT == 0 || entry & PM_FILE != 0 {
            continue;
        }
        let at = gpa + i as u64 * PAGE_SIZE;
        if let Some((start, len)) = runs.last_mut() {
            if *start + *len == at {
                *len += PAGE_SIZE;
                continue;
            }
        }
        if runs.len() >= MAX_RUNS {
            return;
        }
        runs.push((at, PAGE_SIZE));
    }
}

/// The guest pages of `regions` this process holds copies of (written since the
/// mapping), read from `pagemap` (this process's `/proc/self/pagemap`), as runs of
/// guest addresses, in order; at most `MAX_RUNS`.
pub fn written_runs(pagemap: RawFd, regions: &Regions) -> Result<Vec<(u64, u64)>, String> {
    let mut runs = Vec::new();
    let mut buffer = vec![0u64; PAGEMAP_CHUNK];
    for &(gpa, size, host) in regions {
        let pages = size / PAGE_SIZE;
        let mut done = 0u64;
        while done < pages {
            let want = (pages - done).min(PAGEMAP_CHUNK as u64) as usize;
            let offset = (host / PAGE_SIZE + done) * 8;
            // SAFETY: a read into the live buffer, at most its length in bytes.
            let got = unsafe {
                libc::pread(
                    pagemap,
                    buffer.as_mut_ptr().cast(),
                    want * 8,
                    offset as libc::off_t,
                )
            };
            if got <= 0 {
                return Err(format!(
                    "pagemap at {offset:#x}: {}",
                    if got == 0 {
                        "end of file".into()
                    } else {
                        std::io::Error::last_os_error().to_string()
                    }
                ));
            }
            let entries = got as usize / 8;
            collect_runs(&buffer[..entries], gpa + done * PAGE_SIZE, &mut runs);
            done += entries as u64;
        }
    }
    Ok(runs)
}

/// Write `runs` as `path` (through `path.tmp`, renamed over it).
pub fn save(path: &Path, runs: &[(u64, u64)]) -> Result<(), String> {
    let text = serde_json::json!({"version": 1, "runs": runs}).to_string();
    let tmp = path.with_extension("json.tmp");
    let cstr = |p: &Path| {
        CString::new(p.as_os_str().as_encoded_bytes())
            .map_err(|_| format!("{} has a NUL", p.display()))
    };
    replace_file(&cstr(&tmp)?, &cstr(path)?, text.as_bytes())
        .map_err(|e| format!("{}: {e}", path.display()))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Saved {
    version: u32,
    runs: Vec<(u64, u64)>,
}

/// The runs of the learner's file `path`, checked against `regions`: page-aligned,
/// non-empty, ascending and apart, each inside one region; cut at `MAX_RUNS` runs and
/// at `max_bytes` of the RAM. Refuses a file that is not a regular file (a symbolic
/// link included), is longer than `MAX_FILE_BYTES`, or does not parse.
pub fn load(path: &Path, regions: &Regions) -> Result<Vec<(u64, u64)>, String> {
    let shown = |e: std::io::Error| format!("{}: {e}", path.display());
    let mut file = File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(shown)?;
    let meta = file.metadata().map_err(shown)?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", path.display()));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(format!(
            "{} is {} bytes, more than {MAX_FILE_BYTES}",
            path.display(),
            meta.len()
        ));
    }
    let mut text = Vec::new();
    file.by_ref()
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(shown)?;
    let saved: Saved =
        serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    if saved.version != 1 {
        return Err(format!(
            "{}: version {}, not 1",
            path.display(),
            saved.version
        ));
    }
    checked(&saved.runs, regions).map_err(|e| format!("{}: {e}", path.display()))
}

/// `runs` checked against `regions` and cut at the bounds (`load`).
fn checked(runs: &[(u64, u64)], regions: &Regions) -> Result<Vec<(u64, u64)>, String> {
    let mem_size: u64 = regions.iter().map(|r| r.1).sum();
    let budget = max_bytes(mem_size);
    let mut out = Vec::with_capacity(runs.len().min(MAX_RUNS));
    let mut end = 0u64;
    let mut total = 0u64;
    for &(gpa, len) in runs {
        if gpa % PAGE_SIZE != 0 || len % PAGE_SIZE != 0 || len == 0 {
            return Err(format!("run {gpa:#x}+{len:#x} is not whole pages"));
        }
        if gpa < end {
            return Err(format!("run {gpa:#x} is not after the one before"));
        }
        let inside = regions
            .iter()
            .any(|&(start, size, _)| gpa >= start && gpa.saturating_add(len) <= start + size);
        if !inside {
            return Err(format!("run {gpa:#x}+{len:#x} is not inside guest RAM"));
        }
        if out.len() == MAX_RUNS || total + len > budget {
            break;
        }
        out.push((gpa, len));
        end = gpa + len;
        total += len;
    }
    Ok(out)
}

/// The host ranges (address, bytes) of `runs`, guest addresses in `regions`, in
/// order, up to the first run that is not inside one region.
fn host_runs(regions: &Regions, runs: &[(u64, u64)]) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(runs.len());
    for &(gpa, len) in runs {
        let Some(&(start, _, host)) = regions
            .iter()
            .find(|&&(start, size, _)| gpa >= start && gpa.saturating_add(len) <= start + size)
        else {
            break;
        };
        out.push(((host + (gpa - start)) as usize, len as usize));
    }
    out
}

/// `MADV_POPULATE_WRITE` over `[addr, addr + len)`: every page copied as a write would
/// (Linux 5.14); the errno where it failed.
///
/// # Safety
///
/// The range must be mapped readable and writable in this process.
unsafe fn populate_write(addr: usize, len: usize) -> Result<(), i32> {
    // SAFETY: a range the caller vouches for; the call changes no byte of it.
    let rc = unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) };
    if rc == 0 {
        return Ok(());
    }
    Err(std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO))
}

/// Populate `runs` (host ranges) for writing, counting the pages into `copied`, until
/// done, a call fails, or `cancel` is set; returns the CPU time it took (ns).
///
/// # Safety
///
/// Every range must be mapped readable and writable in this process for the call.
unsafe fn copy_runs(runs: &[(usize, usize)], copied: &AtomicU64, cancel: &AtomicBool) -> i64 {
    let cpu = || crate::spawn_profile::clock_ns(libc::CLOCK_THREAD_CPUTIME_ID);
    let from = cpu();
    'runs: for &(addr, len) in runs {
        for at in (0..len).step_by(CHUNK_BYTES) {
            if cancel.load(Relaxed) {
                break 'runs;
            }
            let bytes = CHUNK_BYTES.min(len - at);
            // SAFETY: a range inside one the caller vouches for.
            if unsafe { populate_write(addr + at, bytes) }.is_err() {
                break 'runs;
            }
            copied.fetch_add(bytes as u64 / PAGE_SIZE, Relaxed);
        }
    }
    cpu() - from
}

/// Bytes populated per call by the copying thread, between looks at its cancel flag.
const CHUNK_BYTES: usize = 256 * PAGE_SIZE as usize;

enum Ahead {
    /// Runs not copied yet (`begin` or `copy_here` takes them).
    Pending(Vec<(usize, usize)>),
    /// Copying on its thread, which returns its CPU time (ns).
    Copying(std::thread::JoinHandle<i64>),
    /// Done, in this much CPU time (ns) of the thread that copied.
    Done(i64),
}

/// The copy of a snapshot's write set in one child: a batch's child makes it before it
/// reports itself prepared, its vCPU parked (`copy_here`), so the start gate opens on
/// copies all made; a lone child, which has no gate, on a thread of its own begun with
/// its guest (`begin`).
///
/// `MADV_POPULATE_WRITE` takes the same page-table locks a guest's fault does, so the
/// copy is safe while vCPUs run: a page the guest wrote first is already its own and
/// costs the call nothing, and a page it has only read loses its read-only stage-2
/// mapping to KVM's MMU notifier when the call copies it, so the guest's next touch
/// maps the copy.
/// Measured in the emulated test host, one CPU (docs/design-notes.md, "Where a child
/// copies its write set"): a lone guest still meets nearly every page after the thread
/// copied it, and `restored` no longer pays for the copy; but forty threads copying
/// beside forty running guests made ready a third later than copies made before the
/// guests ran, and copies made after the `prepared` report, while the gate may already
/// be open, let the first guests run beside the last copies (100 children: restored
/// 5.96 s against 3.80 with no copy). A kernel without the advice (before 5.14) gets
/// the copy in place instead, by writing back one byte a page: that races a running
/// guest's writes, so it is done at once, before any vCPU exists.
pub struct WriteAhead {
    ahead: std::sync::Mutex<Ahead>,
    /// Pages of the set (what the copy is to make).
    planned: u64,
    copied: std::sync::Arc<AtomicU64>,
    cancel: std::sync::Arc<AtomicBool>,
}

impl WriteAhead {
    /// The copy of `runs` (guest addresses in `regions`; those outside stop the set)
    /// made ready: tried on the first page, and on a kernel without
    /// `MADV_POPULATE_WRITE` made here, in place. A first page refused otherwise (a
    /// memory cgroup at its limit) leaves nothing to copy.
    ///
    /// # Safety
    ///
    /// `regions` must stay mapped readable and writable until this value is dropped
    /// or `cancel`led, and no vCPU may run during this call.
    pub unsafe fn new(regions: &Regions, runs: &[(u64, u64)]) -> Self {
        let host = host_runs(regions, runs);
        let planned = host.iter().map(|r| r.1 as u64 / PAGE_SIZE).sum();
        let ahead = WriteAhead {
            ahead: std::sync::Mutex::new(Ahead::Done(0)),
            planned,
            copied: Default::default(),
            cancel: Default::default(),
        };
        let Some(&(first, _)) = host.first() else {
            return ahead;
        };
        // SAFETY: the first page of a run inside the regions (this function's contract).
        match unsafe { populate_write(first, PAGE_SIZE as usize) } {
            Ok(()) => *lock(&ahead.ahead) = Ahead::Pending(host),
            Err(libc::EINVAL) => {
                let cpu = crate::spawn_profile::clock_ns(libc::CLOCK_THREAD_CPUTIME_ID);
                for &(addr, len) in &host {
                    for page in (0..len).step_by(PAGE_SIZE as usize) {
                        let byte = (addr + page) as *mut u8;
                        // SAFETY: a byte of a page of the regions, which no vCPU or
                        // other thread writes during this call: read, then written
                        // back unchanged.
                        unsafe { byte.write_volatile(byte.read_volatile()) };
                    }
                }
                ahead.copied.store(planned, Relaxed);
                let spent = crate::spawn_profile::clock_ns(libc::CLOCK_THREAD_CPUTIME_ID) - cpu;
                *lock(&ahead.ahead) = Ahead::Done(spent);
            }
            Err(_) => {}
        }
        ahead
    }

    /// The pages of the set.
    pub fn planned(&self) -> u64 {
        self.planned
    }

    /// The pages copied so far.
    pub fn copied(&self) -> u64 {
        self.copied.load(Relaxed)
    }

    /// Start the copy, on a thread of its own, once (later calls do nothing). A thread
    /// that cannot start leaves the guest to fault its pages itself.
    pub fn begin(&self) {
        let mut ahead = lock(&self.ahead);
        let Ahead::Pending(runs) = &mut *ahead else {
            return;
        };
        let runs = std::mem::take(runs);
        *ahead = Ahead::Done(0);
        let (copied, cancel) = (self.copied.clone(), self.cancel.clone());
        let spawned = std::thread::Builder::new()
            .name("write-ahead".into())
            .stack_size(64 << 10)
            // SAFETY: the runs are inside the regions, which stay mapped until this
            // thread is joined (`WriteAhead::new`'s contract, `cancel`).
            .spawn(move || unsafe { copy_runs(&runs, &copied, &cancel) });
        if let Ok(handle) = spawned {
            *ahead = Ahead::Copying(handle);
        }
    }

    /// Copy the set now, on this thread, unless its copy has begun (then `begin` does
    /// nothing). For a machine whose vCPUs are parked, so that no stage-2 mapping is
    /// invalidated under a running guest and no thread competes with it: the child of
    /// a batch, before it reports itself prepared.
    pub fn copy_here(&self) {
        let mut ahead = lock(&self.ahead);
        let Ahead::Pending(runs) = &mut *ahead else {
            return;
        };
        let runs = std::mem::take(runs);
        // SAFETY: the runs are inside the regions, mapped until this value is dropped
        // or cancelled (`new`'s contract), which cannot happen during this call.
        let spent = unsafe { copy_runs(&runs, &self.copied, &self.cancel) };
        *ahead = Ahead::Done(spent);
    }

    /// Wait for the copy to end: the pages copied and the CPU time it took (ns). A
    /// copy never begun is dropped.
    pub fn finish(&self) -> (u64, i64) {
        let mut ahead = lock(&self.ahead);
        let spent = match std::mem::replace(&mut *ahead, Ahead::Done(0)) {
            Ahead::Copying(handle) => handle.join().unwrap_or(0),
            Ahead::Done(spent) => spent,
            Ahead::Pending(_) => 0,
        };
        *ahead = Ahead::Done(spent);
        (self.copied.load(Relaxed), spent)
    }

    /// Stop the copy where it is and wait for its thread: from here nothing of the
    /// regions is touched.
    pub fn cancel(&self) {
        self.cancel.store(true, Relaxed);
        self.finish();
    }
}

impl Drop for WriteAhead {
    fn drop(&mut self) {
        self.cancel();
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    const MIB: u64 = 1 << 20;

    fn entry(present: bool, file: bool) -> u64 {
        (if present { PM_PRESENT } else { 0 }) | (if file { PM_FILE } else { 0 })
    }

    #[test]
    fn only_present_private_copies_make_runs_and_neighbours_merge() {
        let entries = [
            entry(true, false),
            entry(true, false),
            entry(true, true),
            entry(false, false),
            entry(true, false),
        ];
        let mut runs = Vec::new();
        collect_runs(&entries, 0x10_0000, &mut runs);
        assert_eq!(
            runs,
            vec![(0x10_0000, 2 * PAGE_SIZE), (0x10_4000, PAGE_SIZE)]
        );
        // A next region's first page right after the last run joins it.
        collect_runs(&[entry(true, false)], 0x10_5000, &mut runs);
        assert_eq!(runs.last(), Some(&(0x10_4000, 2 * PAGE_SIZE)));
    }

    #[test]
    fn runs_stop_at_the_bound() {
        let entries: Vec<u64> = (0..2 * MAX_RUNS + 2)
            .map(|i| entry(i % 2 == 0, false))
            .collect();
        let mut runs = Vec::new();
        collect_runs(&entries, 0, &mut runs);
        assert_eq!(runs.len(), MAX_RUNS);
    }

    fn write(dir: &Path, text: &str) -> std::path::PathBuf {
        let path = dir.join(FILE_NAME);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn tempdir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "vmfork-write-set-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    const RAM: [(u64, u64, u64); 1] = [(0, 64 * MIB, 0)];

    #[test]
    fn a_saved_set_loads_back() {
        let dir = tempdir();
        let path = dir.join(FILE_NAME);
        let runs = vec![(0, PAGE_SIZE), (8 * PAGE_SIZE, 3 * PAGE_SIZE)];
        save(&path, &runs).unwrap();
        assert_eq!(load(&path, &RAM).unwrap(), runs);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_hostile_file_is_refused_with_its_reason() {
        let dir = tempdir();
        for (text, why) in [
            (r#"{"version": 1, "runs": [[1, 4096]]}"#, "whole pages"),
            (r#"{"version": 1, "runs": [[0, 0]]}"#, "whole pages"),
            (
                r#"{"version": 1, "runs": [[8192, 4096], [4096, 4096]]}"#,
                "after",
            ),
            (
                r#"{"version": 1, "runs": [[0, 8192], [4096, 4096]]}"#,
                "after",
            ),
            (
                r#"{"version": 1, "runs": [[67104768, 8192]]}"#,
                "inside guest RAM",
            ),
            (
                r#"{"version": 1, "runs": [[18446744073709547520, 8192]]}"#,
                "inside",
            ),
            (r#"{"version": 2, "runs": []}"#, "version 2"),
            (r#"{"version": 1, "runs": [], "more": 1}"#, "unknown field"),
            ("[", "EOF"),
        ] {
            let err = load(&write(&dir, text), &RAM).unwrap_err();
            assert!(err.contains(why), "{text}: {err}");
        }
        let big = write(&dir, &" ".repeat(MAX_FILE_BYTES as usize + 1));
        assert!(load(&big, &RAM).unwrap_err().contains("more than"));
        let link = dir.join("link.json");
        std::os::unix::fs::symlink(&big, &link).unwrap();
        assert!(load(&link, &RAM).is_err(), "a symbolic link is followed");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_set_is_cut_at_a_quarter_of_the_ram() {
        let runs: Vec<(u64, u64)> = (0..20).map(|i| (i * MIB, MIB)).collect();
        let kept = checked(&runs, &RAM).unwrap();
        assert_eq!(kept.iter().map(|r| r.1).sum::<u64>(), max_bytes(64 * MIB));
    }

    /// A private mapping of a file, as a child's RAM is; unmapped when dropped.
    struct Mapping {
        addr: usize,
        len: usize,
    }

    impl Mapping {
        /// The mapping as guest RAM's one region, at guest address `gpa`.
        fn region(&self, gpa: u64) -> [(u64, u64, u64); 1] {
            [(gpa, self.len as u64, self.addr as u64)]
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: the test's own mapping; each test drops its copies first.
            unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
        }
    }

    fn private_mapping(pages: u64) -> Mapping {
        let dir = tempdir();
        let path = dir.join("memory");
        let mut file = File::create(&path).unwrap();
        for page in 0..pages {
            file.write_all(&[page as u8 + 1; PAGE_SIZE as usize])
                .unwrap();
        }
        let file = File::open(&path).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        let len = (pages * PAGE_SIZE) as usize;
        // SAFETY: a new private mapping of the file, ours alone.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        Mapping {
            addr: addr as usize,
            len,
        }
    }

    #[test]
    fn populated_pages_become_the_process_own_copies_unchanged_and_are_read_back() {
        let pages = 16;
        let ram = private_mapping(pages);
        let regions = ram.region(0x20_0000);
        let runs = [
            (0x20_0000 + PAGE_SIZE, 2 * PAGE_SIZE),
            (0x20_0000 + 9 * PAGE_SIZE, PAGE_SIZE),
        ];
        // SAFETY: the test's own mapping, unmapped after the copy is dropped (`Mapping`).
        let ahead = unsafe { WriteAhead::new(&regions, &runs) };
        assert_eq!(ahead.planned(), 3);
        ahead.begin();
        ahead.begin(); // once only
        assert_eq!(ahead.finish().0, 3);
        for page in 0..pages {
            // SAFETY: a byte of the mapping above.
            let byte = unsafe { *((ram.addr + (page * PAGE_SIZE) as usize) as *const u8) };
            assert_eq!(byte, page as u8 + 1, "page {page} changed");
        }
        let pagemap = File::open("/proc/self/pagemap").unwrap();
        assert_eq!(written_runs(pagemap.as_raw_fd(), &regions).unwrap(), runs);
    }

    #[test]
    fn the_copy_waits_for_begin_and_a_cancelled_one_copies_nothing_more() {
        let pages = 8;
        let ram = private_mapping(pages);
        let regions = ram.region(0);
        let pagemap = File::open("/proc/self/pagemap").unwrap();
        // SAFETY: the test's own mapping, unmapped after the copies are dropped.
        let ahead = unsafe { WriteAhead::new(&regions, &[(0, 4 * PAGE_SIZE)]) };
        // Only the first page, tried at once; the rest waits for the guest's start.
        assert_eq!(
            written_runs(pagemap.as_raw_fd(), &regions).unwrap(),
            [(0, PAGE_SIZE)]
        );
        ahead.cancel();
        ahead.begin();
        assert_eq!(ahead.finish().0, 0);
        drop(ahead);
        // A copy dropped before it began never begins.
        // SAFETY: as above.
        drop(unsafe { WriteAhead::new(&regions, &[(4 * PAGE_SIZE, 4 * PAGE_SIZE)]) });
        assert_eq!(
            written_runs(pagemap.as_raw_fd(), &regions).unwrap(),
            [(0, PAGE_SIZE), (4 * PAGE_SIZE, PAGE_SIZE)]
        );
    }

    #[test]
    fn a_copy_made_here_is_done_when_it_returns_and_begins_no_thread() {
        let pages = 4;
        let ram = private_mapping(pages);
        let regions = ram.region(0);
        // SAFETY: the test's own mapping, unmapped after the copy is dropped (`Mapping`).
        let ahead = unsafe { WriteAhead::new(&regions, &[(PAGE_SIZE, 3 * PAGE_SIZE)]) };
        ahead.copy_here();
        assert_eq!(ahead.copied(), 3);
        ahead.begin(); // nothing left to begin
        assert_eq!(ahead.finish().0, 3);
        let pagemap = File::open("/proc/self/pagemap").unwrap();
        assert_eq!(
            written_runs(pagemap.as_raw_fd(), &regions).unwrap(),
            [(PAGE_SIZE, 3 * PAGE_SIZE)]
        );
    }

    #[test]
    fn a_run_outside_the_regions_ends_the_set() {
        let ram = private_mapping(2);
        let regions = ram.region(0);
        // SAFETY: the test's own mapping, unmapped after the copy is dropped (`Mapping`).
        let ahead =
            unsafe { WriteAhead::new(&regions, &[(0, PAGE_SIZE), (PAGE_SIZE, 2 * PAGE_SIZE)]) };
        assert_eq!(ahead.planned(), 1);
        ahead.begin();
        assert_eq!(ahead.finish().0, 1);
    }
}
