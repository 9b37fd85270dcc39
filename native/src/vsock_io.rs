//! The vsock device's byte paths, natively: stream data moves between a host Unix
//! socket and the guest's virtqueue buffers with one `readv`/`sendmsg` over the
//! buffers themselves, never through a Python object. The connection state machine,
//! credit bookkeeping and the Firecracker convention are `vsock_serve.rs`'s; it calls
//! these with a connection's numbers and applies what they report.
//!
//! Bounds: a batch serves at most `max_packets` rx chains; each packet carries at most
//! `min(room in the chain, the guest's credit, MAX_PAYLOAD)` bytes, so neither the
//! guest's buffer sizes nor the host's socket decide how much we move. The iovec
//! lists are capped at `MAX_IOV` entries (a chain has at most 256 descriptors).

use crate::guest_ram::Ram;
use crate::virtq::{self, QueueError, Rings};
use crate::vsock_packet::{Header, Op, HEADER_SIZE, TYPE_STREAM};

pub const MAX_PAYLOAD: usize = 64 * 1024;
const MAX_IOV: usize = 256;

/// The header fields that are the same for every data packet of a batch.
#[derive(Clone, Copy)]
pub struct DataHeader {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl DataHeader {
    fn encode(&self, len: u32) -> [u8; HEADER_SIZE] {
        Header {
            src_cid: self.src_cid,
            dst_cid: self.dst_cid,
            src_port: self.src_port,
            dst_port: self.dst_port,
            len,
            type_: TYPE_STREAM,
            op: Op::Rw as u16,
            flags: 0,
            buf_alloc: self.buf_alloc,
            fwd_cnt: self.fwd_cnt,
        }
        .encode()
    }
}

/// Why a batch stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// The socket has nothing more now (EAGAIN).
    Drained,
    /// The socket's peer shut its sending side (a read returned 0).
    Eof,
    /// The guest's credit is used up.
    Credit,
    /// The guest offered no more rx buffers.
    NoBuffers,
    /// `max_packets` were delivered.
    Budget,
    /// The socket failed with this errno.
    Failed(i32),
}

pub struct Batch {
    pub next_avail: u16,
    pub next_used: u16,
    pub packets: u32,
    pub bytes: u64,
    pub stop: Stop,
}

/// iovecs for `len` bytes of `segments` from `offset` bytes in.
fn iovecs(
    ram: &Ram<'_>,
    segments: &[(u64, u32)],
    mut offset: u64,
    len: usize,
) -> Result<Vec<libc::iovec>, QueueError> {
    let mut iov = Vec::new();
    let mut left = len;
    for &(gpa, seg) in segments {
        if left == 0 || iov.len() == MAX_IOV {
            break;
        }
        let seg = u64::from(seg);
        if offset >= seg {
            offset -= seg;
            continue;
        }
        let take = ((seg - offset) as usize).min(left);
        let base = ram.host(gpa + offset, take as u64)?;
        iov.push(libc::iovec {
            iov_base: base.cast(),
            iov_len: take,
        });
        left -= take;
        offset = 0;
    }
    Ok(iov)
}

/// Deliver what `fd` has to the guest as RW packets, one per rx chain, until one of
/// the `Stop` reasons. `credit` is what the guest lets us have in flight now.
#[allow(clippy::too_many_arguments)]
pub fn rx_data(
    ram: &Ram<'_>,
    rings: &Rings,
    mut next_avail: u16,
    mut next_used: u16,
    fd: i32,
    header: &DataHeader,
    mut credit: u64,
    max_packets: u32,
) -> Result<Batch, QueueError> {
    let mut batch = Batch {
        next_avail,
        next_used,
        packets: 0,
        bytes: 0,
        stop: Stop::Budget,
    };
    let stop = loop {
        if batch.packets >= max_packets {
            break Stop::Budget;
        }
        if credit == 0 {
            break Stop::Credit;
        }
        // Popped for real only once a packet is in it: on EAGAIN/EOF the chain stays
        // the guest's, for the next packet.
        let Some(chain) = virtq::pop(ram, rings, next_avail)? else {
            break Stop::NoBuffers;
        };
        let room = virtq::total(&chain.writable);
        if room < HEADER_SIZE as u64 {
            return Err(QueueError::Virtqueue(format!(
                "rx buffer of {room} bytes cannot hold a {HEADER_SIZE}-byte packet header"
            )));
        }
        let want = (room - HEADER_SIZE as u64)
            .min(credit)
            .min(MAX_PAYLOAD as u64) as usize;
        if want == 0 {
            // A buffer with room for the header alone: wait for the guest to offer
            // another rather than re-reading the socket for a packet that cannot go.
            break Stop::NoBuffers;
        }
        let iov = iovecs(ram, &chain.writable, HEADER_SIZE as u64, want)?;
        // SAFETY: every iovec points into one guest RAM region (checked by `host`),
        // mapped while `ram` holds its read lock, and covers at most the chain's own
        // writable bytes; the kernel writes at most their total. `iov` outlives the call.
        let n = unsafe { libc::readv(fd, iov.as_ptr(), iov.len() as libc::c_int) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) => break Stop::Drained,
                e => break Stop::Failed(e.unwrap_or(libc::EIO)),
            }
        }
        if n == 0 {
            break Stop::Eof;
        }
        let n = n as usize;
        let written = virtq::write_segments(ram, &chain.writable, &header.encode(n as u32), 0)?;
        next_avail = next_avail.wrapping_add(1);
        next_used = virtq::add_used(ram, rings, next_used, chain.head, (written + n) as u32)?;
        credit -= n as u64;
        batch.packets += 1;
        batch.bytes += n as u64;
    };
    batch.next_avail = next_avail;
    batch.next_used = next_used;
    batch.stop = stop;
    Ok(batch)
}

/// Send up to `len` bytes of `segments` (from `offset`) to `fd` with one `sendmsg`
/// (MSG_NOSIGNAL | MSG_DONTWAIT). Ok(bytes sent, 0 on EAGAIN) or Err(errno).
pub fn send_segments(
    ram: &Ram<'_>,
    segments: &[(u64, u32)],
    offset: u64,
    len: usize,
    fd: i32,
) -> Result<Result<usize, i32>, QueueError> {
    let mut iov = iovecs(ram, segments, offset, len.min(MAX_PAYLOAD))?;
    if iov.is_empty() {
        return Ok(Ok(0));
    }
    loop {
        // SAFETY: an all-zero msghdr is a valid "no name, no control data" header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len();
        // SAFETY: the iovecs point into guest RAM regions mapped while `ram` holds
        // its read lock (checked by `host`); the kernel only reads them.
        let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if n >= 0 {
            return Ok(Ok(n as usize));
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => return Ok(Ok(0)),
            e => return Ok(Err(e.unwrap_or(libc::EIO))),
        }
    }
}
