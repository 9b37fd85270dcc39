"""A streaming ``multipart/form-data`` reader (RFC 7578) for envd's ``POST /files``:
each part's data is handed on in pieces as it arrives, so an upload is never held
whole. Bounded: part headers of at most ``MAX_PART_HEADERS`` bytes, at most
``MAX_PARTS`` parts."""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

from vmfork.server import api
from vmfork.server.errors import BadRequest

MAX_PART_HEADERS = 16 << 10
MAX_PARTS = 1000
READ = 64 << 10


@dataclass
class Part:
    name: str | None
    filename: str | None
    _reader: _Reader

    def chunks(self) -> Iterator[bytes]:
        """The part's data, piece by piece; must be read before the next part."""
        return self._reader.part_data()


class _Reader:
    def __init__(self, req: api.Request, boundary: bytes, where: str) -> None:
        self._req = req
        self._delimiter = b"\r\n--" + boundary
        self._buf = b""
        self._eof = False
        self._where = where
        self.part_done = True

    def _fill(self) -> bool:
        if self._eof:
            return False
        data = self._req.body.read(READ)
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

    def _fail(self, problem: str) -> BadRequest:
        return BadRequest(f"{self._where}: bad multipart body: {problem}")

    def start(self) -> None:
        """Skip the preamble up to the first delimiter line."""
        first = self._delimiter[2:]
        while True:
            at = self._buf.find(first)
            if at >= 0:
                self._buf = self._buf[at + len(first):]
                return
            if len(self._buf) > MAX_PART_HEADERS:
                raise self._fail("no boundary in the first 16 KiB")
            if not self._fill():
                raise self._fail("no boundary")

    def next_headers(self) -> dict[str, str] | None:
        """After a delimiter: None at the closing one, else the part's headers."""
        while len(self._buf) < 2 and self._fill():
            pass
        if self._buf.startswith(b"--"):
            return None
        while b"\r\n\r\n" not in self._buf:
            if len(self._buf) > MAX_PART_HEADERS:
                raise self._fail(f"part headers over {MAX_PART_HEADERS} bytes")
            if not self._fill():
                raise self._fail("the body ended inside part headers")
        head, self._buf = self._buf.split(b"\r\n\r\n", 1)
        headers: dict[str, str] = {}
        for line in head.split(b"\r\n"):
            if not line.strip():
                continue
            name, sep, value = line.decode("utf-8", "replace").partition(":")
            if not sep:
                raise self._fail(f"a part header line {line[:60]!r}")
            headers[name.strip().lower()] = value.strip()
        self.part_done = False
        return headers

    def part_data(self) -> Iterator[bytes]:
        keep = len(self._delimiter)
        while not self.part_done:
            at = self._buf.find(self._delimiter)
            if at >= 0:
                data, self._buf = self._buf[:at], self._buf[at + len(self._delimiter):]
                self.part_done = True
                if data:
                    yield data
                return
            if len(self._buf) > keep:
                data, self._buf = self._buf[:-keep], self._buf[-keep:]
                yield data
            if not self._fill():
                raise self._fail("the body ended inside a part")


def parts(req: api.Request, content_type: str, where: str) -> Iterator[Part]:
    """The parts of the request's multipart body, in order."""
    boundary = _param(content_type, "boundary")
    if not boundary or len(boundary) > 200:
        raise BadRequest(f"{where}: a multipart Content-Type needs a boundary of 1-200 "
                         "characters")
    reader = _Reader(req, boundary.encode("latin-1", "replace"), where)
    reader.start()
    for _ in range(MAX_PARTS):
        headers = reader.next_headers()
        if headers is None:
            return
        disposition = headers.get("content-disposition", "")
        yield Part(_param(disposition, "name"), _filename(disposition), reader)
        for _piece in reader.part_data():   # what the consumer left unread
            pass
    raise BadRequest(f"{where}: more than {MAX_PARTS} parts")


def _param(header: str, name: str) -> str | None:
    for item in _split_params(header)[1:]:
        key, sep, value = item.partition("=")
        if sep and key.strip().lower() == name:
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = value[1:-1].replace('\\"', '"').replace("\\\\", "\\")
            return value
    return None


def _filename(disposition: str) -> str | None:
    extended = _param(disposition, "filename*")
    if extended is not None and "''" in extended:
        charset, _, quoted = extended.partition("''")
        return urllib.parse.unquote(quoted, encoding=charset or "utf-8", errors="replace")
    plain = _param(disposition, "filename")
    # httpx percent-encodes the quote and backslash characters of a filename.
    return None if plain is None else plain.replace("%22", '"').replace("%5C", "\\")


def _split_params(header: str) -> list[str]:
    out: list[str] = []
    current = ""
    quoted = False
    escaped = False
    for ch in header:
        if escaped:
            current += ch
            escaped = False
        elif ch == "\\" and quoted:
            current += ch
            escaped = True
        elif ch == '"':
            quoted = not quoted
            current += ch
        elif ch == ";" and not quoted:
            out.append(current)
            current = ""
        else:
            current += ch
    out.append(current)
    return [p.strip() for p in out]
