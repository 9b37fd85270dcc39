"""Errors that become HTTP responses, one class per who caused them.

The body is always ``{"error": "<what failed and what to do>"}`` (forkd's shape),
plus optional extra fields (an exec timeout carries its partial output).
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    status = 500

    def __init__(self, message: str, *, extra: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.extra = dict(extra or {})
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": self.message, **self.extra}


class BadRequest(ApiError):
    """The request is malformed or names something invalid (the caller's mistake)."""
    status = 400


class NotFound(ApiError):
    status = 404


class MethodNotAllowed(ApiError):
    status = 405


class Conflict(ApiError):
    """Valid request, wrong state: tag in flight, sandbox not running, tag exists."""
    status = 409


class PayloadTooLarge(ApiError):
    status = 413


class Unprocessable(ApiError):
    """The guest refused an operation it understood (permission denied, not a directory)."""
    status = 422


class InternalError(ApiError):
    status = 500


class NotImplementedApi(ApiError):
    """A valid request for something this build cannot do (a BRANCH mode its VMM lacks)."""
    status = 501


class BadGateway(ApiError):
    """The sandbox (its VMM or agent) or the zygote failed or cannot be reached."""
    status = 502


class QuotaExceeded(ApiError):
    """The daemon-wide caps on sandboxes or committed guest RAM would be exceeded; the
    message says which cap, what is in use and the flag that sets it."""
    status = 429


class Busy(ApiError):
    """Too many heavy operations at once; retry after ``retry_after`` seconds."""
    status = 503

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class GatewayTimeout(ApiError):
    """An operation in the sandbox ran past its timeout."""
    status = 504
