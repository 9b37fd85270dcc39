"""Agent-side request handling basics: the error an op raises, field validation, and
the mapping from ``OSError`` to protocol error codes (stdlib only)."""

from __future__ import annotations

import errno as errno_codes
import os
from typing import Any

_ERRNO_CODES = {
    errno_codes.ENOENT: "not_found",
    errno_codes.EEXIST: "exists",
    errno_codes.EACCES: "permission_denied",
    errno_codes.EPERM: "permission_denied",
    errno_codes.ENOTDIR: "not_a_directory",
    errno_codes.EISDIR: "is_a_directory",
    errno_codes.ENOTEMPTY: "not_empty",
}


class OpError(Exception):
    """An op failed in a way the caller should hear about: becomes one ``error`` frame."""

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.extra = extra


def os_error(err: OSError, action: str, path: str | None = None, **extra: Any) -> OpError:
    """``OpError`` for a failed system call: ``action`` names the step that failed
    (``"open"``, ``"rename into place"``), ``path`` the file it was about."""
    code = _ERRNO_CODES.get(err.errno or 0, "os_error")
    reason = err.strerror or str(err)
    where = f" {path!r}" if path is not None else ""
    fields: dict[str, Any] = {"errno": err.errno, **extra}
    if path is not None:
        fields["path"] = path
    return OpError(code, f"{action}{where}: {reason}", **fields)


def get_str(req: dict[str, Any], name: str, default: str | None = None) -> str:
    value = req.get(name, default)
    if not isinstance(value, str):
        raise OpError("bad_request", f"field {name!r} must be a string, got {value!r:.80}")
    if "\0" in value:
        raise OpError("bad_request", f"field {name!r} contains a NUL byte")
    return value


def get_path(req: dict[str, Any], name: str = "path") -> str:
    path = get_str(req, name)
    if not os.path.isabs(path):
        raise OpError("bad_request", f"field {name!r} must be an absolute path, got {path!r}")
    return path


def get_bool(req: dict[str, Any], name: str, default: bool) -> bool:
    value = req.get(name, default)
    if not isinstance(value, bool):
        raise OpError("bad_request", f"field {name!r} must be true or false, got {value!r:.80}")
    return value


def get_int(req: dict[str, Any], name: str, default: int | None, *, minimum: int = 0) -> int | None:
    value = req.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise OpError("bad_request",
                      f"field {name!r} must be an integer >= {minimum}, got {value!r:.80}")
    return value


def get_mode(req: dict[str, Any], name: str, default: int) -> int:
    mode = get_int(req, name, default)
    assert mode is not None
    if mode > 0o7777:
        raise OpError("bad_request", f"field {name!r} must be a permission mode <= 0o7777, "
                                     f"got {oct(mode)}")
    return mode
