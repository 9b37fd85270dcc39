"""The Connect protocol (connectrpc.com/docs/protocol) with its JSON codec: what envd
speaks and the E2B SDKs send.

Unary calls are ``POST /<service>/<Method>`` with ``Content-Type: application/json``
and the request message as the body; the answer is 200 with the response message, or
an error status with ``{"code": "not_found", "message": "..."}``. Streaming calls use
``application/connect+json``: request and response bodies are envelopes (one flag
byte, a 4-byte big-endian length, the JSON message), and a response stream always ends
with an envelope flagged ``END_STREAM`` holding ``{}`` or ``{"error": {...}}`` —
errors after the headers travel there, with status 200.

Protobuf's JSON mapping, as far as envd's messages need it: field names in
lowerCamelCase (the original snake_case is accepted too), ``bytes`` as base64, 64-bit
integers as strings, enums by name (numbers accepted), ``Timestamp`` as RFC 3339.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
import time
from collections.abc import Callable, Generator
from typing import Any

from vmfork.server import api
from vmfork.server.errors import ApiError

UNARY_TYPE = "application/json"
STREAM_TYPE = "application/connect+json"
END_STREAM = 0x02
COMPRESSED = 0x01
MAX_MESSAGE = 1 << 20
"""One request message (a unary body or one envelope): envd's requests are small; file
data travels over ``/files``, not RPCs. ``SendInput`` carries at most this much stdin."""

_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403,
    "resource_exhausted": 429, "failed_precondition": 400, "aborted": 409,
    "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}
_CODE_FOR_STATUS = {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied",
                    404: "not_found", 409: "already_exists", 413: "resource_exhausted",
                    429: "resource_exhausted", 501: "unimplemented", 502: "unavailable",
                    503: "unavailable", 504: "deadline_exceeded"}


class ConnectError(Exception):
    """An RPC's failure with its Connect code (a key of ``_STATUS``)."""

    def __init__(self, code: str, message: str) -> None:
        assert code in _STATUS, code
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def from_api(cls, err: ApiError) -> ConnectError:
        """The daemon's own errors (``NotFound``, ``Conflict`` ...) as Connect codes."""
        code = _CODE_FOR_STATUS.get(err.status, "internal" if err.status >= 500 else "unknown")
        return cls(code, str(err.body().get("error", err)))

    def body(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def unary_response(message: dict[str, Any]) -> api.Response:
    return api.Response(200, message, content_type=UNARY_TYPE)


def unary_error(err: ConnectError) -> api.Response:
    return api.Response(_STATUS[err.code], err.body(), content_type=UNARY_TYPE)


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_of_stream(err: ConnectError | None = None) -> bytes:
    return envelope({} if err is None else {"error": err.body()}, END_STREAM)


def stream_response(events: Callable[[], Generator[dict[str, Any], None, None]]
                    ) -> api.StreamResponse:
    """A server stream: each message ``events`` yields as an envelope, then the end of
    the stream, with the error that stopped it if one did."""

    def produce(write: api.Writer) -> None:
        stream = events()
        try:
            for message in stream:
                write(envelope(message))
        except ConnectError as err:
            write(end_of_stream(err))
            return
        except ApiError as err:
            write(end_of_stream(ConnectError.from_api(err)))
            return
        finally:
            # A client that went away (a write failed) ends the stream here, and with
            # it what it holds in the agent (an attach, a watch), not at some later GC.
            stream.close()
        write(end_of_stream())

    return api.StreamResponse(200, content_type=STREAM_TYPE, produce=produce)


def read_unary(req: api.Request, where: str) -> dict[str, Any]:
    """The request message of a unary call."""
    kind = req.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != UNARY_TYPE:
        raise ConnectError("invalid_argument", f"{where}: Content-Type {kind!r:.60}; this "
                           f"server speaks Connect with the JSON codec ({UNARY_TYPE})")
    if req.headers.get("content-encoding", "identity").lower() != "identity":
        raise ConnectError("unimplemented", f"{where}: compressed requests are not accepted")
    return _object(req.read_all(MAX_MESSAGE, where, "the request message"), where)


def read_stream_request(req: api.Request, where: str) -> dict[str, Any]:
    """The one request message of a server-streaming call (its first envelope)."""
    kind = req.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != STREAM_TYPE:
        raise ConnectError("invalid_argument", f"{where}: Content-Type {kind!r:.60}; a "
                           f"streaming call is {STREAM_TYPE}")
    head = _exactly(req, 5, where)
    flags, length = struct.unpack(">BI", head)
    if flags & COMPRESSED:
        raise ConnectError("unimplemented", f"{where}: compressed messages are not accepted")
    if length > MAX_MESSAGE:
        raise ConnectError("resource_exhausted", f"{where}: a {length}-byte message; the "
                           f"limit is {MAX_MESSAGE}")
    message = _object(_exactly(req, length, where), where)
    req.body.read(MAX_MESSAGE)   # an end-of-stream envelope, if the client sent one
    return message


def _exactly(req: api.Request, n: int, where: str) -> bytes:
    data = b""
    while len(data) < n:
        more = req.body.read(n - len(data))
        if not more:
            raise ConnectError("invalid_argument", f"{where}: the request ended inside an "
                               "envelope")
        data += more
    return data


def _object(raw: bytes, where: str) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConnectError("invalid_argument", f"{where}: the message is not JSON: "
                           f"{err}") from None
    if not isinstance(value, dict):
        raise ConnectError("invalid_argument", f"{where}: the message is not a JSON object")
    return value


# -- protobuf's JSON mapping -----------------------------------------------------------


def field(message: dict[str, Any], name: str) -> Any:
    """A field by its JSON name (lowerCamelCase) or its proto name (snake_case)."""
    if name in message:
        return message[name]
    head, *rest = name.split("_")
    return message.get(head + "".join(part.title() for part in rest))


def string(message: dict[str, Any], name: str, where: str, default: str = "") -> str:
    value = field(message, name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ConnectError("invalid_argument", f"{where}: {name} must be a string")
    return value


def boolean(message: dict[str, Any], name: str, where: str) -> bool:
    value = field(message, name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConnectError("invalid_argument", f"{where}: {name} must be true or false")
    return value


def uint(message: dict[str, Any], name: str, where: str, maximum: int = (1 << 32) - 1) -> int:
    value = field(message, name)
    if value is None:
        return 0
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= maximum:
        raise ConnectError("invalid_argument", f"{where}: {name} must be an integer "
                           f"0-{maximum}")
    return value


def obj(message: dict[str, Any], name: str, where: str) -> dict[str, Any] | None:
    value = field(message, name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConnectError("invalid_argument", f"{where}: {name} must be an object")
    return value


def data(message: dict[str, Any], name: str, where: str) -> bytes:
    value = field(message, name)
    if value is None:
        return b""
    if not isinstance(value, str):
        raise ConnectError("invalid_argument", f"{where}: {name} must be base64 text")
    try:
        return base64.b64decode(value + "=" * (-len(value) % 4),
                                altchars=b"-_" if ("-" in value or "_" in value) else None,
                                validate=True)
    except (binascii.Error, ValueError):
        raise ConnectError("invalid_argument", f"{where}: {name} is not base64") from None


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def timestamp(unix: float) -> str:
    whole = int(unix)
    nanos = int(round((unix - whole) * 1e9))
    if nanos >= 1_000_000_000:
        whole, nanos = whole + 1, 0
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    return f"{stamp}.{nanos:09d}Z" if nanos else f"{stamp}Z"
