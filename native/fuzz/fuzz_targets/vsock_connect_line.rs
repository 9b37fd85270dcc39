//! The native vsock server's CONNECT line parser (`vsock_connect_line.rs`) against a
//! second reading of the convention's pattern (`CONNECT\s+(\d{1,10})\s*\n`, the whole
//! line), written from the other end: strip the newline and trailing spaces, take the
//! trailing digits, and what is left between them and `CONNECT` must be spaces. On any
//! bytes the two agree, the port is the digits' decimal value, and a line that parses
//! still parses with its port written back in.
#![no_main]

#[path = "../../src/vsock_connect_line.rs"]
mod vsock_connect_line;

use libfuzzer_sys::fuzz_target;
use vsock_connect_line::{is_space, parse_connect_line};

fn reference(line: &[u8]) -> Option<u64> {
    let body = line.strip_prefix(b"CONNECT")?.strip_suffix(b"\n")?;
    let end = body
        .iter()
        .rposition(|&b| !is_space(b))
        .map_or(0, |i| i + 1);
    let core = &body[..end];
    let start = core
        .iter()
        .rposition(|b| !b.is_ascii_digit())
        .map_or(0, |i| i + 1);
    let (lead, digits) = core.split_at(start);
    if lead.is_empty() || !lead.iter().all(|&b| is_space(b)) {
        return None;
    }
    if digits.is_empty() || digits.len() > 10 {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

fuzz_target!(|data: &[u8]| {
    // The server never hands it more than 127 bytes; longer inputs cost time only.
    let line = &data[..data.len().min(256)];
    let got = parse_connect_line(line);
    assert_eq!(got, reference(line), "{line:?}");
    if let Some(port) = got {
        assert!(port <= 9_999_999_999);
        let again = format!("CONNECT {port}\n");
        assert_eq!(parse_connect_line(again.as_bytes()), Some(port));
    }
    // Every prefix of the bytes that fits in a read of the server is parsed too.
    if line.len() > 1 {
        let cut = line.len() / 2;
        assert_eq!(parse_connect_line(&line[..cut]), reference(&line[..cut]));
    }
});
