"""Bearer-token auth, with forkd's rules (REFERENCE-forkd.md, REST API).

The token comes from a file (``--token-file``) so it never shows in ``ps`` or
shell history. Short tokens and the placeholders shipped in example configs
(``REPLACE_ME…``, ``CHANGE_ME…``) are refused at start-up, because a daemon that
runs with one is as open as one without. The comparison is ``hmac.compare_digest``
on bytes, which takes the same time wherever the first differing byte is.
"""

from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path

MIN_TOKEN_BYTES = 16
PLACEHOLDER_PREFIXES = ("REPLACE_ME", "CHANGE_ME")
# Route templates (server/api.ROUTES) served without a token: the health check, and the
# dashboard's files, which hold no data (server/ui): the page asks for the token and
# sends it with every API call it makes, which the API checks as any other client's.
# Matched on the route, never on a path prefix, so no path can borrow their openness.
OPEN_ROUTES = frozenset({"/healthz", "/ui", "/ui/{asset}"})

MISSING = "missing bearer token"
INVALID = "invalid bearer token"


class AuthConfigError(Exception):
    """The token file or the bind address is unusable; the daemon does not start."""


def check_token(token: bytes, source: str) -> bytes:
    if len(token) < MIN_TOKEN_BYTES:
        raise AuthConfigError(f"the token in {source} is {len(token)} bytes; use at least "
                              f"{MIN_TOKEN_BYTES} random bytes (e.g. `openssl rand -hex 32`)")
    if token.upper().startswith(tuple(p.encode() for p in PLACEHOLDER_PREFIXES)):
        raise AuthConfigError(f"the token in {source} is a placeholder "
                              f"({token[:10].decode(errors='replace')}…); replace it with a "
                              "random secret (e.g. `openssl rand -hex 32`)")
    return token


def load_token(path: str | Path) -> bytes:
    """Read and check the token (surrounding whitespace, e.g. a final newline, is dropped)."""
    try:
        token = Path(path).read_bytes().strip()
    except OSError as err:
        raise AuthConfigError(f"cannot read the token file {path}: {err.strerror}") from err
    return check_token(token, str(path))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: bytes | None) -> None:
    if token is None and not is_loopback(host):
        raise AuthConfigError(f"refusing to listen on {host} (not a loopback address) without "
                              "a token: anyone who can reach it could run code in every "
                              "sandbox. Pass --token-file, or bind 127.0.0.1")


def authorize(header: str | None, token: bytes) -> str | None:
    """None if ``header`` (the Authorization value) carries ``token``, else the 401 reason."""
    if not header:
        return MISSING
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return MISSING
    if not hmac.compare_digest(value.strip().encode("utf-8", "surrogateescape"), token):
        return INVALID
    return None
