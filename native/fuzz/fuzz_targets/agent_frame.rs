//! What the host reads of the guest agent's frames (`agent_frame.rs`), on arbitrary
//! bytes: the first 8 are a frame's length prefix, the rest its header. Checked: the
//! prefix is accepted exactly when both lengths are within the protocol's caps; a
//! header that parses is an object whose message form (`shown`) keeps to its limit;
//! the reply checks never panic and return the refresh's counts as the header holds
//! them; and the clock exchange's round trip is never negative nor longer than the
//! host's own, whatever the guest's clock and processing time say.
#![no_main]

// The handshake's clock constants are not part of what the host reads.
#[allow(dead_code)]
#[path = "../../src/agent_frame.rs"]
mod agent_frame;

use agent_frame::{
    check_result, clock_exchange_step, frame_lengths, int, parse_header, record, shown, MAX_HEADER,
    MAX_PAYLOAD,
};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Some((prefix, rest)) = data.split_first_chunk::<8>() else {
        return;
    };
    let header_len = u32::from_be_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
    let payload_len = u32::from_be_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]) as usize;
    let within = (1..=MAX_HEADER).contains(&header_len) && payload_len <= MAX_PAYLOAD;
    assert_eq!(frame_lengths(prefix).is_ok(), within);
    if let Ok((h, p)) = frame_lengths(prefix) {
        assert_eq!((h, p), (header_len, payload_len));
    }

    let Ok(header) = parse_header(rest) else {
        return;
    };
    for limit in [0, 60, 200] {
        assert!(shown(&Value::Object(header.clone()), limit).chars().count() <= limit);
    }
    if let Ok(net) = check_result(&header) {
        let counts = net.map(|(a, f)| (a as i128, f as i128));
        let held = record(&header, "net", "after_fork").ok().map(|n| {
            (
                int(n, "connections_aborted", "net_refresh", Some(0)).unwrap(),
                int(n, "neighbours_flushed", "net_refresh", Some(0)).unwrap(),
            )
        });
        assert_eq!(
            counts,
            held.map(|(a, f)| (a.min(u64::MAX as i128), f.min(u64::MAX as i128)))
        );
    }
    // The host's send and receive times from the prefix, the guest's from the header.
    let sent = i128::from(i64::from_be_bytes(*prefix));
    let received = sent
        + i128::from(u32::from_be_bytes([
            prefix[4], prefix[5], prefix[6], prefix[7],
        ]));
    if let (Ok(guest), Ok(processing)) = (
        int(&header, "ns", "after_fork", None),
        int(&header, "processing_ns", "after_fork", None),
    ) {
        let (_, round_trip) = clock_exchange_step(sent, guest, processing, received);
        assert!((0..=received - sent).contains(&round_trip));
    }
});
