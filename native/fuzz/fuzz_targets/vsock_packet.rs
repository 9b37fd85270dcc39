//! vsock's tx parse against arbitrary guest memory and queue registers: whatever the
//! descriptor table, rings and headers hold, classifying every chain of a tx queue
//! ends, fails only as a guest memory error (for buffers the walk did not check), and
//! its verdict is the one the rules give for the header it copied: a short header
//! exactly when the chain has fewer than 44 readable bytes; a wrong CID exactly when
//! the CIDs are not our guest's and the host's; a refusal only for a payload beyond
//! the chain or the 64 KiB limit or a type other than STREAM, and then with the
//! header; a packet only for one within both and of type STREAM, with its op decoded,
//! whose payload can be read from the chain in full. Headers round-trip through
//! `encode`/`decode`. On the rx side, writing a packet into any chain that holds a
//! header succeeds, uses the chain, and leaves the header in it. The target shapes some headers as a driver would (`shape`), so
//! that inputs reach every rule and its boundaries, not only the first ones.
#![no_main]

#[path = "common/guest_image.rs"]
mod guest_image;
#[allow(dead_code)]
#[path = "../../src/guest_ram.rs"]
mod guest_ram;
#[allow(dead_code)]
#[path = "../../src/virtq.rs"]
mod virtq;
#[allow(dead_code)]
#[path = "../../src/vsock_packet.rs"]
mod vsock_packet;

use guest_image::{rings, GuestImage};
use libfuzzer_sys::fuzz_target;
use vsock_packet::{Header, Op, Verdict, HEADER_SIZE, HOST_CID, MAX_PAYLOAD, TYPE_STREAM};

/// Check `verdict` against the rules for the chain's readable `segments`; `walked`:
/// every segment is known to be in RAM (so the whole payload can be read).
fn check(
    ram: &guest_ram::Ram<'_>,
    segments: &[(u64, u32)],
    guest_cid: u64,
    verdict: Verdict,
    walked: bool,
) {
    let total = virtq::total(segments);
    let raw = virtq::read_segments(ram, segments, HEADER_SIZE, 0).unwrap();
    if total < HEADER_SIZE as u64 {
        assert_eq!(verdict, Verdict::Drop(vsock_packet::SHORT_HEADER));
        return;
    }
    let hdr = Header::decode(raw.as_slice().try_into().unwrap());
    assert_eq!(
        Header::decode(&hdr.encode()),
        hdr,
        "encode/decode round trip"
    );
    let fits =
        u64::from(hdr.len) <= MAX_PAYLOAD && HEADER_SIZE as u64 + u64::from(hdr.len) <= total;
    match verdict {
        Verdict::Drop(key) => {
            assert_eq!(key, vsock_packet::WRONG_CID);
            assert!(hdr.src_cid != guest_cid || hdr.dst_cid != HOST_CID);
        }
        Verdict::Refuse(key, h) => {
            assert_eq!(h, hdr);
            assert!(hdr.src_cid == guest_cid && hdr.dst_cid == HOST_CID);
            if key == vsock_packet::BAD_LENGTH {
                assert!(!fits);
            } else {
                assert_eq!(key, vsock_packet::BAD_TYPE);
                assert!(fits && hdr.type_ != TYPE_STREAM);
            }
        }
        Verdict::Packet(h, op) => {
            assert_eq!(h, hdr);
            assert!(hdr.src_cid == guest_cid && hdr.dst_cid == HOST_CID);
            assert!(fits && hdr.type_ == TYPE_STREAM);
            assert_eq!(op, Op::from_u16(hdr.op));
            assert_eq!(op.map(|o| o as u16).unwrap_or(hdr.op), hdr.op);
            if walked {
                let payload =
                    virtq::read_segments(ram, segments, hdr.len as usize, HEADER_SIZE as u64)
                        .unwrap();
                assert_eq!(
                    payload.len(),
                    hdr.len as usize,
                    "the payload is in the chain"
                );
            }
        }
    }
}

/// Make the header in `segments` more like a driver's, as `flags` says, so that the
/// later rules are reached: bit 0 our guest's and the host's CIDs, bit 1 a length at
/// the chain's readable bytes (`delta` -2..=2 from it), bit 2 type STREAM.
fn shape(ram: &guest_ram::Ram<'_>, segments: &[(u64, u32)], guest_cid: u64, flags: u8, delta: u8) {
    let total = virtq::total(segments);
    let Ok(raw) = virtq::read_segments(ram, segments, HEADER_SIZE, 0) else {
        return;
    };
    let Ok(raw) = <[u8; HEADER_SIZE]>::try_from(raw.as_slice()) else {
        return;
    };
    let mut hdr = Header::decode(&raw);
    if flags & 1 != 0 {
        hdr.src_cid = guest_cid;
        hdr.dst_cid = HOST_CID;
    }
    if flags & 2 != 0 {
        let room = (total - HEADER_SIZE as u64) as i64 + i64::from(delta % 5) - 2;
        hdr.len = room.clamp(0, i64::from(u32::MAX)) as u32;
    }
    if flags & 4 != 0 {
        hdr.type_ = TYPE_STREAM;
    }
    let _ = virtq::write_segments(ram, segments, &hdr.encode(), 0);
}

fuzz_target!(|input: &[u8]| {
    if input.len() < 80 {
        return;
    }
    let (head, image) = input.split_at(80);
    let tx_rings = rings(head, 0);
    let next_avail = u16::from_le_bytes([head[1], head[2]]);
    // Our guest's CID: mostly the one most headers in a small image carry (3), else
    // whatever the input says.
    let guest_cid = if head[3] & 1 == 0 {
        3
    } else {
        u64::from_le_bytes(head[32..40].try_into().unwrap())
    };
    let guest = GuestImage::new(image);
    let r = guest.ram().lock().unwrap();

    // Chains as the queue hands them over: every buffer was checked to be in RAM.
    if virtq::validate(&r, &tx_rings, 256).is_ok() {
        let mut avail = next_avail;
        for _ in 0..u32::from(tx_rings.size) + 2 {
            let Ok(Some(chain)) = virtq::pop(&r, &tx_rings, avail) else {
                break;
            };
            avail = avail.wrapping_add(1);
            shape(&r, &chain.readable, guest_cid, head[4], head[5]);
            let verdict = vsock_packet::classify_tx(&r, &chain.readable, guest_cid)
                .expect("a walked chain's buffers are in RAM");
            check(&r, &chain.readable, guest_cid, verdict, true);
        }
    }

    // The rx side: a header and payload from the input written into each rx chain
    // that holds a header; the used index moves by one per chain, and the header
    // lands in the chain unless its buffers overlap each other or the used ring (a
    // guest may make them).
    let rx_rings = rings(head, 48);
    if virtq::validate(&r, &rx_rings, 256).is_ok() {
        let (mut avail, mut used) = (next_avail, next_avail);
        let hdr = Header::decode(input[..HEADER_SIZE].try_into().unwrap());
        let payload = &image[..image.len().min(usize::from(head[6]) * 4)];
        for _ in 0..u32::from(rx_rings.size) + 2 {
            let Ok(Some(chain)) = virtq::pop(&r, &rx_rings, avail) else {
                break;
            };
            if virtq::total(&chain.writable) < HEADER_SIZE as u64 {
                break;
            }
            avail = avail.wrapping_add(1);
            let next = vsock_packet::deliver_rx(
                &r,
                &rx_rings,
                used,
                chain.head,
                &chain.writable,
                &hdr,
                payload,
            )
            .expect("a walked chain's buffers and a validated used ring are in RAM");
            assert_eq!(next, used.wrapping_add(1));
            used = next;
            let mut ranges: Vec<(u64, u64)> = chain
                .writable
                .iter()
                .map(|&(gpa, len)| (gpa, gpa + u64::from(len)))
                .collect();
            ranges.push((
                rx_rings.used,
                rx_rings.used + 6 + 8 * u64::from(rx_rings.size),
            ));
            ranges.sort_unstable();
            let overlaps = ranges.windows(2).any(|w| w[1].0 < w[0].1);
            if !overlaps {
                let back = virtq::read_segments(&r, &chain.writable, HEADER_SIZE, 0).unwrap();
                assert_eq!(
                    back.as_slice(),
                    &hdr.encode()[..],
                    "the header is in the chain"
                );
            }
        }
    }

    // Buffers the walk never saw, anywhere (the hole, past the end, across a region's
    // end): a verdict for those in RAM, a memory error for the others.
    let segments: Vec<(u64, u32)> = head[40..48]
        .chunks(2)
        .map(|c| {
            let gpa = u64::from(u16::from_le_bytes([c[0], c[1]])) * 3;
            (gpa, u32::from(c[0] % 64))
        })
        .collect();
    match vsock_packet::classify_tx(&r, &segments, guest_cid) {
        Ok(verdict) => check(&r, &segments, guest_cid, verdict, false),
        Err(virtq::QueueError::Memory(_)) => {}
        Err(e) => panic!("not a memory error: {e:?}"),
    }
});
