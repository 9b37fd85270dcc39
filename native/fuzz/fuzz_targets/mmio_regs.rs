//! The virtio-mmio register file against an arbitrary guest: any sequence of reads
//! and writes (any offset in the window, any size up to 8, any value), mixed with the
//! device side's calls, never panics, and keeps the invariants the transport relies
//! on: the driver's status bits are always a prefix of ACKNOWLEDGE, DRIVER,
//! FEATURES_OK, DRIVER_OK; every queue size is a power of 2 within its maximum; only
//! the two defined interrupt bits are ever set; an activation or a notification is
//! only asked for a running device, a notification only for a queue that exists.
#![no_main]

#[allow(dead_code)]
#[path = "../../src/mmio.rs"]
mod mmio;

use libfuzzer_sys::fuzz_target;
use mmio::{Event, Read, Registers};

const PREFIXES: [u32; 5] = [0, 0x1, 0x3, 0xB, 0xF];

fuzz_target!(|input: &[u8]| {
    if input.len() < 2 {
        return;
    }
    let sizes: [&[u32]; 4] = [&[], &[256], &[16, 1], &[128, 128, 2]];
    let max_sizes = sizes[usize::from(input[0] % 4)];
    let config = (input[1] & 1 == 0).then(|| input[..input.len().min(24)].to_vec());
    let features = if input[1] & 2 == 0 {
        mmio::VIRTIO_F_VERSION_1
    } else {
        u64::from_le_bytes([input[1], 0, 0, 0, 1, 0, 0, 0])
    };
    let mut r = Registers::new(19, features, max_sizes, config).expect("valid sizes");
    let mut ops = input[2..].chunks_exact(8);
    for op in &mut ops {
        let offset = u64::from(u16::from_le_bytes([op[0], op[1]]) & 0xFFF);
        let size = [1usize, 2, 3, 4, 4, 4, 8, 4][usize::from(op[2] & 7)];
        let value = [op[3], op[4], op[5], op[6], op[7], 0, 0, 0];
        let mut events = Vec::new();
        match op[2] >> 3 {
            0..=15 => r.write(offset, &value[..size], &mut events),
            16..=25 => {
                let mut out = [0u8; 8];
                if let Read::Device = r.read(offset, &mut out[..size]) {
                    assert!(offset >= mmio::CONFIG_SPACE);
                }
            }
            26 => {
                let epoch = r.epoch;
                r.raise(u32::from(op[3] & 3), epoch);
            }
            27 => {
                let epoch = r.epoch;
                r.device_error("fuzz".into(), epoch);
            }
            28 => {
                r.config_changed(None);
            }
            29 => {
                let saved = r.save();
                r.restore(&saved).expect("its own state");
            }
            _ => {
                // The bring-up steps, so the later stages are reached often.
                for (o, v) in [(0x70, 1u32), (0x70, 3), (0x24, 1), (0x20, 1), (0x70, 11)] {
                    r.write(o, &v.to_le_bytes(), &mut events);
                }
            }
        }
        let running = r.status & mmio::STATUS_DRIVER_OK != 0
            && r.status & mmio::STATUS_DEVICE_NEEDS_RESET == 0;
        for e in &events {
            match e {
                Event::Activate(epoch) => assert!(running && *epoch == r.epoch),
                Event::Notify(index, _) => {
                    assert!(running && (*index as usize) < max_sizes.len())
                }
                _ => {}
            }
        }
        assert!(
            PREFIXES.contains(&(r.status & 0xF)),
            "status {:#x}",
            r.status
        );
        assert_eq!(r.interrupt_status & !3, 0);
        for (q, &m) in r.queues.iter().zip(max_sizes) {
            assert!(q.max_size == m && q.size.is_power_of_two() && q.size <= m);
        }
    }
});
