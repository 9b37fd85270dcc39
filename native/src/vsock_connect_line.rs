//! A host's CONNECT line (Firecracker's convention, `CONNECT\s+(\d{1,10})\s*\n`):
//! the one parser of host-peer bytes in the native vsock server (`vsock_serve.rs`),
//! kept apart so that the fuzz target (`native/fuzz`'s `vsock_connect_line`) builds it
//! without Python. Its input is at most one line of at most 127 bytes (the server reads
//! at most 64 bytes at a time and gives up on a line of 64 without a newline).

pub fn is_space(b: u8) -> bool {
    // Python's `\s` on bytes.
    matches!(b, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c)
}

/// The port of a host's CONNECT line (`CONNECT\s+(\d{1,10})\s*\n`, the whole line,
/// `\s` as Python's regexes read it on bytes), the number not yet range-checked.
pub fn parse_connect_line(line: &[u8]) -> Option<u64> {
    let rest = line.strip_prefix(b"CONNECT")?;
    let spaces = rest.iter().take_while(|&&b| is_space(b)).count();
    if spaces == 0 {
        return None;
    }
    let rest = &rest[spaces..];
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits > 10 {
        return None;
    }
    let tail = &rest[digits..];
    if tail.last() != Some(&b'\n') || !tail.iter().all(|&b| is_space(b)) {
        return None;
    }
    // At most 10 digits: fits a u64.
    Some(
        rest[..digits]
            .iter()
            .fold(0u64, |n, &d| n * 10 + u64::from(d - b'0')),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_lines_parse_as_vsock_pys_pattern() {
        assert_eq!(parse_connect_line(b"CONNECT 52\n"), Some(52));
        assert_eq!(
            parse_connect_line(b"CONNECT\t 4294967295 \r\n"),
            Some(u32::MAX.into())
        );
        assert_eq!(
            parse_connect_line(b"CONNECT 9999999999\n"),
            Some(9_999_999_999)
        );
        assert_eq!(parse_connect_line(b"CONNECT 12345678901\n"), None); // 11 digits
        assert_eq!(parse_connect_line(b"CONNECT52\n"), None);
        assert_eq!(parse_connect_line(b"CONNECT 52"), None);
        assert_eq!(parse_connect_line(b"CONNECT 52 x\n"), None);
        assert_eq!(parse_connect_line(b"connect 52\n"), None);
        assert_eq!(parse_connect_line(b" CONNECT 52\n"), None);
        assert_eq!(parse_connect_line(b"CONNECT -1\n"), None);
        assert_eq!(parse_connect_line(b""), None);
    }
}
