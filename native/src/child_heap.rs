//! The core's global allocator: glibc's everywhere, except in a native child, whose
//! Rust allocations come from a mapping of its own.
//!
//! Why. A forked child inherits the zygote's heap, and glibc serves the child's
//! allocations from the zygote's free lists, scattered over that heap: each one
//! copies a 4 KiB page of the zygote's to write a few bytes, and an idle native
//! child owned ~570 KiB of `[heap]` that way, most of its own memory at N = 10
//! (design notes, "Where an idle native child's memory goes"). Allocated from fresh
//! pages instead, the same allocations pack densely.
//!
//! How. Until `use_fresh_pages` is called the allocator is `System`. The call (once
//! per process, in the child, before its first thread) maps an anonymous region
//! between two inaccessible pages, names it `[anon:vmfork-child-heap]` in smaps where
//! the kernel names anonymous mappings, and from then on serves every
//! allocation under `SMALL_MAX` from it with `talc` (a dlmalloc-style allocator over
//! a region it is given). Larger ones stay glibc's: it maps them fresh and unmaps
//! them when freed, where a region would keep their pages dirty. A pointer is freed
//! by whoever owns its address, so the zygote's allocations the child drops go back
//! to glibc. A full region falls back to glibc as well.
//!
//! Locking. One lock, glibc's mutex, taken for a few hundred nanoseconds at a time.
//! No signal handler of the core allocates (`vcpu.rs`'s kick, `child.rs`'s SIGTERM),
//! so a handler cannot wait for the lock its own thread holds. A fork from a child
//! (a diff or live BRANCH's writer, forked by the hand-over's Python) takes the lock
//! first through `pthread_atfork`, as glibc does for its own arenas, so the forked
//! process never inherits it held by a thread that does not exist there.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use talc::base::Talc;
use talc::source::Manual;
use talc::DefaultBinning;

/// The region's size: address space only (`MAP_NORESERVE`); a page costs memory
/// once written. An idle native child's allocations under `SMALL_MAX` come to a few
/// hundred KiB; a busy one's connections and logs are bounded well under this. A
/// size no other mapping of a VMM process has, so `runtime/memphases.py` tells the
/// region apart where the kernel names no anonymous mapping (`_core.CHILD_HEAP_BYTES`).
pub(crate) const REGION_BYTES: usize = 48 << 20;

/// An inaccessible page on each side of the region.
const GUARD_BYTES: usize = 4096;

/// Allocations from this size up stay glibc's (its default mmap threshold).
const SMALL_MAX: usize = 128 << 10;

/// The name the region has in `/proc/<pid>/smaps` (`[anon:vmfork-child-heap]`), for
/// `runtime/memphases.py`'s breakdown.
const REGION_NAME: &std::ffi::CStr = c"vmfork-child-heap";

pub struct CoreAllocator {
    /// The region's bounds; both 0 until `use_fresh_pages`.
    start: AtomicUsize,
    end: AtomicUsize,
    /// glibc's mutex: it sleeps in the kernel when taken, so a waiter leaves the CPU to
    /// the holder (a spinning waiter, tried first, could burn its time slices while the
    /// holder waited to run behind a hundred other children's threads).
    lock: UnsafeCell<libc::pthread_mutex_t>,
    talc: UnsafeCell<Talc<Manual, DefaultBinning>>,
}

// SAFETY: `talc` is only reached through `with_talc`, under `lock`; the mutex is made
// for sharing between threads.
unsafe impl Sync for CoreAllocator {}

#[global_allocator]
static ALLOCATOR: CoreAllocator = CoreAllocator::new();

impl CoreAllocator {
    const fn new() -> Self {
        CoreAllocator {
            start: AtomicUsize::new(0),
            end: AtomicUsize::new(0),
            lock: UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER),
            talc: UnsafeCell::new(Talc::new(Manual)),
        }
    }

    fn lock(&self) {
        // SAFETY: a mutex initialised statically, never moved once used (it lives in a
        // static, or in a test's allocator that stays put), locked by this thread.
        unsafe { libc::pthread_mutex_lock(self.lock.get()) };
    }

    fn unlock(&self) {
        // SAFETY: as `lock`; this thread holds it.
        unsafe { libc::pthread_mutex_unlock(self.lock.get()) };
    }

    fn with_talc<R>(&self, f: impl FnOnce(&mut Talc<Manual, DefaultBinning>) -> R) -> R {
        self.lock();
        // SAFETY: the lock is held, so this is the only reference to the allocator.
        let out = f(unsafe { &mut *self.talc.get() });
        self.unlock();
        out
    }

    /// Serving from fresh pages (`use_fresh_pages` was called).
    fn fresh(&self) -> bool {
        self.end.load(Ordering::Acquire) != 0
    }

    fn owns(&self, ptr: *mut u8) -> bool {
        let at = ptr as usize;
        at >= self.start.load(Ordering::Acquire) && at < self.end.load(Ordering::Acquire)
    }

    fn alloc_in_region(&self, layout: Layout) -> Option<*mut u8> {
        if layout.size() >= SMALL_MAX || !self.fresh() {
            return None;
        }
        // SAFETY: the size is nonzero (GlobalAlloc's callers never ask for zero bytes).
        self.with_talc(|talc| unsafe { talc.allocate(layout) })
            .map(NonNull::as_ptr)
    }

    /// Serve this allocator from `region` from now on (`use_fresh_pages`, and the tests'
    /// own regions). Returns false, changing nothing, if talc cannot claim it.
    ///
    /// # Safety
    /// `region` is writable memory of `len` bytes that nothing else uses from now on,
    /// and this is the allocator's first region.
    unsafe fn serve_from(&self, region: *mut u8, len: usize) -> bool {
        // SAFETY: the caller's contract; the lock makes this the only reference.
        let claimed = self.with_talc(|talc| unsafe { talc.claim(region, len) });
        if claimed.is_none() {
            return false;
        }
        self.start.store(region as usize, Ordering::Release);
        self.end.store(region as usize + len, Ordering::Release);
        true
    }
}

// SAFETY: every pointer handed out is either glibc's (`System`, with the layout it was
// asked for) or talc's within the region; each is freed or resized by its owner,
// decided by its address, which no glibc allocation can share with the region.
unsafe impl GlobalAlloc for CoreAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match self.alloc_in_region(layout) {
            Some(ptr) => ptr,
            // SAFETY: GlobalAlloc's own contract, passed on.
            None => unsafe { System.alloc(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if self.owns(ptr) {
            // SAFETY: talc handed out `ptr` with `layout` (it is in the region).
            self.with_talc(|talc| unsafe { talc.deallocate(ptr, layout) });
        } else {
            // SAFETY: glibc handed out `ptr` with `layout`.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let ours = self.owns(ptr);
        if ours
            // SAFETY: talc's pointer with its layout; `new_size` is nonzero.
            && self.with_talc(|talc| unsafe { talc.try_realloc_in_place(ptr, layout, new_size) })
        {
            return ptr;
        }
        if !ours && (!self.fresh() || new_size >= SMALL_MAX) {
            // SAFETY: glibc's pointer, staying glibc's (no region yet, or too large for
            // it): glibc resizes it, in place where it can.
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // Moved: to the region if it fits there (a zygote's block the child grows
        // moves onto the child's fresh pages), else to glibc.
        // SAFETY: `new_size` with `layout`'s alignment is a valid layout (realloc's
        // contract).
        let grown = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: a nonzero layout.
        let moved = unsafe { self.alloc(grown) };
        if !moved.is_null() {
            // SAFETY: two distinct blocks, each at least as long as the copy.
            unsafe { std::ptr::copy_nonoverlapping(ptr, moved, layout.size().min(new_size)) };
            // SAFETY: `ptr` with `layout` is the caller's, freed once, by its owner.
            unsafe { self.dealloc(ptr, layout) };
        }
        moved
    }
}

extern "C" fn before_fork() {
    ALLOCATOR.lock();
}

extern "C" fn after_fork_in_parent() {
    ALLOCATOR.unlock();
}

extern "C" fn after_fork_in_child() {
    // The forking thread took the lock; in the child it is the only thread, with
    // another thread id: the lock is made anew rather than unlocked by a new owner.
    // SAFETY: one thread runs here, and nothing else refers to the mutex.
    unsafe { *ALLOCATOR.lock.get() = libc::PTHREAD_MUTEX_INITIALIZER };
}

/// Serve this process's Rust allocations from fresh pages from now on (the module's
/// doc says why). For a native child, in the child, while it has one thread: the
/// first call maps and claims the region; later calls do nothing. A region the kernel
/// refuses leaves glibc serving everything, as before, and says why.
pub(crate) fn use_fresh_pages() -> Result<(), String> {
    if ALLOCATOR.fresh() {
        return Ok(());
    }
    // The region between two inaccessible pages: a mapping of its own in smaps, never
    // merged by the kernel with a neighbour of the same protection and flags (a thread's
    // stack is `MAP_NORESERVE` too), so `memphases` finds it by its size.
    let reserved = REGION_BYTES + 2 * GUARD_BYTES;
    // SAFETY: a fresh anonymous private mapping at an address the kernel picks; no
    // existing memory is touched.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserved,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(format!(
            "mmap of the child's heap: {}",
            std::io::Error::last_os_error()
        ));
    }
    let unmap = || {
        // SAFETY: our own mapping, unused.
        unsafe { libc::munmap(base, reserved) };
    };
    // SAFETY: inside the mapping just made.
    let region = unsafe { base.cast::<u8>().add(GUARD_BYTES) }.cast::<libc::c_void>();
    // SAFETY: the range lies inside the mapping just made, which nothing else uses.
    if unsafe { libc::mprotect(region, REGION_BYTES, libc::PROT_READ | libc::PROT_WRITE) } != 0 {
        let err = std::io::Error::last_os_error();
        unmap();
        return Err(format!("mprotect of the child's heap: {err}"));
    }
    // A name in smaps only; a kernel without CONFIG_ANON_VMA_NAME refuses it, harmlessly.
    // SAFETY: the range is the mapping above; the name is a NUL-terminated string the
    // kernel copies.
    unsafe {
        libc::prctl(
            libc::PR_SET_VMA,
            libc::PR_SET_VMA_ANON_NAME,
            region as libc::c_ulong,
            REGION_BYTES as libc::c_ulong,
            REGION_NAME.as_ptr() as libc::c_ulong,
        )
    };
    // SAFETY: one thread runs (the caller's contract), so the handlers are registered
    // before any fork this process makes; they take and give back the lock only.
    let rc = unsafe {
        libc::pthread_atfork(
            Some(before_fork),
            Some(after_fork_in_parent),
            Some(after_fork_in_child),
        )
    };
    // SAFETY: the mapping is new, writable, REGION_BYTES long and used by nothing else;
    // no region was served before (`fresh` was false).
    if rc != 0 || !unsafe { ALLOCATOR.serve_from(region.cast(), REGION_BYTES) } {
        unmap();
        return Err(if rc != 0 {
            format!("pthread_atfork: {}", std::io::Error::from_raw_os_error(rc))
        } else {
            "talc refused the child's heap".to_owned()
        });
    }
    Ok(())
}

/// The region's bounds (`(start, end)`), or None before `use_fresh_pages`: for tests
/// that check where an allocation landed.
#[cfg(test)]
fn region() -> Option<(usize, usize)> {
    ALLOCATOR.fresh().then(|| {
        (
            ALLOCATOR.start.load(Ordering::Acquire),
            ALLOCATOR.end.load(Ordering::Acquire),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An allocator of its own over a heap-allocated buffer, so the test does not
    /// depend on the process's global one.
    struct Local {
        alloc: CoreAllocator,
        buf: Vec<u64>,
    }

    impl Local {
        fn new() -> Self {
            Local {
                alloc: CoreAllocator::new(),
                buf: vec![0u64; 1 << 16],
            }
        }

        fn switch(&mut self) {
            let len = self.buf.len() * 8;
            // SAFETY: the buffer is ours, unused otherwise, and lives as long as `alloc`.
            assert!(unsafe { self.alloc.serve_from(self.buf.as_mut_ptr().cast(), len) });
        }
    }

    #[test]
    fn glibc_serves_until_the_switch_and_each_block_goes_back_to_its_owner() {
        let mut local = Local::new();
        let small = Layout::from_size_align(40, 8).unwrap();
        // SAFETY: nonzero layouts; every block is freed once with its own layout.
        unsafe {
            let before = local.alloc.alloc(small);
            assert!(!before.is_null() && !local.alloc.owns(before));
            before.write_bytes(0xAB, 40);

            local.switch();
            let after = local.alloc.alloc(small);
            assert!(
                local.alloc.owns(after),
                "a small block after the switch is the region's"
            );
            let large = local
                .alloc
                .alloc(Layout::from_size_align(SMALL_MAX, 8).unwrap());
            assert!(
                !large.is_null() && !local.alloc.owns(large),
                "a large one stays glibc's"
            );

            // A large glibc block grows as glibc's.
            let big = Layout::from_size_align(SMALL_MAX, 8).unwrap();
            let big_block = local.alloc.alloc(big);
            let bigger = local.alloc.realloc(big_block, big, 2 * SMALL_MAX);
            assert!(!bigger.is_null() && !local.alloc.owns(bigger));
            local
                .alloc
                .dealloc(bigger, Layout::from_size_align(2 * SMALL_MAX, 8).unwrap());

            // A zygote block grown in the child moves to the region, its bytes kept.
            let grown = local.alloc.realloc(before, small, 400);
            assert!(local.alloc.owns(grown));
            assert!(std::slice::from_raw_parts(grown, 40)
                .iter()
                .all(|&b| b == 0xAB));

            // The region's blocks grow in place or move within it.
            let regrown =
                local
                    .alloc
                    .realloc(grown, Layout::from_size_align(400, 8).unwrap(), 4000);
            assert!(local.alloc.owns(regrown));
            assert!(std::slice::from_raw_parts(regrown, 40)
                .iter()
                .all(|&b| b == 0xAB));

            local
                .alloc
                .dealloc(regrown, Layout::from_size_align(4000, 8).unwrap());
            local.alloc.dealloc(after, small);
            local
                .alloc
                .dealloc(large, Layout::from_size_align(SMALL_MAX, 8).unwrap());
        }
    }

    #[test]
    fn a_full_region_falls_back_to_glibc() {
        let mut local = Local::new();
        local.switch();
        let block = Layout::from_size_align(32 << 10, 8).unwrap();
        let mut blocks = Vec::new();
        // SAFETY: nonzero layouts, each freed once below.
        unsafe {
            // 512 KiB of region: the 17th block of 32 KiB cannot fit.
            for _ in 0..20 {
                let ptr = local.alloc.alloc(block);
                assert!(!ptr.is_null());
                blocks.push(ptr);
            }
            assert!(
                blocks.iter().any(|&p| !local.alloc.owns(p)),
                "some came from glibc"
            );
            assert!(
                blocks.iter().any(|&p| local.alloc.owns(p)),
                "some from the region"
            );
            for ptr in blocks {
                local.alloc.dealloc(ptr, block);
            }
        }
    }

    #[test]
    fn a_child_allocates_from_its_own_mapping_on_every_thread() {
        // The global allocator, switched in a forked child (a switched test process
        // would stay switched for every later test).
        crate::machine::tests::in_child(|| {
            let before = vec![1u8; 64];
            use_fresh_pages()?;
            let (start, end) = region().ok_or("no region after the switch")?;
            let inside = |p: *const u8| (start..end).contains(&(p as usize));
            let here = Box::new([2u8; 64]);
            let there = std::thread::spawn(|| {
                let block = Box::new([3u8; 64]);
                block.as_ptr() as usize
            })
            .join()
            .map_err(|_| "the thread panicked")?;
            let maps = std::fs::read_to_string("/proc/self/maps").map_err(|e| e.to_string())?;
            let named = maps.lines().any(|l| l.contains("[anon:vmfork-child-heap]"));
            drop(before);
            if !inside(here.as_ptr()) || !inside(there as *const u8) {
                return Err(format!(
                    "allocations outside the region {start:#x}..{end:#x}"
                ));
            }
            if !named && !maps.contains(&format!("{start:x}-")) {
                return Err("the region is not in /proc/self/maps".into());
            }
            Ok(())
        });
    }

    #[test]
    fn a_fork_while_another_thread_allocates_leaves_the_forked_process_an_allocator() {
        // A BRANCH writer is forked from a child whose I/O thread may be allocating:
        // without the fork handlers, the writer could inherit the lock held and hang at
        // its first allocation.
        crate::machine::tests::in_child(|| {
            use_fresh_pages()?;
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let churn = {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let block: Vec<u64> = (0..64).collect();
                        std::hint::black_box(block);
                    }
                })
            };
            let mut outcome = Ok(());
            for _ in 0..50 {
                // SAFETY: the forked process allocates, then leaves with `_exit`.
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    let block = std::hint::black_box(vec![7u8; 256]);
                    // SAFETY: leaves at once, running no destructor of the parent's.
                    unsafe { libc::_exit(i32::from(block[255] != 7)) };
                }
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                let mut status = 0;
                // SAFETY: our own child, and a status to fill.
                while unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == 0 {
                    if std::time::Instant::now() > deadline {
                        // SAFETY: our own child.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                        outcome = Err("a forked process hung at its first allocation".into());
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                if outcome.is_err() {
                    break;
                }
                if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
                    outcome = Err(format!("the forked process ended with status {status}"));
                    break;
                }
            }
            stop.store(true, Ordering::Relaxed);
            churn.join().map_err(|_| "the allocating thread panicked")?;
            outcome
        });
    }
}
