//! What the host reads of the guest agent's frames (`agent/protocol.py`), as pure
//! functions of the bytes: a frame's length prefix, its JSON header, and the checks
//! `AgentClient` makes of an `after_fork` reply, each refusal with the client's
//! message. Everything here comes from the guest, which runs untrusted code; the
//! fuzz target `agent_frame` drives it with arbitrary bytes.
//!
//! No I/O and no PyO3 here (the fuzz target builds this file alone):
//! `agent_handshake.rs` reads the bytes and acts on the answers.

use serde_json::{Map, Value};

pub const MAX_HEADER: usize = 1 << 20;
pub const MAX_PAYLOAD: usize = 1 << 20;
/// `protocol.MAX_CLOCK_STEP_NS`.
pub const MAX_CLOCK_STEP_NS: i128 = 3600 * 1_000_000_000;
/// `client.CLOCK_EXCHANGE_MAX_BOUND_NS`.
pub const CLOCK_EXCHANGE_MAX_BOUND_NS: i128 = 250_000_000;

/// A reply the client refuses (`AgentProtocolError`): the op it names and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub op: &'static str,
    pub message: String,
}

fn refuse(op: &'static str, message: String) -> Refusal {
    Refusal { op, message }
}

/// A frame's header and payload lengths from its 8-byte prefix (`>II`), or why the
/// frame breaks the protocol (`protocol.recv_frame`'s messages). Both are checked
/// before anything is read or allocated for them.
pub fn frame_lengths(prefix: &[u8; 8]) -> Result<(usize, usize), String> {
    let header_len = u32::from_be_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
    let payload_len = u32::from_be_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]) as usize;
    if header_len == 0 {
        return Err("frame header length is 0; a JSON object is required".to_owned());
    }
    if header_len > MAX_HEADER {
        return Err(format!(
            "frame header length {header_len} is over the {MAX_HEADER} cap"
        ));
    }
    if payload_len > MAX_PAYLOAD {
        return Err(format!(
            "frame payload length {payload_len} is over the {MAX_PAYLOAD} cap"
        ));
    }
    Ok((header_len, payload_len))
}

/// A frame's header: a JSON object, in the order the agent wrote its keys.
pub fn parse_header(raw: &[u8]) -> Result<Map<String, Value>, String> {
    let header: Value = serde_json::from_slice(raw)
        .map_err(|err| format!("frame header is not UTF-8 JSON: {err}"))?;
    match header {
        Value::Object(header) => Ok(header),
        other => Err(format!(
            "frame header must be a JSON object, got {}",
            type_name(&other)
        )),
    }
}

/// Python's `repr` of a str, near enough for a message: single quotes.
pub fn quoted(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// Python's name for a JSON value's type (`type(value).__name__`).
pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "NoneType",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_f64() => "float",
        Value::Number(_) => "int",
        Value::String(_) => "str",
        Value::Array(_) => "list",
        Value::Object(_) => "dict",
    }
}

/// Python's `repr` of the value `json.loads` makes of `v` (what the client's
/// messages show), at most `limit` characters.
pub fn shown(v: &Value, limit: usize) -> String {
    let mut out = String::new();
    py_repr(v, &mut out, limit);
    out.chars().take(limit).collect()
}

fn py_repr(v: &Value, out: &mut String, limit: usize) {
    // Past the limit (in UTF-8 bytes, up to 4 a character) nothing more is shown: a
    // header of 1 MiB is not walked whole.
    if out.len() > limit * 4 {
        return;
    }
    match v {
        Value::Null => out.push_str("None"),
        Value::Bool(true) => out.push_str("True"),
        Value::Bool(false) => out.push_str("False"),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => out.push_str(&quoted(s)),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if out.len() > limit * 4 {
                    break;
                }
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(item, out, limit);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if out.len() > limit * 4 {
                    break;
                }
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&quoted(k));
                out.push_str(": ");
                py_repr(item, out, limit);
            }
            out.push('}');
        }
    }
}

// -- typed reading of replies (client.py's `_field` and friends) --------------------

fn field<'a>(r: &'a Map<String, Value>, key: &str, op: &'static str) -> Result<&'a Value, Refusal> {
    match r.get(key) {
        None | Some(Value::Null) => Err(refuse(op, format!("the agent's reply lacks '{key}'"))),
        Some(v) => Ok(v),
    }
}

fn wrong_type(key: &str, v: &Value, expected: &str, op: &'static str) -> Refusal {
    // bool is an int subclass in Python; a count of True is a lie, not a number.
    if let Value::Bool(_) = v {
        return refuse(
            op,
            format!("the agent's '{key}' is a bool, expected {expected}"),
        );
    }
    refuse(
        op,
        format!(
            "the agent's '{key}' is {} {}, expected {expected}",
            type_name(v),
            shown(v, 60)
        ),
    )
}

/// `client._int`: an integer (at least `minimum`).
pub fn int(
    r: &Map<String, Value>,
    key: &str,
    op: &'static str,
    minimum: Option<i128>,
) -> Result<i128, Refusal> {
    let v = field(r, key, op)?;
    let value = match v {
        Value::Number(n) if n.is_i64() => i128::from(n.as_i64().unwrap_or_default()),
        Value::Number(n) if n.is_u64() => i128::from(n.as_u64().unwrap_or_default()),
        _ => return Err(wrong_type(key, v, "int", op)),
    };
    if let Some(min) = minimum {
        if value < min {
            return Err(refuse(
                op,
                format!("the agent's '{key}' is {value}, below {min}"),
            ));
        }
    }
    Ok(value)
}

fn num(r: &Map<String, Value>, key: &str, op: &'static str) -> Result<f64, Refusal> {
    let v = field(r, key, op)?;
    match v {
        Value::Number(n) => n
            .as_f64()
            .filter(|f| f.is_finite())
            .ok_or_else(|| refuse(op, format!("the agent's '{key}' is not a finite number"))),
        _ => Err(wrong_type(key, v, "int/float", op)),
    }
}

fn string(
    r: &Map<String, Value>,
    key: &str,
    op: &'static str,
    optional: bool,
) -> Result<(), Refusal> {
    match r.get(key) {
        None | Some(Value::Null) if optional => Ok(()),
        _ => match field(r, key, op)? {
            Value::String(_) => Ok(()),
            v => Err(wrong_type(key, v, "str", op)),
        },
    }
}

fn boolean(r: &Map<String, Value>, key: &str, op: &'static str) -> Result<bool, Refusal> {
    match field(r, key, op)? {
        Value::Bool(b) => Ok(*b),
        v => Err(wrong_type(key, v, "bool", op)),
    }
}

/// `client._record`: a nested object.
pub fn record<'a>(
    r: &'a Map<String, Value>,
    key: &str,
    op: &'static str,
) -> Result<&'a Map<String, Value>, Refusal> {
    match field(r, key, op)? {
        Value::Object(m) => Ok(m),
        v => Err(wrong_type(key, v, "dict", op)),
    }
}

/// `AfterForkResult`'s checks of an `after_fork` result, in its order: the ping's
/// fields, the reseed, the network refresh, the clock. The refresh's counts
/// `(connections_aborted, neighbours_flushed)` when the guest refreshed.
pub fn check_result(r: &Map<String, Value>) -> Result<Option<(u64, u64)>, Refusal> {
    let op = "after_fork";
    int(r, "pid", "ping", Some(0))?;
    string(r, "version", "ping", false)?;
    int(r, "protocol", "ping", None)?;
    num(r, "uptime", "ping")?;
    string(r, "boot_id", "ping", true)?;
    check_reseed(record(r, "reseed", op)?)?;
    let net = match r.get("net") {
        None | Some(Value::Null) => None,
        Some(_) => Some(net_counts(record(r, "net", op)?)?),
    };
    int(record(r, "clock", op)?, "previous_ns", op, None)?;
    Ok(net)
}

/// `client._reseed_result`'s checks of a reseed's record (`after_fork`'s `reseed`, or
/// a `reseed` call's result).
pub fn check_reseed(reseed: &Map<String, Value>) -> Result<(), Refusal> {
    int(reseed, "bytes", "reseed", Some(0))?;
    int(reseed, "entropy_bits", "reseed", Some(0))?;
    boolean(reseed, "kernel_reseeded", "reseed")?;
    Ok(())
}

/// `NetRefreshResult.from_reply`'s checks of a network refresh's record (`after_fork`'s
/// `net`, or a `net_refresh` call's result): `(connections_aborted, neighbours_flushed)`.
pub fn net_counts(net: &Map<String, Value>) -> Result<(u64, u64), Refusal> {
    let refresh = "net_refresh";
    string(net, "interface", refresh, true)?;
    let aborted = int(net, "connections_aborted", refresh, Some(0))?;
    let flushed = int(net, "neighbours_flushed", refresh, Some(0))?;
    Ok((clamp_u64(aborted), clamp_u64(flushed)))
}

fn clamp_u64(v: i128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// `client.clock_exchange_step`: `(step, round trip)` in ns, NTP style; the guest's
/// processing time is kept within the round trip, so a lie moves only its own clock
/// and never makes the host's error bound negative. Python's floor division.
pub fn clock_exchange_step(
    sent: i128,
    guest: i128,
    processing: i128,
    received: i128,
) -> (i128, i128) {
    let processing = processing.max(0).min((received - sent).max(0));
    let guest_set = guest - processing;
    let step = ((sent - guest_set) + (received - guest)).div_euclid(2);
    (step, (received - sent - processing).max(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefix(header: u32, payload: u32) -> [u8; 8] {
        let mut p = [0u8; 8];
        p[..4].copy_from_slice(&header.to_be_bytes());
        p[4..].copy_from_slice(&payload.to_be_bytes());
        p
    }

    #[test]
    fn lengths_are_capped_before_anything_is_read() {
        assert_eq!(frame_lengths(&prefix(1, 0)), Ok((1, 0)));
        assert_eq!(
            frame_lengths(&prefix(MAX_HEADER as u32, MAX_PAYLOAD as u32)),
            Ok((MAX_HEADER, MAX_PAYLOAD))
        );
        assert!(frame_lengths(&prefix(0, 0)).is_err());
        assert!(frame_lengths(&prefix(MAX_HEADER as u32 + 1, 0)).is_err());
        assert!(frame_lengths(&prefix(1, MAX_PAYLOAD as u32 + 1)).is_err());
        assert!(frame_lengths(&prefix(u32::MAX, u32::MAX)).is_err());
    }

    #[test]
    fn a_header_is_an_object_in_the_agents_order() {
        let h = parse_header(br#"{"type":"clock","ns":5,"a":[1,"x",null,true]}"#).unwrap();
        assert_eq!(
            shown(&Value::Object(h), 200),
            "{'type': 'clock', 'ns': 5, 'a': [1, 'x', None, True]}"
        );
        assert_eq!(
            parse_header(b"[1]"),
            Err("frame header must be a JSON object, got list".to_owned())
        );
        assert!(parse_header(b"{nope").is_err());
        assert!(parse_header(&[0xff, 0xfe]).is_err());
    }

    #[test]
    fn shown_stops_at_its_limit() {
        let big = Value::Array(vec![Value::String("x".repeat(100)); 10_000]);
        assert_eq!(shown(&big, 60).chars().count(), 60);
    }

    #[test]
    fn the_checks_name_the_op_and_the_field() {
        let good = parse_header(
            br#"{"type":"result","pid":1,"version":"v","protocol":4,"uptime":1.5,
                "boot_id":null,"reseed":{"bytes":64,"entropy_bits":512,"kernel_reseeded":true},
                "net":{"interface":null,"connections_aborted":3,"neighbours_flushed":2},
                "clock":{"previous_ns":1}}"#,
        )
        .unwrap();
        assert_eq!(check_result(&good), Ok(Some((3, 2))));
        let mut bad = good.clone();
        bad.insert("pid".into(), Value::Bool(true));
        assert_eq!(
            check_result(&bad),
            Err(Refusal {
                op: "ping",
                message: "the agent's 'pid' is a bool, expected int".into()
            })
        );
        let mut bad = good.clone();
        bad.insert("reseed".into(), Value::String("r".into()));
        assert_eq!(
            check_result(&bad).unwrap_err().message,
            "the agent's 'reseed' is str 'r', expected dict"
        );
        let mut bad = good;
        bad.remove("clock");
        assert_eq!(
            check_result(&bad).unwrap_err().message,
            "the agent's reply lacks 'clock'"
        );
    }

    #[test]
    fn the_clock_arithmetic_floors_as_python_does() {
        assert_eq!(clock_exchange_step(1000, 1050, 50, 1150), (50, 100));
        assert_eq!(clock_exchange_step(1000, 1000, -5, 1100), (50, 100));
        assert_eq!(clock_exchange_step(1000, 1000, 0, 900).1, 0);
        // (1 - 4 + (2 - 4)) = -5: Python's -5 // 2 is -3.
        assert_eq!(clock_exchange_step(1, 4, 0, 2).0, -3);
    }
}
