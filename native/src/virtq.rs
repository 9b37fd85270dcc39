//! The device side of a split virtqueue (virtio 1.x, 2.7), natively: the chain walk,
//! the used ring, and the copies in and out of a chain's buffers.
//!
//! The one implementation (its Python twin is deleted; `vmm/devices/virtio/queue.py`
//! keeps the queue's registers and record), held by the hostile-descriptor properties
//! of `tests/unit/test_virtio_queue.py` through `GuestRam` and fuzzed here
//! (native/fuzz). Every number in the rings is the guest's, written perhaps while we
//! read it; the rules:
//! * a chain is walked at most `size` descriptors (a longer one must loop), a `next`
//!   at or beyond `size` is an error, an avail index more than `size` ahead of ours
//!   is an error;
//! * every descriptor's buffer is checked to lie in guest RAM before it is kept,
//!   INDIRECT (never offered) is an error, a readable descriptor after a writable
//!   one is an error;
//! * copies are bounded by the caller's limit and by the chain, whatever lengths
//!   the guest claims, so no guest number sizes an allocation.
//!
//! * any violation is a `QueueError` (Python's `VirtqueueError`), which the transport
//!   turns into DEVICE_NEEDS_RESET; nothing here repairs a broken ring.
//!
//! Why not rust-vmm's `virtio-queue`: its chain iterator ends a chain quietly at a
//! loop or an out-of-range `next` (a truncated chain the device then serves), where
//! our contract makes both a device error (DEVICE_NEEDS_RESET) that the tests pin;
//! and its `Queue` wants `vm-memory`'s `GuestMemory` (see guest_ram.rs). The walk is
//! sixty lines against that contract.
//!
//! Notification suppression (VIRTIO_RING_F_EVENT_IDX, 2.7.7/2.7.10), where the device
//! negotiated it (`Rings::event_idx`; virtio-net only): `pop` finding the ring empty
//! publishes `avail_event` (the used ring's trailing u16) as its `next_avail`, so the
//! driver kicks for the next chain and not for the ones it adds while the device is
//! still popping, then looks again; `needs_interrupt` says whether a batch that moved
//! the used index from `old` to `new` crossed the driver's `used_event` (the avail ring's
//! trailing u16), or, without EVENT_IDX, whether the driver left VRING_AVAIL_F_NO_INTERRUPT
//! clear. Both words are read once per decision (the guest may change them any time; a
//! guest that never lets an interrupt through only starves itself).
//!
//! Ordering: x86 is TSO, so program order is the order the spec asks for (the avail
//! index before the ring entries it covers; used elements before the used index);
//! the Acquire/Release fences below compile to nothing on x86 and keep the compiler
//! from reordering. The two suppression protocols need a store before a load, which
//! TSO does reorder (the store buffer): the used index before `used_event` (else the
//! driver re-enabling interrupts between the two sees the old index, we the old event:
//! a lost interrupt) and `avail_event` before the avail index (else a lost kick); those
//! are SeqCst fences (`mfence`), as Linux's `virtio_mb`.

use std::sync::atomic::{fence, Ordering};

use crate::guest_ram::{Ram, RamError};

pub const DESC_SIZE: u64 = 16;
pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;
pub const F_INDIRECT: u16 = 4;
/// The avail ring's flag asking for no interrupts (honoured only without EVENT_IDX).
pub const AVAIL_F_NO_INTERRUPT: u16 = 1;

#[derive(Debug, PartialEq, Eq)]
pub enum QueueError {
    /// The guest broke the virtqueue contract (Python's `VirtqueueError`).
    Virtqueue(String),
    /// A range outside guest RAM where no queue rule names it (`GuestMemoryError`).
    Memory(RamError),
}

impl From<RamError> for QueueError {
    fn from(e: RamError) -> Self {
        QueueError::Memory(e)
    }
}

fn bad<T>(msg: String) -> Result<T, QueueError> {
    Err(QueueError::Virtqueue(msg))
}

/// The ring registers of one queue (the transport's), as plain numbers.
#[derive(Clone, Copy, Debug)]
pub struct Rings {
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    /// VIRTIO_RING_F_EVENT_IDX was negotiated: `used_event` and `avail_event` are live.
    pub event_idx: bool,
}

/// One available chain: its head and its buffers, readable ones first; every
/// `(gpa, len)` was inside guest RAM when walked (RAM does not shrink).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Chain {
    pub head: u16,
    pub readable: Vec<(u64, u32)>,
    pub writable: Vec<(u64, u32)>,
}

pub fn size_is_valid(size: u32, max_size: u32) -> bool {
    size > 0 && size <= max_size && size.is_power_of_two()
}

/// Alignment and placement of the rings (at DRIVER_OK).
pub fn validate(ram: &Ram<'_>, rings: &Rings, max_size: u32) -> Result<(), QueueError> {
    let size = u64::from(rings.size);
    if !size_is_valid(u32::from(rings.size), max_size) {
        return bad(format!(
            "queue size {} is not a power of 2 in 1..{max_size}",
            rings.size
        ));
    }
    for (name, addr, align, len) in [
        ("descriptor table", rings.desc, 16, DESC_SIZE * size),
        ("available ring", rings.avail, 2, 6 + 2 * size),
        ("used ring", rings.used, 4, 6 + 8 * size),
    ] {
        if addr % align != 0 {
            return bad(format!("{name} at {addr:#x} is not {align}-byte aligned"));
        }
        if let Err(e) = ram.check(addr, len) {
            return bad(format!(
                "{name} at {addr:#x}+{len:#x} is outside guest RAM: {e}"
            ));
        }
    }
    Ok(())
}

/// How many chains the driver offered that we have not popped.
pub fn pending(ram: &Ram<'_>, rings: &Rings, next_avail: u16) -> Result<u16, QueueError> {
    let idx = ram.read_u16(rings.avail + 2)?;
    let ahead = idx.wrapping_sub(next_avail);
    if ahead > rings.size {
        return bad(format!(
            "available index ran {ahead} entries ahead of the device, more than the \
             queue size {}",
            rings.size
        ));
    }
    Ok(ahead)
}

/// The chain at `next_avail`, or `None` if the driver offered none (with EVENT_IDX,
/// having asked for a kick at the next one: `avail_event` is set to `next_avail` and the
/// ring looked at again, so a chain added before the driver could see the request is
/// popped now, not left waiting for a kick that will not come). The caller advances
/// its `next_avail` on `Some`.
pub fn pop(ram: &Ram<'_>, rings: &Rings, next_avail: u16) -> Result<Option<Chain>, QueueError> {
    if pending(ram, rings, next_avail)? == 0 {
        if !rings.event_idx {
            return Ok(None);
        }
        ram.write_u16(rings.used + 4 + 8 * u64::from(rings.size), next_avail)?;
        fence(Ordering::SeqCst); // avail_event above before the avail index below
        if pending(ram, rings, next_avail)? == 0 {
            return Ok(None);
        }
    }
    fence(Ordering::Acquire); // the index above before the entry below
    let slot = u64::from(next_avail % rings.size);
    let head = ram.read_u16(rings.avail + 4 + 2 * slot)?;
    walk(ram, rings, head).map(Some)
}

fn walk(ram: &Ram<'_>, rings: &Rings, head: u16) -> Result<Chain, QueueError> {
    if head >= rings.size {
        return bad(format!(
            "chain head {head} is beyond the queue size {}",
            rings.size
        ));
    }
    let mut chain = Chain {
        head,
        ..Chain::default()
    };
    let mut index = head;
    for _ in 0..rings.size {
        let mut raw = [0u8; 16];
        ram.read_into(rings.desc + DESC_SIZE * u64::from(index), &mut raw)?;
        let addr = u64::from_le_bytes(raw[0..8].try_into().unwrap_or_default());
        let len = u32::from_le_bytes(raw[8..12].try_into().unwrap_or_default());
        let flags = u16::from_le_bytes([raw[12], raw[13]]);
        let next = u16::from_le_bytes([raw[14], raw[15]]);
        if flags & F_INDIRECT != 0 {
            return bad(format!(
                "descriptor {index} is indirect, which was not offered"
            ));
        }
        if ram.check(addr, u64::from(len)).is_err() {
            return bad(format!(
                "descriptor {index} buffer {addr:#x}+{len:#x} is outside guest RAM"
            ));
        }
        if flags & F_WRITE != 0 {
            chain.writable.push((addr, len));
        } else if !chain.writable.is_empty() {
            return bad(format!(
                "descriptor {index} is device-readable but follows a device-writable \
                 one in chain {head}"
            ));
        } else {
            chain.readable.push((addr, len));
        }
        if flags & F_NEXT == 0 {
            return Ok(chain);
        }
        if next >= rings.size {
            return bad(format!(
                "descriptor {index} links to {next}, beyond the queue size {}",
                rings.size
            ));
        }
        index = next;
    }
    bad(format!(
        "chain {head} is longer than the queue size {} (a descriptor loop)",
        rings.size
    ))
}

/// Put `(head, written)` on the used ring at `next_used`; returns the new `next_used`.
pub fn add_used(
    ram: &Ram<'_>,
    rings: &Rings,
    next_used: u16,
    head: u16,
    written: u32,
) -> Result<u16, QueueError> {
    let elem = rings.used + 4 + 8 * u64::from(next_used % rings.size);
    let mut raw = [0u8; 8];
    raw[..4].copy_from_slice(&u32::from(head).to_le_bytes());
    raw[4..].copy_from_slice(&written.to_le_bytes());
    ram.write_from(elem, &raw)?;
    fence(Ordering::Release); // the element above before the index below
    let next = next_used.wrapping_add(1);
    ram.write_u16(rings.used + 2, next)?;
    Ok(next)
}

/// Whether the driver wants an interrupt for a batch that moved the used index from
/// `old_used` to `new_used` (the index of the last batch checked and this one's; equal:
/// nothing to signal). With EVENT_IDX: whether the batch crossed `used_event`
/// (`vring_need_event`); without: whether VRING_AVAIL_F_NO_INTERRUPT is clear.
pub fn needs_interrupt(
    ram: &Ram<'_>,
    rings: &Rings,
    old_used: u16,
    new_used: u16,
) -> Result<bool, QueueError> {
    if old_used == new_used {
        return Ok(false);
    }
    fence(Ordering::SeqCst); // the used index the caller stored before the word below
    if rings.event_idx {
        let used_event = ram.read_u16(rings.avail + 4 + 2 * u64::from(rings.size))?;
        Ok(need_event(used_event, new_used, old_used))
    } else {
        let flags = ram.read_u16(rings.avail)?;
        Ok(flags & AVAIL_F_NO_INTERRUPT == 0)
    }
}

/// `vring_need_event`: whether `event` lies in `[old, new)`, modulo 2^16.
pub fn need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

/// Total bytes of segments (u64: 256 x 4 GiB does not fit a u32).
pub fn total(segments: &[(u64, u32)]) -> u64 {
    segments.iter().map(|&(_, n)| u64::from(n)).sum()
}

/// Up to `limit` bytes of `segments` from `offset` bytes in.
pub fn read_segments(
    ram: &Ram<'_>,
    segments: &[(u64, u32)],
    limit: usize,
    mut offset: u64,
) -> Result<Vec<u8>, QueueError> {
    let want = (total(segments).saturating_sub(offset)).min(limit as u64) as usize;
    let mut out = vec![0u8; want];
    let mut done = 0usize;
    for &(gpa, len) in segments {
        if done >= want {
            break;
        }
        let len = u64::from(len);
        if offset >= len {
            offset -= len;
            continue;
        }
        let take = ((len - offset) as usize).min(want - done);
        ram.read_into(gpa + offset, &mut out[done..done + take])?;
        done += take;
        offset = 0;
    }
    out.truncate(done);
    Ok(out)
}

/// Scatter `data` into `segments` from `offset` bytes in; returns bytes written
/// (a short chain truncates, it never overflows).
pub fn write_segments(
    ram: &Ram<'_>,
    segments: &[(u64, u32)],
    data: &[u8],
    mut offset: u64,
) -> Result<usize, QueueError> {
    let mut done = 0usize;
    for &(gpa, len) in segments {
        if done >= data.len() {
            break;
        }
        let len = u64::from(len);
        if offset >= len {
            offset -= len;
            continue;
        }
        let take = ((len - offset) as usize).min(data.len() - done);
        ram.write_from(gpa + offset, &data[done..done + take])?;
        done += take;
        offset = 0;
    }
    Ok(done)
}

/// Fill up to `limit` bytes of `segments` with getrandom(2) output, straight into
/// guest RAM; returns bytes written.
pub fn fill_random(
    ram: &Ram<'_>,
    segments: &[(u64, u32)],
    limit: usize,
) -> Result<usize, QueueError> {
    let mut done = 0usize;
    for &(gpa, len) in segments {
        if done >= limit {
            break;
        }
        let take = (len as usize).min(limit - done);
        let dst = ram.host(gpa, take as u64)?;
        let mut filled = 0usize;
        while filled < take {
            // SAFETY: `dst..dst + take` lies in one guest RAM region, mapped while
            // `ram` holds its read lock; getrandom writes at most `take - filled`
            // bytes at `dst + filled`. The guest may read or write them meanwhile;
            // every byte value is valid for both sides.
            let n = unsafe { libc::getrandom(dst.add(filled).cast(), take - filled, 0) };
            if n < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                // getrandom without flags fails only for EFAULT/EINVAL/ENOSYS: report
                // what was filled, as a short fill, which the driver accepts.
                return Ok(done + filled);
            }
            filled += n as usize;
        }
        done += take;
    }
    Ok(done)
}

/// Rings in a test's guest memory, and a descriptor writer: the unit tests of every
/// device served from a virtqueue (`blk.rs` too) lay their chains out the same way.
#[cfg(test)]
pub(crate) mod test_rings {
    use crate::guest_ram::{GuestRam, Ram, Region};

    pub const DESC: u64 = 0x1000;
    pub const AVAIL: u64 = 0x2000;
    pub const USED: u64 = 0x3000;
    pub const RINGS: super::Rings = super::Rings {
        size: 8,
        desc: DESC,
        avail: AVAIL,
        used: USED,
        event_idx: false,
    };

    pub fn ram(buf: &mut [u8]) -> GuestRam {
        // SAFETY: every test keeps `buf` alive for as long as the GuestRam.
        unsafe {
            GuestRam::new(vec![Region {
                gpa: 0,
                size: buf.len() as u64,
                host: buf.as_mut_ptr() as usize,
            }])
        }
    }

    pub fn put(r: &Ram<'_>, i: u64, addr: u64, len: u32, flags: u16, next: u16) {
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&addr.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        raw[12..14].copy_from_slice(&flags.to_le_bytes());
        raw[14..].copy_from_slice(&next.to_le_bytes());
        r.write_from(DESC + 16 * i, &raw).unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::test_rings::*;
    use super::*;

    #[test]
    fn a_loop_is_an_error_not_a_hang() {
        let mut buf = vec![0u8; 0x10000];
        let g = ram(&mut buf);
        let r = g.lock().unwrap();
        put(&r, 0, 0x8000, 1, F_NEXT, 1);
        put(&r, 1, 0x8000, 1, F_NEXT, 0);
        r.write_u16(AVAIL + 2, 1).unwrap();
        let err = pop(&r, &RINGS, 0).unwrap_err();
        assert!(matches!(err, QueueError::Virtqueue(m) if m.contains("descriptor loop")));
    }

    #[test]
    fn copies_are_bounded_by_limit_and_chain() {
        let mut buf = vec![0u8; 0x10000];
        let g = ram(&mut buf);
        let r = g.lock().unwrap();
        r.write_from(0x8000, b"hello").unwrap();
        let segs = [(0x8000u64, 5u32), (0x9000, 0), (0x8000, 2)];
        assert_eq!(read_segments(&r, &segs, 100, 0).unwrap(), b"hellohe");
        assert_eq!(read_segments(&r, &segs, 3, 4).unwrap(), b"ohe");
        assert_eq!(read_segments(&r, &segs, 3, 99).unwrap(), b"");
        assert_eq!(write_segments(&r, &segs, b"0123456789", 1).unwrap(), 6);
        assert_eq!(add_used(&r, &RINGS, 0xFFFF, 3, 6).unwrap(), 0);
        assert_eq!(r.read_u16(USED + 2).unwrap(), 0);
        assert_eq!(r.read_u32(USED + 4 + 8 * 7).unwrap(), 3);
    }

    #[test]
    fn event_idx_asks_for_the_next_kick_and_interrupts_at_used_event() {
        let mut buf = vec![0u8; 0x10000];
        let g = ram(&mut buf);
        let r = g.lock().unwrap();
        let rings = Rings {
            event_idx: true,
            ..RINGS
        };
        let avail_event = USED + 4 + 8 * 8;
        let used_event = AVAIL + 4 + 2 * 8;
        r.write_u16(avail_event, 0xBEEF).unwrap();
        r.write_u16(AVAIL + 2, 5).unwrap();
        assert_eq!(pop(&r, &RINGS, 5).unwrap(), None);
        assert_eq!(r.read_u16(avail_event).unwrap(), 0xBEEF); // not negotiated: untouched
        assert_eq!(pop(&r, &rings, 5).unwrap(), None);
        assert_eq!(r.read_u16(avail_event).unwrap(), 5);
        // used_event 7: a batch 5 -> 7 does not cross it, 7 -> 8 does, so does 6 -> 9.
        r.write_u16(used_event, 7).unwrap();
        assert!(!needs_interrupt(&r, &rings, 5, 7).unwrap());
        assert!(needs_interrupt(&r, &rings, 7, 8).unwrap());
        assert!(needs_interrupt(&r, &rings, 6, 9).unwrap());
        assert!(!needs_interrupt(&r, &rings, 8, 8).unwrap());
        // Across the wrap: used_event 0xFFFF crossed by 0xFFFE -> 0x0001.
        r.write_u16(used_event, 0xFFFF).unwrap();
        assert!(needs_interrupt(&r, &rings, 0xFFFE, 1).unwrap());
        // Without EVENT_IDX the avail ring's NO_INTERRUPT flag decides.
        r.write_u16(AVAIL, AVAIL_F_NO_INTERRUPT).unwrap();
        assert!(!needs_interrupt(&r, &RINGS, 0, 1).unwrap());
        r.write_u16(AVAIL, 0).unwrap();
        assert!(needs_interrupt(&r, &RINGS, 0, 1).unwrap());
    }
}
