"""The agent's frame codec: round trips, caps, malformed input."""

from __future__ import annotations

import json
import socket
import struct

import pytest

from vmfork.agent.protocol import (
    HEADER,
    MAX_HEADER,
    MAX_PAYLOAD,
    OPS,
    ConnectionClosed,
    ProtocolError,
    encode_frame,
    recv_frame,
    send_frame,
)


@pytest.fixture
def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def test_round_trip_binary_payload(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    payload = bytes(range(256)) * 100
    send_frame(a, {"op": "write", "path": "/tmp/ü"}, payload)
    send_frame(a, {"type": "eof"})
    first = recv_frame(b)
    assert first.header == {"op": "write", "path": "/tmp/ü"}
    assert first.payload == payload
    second = recv_frame(b)
    assert second.type == "eof" and second.payload == b""


def test_frame_layout_is_big_endian_lengths_then_json_then_payload() -> None:
    raw = encode_frame({"type": "stdout"}, b"\x00\xff")
    header_len, payload_len = struct.unpack(">II", raw[:8])
    assert (header_len, payload_len) == (len(b'{"type":"stdout"}'), 2)
    assert json.loads(raw[8:8 + header_len]) == {"type": "stdout"}
    assert raw[8 + header_len:] == b"\x00\xff"


def test_surrogate_escaped_names_round_trip(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    name = b"/tmp/caf\xe9".decode("utf-8", "surrogateescape")  # a Latin-1 file name
    send_frame(a, {"path": name})
    assert recv_frame(b).header["path"] == name


def test_encode_refuses_oversized_parts() -> None:
    with pytest.raises(ProtocolError) as err:
        encode_frame({"type": "data"}, b"x" * (MAX_PAYLOAD + 1))
    assert err.value.code == "too_large"
    with pytest.raises(ProtocolError) as err:
        encode_frame({"blob": "x" * MAX_HEADER})
    assert err.value.code == "too_large"


@pytest.mark.parametrize(("raw", "code"), [
    (HEADER.pack(MAX_HEADER + 1, 0), "too_large"),
    (HEADER.pack(2, MAX_PAYLOAD + 1), "too_large"),
    (HEADER.pack(0, 0), "bad_request"),
    (HEADER.pack(5, 0) + b"nope!", "bad_request"),
    (HEADER.pack(2, 0) + b"[]", "bad_request"),
    (HEADER.pack(2, 0) + b"\xff\xfe", "bad_request"),
])
def test_recv_rejects_malformed_frames(pair: tuple[socket.socket, socket.socket], raw: bytes,
                                       code: str) -> None:
    a, b = pair
    a.sendall(raw)
    with pytest.raises(ProtocolError) as err:
        recv_frame(b)
    assert err.value.code == code


def test_recv_distinguishes_clean_close_from_truncation(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.close()
    with pytest.raises(ConnectionClosed) as err:
        recv_frame(b)
    assert err.value.clean
    c, d = socket.socketpair()
    c.sendall(HEADER.pack(10, 0) + b'{"op"')
    c.close()
    with pytest.raises(ConnectionClosed) as err:
        recv_frame(d)
    assert not err.value.clean
    assert "header" in err.value.message
    d.close()


def test_documented_ops_are_the_served_ops() -> None:
    from vmfork.agent import protocol

    doc = protocol.__doc__ or ""
    for op in OPS:
        assert f"``{op}``" in doc, f"op {op!r} is not documented in protocol.py"
