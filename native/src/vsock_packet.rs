//! vsock's packet header (virtio 1.2, 5.10.6) and the tx side's parse of one guest
//! chain: the header is copied once out of the chain's readable buffers, decoded from
//! our copy, and checked by the rules below in their order, each refusal with the
//! counter key `vsock.py` names word for word. What comes back is a `Verdict` that
//! `vsock_serve.rs`'s connection state machine acts on.
//!
//! The rules, in order:
//! 1. fewer than 44 readable bytes: dropped ("shorter than the header");
//! 2. not from our guest's CID to the host's: dropped, never answered (the key is
//!    fixed, never the CIDs, which are the guest's choice);
//! 3. a payload over 64 KiB or beyond the chain's readable bytes: refused (the
//!    connection, if any, is reset; else an RST answers it unless it is one);
//! 4. a socket type other than STREAM: refused the same way;
//! 5. otherwise a packet, its op decoded (`None` for an op we do not know: what
//!    that means depends on whether a connection exists, which the server knows).
//!
//! Hostile input: the guest writes its buffers while we read them; `read_segments`
//! copies the 44 bytes once and only our copy is interpreted. Nothing here loops on
//! a guest number beyond the chain's segments (at most the queue size), and the
//! length check is in u64 (44 + u32::MAX cannot wrap; the chain's total is a u64).

use crate::guest_ram::Ram;
use crate::virtq::{self, QueueError, Rings};

pub const HEADER_SIZE: usize = 44;
pub const MAX_PAYLOAD: u64 = 64 * 1024;
pub const HOST_CID: u64 = 2;
pub const TYPE_STREAM: u16 = 1;

pub const SHORT_HEADER: &str = "tx packet shorter than the header";
pub const WRONG_CID: &str = "tx packet with a wrong source or destination CID";
pub const BAD_LENGTH: &str = "tx packet payload beyond the chain or the 64 KiB limit";
pub const BAD_TYPE: &str = "tx packet of an unknown socket type";

/// `struct virtio_vsock_hdr`, little-endian and packed (44 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl Header {
    pub fn decode(raw: &[u8; HEADER_SIZE]) -> Header {
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&raw[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let u32_at = |i: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&raw[i..i + 4]);
            u32::from_le_bytes(b)
        };
        let u16_at = |i: usize| u16::from_le_bytes([raw[i], raw[i + 1]]);
        Header {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut h = [0u8; HEADER_SIZE];
        h[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        h[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        h[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        h[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        h[24..28].copy_from_slice(&self.len.to_le_bytes());
        h[28..30].copy_from_slice(&self.type_.to_le_bytes());
        h[30..32].copy_from_slice(&self.op.to_le_bytes());
        h[32..36].copy_from_slice(&self.flags.to_le_bytes());
        h[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        h[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        h
    }
}

/// The ops of virtio 1.2, 5.10.6.1 (`vsock.Op`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Request = 1,
    Response = 2,
    Rst = 3,
    Shutdown = 4,
    Rw = 5,
    CreditUpdate = 6,
    CreditRequest = 7,
}

impl Op {
    pub fn from_u16(op: u16) -> Option<Op> {
        Some(match op {
            1 => Op::Request,
            2 => Op::Response,
            3 => Op::Rst,
            4 => Op::Shutdown,
            5 => Op::Rw,
            6 => Op::CreditUpdate,
            7 => Op::CreditRequest,
            _ => return None,
        })
    }
}

/// What the tx side makes of one chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Counted under this key and dropped: no header, or not from our guest to us.
    Drop(&'static str),
    /// Counted under this key and refused: the connection it names (if any) is
    /// reset, else an RST answers it unless it is an RST.
    Refuse(&'static str, Header),
    /// Well formed; the op, `None` if it is not one of virtio's.
    Packet(Header, Option<Op>),
}

/// Parse and check the packet in a tx chain's readable buffers (`readable`, each
/// inside guest RAM when the chain was walked) for the guest `guest_cid`.
pub fn classify_tx(
    ram: &Ram<'_>,
    readable: &[(u64, u32)],
    guest_cid: u64,
) -> Result<Verdict, QueueError> {
    let copied = virtq::read_segments(ram, readable, HEADER_SIZE, 0)?;
    let Ok(raw) = <&[u8; HEADER_SIZE]>::try_from(copied.as_slice()) else {
        return Ok(Verdict::Drop(SHORT_HEADER));
    };
    Ok(classify_header(
        &Header::decode(raw),
        virtq::total(readable),
        guest_cid,
    ))
}

/// The checks of `classify_tx` on a decoded header, `readable` the chain's readable
/// bytes (header included).
pub fn classify_header(hdr: &Header, readable: u64, guest_cid: u64) -> Verdict {
    if hdr.src_cid != guest_cid || hdr.dst_cid != HOST_CID {
        return Verdict::Drop(WRONG_CID);
    }
    let len = u64::from(hdr.len);
    if len > MAX_PAYLOAD || HEADER_SIZE as u64 + len > readable {
        return Verdict::Refuse(BAD_LENGTH, *hdr);
    }
    if hdr.type_ != TYPE_STREAM {
        return Verdict::Refuse(BAD_TYPE, *hdr);
    }
    Verdict::Packet(*hdr, Op::from_u16(hdr.op))
}

/// The rx side: put one packet into `writable` (the buffers of the rx chain `head`,
/// popped by the caller, which checked they hold a header): the header, then
/// `payload` from byte 44 on, each cut at the end of the buffers, then the used entry
/// with the bytes written. Returns the new `next_used`. Which packet, and its fields,
/// are `vsock_serve.rs`'s state machine's.
pub fn deliver_rx(
    ram: &Ram<'_>,
    rings: &Rings,
    next_used: u16,
    head: u16,
    writable: &[(u64, u32)],
    hdr: &Header,
    payload: &[u8],
) -> Result<u16, QueueError> {
    let mut written = virtq::write_segments(ram, writable, &hdr.encode(), 0)?;
    written += virtq::write_segments(ram, writable, payload, HEADER_SIZE as u64)?;
    // At most 44 bytes and the payload (the caller's, at most 64 KiB): fits a u32.
    virtq::add_used(ram, rings, next_used, head, written as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtq::test_rings::ram;

    const GUEST: u64 = 3;

    fn header(len: u32, type_: u16, op: u16) -> Header {
        Header {
            src_cid: GUEST,
            dst_cid: HOST_CID,
            src_port: 40000,
            dst_port: 5000,
            len,
            type_,
            op,
            flags: 0xdead_beef,
            buf_alloc: 1 << 18,
            fwd_cnt: 7,
        }
    }

    #[test]
    fn a_header_split_over_buffers_is_read_once_and_decoded() {
        let mut buf = vec![0u8; 0x4000];
        let gram = ram(&mut buf);
        let r = gram.lock().unwrap();
        let hdr = header(3, TYPE_STREAM, Op::Rw as u16);
        let raw = hdr.encode();
        r.write_from(0x100, &raw[..5]).unwrap();
        r.write_from(0x200, &raw[5..]).unwrap();
        r.write_from(0x300, b"abc").unwrap();
        let segs = [(0x100, 5), (0x180, 0), (0x200, 39), (0x300, 3)];
        assert_eq!(
            classify_tx(&r, &segs, GUEST).unwrap(),
            Verdict::Packet(hdr, Some(Op::Rw))
        );
        assert_eq!(Header::decode(&raw), hdr);
        // One byte short of the payload it claims.
        assert_eq!(
            classify_tx(&r, &segs[..3], GUEST).unwrap(),
            Verdict::Refuse(BAD_LENGTH, hdr)
        );
        assert_eq!(
            classify_tx(&r, &segs[..2], GUEST).unwrap(),
            Verdict::Drop(SHORT_HEADER)
        );
    }

    #[test]
    fn the_checks_go_in_vsock_pys_order() {
        let h = header(0, 9, 42);
        // A wrong CID is dropped before anything else is looked at.
        let wrong = Header { dst_cid: 9, ..h };
        assert_eq!(classify_header(&wrong, 44, GUEST), Verdict::Drop(WRONG_CID));
        assert_eq!(classify_header(&h, 44, 4), Verdict::Drop(WRONG_CID));
        // Length before type, type before op.
        let long = Header { len: 1, ..h };
        assert_eq!(
            classify_header(&long, 44, GUEST),
            Verdict::Refuse(BAD_LENGTH, long)
        );
        assert_eq!(classify_header(&h, 44, GUEST), Verdict::Refuse(BAD_TYPE, h));
        let stream = Header { type_: 1, ..h };
        assert_eq!(
            classify_header(&stream, 44, GUEST),
            Verdict::Packet(stream, None)
        );
    }

    #[test]
    fn an_rx_packet_is_written_header_first_and_cut_at_the_chains_end() {
        use crate::virtq::test_rings::{RINGS, USED};
        let mut buf = vec![0u8; 0x8000];
        let gram = ram(&mut buf);
        let r = gram.lock().unwrap();
        let hdr = header(5, TYPE_STREAM, Op::Rw as u16);
        // 40 + 4 bytes of header, then 3 of the 5 payload bytes fit.
        let segs = [(0x4000, 40), (0x5000, 0), (0x6000, 7)];
        let next = deliver_rx(&r, &RINGS, 9, 4, &segs, &hdr, b"hello").unwrap();
        assert_eq!(next, 10);
        let mut got = [0u8; 47];
        r.read_into(0x4000, &mut got[..40]).unwrap();
        r.read_into(0x6000, &mut got[40..]).unwrap();
        assert_eq!(&got[..44], &hdr.encode());
        assert_eq!(&got[44..], b"hel");
        // Used element 9 % 8 = 1: head 4, 47 bytes; the used index 10.
        assert_eq!(r.read_u32(USED + 4 + 8).unwrap(), 4);
        assert_eq!(r.read_u32(USED + 4 + 8 + 4).unwrap(), 47);
        assert_eq!(r.read_u16(USED + 2).unwrap(), 10);
    }

    #[test]
    fn lengths_are_bounded_without_wrapping() {
        let max = header(u32::MAX, TYPE_STREAM, Op::Rw as u16);
        assert_eq!(
            classify_header(&max, u64::MAX, GUEST),
            Verdict::Refuse(BAD_LENGTH, max)
        );
        let limit = header(64 * 1024, TYPE_STREAM, Op::Rw as u16);
        assert_eq!(
            classify_header(&limit, 44 + 64 * 1024, GUEST),
            Verdict::Packet(limit, Some(Op::Rw))
        );
        let over = Header {
            len: 64 * 1024 + 1,
            ..limit
        };
        assert_eq!(
            classify_header(&over, u64::MAX, GUEST),
            Verdict::Refuse(BAD_LENGTH, over)
        );
    }
}
