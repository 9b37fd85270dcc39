//! virtio-blk's request path, natively: pop a request chain, parse and bound its
//! header, move the data with one `preadv`/`pwritev` straight between the backing
//! file and the guest's buffers, write the status byte, put the chain on the used
//! ring. What a request may be and what each wrong one gets are the rules in
//! `blk.py`'s module comment, which gives the reasons; this file is their one
//! implementation (tests/unit/test_virtio_blk_native.py drives hostile chains through
//! it and works the spec's answers out for clean ones).
//!
//! Bounds on what the guest drives: a call serves at most `max_requests` chains and
//! stops once `max_bytes` have been written to guest buffers (the caller re-arms, as
//! `blk.py` does); a chain is at most the queue size long (`virtq::pop`), so an iovec
//! list has at most 256 entries (IOV_MAX is 1024); a request moves at most
//! `MAX_BYTES_PER_REQUEST`, checked before any I/O, with sector arithmetic in u128 so
//! no guest number overflows. Nothing is allocated by guest-chosen sizes.
//!
//! The device state (counters, the media, the queue indices) stays in Python: a call
//! takes the numbers it needs and reports what changed, including the counters and
//! the host failures to log of the requests served before a guest fault, which
//! `blk.py` counts and logs before it raises the fault.

use crate::guest_ram::Ram;
use crate::virtq::{self, QueueError, Rings};

pub const SECTOR_SIZE: u64 = 512;
pub const HEADER_SIZE: u64 = 16;
pub const ID_BYTES: usize = 20;
pub const MAX_BYTES_PER_REQUEST: u64 = 128 * 64 * 1024; // SEG_MAX x SIZE_MAX

pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;
pub const T_FLUSH: u32 = 4;
pub const T_GET_ID: u32 = 8;
pub const T_DISCARD: u32 = 11;
pub const T_WRITE_ZEROES: u32 = 13;
pub const T_SECURE_ERASE: u32 = 14;
pub const S_OK: u8 = 0;
pub const S_IOERR: u8 = 1;
pub const S_UNSUPP: u8 = 2;

/// Everything that would change the disk (IOERR on a read-only device).
fn is_write_type(kind: u32) -> bool {
    matches!(kind, T_OUT | T_DISCARD | T_WRITE_ZEROES | T_SECURE_ERASE)
}

/// The media as `blk.py` holds them: `fd` is None once detached (or for an empty slot).
#[derive(Clone, Copy, Debug)]
pub struct Disk<'a> {
    pub fd: Option<i32>,
    pub capacity: u64,
    pub read_only: bool,
    pub id: &'a [u8],
}

/// `blk.py`'s `BlkCounters`, as increments of one call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub requests: u64,
    pub reads: u64,
    pub bytes_read: u64,
    pub flushes: u64,
    pub get_ids: u64,
    pub writes: u64,
    pub bytes_written: u64,
    pub write_errors: u64,
    pub writes_refused: u64,
    pub read_errors: u64,
    pub malformed: u64,
    pub unsupported: u64,
}

impl Counters {
    /// The counters as `BlkCounters`' fields: (name, n).
    pub fn named(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("requests", self.requests),
            ("reads", self.reads),
            ("bytes_read", self.bytes_read),
            ("flushes", self.flushes),
            ("get_ids", self.get_ids),
            ("writes", self.writes),
            ("bytes_written", self.bytes_written),
            ("write_errors", self.write_errors),
            ("writes_refused", self.writes_refused),
            ("read_errors", self.read_errors),
            ("malformed", self.malformed),
            ("unsupported", self.unsupported),
        ]
    }

    pub fn add(&mut self, more: &Counters) {
        self.requests += more.requests;
        self.reads += more.reads;
        self.bytes_read += more.bytes_read;
        self.flushes += more.flushes;
        self.get_ids += more.get_ids;
        self.writes += more.writes;
        self.bytes_written += more.bytes_written;
        self.write_errors += more.write_errors;
        self.writes_refused += more.writes_refused;
        self.read_errors += more.read_errors;
        self.malformed += more.malformed;
        self.unsupported += more.unsupported;
    }
}

/// A host failure `blk.py` logs as a warning (the caller logs it, with the path).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Warning {
    /// (length, offset, errno)
    ReadFailed(u64, u64, i32),
    /// (got, length, offset)
    ReadShort(u64, u64, u64),
    WriteFailed(u64, u64, i32),
    /// (done, length, offset)
    WriteShort(u64, u64, u64),
    /// errno
    FdatasyncFailed(i32),
}

impl Warning {
    /// (kind, a, b, c): the warning as plain values, for a Python caller.
    pub fn as_tuple(&self) -> (&'static str, u64, u64, i64) {
        match *self {
            Warning::ReadFailed(len, off, e) => ("read_failed", len, off, i64::from(e)),
            Warning::ReadShort(got, len, off) => ("read_short", got, len, off as i64),
            Warning::WriteFailed(len, off, e) => ("write_failed", len, off, i64::from(e)),
            Warning::WriteShort(done, len, off) => ("write_short", done, len, off as i64),
            Warning::FdatasyncFailed(e) => ("fdatasync_failed", 0, 0, i64::from(e)),
        }
    }
}

/// What one call did. `error` is the guest fault that ended it, if one did; the
/// counters and warnings are those of the requests served before it.
#[derive(Debug)]
pub struct Served {
    pub next_avail: u16,
    pub next_used: u16,
    pub served: u32,
    pub moved: u64,
    /// The budget ran out before the queue did (the caller serves again later).
    pub more: bool,
    pub counters: Counters,
    pub warnings: Vec<Warning>,
    pub error: Option<QueueError>,
}

/// Serve the request queue from `next_avail`/`next_used` (`blk_serve.rs`'s wake).
pub fn serve(
    ram: &Ram<'_>,
    rings: &Rings,
    next_avail: u16,
    next_used: u16,
    disk: &Disk<'_>,
    max_requests: u32,
    max_bytes: u64,
) -> Served {
    let mut out = Served {
        next_avail,
        next_used,
        served: 0,
        moved: 0,
        more: true,
        counters: Counters::default(),
        warnings: Vec::new(),
        error: None,
    };
    while out.served < max_requests && out.moved < max_bytes {
        match serve_one(ram, rings, disk, &mut out) {
            Ok(true) => {}
            Ok(false) => {
                out.more = false;
                break;
            }
            Err(e) => {
                out.error = Some(e);
                break;
            }
        }
    }
    out
}

/// One chain: Ok(false) if the driver offered none.
fn serve_one(
    ram: &Ram<'_>,
    rings: &Rings,
    disk: &Disk<'_>,
    out: &mut Served,
) -> Result<bool, QueueError> {
    let Some(chain) = virtq::pop(ram, rings, out.next_avail)? else {
        return Ok(false);
    };
    out.next_avail = out.next_avail.wrapping_add(1);
    let (data, status_at) = split_status(&chain)?;
    out.counters.requests += 1;
    let (status, written) = execute(ram, &chain, &data, disk, out)?;
    ram.write_from(status_at, &[status])?;
    let written = written + 1;
    out.next_used = virtq::add_used(ram, rings, out.next_used, chain.head, written as u32)?;
    out.served += 1;
    out.moved += written;
    Ok(true)
}

/// The data segments of the writable part and the address of the status byte (its
/// very last byte); zero-length descriptors carry nothing and are dropped.
fn split_status(chain: &virtq::Chain) -> Result<(Vec<(u64, u32)>, u64), QueueError> {
    let mut segments: Vec<(u64, u32)> = chain
        .writable
        .iter()
        .copied()
        .filter(|&(_, n)| n > 0)
        .collect();
    let Some((gpa, n)) = segments.pop() else {
        return Err(QueueError::Virtqueue(format!(
            "virtio-blk request {} has no device-writable byte for its status",
            chain.head
        )));
    };
    if n > 1 {
        segments.push((gpa, n - 1));
    }
    Ok((segments, gpa + u64::from(n) - 1))
}

/// `segments` without their first `skip` bytes, zero-length ones dropped.
fn skip(segments: &[(u64, u32)], mut skip: u64) -> Vec<(u64, u32)> {
    let mut out = Vec::new();
    for &(gpa, n) in segments {
        let len = u64::from(n);
        if skip >= len {
            skip -= len;
            continue;
        }
        out.push((gpa + skip, (len - skip) as u32));
        skip = 0;
    }
    out
}

/// (status, data bytes written) for one request.
fn execute(
    ram: &Ram<'_>,
    chain: &virtq::Chain,
    data: &[(u64, u32)],
    disk: &Disk<'_>,
    out: &mut Served,
) -> Result<(u8, u64), QueueError> {
    let c = &mut out.counters;
    let readable = virtq::total(&chain.readable);
    if readable < HEADER_SIZE {
        c.malformed += 1;
        return Ok((S_IOERR, 0));
    }
    let raw = virtq::read_segments(ram, &chain.readable, HEADER_SIZE as usize, 0)?;
    let kind = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
    let mut sector = [0u8; 8];
    sector.copy_from_slice(&raw[8..16]);
    let sector = u64::from_le_bytes(sector);
    if kind == T_OUT && !disk.read_only {
        if !data.is_empty() {
            c.malformed += 1;
            return Ok((S_IOERR, 0));
        }
        let segments = skip(&chain.readable, HEADER_SIZE);
        return Ok((write(ram, &segments, sector, disk, out)?, 0));
    }
    if is_write_type(kind) {
        c.writes_refused += 1;
        return Ok((S_IOERR, 0));
    }
    if kind == T_FLUSH {
        c.flushes += 1;
        return Ok((flush(disk, out), 0));
    }
    if kind != T_IN && kind != T_GET_ID {
        c.unsupported += 1;
        return Ok((S_UNSUPP, 0));
    }
    if readable != HEADER_SIZE {
        c.malformed += 1;
        return Ok((S_IOERR, 0));
    }
    if kind == T_GET_ID {
        c.get_ids += 1;
        let room = virtq::total(data).min(disk.id.len() as u64) as usize;
        let done = virtq::write_segments(ram, data, &disk.id[..room], 0)?;
        return Ok((S_OK, done as u64));
    }
    read(ram, data, sector, disk, out)
}

/// Whether `length` bytes at `sector` are a request the disk may serve.
fn in_bounds(length: u64, sector: u64, disk: &Disk<'_>) -> bool {
    let end = u128::from(sector) * u128::from(SECTOR_SIZE) + u128::from(length);
    length.is_multiple_of(SECTOR_SIZE)
        && length <= MAX_BYTES_PER_REQUEST
        && end <= u128::from(disk.capacity)
        && disk.fd.is_some()
}

/// iovecs over `segments` (each checked to lie in one RAM region by `host`).
fn iovecs(ram: &Ram<'_>, segments: &[(u64, u32)]) -> Result<Vec<libc::iovec>, QueueError> {
    let mut iov = Vec::with_capacity(segments.len());
    for &(gpa, n) in segments {
        iov.push(libc::iovec {
            iov_base: ram.host(gpa, u64::from(n))?.cast(),
            iov_len: n as usize,
        });
    }
    Ok(iov)
}

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn read(
    ram: &Ram<'_>,
    data: &[(u64, u32)],
    sector: u64,
    disk: &Disk<'_>,
    out: &mut Served,
) -> Result<(u8, u64), QueueError> {
    let length = virtq::total(data);
    let (fd, offset) = match disk.fd {
        Some(fd) if in_bounds(length, sector, disk) => (fd, sector * SECTOR_SIZE),
        _ => {
            out.counters.read_errors += 1;
            return Ok((S_IOERR, 0));
        }
    };
    if length == 0 {
        return Ok((S_OK, 0));
    }
    let iov = iovecs(ram, data)?;
    let got = loop {
        // SAFETY: every iovec covers one checked range of one guest RAM region (at
        // most 256 of them, 8 MiB in all), mapped while `ram` holds its read lock;
        // the kernel writes at most their total. The guest may touch the bytes
        // meanwhile, which any byte value survives. `offset + length` is within the
        // capacity, which is a file size, so it fits an off_t.
        let n = unsafe {
            libc::preadv(
                fd,
                iov.as_ptr(),
                iov.len() as libc::c_int,
                offset as libc::off_t,
            )
        };
        if n >= 0 {
            break n as u64;
        }
        let e = errno();
        if e != libc::EINTR {
            out.counters.read_errors += 1;
            out.warnings.push(Warning::ReadFailed(length, offset, e));
            return Ok((S_IOERR, 0));
        }
    };
    if got != length {
        // The file was shortened after it was sized; what arrived is in the guest's
        // buffers, and the status says not to trust it.
        out.counters.read_errors += 1;
        out.warnings.push(Warning::ReadShort(got, length, offset));
        return Ok((S_IOERR, got));
    }
    out.counters.reads += 1;
    out.counters.bytes_read += length;
    Ok((S_OK, length))
}

fn write(
    ram: &Ram<'_>,
    segments: &[(u64, u32)],
    sector: u64,
    disk: &Disk<'_>,
    out: &mut Served,
) -> Result<u8, QueueError> {
    let length = virtq::total(segments);
    let (fd, offset) = match disk.fd {
        Some(fd) if in_bounds(length, sector, disk) => (fd, sector * SECTOR_SIZE),
        _ => {
            out.counters.write_errors += 1;
            return Ok(S_IOERR);
        }
    };
    if length == 0 {
        return Ok(S_OK);
    }
    let iov = iovecs(ram, segments)?;
    let done = loop {
        // SAFETY: as in `read`; here the kernel only reads the guest's buffers.
        let n = unsafe {
            libc::pwritev(
                fd,
                iov.as_ptr(),
                iov.len() as libc::c_int,
                offset as libc::off_t,
            )
        };
        if n >= 0 {
            break n as u64;
        }
        let e = errno();
        if e != libc::EINTR {
            out.counters.write_errors += 1;
            out.warnings.push(Warning::WriteFailed(length, offset, e));
            return Ok(S_IOERR);
        }
    };
    if done != length {
        // A full file system: the sectors after `done` are not written.
        out.counters.write_errors += 1;
        out.warnings.push(Warning::WriteShort(done, length, offset));
        return Ok(S_IOERR);
    }
    out.counters.writes += 1;
    out.counters.bytes_written += length;
    Ok(S_OK)
}

/// A read-only disk has no cache to flush (OK); a writable one is `fdatasync`ed.
fn flush(disk: &Disk<'_>, out: &mut Served) -> u8 {
    if disk.read_only {
        return S_OK;
    }
    let Some(fd) = disk.fd else {
        return S_IOERR;
    };
    loop {
        // SAFETY: fdatasync takes no pointers; a bad fd is an error return.
        if unsafe { libc::fdatasync(fd) } == 0 {
            return S_OK;
        }
        let e = errno();
        if e != libc::EINTR {
            out.warnings.push(Warning::FdatasyncFailed(e));
            return S_IOERR;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtq::test_rings::*;
    use crate::virtq::{F_NEXT, F_WRITE};
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::fd::AsRawFd;

    const ID: &[u8; 20] = b"0123456789abcdef0123";

    fn header(r: &Ram<'_>, at: u64, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&kind.to_le_bytes());
        h[8..].copy_from_slice(&sector.to_le_bytes());
        r.write_from(at, &h).unwrap();
    }

    /// A 4-sector disk file of known bytes.
    fn disk_file() -> std::fs::File {
        let mut f = tempfile();
        let bytes: Vec<u8> = (0..2048u32).map(|i| (i * 7 % 251) as u8).collect();
        f.write_all(&bytes).unwrap();
        f
    }

    fn tempfile() -> std::fs::File {
        let dir = std::env::temp_dir();
        let path = dir.join(format!(
            "vmfork-blk-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }

    #[test]
    fn a_read_lands_in_the_guest_buffers_and_past_capacity_is_ioerr() {
        let mut buf = vec![0u8; 0x10000];
        let g = ram(&mut buf);
        let r = g.lock().unwrap();
        let f = disk_file();
        let disk = Disk {
            fd: Some(f.as_raw_fd()),
            capacity: 2048,
            read_only: true,
            id: ID,
        };
        // chain 0: header, 1024 bytes in two buffers (the second shares the status).
        header(&r, 0x4000, T_IN, 1);
        put(&r, 0, 0x4000, 16, F_NEXT, 1);
        put(&r, 1, 0x5000, 512, F_NEXT | F_WRITE, 2);
        put(&r, 2, 0x6000, 513, F_WRITE, 0);
        // chain 3: a read of 2 sectors at sector 3, past the 4-sector capacity.
        header(&r, 0x4100, T_IN, 3);
        put(&r, 3, 0x4100, 16, F_NEXT, 4);
        put(&r, 4, 0x7000, 1025, F_WRITE, 0);
        r.write_u16(AVAIL + 4, 0).unwrap();
        r.write_u16(AVAIL + 6, 3).unwrap();
        r.write_u16(AVAIL + 2, 2).unwrap();
        let s = serve(&r, &RINGS, 0, 0, &disk, 64, 1 << 30);
        assert!(s.error.is_none() && !s.more);
        assert_eq!(
            (s.next_avail, s.next_used, s.served, s.moved),
            (2, 2, 2, 1026)
        );
        let mut want = vec![0u8; 1024];
        let mut file = &f;
        file.seek(SeekFrom::Start(512)).unwrap();
        file.read_exact(&mut want).unwrap();
        let mut got = vec![0u8; 1024];
        r.read_into(0x5000, &mut got[..512]).unwrap();
        r.read_into(0x6000, &mut got[512..]).unwrap();
        assert_eq!(got, want);
        assert_eq!(r.read_u16(0x6000 + 512).unwrap() & 0xff, u16::from(S_OK));
        assert_eq!(
            r.read_u16(0x7000 + 1024).unwrap() & 0xff,
            u16::from(S_IOERR)
        );
        assert_eq!(r.read_u32(USED + 4 + 4).unwrap(), 1025);
        assert_eq!(r.read_u32(USED + 12 + 4).unwrap(), 1);
        assert_eq!(s.counters.reads, 1);
        assert_eq!(s.counters.read_errors, 1);
        assert_eq!(s.counters.bytes_read, 1024);
    }

    #[test]
    fn huge_sectors_do_not_overflow_and_writes_to_a_ro_disk_are_refused() {
        let mut buf = vec![0u8; 0x10000];
        let g = ram(&mut buf);
        let r = g.lock().unwrap();
        let f = disk_file();
        let disk = Disk {
            fd: Some(f.as_raw_fd()),
            capacity: 2048,
            read_only: true,
            id: ID,
        };
        assert!(!in_bounds(512, u64::MAX, &disk));
        assert!(!in_bounds(512, u64::MAX / 512 + 1, &disk));
        header(&r, 0x4000, T_OUT, 0);
        put(&r, 0, 0x4000, 16 + 512, F_NEXT, 1);
        put(&r, 1, 0x5000, 1, F_WRITE, 0);
        r.write_u16(AVAIL + 2, 1).unwrap();
        let s = serve(&r, &RINGS, 0, 0, &disk, 64, 1 << 30);
        assert_eq!(s.counters.writes_refused, 1);
        assert_eq!(r.read_u16(0x5000).unwrap() & 0xff, u16::from(S_IOERR));
    }

    #[test]
    fn a_chain_without_a_status_byte_is_a_guest_fault_after_the_ones_before() {
        let mut buf = vec![0u8; 0x10000];
        let g = ram(&mut buf);
        let r = g.lock().unwrap();
        let disk = Disk {
            fd: None,
            capacity: 0,
            read_only: true,
            id: ID,
        };
        header(&r, 0x4000, T_GET_ID, 0);
        put(&r, 0, 0x4000, 16, F_NEXT, 1);
        put(&r, 1, 0x5000, 8, F_WRITE, 0);
        put(&r, 2, 0x4000, 16, F_NEXT, 3);
        put(&r, 3, 0x5000, 0, F_WRITE, 0);
        r.write_u16(AVAIL + 4, 0).unwrap();
        r.write_u16(AVAIL + 6, 2).unwrap();
        r.write_u16(AVAIL + 2, 2).unwrap();
        let s = serve(&r, &RINGS, 0, 0, &disk, 64, 1 << 30);
        assert_eq!(s.counters.get_ids, 1);
        assert_eq!((s.next_avail, s.next_used, s.served), (2, 1, 1));
        let mut got = [0u8; 7];
        r.read_into(0x5000, &mut got).unwrap();
        assert_eq!(&got, b"0123456");
        assert!(matches!(s.error, Some(QueueError::Virtqueue(m)) if m.contains("status")));
    }

    #[test]
    fn the_byte_budget_stops_a_call_and_says_there_is_more() {
        let mut buf = vec![0u8; 0x10000];
        let g = ram(&mut buf);
        let r = g.lock().unwrap();
        let f = disk_file();
        let disk = Disk {
            fd: Some(f.as_raw_fd()),
            capacity: 2048,
            read_only: true,
            id: ID,
        };
        header(&r, 0x4000, T_IN, 0);
        for k in 0..3u16 {
            put(&r, 2 * u64::from(k), 0x4000, 16, F_NEXT, 2 * k + 1);
            put(&r, 2 * u64::from(k) + 1, 0x8000, 513, F_WRITE, 0);
            r.write_u16(AVAIL + 4 + 2 * u64::from(k), 2 * k).unwrap();
        }
        r.write_u16(AVAIL + 2, 3).unwrap();
        let s = serve(&r, &RINGS, 0, 0, &disk, 64, 1000);
        assert_eq!((s.served, s.moved, s.more), (2, 1026, true));
    }
}
