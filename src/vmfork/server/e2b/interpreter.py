"""E2B's code interpreter (``e2b-code-interpreter``, ``@e2b/code-interpreter``): the
HTTP server its SDKs reach on port 49999 of a sandbox, served by the host daemon on top
of the guest agent's ``cell`` and ``contexts`` ops (``agent/interpreter.py``), which run
Python in the agent's warm interpreter.

The SDK names the sandbox as for envd — the ``E2b-Sandbox-Id`` header, here with
``E2b-Sandbox-Port: 49999``, or ``Host: 49999-<id>.<domain>`` — and proves it may with
the sandbox's token as ``X-Access-Token`` (``run_code``) or as
``E2B-Traffic-Access-Token`` (every call: the control plane answers the same token as
``trafficAccessToken``). Routes:

- ``POST /execute`` ``{code, context_id, language, env_vars}``: the cell's output as
  NDJSON lines, each as it happens — ``stdout``/``stderr`` ``{text, timestamp}``,
  ``result`` (the representations: ``text``, ``html``, ``png``…, ``is_main_result``),
  ``error`` ``{name, value, traceback}``, ``number_of_executions``, then
  ``end_of_execution``. A bad request, an unknown context, too much code are refused
  with a 4xx before the stream starts; a cell's own exception is an ``error`` line.
- ``GET /contexts``, ``POST /contexts`` ``{language, cwd}``, ``DELETE /contexts/{id}``,
  ``POST /contexts/{id}/restart``; ``GET /health``.

Only Python is served (``language`` null or ``python``). A cell may run for at most
``CELL_TIMEOUT_SECS``; the SDK's own ``timeout`` closes its connection, which the daemon
notices at the cell's next output and passes on (the cell is interrupted).
"""

from __future__ import annotations

import json
from collections.abc import Generator, Iterator
from typing import Any

from vmfork.agent.client import AgentError, AgentTimeout
from vmfork.agent.interpreter import MAX_CODE_CHARS, MAX_ENV, MAX_ENV_BYTES, MAX_TIMEOUT
from vmfork.server import api
from vmfork.server.controller import Controller, agent_errors
from vmfork.server.errors import (
    ApiError,
    BadRequest,
    MethodNotAllowed,
    NotFound,
    NotImplementedApi,
    PayloadTooLarge,
    QuotaExceeded,
)
from vmfork.server.validation import Field, parse_json_object, validate_fields

INTERPRETER_PORT = 49999
CELL_TIMEOUT_SECS = MAX_TIMEOUT
NDJSON = "application/x-ndjson"
KEEPALIVE_SECS = 1.0
"""A silent cell's stream gets one space this often: JSON allows it before the next
line, and a write that fails tells that the client went away (the cell is then
interrupted rather than left running, holding the interpreter)."""
MAX_CONTEXT_ID = 128
EXECUTE: dict[str, Field] = {
    "code": Field(str),
    "context_id": Field(str, None, nullable=True),
    "language": Field(str, None, nullable=True),
    "env_vars": Field(dict, None, nullable=True),
}
CREATE_CONTEXT: dict[str, Field] = {
    "language": Field(str, None, nullable=True),
    "cwd": Field(str, None, nullable=True),
}
ROUTES: tuple[tuple[str, str], ...] = (
    ("POST", "/execute"), ("GET", "/contexts"), ("POST", "/contexts"),
    ("DELETE", "/contexts/{id}"), ("POST", "/contexts/{id}/restart"), ("GET", "/health"))
"""What this server has (for route names in metrics and the audit log, and 404/405)."""


def route_name(req: api.Request) -> str:
    """A name from a fixed set (a client picks the path)."""
    template = _template(req.path)
    return "interpreter " + (template if template is not None else "unmatched")


def _template(path: str) -> str | None:
    parts = path.strip("/").split("/")
    if parts == ["execute"] or parts == ["health"] or parts == ["contexts"]:
        return "/" + parts[0]
    if len(parts) == 2 and parts[0] == "contexts":
        return "/contexts/{id}"
    if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
        return "/contexts/{id}/restart"
    return None


def handle(c: Controller, req: api.Request, sandbox_id: str) -> api.Response:
    """One call to a sandbox's code interpreter (the token was checked by the caller)."""
    where = f"{req.method} {req.path} (sandbox {sandbox_id}, port {INTERPRETER_PORT})"
    try:
        template = _template(req.path)
        if template is None:
            raise NotFound(f"{where}: the code interpreter has no such route")
        allowed = sorted(m for m, t in ROUTES if t == template)
        if req.method not in allowed:
            raise MethodNotAllowed(f"{where}: use {' or '.join(allowed)}",
                                   headers={"Allow": ", ".join(allowed)})
        if template == "/health":
            c.agent(sandbox_id)   # 404/409 for a sandbox that is gone
            return api.Response(204)
        if template == "/execute":
            return _execute(c, req, sandbox_id, where)
        if template == "/contexts":
            if req.method == "GET":
                listed = _contexts(c, sandbox_id, "list")["contexts"]
                return api.Response(200, listed)
            body = _json(req, CREATE_CONTEXT, where)
            _python_only(body["language"], where)
            made = _contexts(c, sandbox_id, "create", cwd=body["cwd"])["context"]
            return api.Response(200, made)
        context_id = _context_id(req.path.strip("/").split("/")[1], where)
        if template == "/contexts/{id}":
            _contexts(c, sandbox_id, "remove", context=context_id)
        else:
            _contexts(c, sandbox_id, "restart", context=context_id)
        return api.Response(204)
    except ApiError as err:
        return error_response(err)


def error_response(err: ApiError) -> api.Response:
    """E2B's error body, as its control plane and ``/files`` have it."""
    message = err.body().get("error", str(err))
    return api.Response(err.status, {"code": err.status, "message": message},
                        headers=err.headers)


def _json(req: api.Request, spec: dict[str, Field], where: str) -> dict[str, Any]:
    raw = req.read_all(api.MAX_JSON_BODY, where, "the JSON body")
    return validate_fields(parse_json_object(raw, where), spec, where)


def _python_only(language: str | None, where: str) -> None:
    if language not in (None, "python"):
        raise BadRequest(f"{where}: language {language[:40]!r}: this code interpreter runs "
                         "Python only (language null or 'python')")


def _context_id(raw: str | None, where: str) -> str | None:
    if raw is None:
        return None
    if not raw or len(raw) > MAX_CONTEXT_ID or not raw.isprintable():
        raise BadRequest(f"{where}: {raw[:40]!r} is not a context id")
    return raw


class _agent_call:  # noqa: N801 - used as a context manager, like agent_errors
    """The agent's refusals as the HTTP statuses the SDK reports clearly; the rest as
    every agent call maps them (``controller.agent_errors``)."""

    def __init__(self, sandbox_id: str, op: str) -> None:
        self.sandbox_id, self.op = sandbox_id, op
        self._inner = agent_errors(sandbox_id, op)

    def __enter__(self) -> None:
        self._inner.__enter__()

    def __exit__(self, kind: Any, err: Any, tb: Any) -> None:
        where = f"{self.op} in sandbox {self.sandbox_id}"
        if isinstance(err, AgentError) and not isinstance(err, AgentTimeout):
            if err.code == "unknown_op":
                raise NotImplementedApi(
                    f"{where}: this sandbox's guest agent has no code interpreter (its "
                    "image predates it): rebuild the image (vmfork image build) and make "
                    "the snapshot again") from err
            if err.code == "not_found":
                raise NotFound(f"{where}: {err.message}") from err
            if err.code == "bad_request":
                raise BadRequest(f"{where}: {err.message}") from err
            if err.code == "too_large":
                raise PayloadTooLarge(f"{where}: {err.message}") from err
            if err.code == "limit":
                raise QuotaExceeded(f"{where}: {err.message}") from err
        self._inner.__exit__(kind, err, tb)   # raises its mapping; never suppresses


def _contexts(c: Controller, sandbox_id: str, action: str, **fields: Any) -> dict[str, Any]:
    agent = c.agent(sandbox_id)
    with _agent_call(sandbox_id, "contexts"):
        return agent.code_contexts(action, **fields)


def _execute(c: Controller, req: api.Request, sandbox_id: str, where: str) -> api.Response:
    body = _json(req, EXECUTE, where)
    code: str = body["code"]
    if len(code) > MAX_CODE_CHARS:
        raise PayloadTooLarge(f"{where}: the code is {len(code)} characters; a cell is at "
                              f"most {MAX_CODE_CHARS}")
    _python_only(body["language"], where)
    context_id = _context_id(body["context_id"], where)
    env = body["env_vars"] or {}
    if (len(env) > MAX_ENV or not all(isinstance(v, str) for v in env.values())
            or sum(len(k) + len(v) for k, v in env.items()) > MAX_ENV_BYTES):
        raise BadRequest(f"{where}: env_vars must map at most {MAX_ENV} names to strings, "
                         f"{MAX_ENV_BYTES} characters in all")
    agent = c.agent(sandbox_id)
    events = agent.cell(code, context=context_id, timeout=CELL_TIMEOUT_SECS, env=env,
                        idle=KEEPALIVE_SECS)
    try:
        with _agent_call(sandbox_id, "cell"):
            next(events)   # "started", or the refusal (an unknown context) as a 4xx
    except BaseException:
        events.close()
        raise

    def produce(write: api.Writer) -> None:
        try:
            for line in _lines(events, sandbox_id):
                if line is None:
                    write(b" ")
                else:
                    write(json.dumps(line, separators=(",", ":")).encode() + b"\n")
        finally:
            events.close()   # a client that went away: the agent interrupts the cell

    return api.StreamResponse(200, content_type=NDJSON, produce=produce)


def _lines(events: Generator[tuple[str, Any], None, None], sandbox_id: str
           ) -> Iterator[dict[str, Any] | None]:
    """The agent's cell events as E2B's NDJSON messages (None: a keep-alive)."""
    try:
        for kind, data in events:
            if kind == "idle":
                yield None
            elif kind in ("stdout", "stderr"):
                text, ts = data
                yield {"type": kind, "text": text, "timestamp": ts}
            elif kind == "result":
                yield {**data, "type": "result"}
            elif kind == "end":
                if data.get("error"):
                    error = data["error"]
                    yield {"type": "error", "name": str(error.get("name", "")),
                           "value": str(error.get("value", "")),
                           "traceback": str(error.get("traceback", ""))}
                yield {"type": "number_of_executions",
                       "execution_count": data.get("execution_count", 0)}
                yield {"type": "end_of_execution"}
                return
    except (AgentError, OSError) as err:   # the agent failed mid-cell: say so, in band
        message = getattr(err, "message", str(err))
        yield {"type": "error", "name": "SandboxError", "traceback": "",
               "value": f"sandbox {sandbox_id}: the cell could not finish: {message}"}
        yield {"type": "end_of_execution"}
