//! The guest every memory-driving fuzz target runs on: two RAM regions with a hole
//! between them, [0, 16 KiB) and [32 KiB, 40 KiB), filled from the fuzzer's input, so
//! that "outside RAM" includes the hole and the end; and a queue's ring registers
//! drawn from the input, aligned and inside the low region, so that chains are walked.
//! Each target declares `guest_ram` and `virtq` (the crate's own files) and this
//! module beside them (`#[path = "common/guest_image.rs"] mod guest_image;`).

use crate::guest_ram::{GuestRam, Region};
use crate::virtq::Rings;

pub const LOW: u64 = 0x4000;
pub const HIGH_AT: u64 = 0x8000;
pub const HIGH: u64 = 0x2000;

/// Guest RAM over two buffers of ours. `ram` is declared first, so it is dropped
/// before the buffers it points into.
pub struct GuestImage {
    ram: GuestRam,
    _low: Vec<u8>,
    _high: Vec<u8>,
}

impl GuestImage {
    /// The low region filled from `image` first, then the high one; the rest zero.
    pub fn new(image: &[u8]) -> GuestImage {
        let mut low = vec![0u8; LOW as usize];
        let mut high = vec![0u8; HIGH as usize];
        let n = image.len().min(low.len());
        low[..n].copy_from_slice(&image[..n]);
        let m = (image.len() - n).min(high.len());
        high[..m].copy_from_slice(&image[n..n + m]);
        // SAFETY: the two vectors' heap buffers are never resized or moved (moving a
        // Vec moves only its pointer), they live as long as `ram` inside this struct,
        // and `ram` is dropped before them (field order).
        let ram = unsafe {
            GuestRam::new(vec![
                Region {
                    gpa: 0,
                    size: LOW,
                    host: low.as_mut_ptr() as usize,
                },
                Region {
                    gpa: HIGH_AT,
                    size: HIGH,
                    host: high.as_mut_ptr() as usize,
                },
            ])
        };
        GuestImage {
            ram,
            _low: low,
            _high: high,
        }
    }

    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }
}

/// Whether `gpa..gpa + len` lies in one region: the targets' own check, independent
/// of `guest_ram`'s.
#[allow(dead_code)] // not every target checks segments itself
pub fn in_ram(gpa: u64, len: u64) -> bool {
    (gpa < LOW && len <= LOW - gpa)
        || (gpa >= HIGH_AT && gpa < HIGH_AT + HIGH && len <= HIGH_AT + HIGH - gpa)
}

/// A queue's registers from `head[at..at + 32]`: a size of 1..256 from the first byte,
/// the three rings from the three words after the first, aligned and in low RAM, with
/// or without EVENT_IDX.
#[allow(dead_code)] // virtq_chain draws its own, sometimes anywhere
pub fn rings(head: &[u8], at: usize) -> Rings {
    let word = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&head[at + i..at + i + 8]);
        u64::from_le_bytes(b)
    };
    Rings {
        size: 1u16 << (head[at] % 9),
        desc: (word(8) % LOW) & !15,
        avail: (word(16) % LOW) & !1,
        used: (word(24) % LOW) & !3,
        // A bit the descriptor table's alignment drops: EVENT_IDX negotiated or not.
        event_idx: word(8) & 8 != 0,
    }
}
