"""E2B's wire protocol on vmfork's daemon (issue 15; docs/e2b.md): an unmodified E2B
SDK drives ``vmfork serve`` when pointed at it by environment variables.

Two surfaces share the daemon's listeners with ``/v1``, without path collisions:

- the control plane (``/sandboxes…``, ``/v2/sandboxes…``; ``control.py``), which the
  SDK reaches at ``E2B_API_URL`` (or ``https://api.<E2B_DOMAIN>``) with the daemon's
  token as ``X-API-KEY``;
- envd, the in-sandbox daemon (``envd.py``): Connect RPCs, ``/files``, ``/health``,
  which the SDK reaches at ``E2B_SANDBOX_URL`` with the ``E2b-Sandbox-Id`` header, or
  at ``https://49983-<id>.<domain>`` (the ``Host`` names the sandbox), with the
  sandbox's access token as ``X-Access-Token``;
- the code interpreter (``interpreter.py``), port 49999 of a sandbox: the same, with
  ``E2b-Sandbox-Port: 49999`` or ``Host: 49999-<id>.<domain>``.

A request is E2B's when its path is a control-plane path, or when it names a sandbox
by header or Host; everything else is vmfork's own API, untouched.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from vmfork.server import api
from vmfork.server.controller import Controller
from vmfork.server.e2b import connect, envd, interpreter
from vmfork.server.e2b.connect import ConnectError
from vmfork.server.e2b.control import ControlPlane, Tokens
from vmfork.server.e2b.envd import Envd
from vmfork.server.errors import ApiError, BadRequest, MethodNotAllowed, NotFound
from vmfork.server.validation import check_sandbox_id

ENVD_PORT = 49983
_ENVD_HOST = re.compile(r"(\d{1,5})-([^.]+)\.[^:]+(:\d+)?")
_CONTROL_ROUTES: tuple[tuple[str, str, str], ...] = (
    ("POST", "/sandboxes", "create"),
    ("POST", "/v2/sandboxes", "create"),
    ("GET", "/sandboxes", "list"),
    ("GET", "/v2/sandboxes", "list"),
    ("GET", "/sandboxes/{id}", "get"),
    ("DELETE", "/sandboxes/{id}", "kill"),
    ("POST", "/sandboxes/{id}/timeout", "set_timeout"),
    ("POST", "/sandboxes/{id}/refreshes", "refresh"),
    ("POST", "/sandboxes/{id}/connect", "connect"),
    ("POST", "/v2/sandboxes/{id}/connect", "connect"),
    ("POST", "/sandboxes/{id}/pause", "pause"),
    ("POST", "/sandboxes/{id}/resume", "resume"),
    ("GET", "/sandboxes/{id}/metrics", "metrics"),
    ("POST", "/sandboxes/{id}/fork", "fork"),
    ("POST", "/sandboxes/{id}/snapshots", "create_snapshot"),
    ("GET", "/snapshots", "list_snapshots"),
    ("DELETE", "/templates/{id}", "delete_template"),
)


@dataclass(frozen=True)
class Route:
    """One E2B request, matched: ``name`` is for metrics and the audit log."""

    name: str
    kind: str           # "control" or "envd"
    target: str         # the control-plane method, or the sandbox id for envd

    def handle(self, c: Controller, req: api.Request, token: bytes | None) -> api.Response:
        wire = _wire(token)
        if self.kind == "envd":
            return _envd(wire, c, req, self.target)
        if self.kind == "interpreter":
            return _interpreter(wire, c, req, self.target)
        return _control(wire, c, req, self.target, token)


def route_for(req: api.Request) -> Route | None:
    """The E2B route ``req`` is for, or None when it is for vmfork's own API."""
    sandbox = req.headers.get("e2b-sandbox-id")
    port = req.headers.get("e2b-sandbox-port", str(ENVD_PORT)).strip()
    if sandbox is None:
        found = _ENVD_HOST.fullmatch(req.headers.get("host", ""))
        if found is not None and int(found.group(1)) in (ENVD_PORT, interpreter.INTERPRETER_PORT):
            sandbox, port = found.group(2), found.group(1)
    if sandbox is not None and port == str(interpreter.INTERPRETER_PORT):
        return Route(interpreter.route_name(req), "interpreter", sandbox)
    if sandbox is not None:
        # Metrics and audit names from a fixed set (a client picks the path).
        known = req.path in ("/files", "/health") or envd.is_rpc(req.path)
        return Route("envd " + req.path if known else "envd unmatched", "envd", sandbox)
    parts = req.path.rstrip("/").strip("/").split("/")
    if not parts or parts[0] not in ("sandboxes", "v2", "snapshots", "templates"):
        return None
    if parts[0] == "v2" and (len(parts) < 2 or parts[1] != "sandboxes"):
        return None
    allowed = []
    matched = ""
    for method, template, target in _CONTROL_ROUTES:
        segments = template.strip("/").split("/")
        if len(segments) != len(parts):
            continue
        params = {}
        for seg, part in zip(segments, parts, strict=True):
            if seg == "{id}":
                params["id"] = part
            elif seg != part:
                break
        else:
            if method != req.method:
                allowed.append(method)
                matched = template
                continue
            req.params = params
            return Route("e2b " + template, "control", target)
    if allowed:
        return Route("e2b " + matched, "control", "!405 " + ", ".join(sorted(set(allowed))))
    return Route("e2b unmatched", "control", "!404")


class _Wire:
    def __init__(self, key: bytes) -> None:
        self.tokens = Tokens(key)
        self.control = ControlPlane(self.tokens)
        self.envd = Envd(self.tokens.for_sandbox)


_WIRES: dict[bytes | None, _Wire] = {}
_PROCESS_KEY = secrets.token_bytes(32)
"""The envd tokens' key on a daemon without a token (a Unix socket only: anyone who
can connect is trusted, but the tokens still tell sandboxes apart)."""


def _wire(token: bytes | None) -> _Wire:
    wire = _WIRES.get(token)
    if wire is None:
        wire = _WIRES.setdefault(token, _Wire(token if token is not None else _PROCESS_KEY))
    return wire


def _control(wire: _Wire, c: Controller, req: api.Request, target: str,
             token: bytes | None) -> api.Response:
    try:
        if token is not None:
            given = req.headers.get("x-api-key")
            if given is None or not secrets.compare_digest(
                    given.strip().encode("utf-8", "surrogateescape"), token):
                return api.Response(401, {"code": 401, "message": "the X-API-KEY is not this "
                                          "daemon's token (E2B_API_KEY must be it)"})
        if target.startswith("!405 "):
            raise MethodNotAllowed(f"{req.method} is not allowed on {req.path}",
                                   headers={"Allow": target[5:]})
        if target == "!404":
            raise NotFound(f"no E2B route {req.method} {req.path}")
        if "id" in req.params:
            check_sandbox_id(req.params["id"])
        response: api.Response = getattr(wire.control, target)(c, req)
        if target == "kill":
            wire.envd.forget_sandbox(req.params["id"])
        return response
    except ApiError as err:
        return _control_error(err)


def _control_error(err: ApiError) -> api.Response:
    """E2B's error body: ``{"code": <status>, "message": ...}``."""
    message = err.body().get("error", str(err))
    return api.Response(err.status, {"code": err.status, "message": message},
                        headers=err.headers)


def _envd(wire: _Wire, c: Controller, req: api.Request, sandbox_id: str) -> api.Response:
    try:
        check_sandbox_id(sandbox_id)
    except BadRequest as err:
        return _denied(req, 400, "invalid_argument", str(err.body().get("error", err)))
    req.sandbox_ids = [sandbox_id]
    given = req.headers.get("x-access-token")
    signed_url = given is None and req.path == "/files"   # envd checks its signature
    if not signed_url and not wire.tokens.check(sandbox_id, given):
        return _denied(req, 401, "unauthenticated", f"sandbox {sandbox_id}: the "
                       "X-Access-Token is not this sandbox's envdAccessToken")
    try:
        return wire.envd.handle(c, req, sandbox_id)
    except ApiError as err:   # an unknown or stopped sandbox, before any RPC parsing
        code = ConnectError.from_api(err)
        return _denied(req, err.status, code.code, code.message)


def _interpreter(wire: _Wire, c: Controller, req: api.Request,
                 sandbox_id: str) -> api.Response:
    """The code interpreter's routes: the sandbox's token as ``X-Access-Token`` or as
    ``E2B-Traffic-Access-Token`` (its SDK sends only the latter on context calls)."""
    try:
        check_sandbox_id(sandbox_id)
    except BadRequest as err:
        return interpreter.error_response(err)
    req.sandbox_ids = [sandbox_id]
    if not any(wire.tokens.check(sandbox_id, req.headers.get(name))
               for name in ("x-access-token", "e2b-traffic-access-token")):
        return api.Response(401, {"code": 401, "message": f"sandbox {sandbox_id}: neither "
                                  "X-Access-Token nor E2B-Traffic-Access-Token is this "
                                  "sandbox's access token"})
    return interpreter.handle(c, req, sandbox_id)


def _denied(req: api.Request, status: int, code: str, message: str) -> api.Response:
    if req.path in ("/files", "/health"):
        return api.Response(status, {"code": status, "message": message})
    if req.headers.get("content-type", "").startswith("application/connect+json"):
        return api.Response(200, connect.end_of_stream(ConnectError(code, message)),
                            content_type=connect.STREAM_TYPE)
    return api.Response(status, {"code": code, "message": message})


