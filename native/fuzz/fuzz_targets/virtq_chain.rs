//! The split-virtqueue code against arbitrary guest memory: whatever the descriptor
//! table, rings and indices hold, popping the queue dry ends (no hang: libFuzzer's
//! timeout catches one), fails only as a guest error, keeps every segment inside
//! RAM and each chain within the queue size, and bounds every copy. The two RAM
//! regions have a hole between them, so "outside RAM" includes the hole and the end.
#![no_main]

#[path = "common/guest_image.rs"]
mod guest_image;
#[allow(dead_code)]
#[path = "../../src/guest_ram.rs"]
mod guest_ram;
#[allow(dead_code)]
#[path = "../../src/virtq.rs"]
mod virtq;

use guest_image::{in_ram, GuestImage, LOW};
use libfuzzer_sys::fuzz_target;
use virtq::{QueueError, Rings};

fuzz_target!(|input: &[u8]| {
    if input.len() < 32 {
        return;
    }
    let (head, image) = input.split_at(32);
    let word = |i: usize| u64::from_le_bytes(head[i..i + 8].try_into().unwrap());
    let size = 1u16 << (head[0] % 9); // 1..256
    let rings = Rings {
        size,
        // Mostly inside RAM and aligned, so that chains are walked; sometimes anywhere.
        desc: if head[1] & 1 == 0 {
            (word(8) % LOW) & !15
        } else {
            word(8)
        },
        avail: if head[1] & 2 == 0 {
            (word(16) % LOW) & !1
        } else {
            word(16)
        },
        used: if head[1] & 4 == 0 {
            (word(24) % LOW) & !3
        } else {
            word(24)
        },
        event_idx: head[1] & 8 != 0,
    };
    let next_avail = u16::from_le_bytes([head[2], head[3]]);
    let guest = GuestImage::new(image);
    let r = guest.ram().lock().unwrap();
    if virtq::validate(&r, &rings, 256).is_err() {
        return;
    }
    let (mut avail, mut used) = (next_avail, next_avail);
    for _ in 0..u32::from(size) + 2 {
        match virtq::pop(&r, &rings, avail) {
            Ok(None) => break,
            Ok(Some(chain)) => {
                assert!(chain.head < size);
                assert!(chain.readable.len() + chain.writable.len() <= usize::from(size));
                for &(gpa, len) in chain.readable.iter().chain(&chain.writable) {
                    assert!(
                        in_ram(gpa, u64::from(len)),
                        "segment {gpa:#x}+{len:#x} outside RAM"
                    );
                }
                let data = virtq::read_segments(&r, &chain.readable, 4096, 3).unwrap();
                assert!(data.len() <= 4096);
                let wrote =
                    virtq::write_segments(&r, &chain.writable, &image[..image.len().min(300)], 1)
                        .unwrap();
                assert!(wrote <= 300);
                avail = avail.wrapping_add(1);
                used = virtq::add_used(&r, &rings, used, chain.head, wrote as u32).unwrap();
            }
            Err(QueueError::Virtqueue(_)) | Err(QueueError::Memory(_)) => break,
        }
    }
    // The interrupt decision reads one word the guest wrote, whatever it holds, inside
    // the validated rings.
    virtq::needs_interrupt(&r, &rings, next_avail, used).unwrap();
});
