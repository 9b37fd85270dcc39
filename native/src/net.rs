//! virtio-net's frame paths, natively: guest -> tap is one `writev` per tx chain
//! straight from the chain's readable buffers, tap -> guest one `readv` per rx chain
//! straight into its writable buffers. Nothing is copied through a Python object.
//!
//! What a frame may be and what each wrong one gets are the rules in `net.py`'s module
//! comment, which gives the reasons; this file is their one implementation, entered
//! by `net_serve.rs` (tests/unit/test_virtio_net_native.py holds the device to the
//! contract on hostile rings):
//! * tx: the frame is the chain's readable part, the 12-byte `virtio_net_hdr_mrg_rxbuf`
//!   first (the tap has IFF_VNET_HDR with that size and takes it as is); writable
//!   descriptors in a tx chain are ignored. A frame of at most the header, or over
//!   `max_tx_bytes`, or with no tap, is dropped; so is one the tap refuses (any errno:
//!   EINVAL for a header the host kernel rejects, EAGAIN/ENOBUFS when congested, EIO
//!   when the tap is down), and the chain is used either way (length 0).
//! * rx: a chain with fewer than 12 writable bytes is a guest fault (the caller sets
//!   DEVICE_NEEDS_RESET); the tap's frame is read with one byte past the chain, so a
//!   frame that does not fit is seen whole-or-not and dropped, and the chain stays the
//!   guest's for the next frame; `num_buffers` (bytes 10..12) is written 1.
//!
//! Bounds on what the guest drives: a call handles at most `max_frames` chains (rx:
//! loop turns, dropped frames included); a chain is at most
//! the queue size long (`virtq::pop`), so an iovec list has at most 257 entries
//! (IOV_MAX is 1024). Nothing is allocated by a guest-chosen size.
//!
//! The device state (counters, the tap, the queue indices, whether the tap is watched)
//! is the caller's (`net_serve.rs`): a call takes the numbers it needs and reports what
//! changed, including the counters of the frames handled before a guest fault.

use crate::guest_ram::Ram;
use crate::virtq::{self, QueueError, Rings};

pub const VNET_HDR_SIZE: u64 = 12;
pub const NUM_BUFFERS_OFFSET: u64 = 10;

/// `net.py`'s `NetCounters`, as increments of one call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub rx_frames: u64,
    pub rx_bytes: u64,
    pub rx_dropped: u64,
    pub tx_frames: u64,
    pub tx_bytes: u64,
    pub tx_dropped: u64,
}

impl Counters {
    /// Add `more` (a later call's increments) to these.
    pub fn add(&mut self, more: &Counters) {
        self.rx_frames += more.rx_frames;
        self.rx_bytes += more.rx_bytes;
        self.rx_dropped += more.rx_dropped;
        self.tx_frames += more.tx_frames;
        self.tx_bytes += more.tx_bytes;
        self.tx_dropped += more.tx_dropped;
    }

    /// As `NetCounters`' fields: (name, n).
    pub fn named(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("rx_frames", self.rx_frames),
            ("rx_bytes", self.rx_bytes),
            ("rx_dropped", self.rx_dropped),
            ("tx_frames", self.tx_frames),
            ("tx_bytes", self.tx_bytes),
            ("tx_dropped", self.tx_dropped),
        ]
    }
}

/// What one `transmit` did. `error` is the guest fault that ended it, if one did.
#[derive(Debug)]
pub struct Sent {
    pub next_avail: u16,
    pub next_used: u16,
    /// Chains put on the used ring (frames sent and dropped).
    pub chains: u32,
    pub counters: Counters,
    pub error: Option<QueueError>,
}

/// Why `receive` stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RxStop {
    /// The tap has no frame now (EAGAIN); the chain popped for it stays the guest's.
    Drained,
    /// The guest offered no more rx chains (the caller stops watching the tap).
    NoBuffers,
    /// `max_frames` loop turns were taken.
    Budget,
    /// The tap read failed with this errno (the caller logs it and stops watching).
    Failed(i32),
}

/// What one `receive` did.
#[derive(Debug)]
pub struct Received {
    pub next_avail: u16,
    pub next_used: u16,
    /// Frames put on the used ring.
    pub delivered: u32,
    pub counters: Counters,
    pub stop: RxStop,
    pub error: Option<QueueError>,
}

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// iovecs over the non-empty `segments` (each checked to lie in one RAM region by
/// `host`), with room for one more.
fn iovecs(ram: &Ram<'_>, segments: &[(u64, u32)]) -> Result<Vec<libc::iovec>, QueueError> {
    let mut iov = Vec::with_capacity(segments.len() + 1);
    for &(gpa, n) in segments.iter().filter(|&&(_, n)| n > 0) {
        iov.push(libc::iovec {
            iov_base: ram.host(gpa, u64::from(n))?.cast(),
            iov_len: n as usize,
        });
    }
    Ok(iov)
}

/// Send at most `max_frames` tx chains to the tap `fd` (None: no tap), from
/// `next_avail`/`next_used`.
pub fn transmit(
    ram: &Ram<'_>,
    rings: &Rings,
    next_avail: u16,
    next_used: u16,
    fd: Option<i32>,
    max_frames: u32,
    max_tx_bytes: u64,
) -> Sent {
    let mut out = Sent {
        next_avail,
        next_used,
        chains: 0,
        counters: Counters::default(),
        error: None,
    };
    while out.chains < max_frames {
        match transmit_one(ram, rings, fd, max_tx_bytes, &mut out) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                out.error = Some(e);
                break;
            }
        }
    }
    out
}

/// One tx chain: Ok(false) if the driver offered none.
fn transmit_one(
    ram: &Ram<'_>,
    rings: &Rings,
    fd: Option<i32>,
    max_tx_bytes: u64,
    out: &mut Sent,
) -> Result<bool, QueueError> {
    let Some(chain) = virtq::pop(ram, rings, out.next_avail)? else {
        return Ok(false);
    };
    out.next_avail = out.next_avail.wrapping_add(1);
    send_frame(ram, &chain, fd, max_tx_bytes, out)?;
    out.next_used = virtq::add_used(ram, rings, out.next_used, chain.head, 0)?;
    out.chains += 1;
    Ok(true)
}

fn send_frame(
    ram: &Ram<'_>,
    chain: &virtq::Chain,
    fd: Option<i32>,
    max_tx_bytes: u64,
    out: &mut Sent,
) -> Result<(), QueueError> {
    let length = virtq::total(&chain.readable);
    let fd = match fd {
        Some(fd) if VNET_HDR_SIZE < length && length <= max_tx_bytes => fd,
        _ => {
            out.counters.tx_dropped += 1;
            return Ok(());
        }
    };
    let iov = iovecs(ram, &chain.readable)?;
    loop {
        // SAFETY: every iovec covers one checked range of one guest RAM region (at
        // most 256 of them), mapped while `ram` holds its read lock; the kernel only
        // reads them. The guest may change the bytes meanwhile: the tap (the host
        // kernel) validates the header it reads, whatever it holds.
        let n = unsafe { libc::writev(fd, iov.as_ptr(), iov.len() as libc::c_int) };
        if n >= 0 {
            break;
        }
        if errno() != libc::EINTR {
            out.counters.tx_dropped += 1;
            return Ok(());
        }
    }
    out.counters.tx_frames += 1;
    out.counters.tx_bytes += length - VNET_HDR_SIZE;
    Ok(())
}

/// Move frames from the tap `fd` into posted rx chains, one frame per chain, at most
/// `max_frames` loop turns.
pub fn receive(
    ram: &Ram<'_>,
    rings: &Rings,
    next_avail: u16,
    next_used: u16,
    fd: i32,
    max_frames: u32,
) -> Received {
    let mut out = Received {
        next_avail,
        next_used,
        delivered: 0,
        counters: Counters::default(),
        stop: RxStop::Budget,
        error: None,
    };
    for _ in 0..max_frames {
        match receive_one(ram, rings, fd, &mut out) {
            Ok(None) => {}
            Ok(Some(stop)) => {
                out.stop = stop;
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

/// One loop turn: Ok(Some(why)) if the loop stops here.
fn receive_one(
    ram: &Ram<'_>,
    rings: &Rings,
    fd: i32,
    out: &mut Received,
) -> Result<Option<RxStop>, QueueError> {
    let Some(chain) = virtq::pop(ram, rings, out.next_avail)? else {
        return Ok(Some(RxStop::NoBuffers));
    };
    // `next_avail` moves only once a frame is in the chain: every other way out of
    // this turn (but a guest fault, after which the indices no longer matter: the
    // driver must reset the device) leaves the chain the guest's.
    let room = virtq::total(&chain.writable);
    if room < VNET_HDR_SIZE {
        out.next_avail = out.next_avail.wrapping_add(1);
        return Err(QueueError::Virtqueue(format!(
            "rx chain {} has {room} writable bytes, less than the {VNET_HDR_SIZE}-byte header",
            chain.head
        )));
    }
    let mut iov = iovecs(ram, &chain.writable)?;
    // One byte past the chain: the tap truncates a frame that does not fit, and a
    // truncated frame must be dropped, not handed to the guest as if whole.
    let mut overflow = [0u8; 1];
    iov.push(libc::iovec {
        iov_base: overflow.as_mut_ptr().cast(),
        iov_len: 1,
    });
    let got = loop {
        // SAFETY: every iovec but the last covers one checked range of one guest RAM
        // region (at most 256 of them), mapped while `ram` holds its read lock; the
        // last is `overflow`, which outlives the call. The kernel writes at most their
        // total. The guest may touch its bytes meanwhile, which any value survives.
        let n = unsafe { libc::readv(fd, iov.as_ptr(), iov.len() as libc::c_int) };
        if n >= 0 {
            break n as u64;
        }
        match errno() {
            libc::EINTR => {}
            libc::EAGAIN => return Ok(Some(RxStop::Drained)),
            libc::EFAULT | libc::EINVAL => {
                // Not even the vnet header fitted: the tap dropped the frame.
                out.counters.rx_dropped += 1;
                return Ok(None);
            }
            e => return Ok(Some(RxStop::Failed(e))),
        }
    };
    if got > room {
        out.counters.rx_dropped += 1;
        return Ok(None);
    }
    out.counters.rx_frames += 1;
    out.counters.rx_bytes += got.saturating_sub(VNET_HDR_SIZE);
    if got == 0 {
        // An empty read (not a tap's: it always gives the header) fills nothing.
        return Ok(None);
    }
    out.next_avail = out.next_avail.wrapping_add(1);
    virtq::write_segments(
        ram,
        &chain.writable,
        &1u16.to_le_bytes(),
        NUM_BUFFERS_OFFSET,
    )?;
    out.next_used = virtq::add_used(ram, rings, out.next_used, chain.head, got as u32)?;
    out.delivered += 1;
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtq::test_rings::*;
    use crate::virtq::{F_NEXT, F_WRITE};

    /// A non-blocking datagram socket pair: each `writev` one datagram, as a tap
    /// takes one frame per write.
    fn dgram_pair() -> (i32, i32) {
        let mut fds = [0i32; 2];
        // SAFETY: `fds` has room for the two descriptors socketpair writes.
        let rc = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0);
        (fds[0], fds[1])
    }

    fn close(fd: i32) {
        // SAFETY: the test's own descriptor, closed once.
        unsafe { libc::close(fd) };
    }

    fn recv(fd: i32) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; 4096];
        // SAFETY: `buf` is ours; recv writes at most its length.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
        (n >= 0).then(|| {
            buf.truncate(n as usize);
            buf
        })
    }

    fn send(fd: i32, data: &[u8]) {
        // SAFETY: `data` is ours; send only reads it.
        let n = unsafe { libc::send(fd, data.as_ptr().cast(), data.len(), 0) };
        assert_eq!(n, data.len() as isize);
    }

    #[test]
    fn tx_sends_the_readable_part_and_drops_what_is_too_short() {
        let mut buf = vec![0u8; 0x10000];
        let g = ram(&mut buf);
        let r = g.lock().unwrap();
        let (dev, host) = dgram_pair();
        r.write_from(0x4000, &[7u8; 12]).unwrap();
        r.write_from(0x5000, b"frame!").unwrap();
        // chain 0: header and frame apart, a writable descriptor that is ignored.
        put(&r, 0, 0x4000, 12, F_NEXT, 1);
        put(&r, 1, 0x5000, 6, F_NEXT, 2);
        put(&r, 2, 0x6000, 100, F_WRITE, 0);
        // chain 3: the header alone, dropped.
        put(&r, 3, 0x4000, 12, 0, 0);
        r.write_u16(AVAIL + 4, 0).unwrap();
        r.write_u16(AVAIL + 6, 3).unwrap();
        r.write_u16(AVAIL + 2, 2).unwrap();
        let s = transmit(&r, &RINGS, 0, 0, Some(dev), 256, 65612);
        assert!(s.error.is_none());
        assert_eq!((s.next_avail, s.next_used, s.chains), (2, 2, 2));
        assert_eq!(
            (
                s.counters.tx_frames,
                s.counters.tx_bytes,
                s.counters.tx_dropped
            ),
            (1, 6, 1)
        );
        let mut want = vec![7u8; 12];
        want.extend_from_slice(b"frame!");
        assert_eq!(recv(host), Some(want));
        assert_eq!(recv(host), None);
        assert_eq!(r.read_u32(USED + 8).unwrap(), 0);
        close(dev);
        close(host);
    }

    #[test]
    fn tx_a_refused_write_is_a_drop() {
        let mut buf = vec![0u8; 0x10000];
        let g = ram(&mut buf);
        let r = g.lock().unwrap();
        put(&r, 0, 0x4000, 20, 0, 0);
        r.write_u16(AVAIL + 2, 1).unwrap();
        let s = transmit(&r, &RINGS, 0, 0, Some(-1), 256, 65612);
        assert_eq!((s.chains, s.counters.tx_dropped), (1, 1));
    }

    #[test]
    fn rx_fills_a_chain_sets_num_buffers_and_drops_what_does_not_fit() {
        let mut buf = vec![0u8; 0x10000];
        let g = ram(&mut buf);
        let r = g.lock().unwrap();
        let (dev, host) = dgram_pair();
        let big = vec![0xAAu8; 40];
        let mut small = vec![0u8; 12];
        small.extend_from_slice(b"hello");
        send(host, &big);
        send(host, &small);
        // chain 0: 8 + 24 writable bytes, across two descriptors.
        put(&r, 0, 0x4000, 8, F_NEXT | F_WRITE, 1);
        put(&r, 1, 0x5000, 24, F_WRITE, 0);
        r.write_u16(AVAIL + 2, 1).unwrap();
        let s = receive(&r, &RINGS, 0, 0, dev, 256);
        assert!(s.error.is_none());
        assert_eq!(s.stop, RxStop::NoBuffers);
        assert_eq!((s.next_avail, s.next_used, s.delivered), (1, 1, 1));
        assert_eq!(
            (
                s.counters.rx_frames,
                s.counters.rx_bytes,
                s.counters.rx_dropped
            ),
            (1, 5, 1)
        );
        let mut got = [0u8; 17];
        r.read_into(0x4000, &mut got[..8]).unwrap();
        r.read_into(0x5000, &mut got[8..]).unwrap();
        assert_eq!(&got[10..12], &[1, 0]);
        assert_eq!(&got[12..], b"hello");
        assert_eq!(r.read_u32(USED + 8).unwrap(), 17);
        // Another chain and an empty tap: the chain stays the guest's.
        r.write_u16(AVAIL + 6, 0).unwrap();
        r.write_u16(AVAIL + 2, 2).unwrap();
        let s = receive(&r, &RINGS, 1, 1, dev, 256);
        assert_eq!((s.stop, s.delivered, s.next_avail), (RxStop::Drained, 0, 1));
        close(dev);
        close(host);
    }

    #[test]
    fn rx_a_chain_too_short_for_the_header_is_a_guest_fault() {
        let mut buf = vec![0u8; 0x10000];
        let g = ram(&mut buf);
        let r = g.lock().unwrap();
        put(&r, 0, 0x4000, 11, F_WRITE, 0);
        r.write_u16(AVAIL + 2, 1).unwrap();
        let s = receive(&r, &RINGS, 0, 0, -1, 256);
        assert!(matches!(s.error, Some(QueueError::Virtqueue(m)) if m.contains("11 writable")));
        let mut ok = vec![0u8; 0x10000];
        let g = ram(&mut ok);
        let r = g.lock().unwrap();
        put(&r, 0, 0x4000, 64, F_WRITE, 0);
        r.write_u16(AVAIL + 2, 1).unwrap();
        let s = receive(&r, &RINGS, 0, 0, -1, 256);
        assert_eq!((s.stop, s.next_avail), (RxStop::Failed(libc::EBADF), 0));
    }
}
