//! virtio-blk's request path against arbitrary guest memory and queue registers:
//! whatever the descriptor table, rings, headers and sectors hold, serving the queue
//! ends (no hang: libFuzzer's timeout catches one), fails only as a guest error, stays
//! within its budget, puts one used entry per request served, never writes a
//! read-only or detached disk, and never grows the disk past its capacity. The
//! disk is a real file (a memfd of a few sectors), so the reads and writes are real.
#![no_main]

#[allow(dead_code)]
#[path = "../../src/blk.rs"]
mod blk;
#[path = "common/guest_image.rs"]
mod guest_image;
#[allow(dead_code)]
#[path = "../../src/guest_ram.rs"]
mod guest_ram;
#[allow(dead_code)]
#[path = "../../src/virtq.rs"]
mod virtq;

use guest_image::{rings, GuestImage};
use libfuzzer_sys::fuzz_target;
const DISK: usize = 8 * 512;

fn disk_file() -> i32 {
    // SAFETY: a NUL-terminated name; memfd_create takes no other pointer.
    let fd = unsafe { libc::memfd_create(c"blk-fuzz".as_ptr(), 0) };
    assert!(fd >= 0, "memfd_create");
    let bytes: Vec<u8> = (0..DISK).map(|i| (i % 251) as u8).collect();
    // SAFETY: `bytes` is ours and outlives the call.
    let n = unsafe { libc::pwrite(fd, bytes.as_ptr().cast(), DISK, 0) };
    assert_eq!(n, DISK as isize);
    fd
}

fn disk_bytes(fd: i32) -> Vec<u8> {
    let mut out = vec![0u8; DISK + 512];
    // SAFETY: `out` is ours; pread writes at most its length.
    let n = unsafe { libc::pread(fd, out.as_mut_ptr().cast(), out.len(), 0) };
    out.truncate(n.max(0) as usize);
    out
}

fuzz_target!(|input: &[u8]| {
    if input.len() < 32 {
        return;
    }
    let (head, image) = input.split_at(32);
    let rings = rings(head, 0);
    let next_avail = u16::from_le_bytes([head[2], head[3]]);
    let flags = head[4];
    let max_requests = u32::from(head[5] % 70);
    let max_bytes = u64::from(head[6]) << (head[7] % 24);
    let guest = GuestImage::new(image);
    let r = guest.ram().lock().unwrap();
    if virtq::validate(&r, &rings, 256).is_err() {
        return;
    }
    let fd = disk_file();
    let before = disk_bytes(fd);
    let read_only = flags & 1 != 0;
    let disk = blk::Disk {
        fd: if flags & 2 != 0 { None } else { Some(fd) },
        // A capacity that may exceed the file (a file shortened under us).
        capacity: if flags & 4 != 0 {
            2 * DISK as u64
        } else {
            DISK as u64
        },
        read_only,
        id: b"0123456789abcdef0123",
    };
    let s = blk::serve(
        &r,
        &rings,
        next_avail,
        next_avail,
        &disk,
        max_requests,
        max_bytes,
    );
    assert!(s.served <= max_requests);
    assert_eq!(u32::from(s.next_used.wrapping_sub(next_avail)), s.served);
    assert!(s.counters.requests <= u64::from(s.served) + 1);
    assert!(s.counters.bytes_read <= s.moved);
    let after = disk_bytes(fd);
    if read_only || disk.fd.is_none() {
        assert_eq!(before, after, "a read-only or detached disk was written");
    }
    assert!(
        after.len() <= disk.capacity as usize,
        "written past the capacity"
    );
    // SAFETY: `fd` is ours, closed once.
    unsafe { libc::close(fd) };
});
