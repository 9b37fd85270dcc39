"""The REST routes: forkd v0.5.3's ``/v1`` surface plus vmfork's extensions.

One table (``ROUTES``) lists every route with its method, path template, handler
and accepted query parameters; the HTTP layer matches against it and the OpenAPI
contract test compares it with ``openapi.json``, so a route cannot exist without
being documented. Handlers validate everything first (path parameters by the
matcher, bodies and queries by their ``Field`` specs), then call the controller.

Wire compatibility (REFERENCE-forkd.md): same paths, field names, defaults and
status codes. Extensions sit beside forkd's fields: ``env``/``cwd``/``stdin`` on
exec, streaming exec (server-sent events), files, ``status``/``exit_reason`` on
sandboxes, ``stdout``/``stderr``/``traceback`` on eval, guest images
(``/v1/images``, ``server.images``).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Protocol

from vmfork.agent.client import AgentError, ProcessEnd
from vmfork.image.spec import DEFAULT_DISK_FORMAT, DISK_FORMATS
from vmfork.server.controller import Controller, agent_errors
from vmfork.server.errors import (
    ApiError,
    BadRequest,
    GatewayTimeout,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
)
from vmfork.server.validation import (
    Field,
    between,
    check_argv,
    check_copies,
    check_env,
    check_find_links,
    check_guest_path,
    check_host_path,
    check_image_name,
    check_image_ref,
    check_path_image,
    check_path_tag,
    check_pty_size,
    check_sandbox_id,
    check_string_map,
    check_strings,
    check_tag,
    check_workspace_name,
    one_of,
    parse_json_object,
    parse_query,
    text_up_to,
    validate_fields,
)

MAX_JSON_BODY = 1 << 20
MAX_REQUIREMENTS = 256 << 10   # a requirements file's text, in characters
MAX_SANDBOXES_PER_REQUEST = 1000
STREAM_CHUNK = 1 << 16
MAX_COMMAND = 64 << 10         # a shell command line, in characters
MAX_STDIN_BODY = 1 << 20       # one send_stdin call (the agent's frame payload cap)
MAX_PTY_SIZE = 1000
WATCH_HEARTBEAT_SECS = 15.0    # an idle watch stream sends a comment this often


# -- request and response ------------------------------------------------------------


class BodyReader(Protocol):
    def read(self, n: int = -1) -> bytes: ...


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]            # lower-cased names
    body: BodyReader
    content_length: int | None
    params: dict[str, str] = field(default_factory=dict)
    # Filled by handlers for the audit log.
    sandbox_ids: list[str] = field(default_factory=list)
    snapshot_tag: str | None = None
    image: str | None = None

    def json(self, spec: dict[str, Field], where: str) -> dict[str, Any]:
        length = self.content_length or 0
        if length > MAX_JSON_BODY:
            raise PayloadTooLarge(f"{where}: the JSON body is {length} bytes; the limit is "
                                  f"{MAX_JSON_BODY}")
        raw = self.body.read(length) if length else b""
        return validate_fields(parse_json_object(raw, where), spec, where)

    def args(self, spec: dict[str, Field], where: str) -> dict[str, Any]:
        return parse_query(self.query, spec, where)

    def chunks(self) -> Iterator[bytes]:
        """The raw body, streamed (needs Content-Length)."""
        total = self.content_length
        if total is None:
            raise BadRequest(f"{self.method} {self.path}: send the body with a Content-Length")
        remaining = total
        while remaining > 0:
            chunk = self.body.read(min(STREAM_CHUNK, remaining))
            if not chunk:
                raise BadRequest(f"{self.method} {self.path}: the body ended after "
                                 f"{total - remaining} of {total} "
                                 "bytes")
            remaining -= len(chunk)
            yield chunk


@dataclass
class Response:
    status: int = 200
    body: Any = None                   # JSON value, or bytes with content_type
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    def encode(self) -> bytes:
        if self.body is None:
            return b""
        if isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body, separators=(",", ":")).encode("utf-8")


Writer = Callable[[bytes], None]


@dataclass
class StreamResponse(Response):
    """A response whose body is produced while it is sent (chunked transfer encoding)."""

    produce: Callable[[Writer], None] = lambda write: None


Handler = Callable[[Controller, Request], Response]


@dataclass(frozen=True)
class Route:
    method: str
    template: str
    handler: Handler

    @property
    def segments(self) -> list[str]:
        return self.template.strip("/").split("/")


# -- bodies ----------------------------------------------------------------------------

SANDBOX_CREATE = {
    "snapshot_tag": Field(str, check=check_tag),
    "n": Field(int, 1, between(1, MAX_SANDBOXES_PER_REQUEST)),
    "per_child_netns": Field(bool, False),
    # vmfork's extension: {"mode": "allow"|"deny"|"allowlist", "cidrs": [], "domains": [],
    # "reach_host": false}
    "egress": Field(dict, None, nullable=True),
    "memory_limit_mib": Field(int, None, between(16, 1 << 20), nullable=True),
    "prewarm": Field(bool, False),
    "live_fork": Field(bool, False),
    "hugepages": Field(bool, False),
    # forkd's --volume: ["SRC:GUEST_PATH[:ro|:rw]" | {source, guest_path, mode}], into
    # the snapshot's empty volume slots (docs/volumes.md).
    "volumes": Field(list, None, nullable=True),
}

EXEC = {
    "args": Field(list, check=check_argv),
    "timeout_secs": Field((int, float), 30, between(0.001, 86400)),
    "env": Field(dict, None, check_env, nullable=True),
    "cwd": Field(str, None, check_guest_path, nullable=True),
    "stdin": Field(str, None, nullable=True),
}

EVAL = {
    "code": Field(str),
    "timeout_secs": Field((int, float), None, between(0.001, 86400), nullable=True),
}

SNAPSHOT_CREATE = {
    "tag": Field(str, check=check_tag),
    "image": Field(str, "default"),
    "mem_mib": Field(int, 256, between(64, 65536)),
    "vcpus": Field(int, 1, between(1, 64)),
    "warm_code": Field(str, None, nullable=True),
    "warm_cmd": Field(str, None, nullable=True),
    # forkd's fields (vmfork.image.foreign): a vmlinux and a root file system image on
    # the daemon's host, booted with the rootfs read-only under a RAM overlay, so rw
    # changes nothing (the guest may write its root; the writes stay in its RAM);
    # boot_wait_secs is checked but not waited: the snapshot is taken once the agent
    # answers, and nothing of the rootfs's own init runs. tap is refused (create_snapshot).
    "kernel": Field(str, None, check_host_path, nullable=True),
    "rootfs": Field(str, None, check_host_path, nullable=True),
    "rw": Field(bool, False),
    "tap": Field(str, None, nullable=True),
    "boot_wait_secs": Field((int, float), 10, between(0, 60)),
    # vmfork's extension: boot the parent with a network device (connected through a
    # namespace of its own, so the warm-up can download), so that its sandboxes can be
    # spawned with per_child_netns; egress: the parent's policy, as for sandboxes.
    "network": Field(bool, False),
    "egress": Field(dict, None, nullable=True),
    # Read-only volumes every child has (forkd's --volume), and the empty volume slots
    # reserved for volumes given at spawn (default 4; volumes + slots <= 24).
    "volumes": Field(list, None, nullable=True),
    "volume_slots": Field(int, None, between(0, 24), nullable=True),
}

PORT_EXPOSE = {
    "guest_port": Field(int, check=between(1, 65535)),
    "host_port": Field(int, 0, between(0, 65535)),
    "protocol": Field(str, "tcp", one_of("tcp", "udp")),
}

EGRESS = {
    "mode": Field(str, check=one_of("allow", "deny", "allowlist")),
    "cidrs": Field(list, []),
    "domains": Field(list, []),
    # Whether the sandbox may reach the host's own addresses and other sandboxes'
    # published ports, which every policy refuses otherwise (docs/security.md).
    "reach_host": Field(bool, False),
}

PORT_QUERY = {"protocol": Field(str, "tcp", one_of("tcp", "udp"))}

BRANCH = {
    "tag": Field(str, None, check_tag, nullable=True),
    "mode": Field(str, None, one_of("full", "diff", "live"), nullable=True),
    "wait": Field(bool, True),
    "measure_diff": Field(bool, False),
    "parent_tag": Field(str, None, check_tag, nullable=True),
    # forkd's legacy spelling of mode.
    "diff": Field(bool, False),
    "live": Field(bool, False),
}

WORKSPACE_CREATE = {
    "name": Field(str, check=check_tag),
    "snapshot_tag": Field(str, check=check_tag),
    "per_child_netns": Field(bool, False),
    "memory_limit_mib": Field(int, None, between(16, 1 << 20), nullable=True),
    "volumes": Field(list, None, nullable=True),
}

WORKSPACE_SUSPEND = {"diff": Field(bool, False)}

# Each list is bounded again by ImageSpec.validate (MAX_ITEMS), and the whole body by
# MAX_JSON_BODY; paths (copy sources, find-links) are the daemon host's.
IMAGE_BUILD = {
    "name": Field(str, check=check_image_name),
    "from": Field(str, None, check_image_name, nullable=True),
    "apt": Field(list, [], check_strings),
    "pip": Field(list, [], check_strings),
    "requirements": Field(str, None, text_up_to(MAX_REQUIREMENTS), nullable=True),
    "pip_index_url": Field(str, None, text_up_to(2048), nullable=True),
    "pip_find_links": Field(list, [], check_find_links),
    "pip_no_index": Field(bool, False),
    "npm": Field(list, [], check_strings),
    "copy": Field(list, [], check_copies),
    "env": Field(dict, {}, check_string_map),
    "workdir": Field(str, None, text_up_to(1024), nullable=True),
    "user": Field(str, None, text_up_to(65), nullable=True),
    "disk_format": Field(str, DEFAULT_DISK_FORMAT, one_of(*DISK_FORMATS)),
    "run": Field(list, [], check_strings),
    "egress": Field(str, None, text_up_to(4096), nullable=True),
    "run_mem_mib": Field(int, 1024, between(128, 65536)),
    "wait": Field(bool, True),
}

IMAGE_IMPORT = {
    "name": Field(str, check=check_image_name),
    "ref": Field(str, check=check_image_ref),
    "insecure": Field(bool, False),
    "wait": Field(bool, True),
}

SNAPSHOT_COMPACT = {"to": Field(str, check=check_tag)}
SNAPSHOT_DELETE_QUERY = {"cascade": Field(bool, False), "force": Field(bool, False)}
PATH_QUERY = {"path": Field(str, check=check_guest_path)}
WRITE_QUERY = {"path": Field(str, check=check_guest_path),
               "mode": Field(int, 0o644, between(0, 0o7777)),
               "make_parents": Field(bool, False)}
REMOVE_QUERY = {"path": Field(str, check=check_guest_path),
                "recursive": Field(bool, False), "missing_ok": Field(bool, False)}
NO_QUERY: dict[str, Field] = {}

# Background processes (the agent's ``start`` … ``ps``, see agent/jobs.py).
PROCESS_START = {
    "args": Field(list, None, check_argv, nullable=True),
    "cmd": Field(str, None, text_up_to(MAX_COMMAND), nullable=True),
    "timeout_secs": Field((int, float), None, between(0.001, 86400), nullable=True),
    "env": Field(dict, None, check_env, nullable=True),
    "cwd": Field(str, None, check_guest_path, nullable=True),
    "stdin": Field(bool, False),
    "pty": Field(dict, None, check_pty_size, nullable=True),
    "tag": Field(str, None, text_up_to(256), nullable=True),
}
PROCESS_OUTPUT_QUERY = {"offset": Field(int, 0, between(0, 1 << 62)),
                        "encoding": Field(str, "text", one_of("text", "base64"))}
PROCESS_STDIN_QUERY = {"eof": Field(bool, False)}
PROCESS_SIGNAL = {"signal": Field((str, int), "SIGKILL"), "group": Field(bool, True)}
PTY_RESIZE = {"rows": Field(int, check=between(1, MAX_PTY_SIZE)),
              "cols": Field(int, check=between(1, MAX_PTY_SIZE))}
FILE_RENAME = {"path": Field(str, check=check_guest_path),
               "new_path": Field(str, check=check_guest_path),
               "overwrite": Field(bool, False)}
FILE_MKDIR = {"path": Field(str, check=check_guest_path), "parents": Field(bool, False),
              "mode": Field(int, 0o755, between(0, 0o7777))}
WATCH_QUERY = {"path": Field(str, check=check_guest_path), "recursive": Field(bool, False)}


def _where(req: Request) -> str:
    return f"{req.method} {req.path}"


def _no_query(req: Request) -> None:
    req.args(NO_QUERY, _where(req))


# -- handlers ------------------------------------------------------------------------


def healthz(c: Controller, req: Request) -> Response:
    return Response(body={"ok": True})


def version(c: Controller, req: Request) -> Response:
    _no_query(req)
    return Response(body=c.version())


def metrics(c: Controller, req: Request) -> Response:
    return Response(body=c.metrics.render().encode(),
                    content_type="text/plain; version=0.0.4; charset=utf-8")


def openapi_document() -> dict[str, Any]:
    text = resources.files("vmfork.server").joinpath("openapi.json").read_text("utf-8")
    doc: dict[str, Any] = json.loads(text)
    return doc


def openapi(c: Controller, req: Request) -> Response:
    doc = openapi_document()
    doc["info"]["version"] = c.version()["version"]
    return Response(body=doc)


def list_snapshots(c: Controller, req: Request) -> Response:
    _no_query(req)
    return Response(body=c.list_snapshots())


def create_snapshot(c: Controller, req: Request) -> Response:
    body = req.json(SNAPSHOT_CREATE, _where(req))
    req.snapshot_tag = body["tag"]
    if body["tap"] is not None:
        # A host tap is host state shared by whoever opens it; vmfork cables each parent
        # and each child to a namespace of its own instead (docs/networking.md).
        raise BadRequest(f"{_where(req)}: tap is not taken: vmfork makes the parent's "
                         "network itself; pass \"network\": true (and \"egress\") instead "
                         "of a host tap")
    if (body["kernel"] is None) != (body["rootfs"] is None):
        raise BadRequest(f"{_where(req)}: kernel and rootfs go together (a vmlinux and the "
                         "root file system image it boots); or pass neither and an \"image\"")
    if body["kernel"] is not None and body["image"] != "default":
        raise BadRequest(f"{_where(req)}: give kernel + rootfs or an image, not both")
    if body["warm_code"] is not None and body["warm_cmd"] is not None:
        raise BadRequest(f"{_where(req)}: give warm_code (Python) or warm_cmd (shell), "
                         "not both")
    return Response(201, c.create_snapshot(body))


def snapshot_info(c: Controller, req: Request) -> Response:
    _no_query(req)
    req.snapshot_tag = req.params["tag"]
    return Response(body=c.snapshot_info(req.params["tag"]))


def delete_snapshot(c: Controller, req: Request) -> Response:
    req.snapshot_tag = req.params["tag"]
    q = req.args(SNAPSHOT_DELETE_QUERY, _where(req))
    c.delete_snapshot(req.params["tag"], q["cascade"], q["force"])
    return Response(204)


def compact_snapshot(c: Controller, req: Request) -> Response:
    _no_query(req)
    req.snapshot_tag = req.params["tag"]
    body = req.json(SNAPSHOT_COMPACT, _where(req))
    return Response(200, c.compact_snapshot(req.params["tag"], body["to"]))


def create_sandboxes(c: Controller, req: Request) -> Response:
    _no_query(req)
    body = req.json(SANDBOX_CREATE, _where(req))
    req.snapshot_tag = body["snapshot_tag"]
    infos = c.create_sandboxes(body)
    req.sandbox_ids = [i["id"] for i in infos]
    return Response(201, infos)


def list_sandboxes(c: Controller, req: Request) -> Response:
    _no_query(req)
    return Response(body=c.list_sandboxes())


def _sandbox_id(req: Request) -> str:
    sandbox_id = req.params["id"]
    req.sandbox_ids = [sandbox_id]
    return sandbox_id


def get_sandbox(c: Controller, req: Request) -> Response:
    _no_query(req)
    return Response(body=c.get_sandbox(_sandbox_id(req)))


def delete_sandbox(c: Controller, req: Request) -> Response:
    _no_query(req)
    c.delete_sandbox(_sandbox_id(req))
    return Response(204)


def ping_sandbox(c: Controller, req: Request) -> Response:
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    req.json({}, _where(req))
    return Response(body=c.ping(sandbox_id))


def exec_sandbox(c: Controller, req: Request) -> Response:
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    return Response(body=c.exec(sandbox_id, req.json(EXEC, _where(req))))


def branch_sandbox(c: Controller, req: Request) -> Response:
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    body = req.json(BRANCH, _where(req))
    status, info = c.branch_sandbox(sandbox_id, body)
    req.snapshot_tag = info["tag"]
    return Response(status, info)


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def exec_stream(c: Controller, req: Request) -> Response:
    """Server-sent events: ``stdout``/``stderr`` ({"data": text}) as the process writes,
    then one ``exit`` (the exec result without its output) or ``error`` ({"error",
    "status", ...}: a timeout carries ``timed_out``)."""
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    body = req.json(EXEC, _where(req))
    c.agent(sandbox_id)  # refuse an unknown or dead sandbox before the stream starts

    def produce(write: Writer) -> None:
        def out(kind: str) -> Callable[[bytes], None]:
            return lambda chunk: write(_sse(kind, {"data": chunk.decode("utf-8", "replace")}))
        try:
            result = c.exec(sandbox_id, body, on_stdout=out("stdout"), on_stderr=out("stderr"))
        except ApiError as err:
            write(_sse("error", {**err.body(), "status": err.status}))
            return
        result.pop("stdout")
        result.pop("stderr")
        write(_sse("exit", result))

    return StreamResponse(200, content_type="text/event-stream",
                          headers={"Cache-Control": "no-cache"}, produce=produce)


def eval_sandbox(c: Controller, req: Request) -> Response:
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    return Response(body=c.eval(sandbox_id, req.json(EVAL, _where(req))))


class _WriterFile:
    """The ``fileobj`` that ``AgentClient.read_file_to`` writes into: the response."""

    def __init__(self, write: Writer) -> None:
        self._write = write

    def write(self, data: bytes) -> int:
        self._write(bytes(data))
        return len(data)


def download_file(c: Controller, req: Request) -> Response:
    sandbox_id = _sandbox_id(req)
    path = req.args(PATH_QUERY, _where(req))["path"]
    info = c.stat_file(sandbox_id, path)   # a missing file is a 404 before any byte is sent
    if info["type"] != "file":
        raise BadRequest(f"{_where(req)}: {path} is a {info['type']}, not a regular file; "
                         "list a directory with GET .../files/list")
    agent = c.agent(sandbox_id)

    def produce(write: Writer) -> None:
        with agent_errors(sandbox_id, "read"):
            agent.read_file_to(path, _WriterFile(write))  # type: ignore[arg-type]

    return StreamResponse(200, content_type="application/octet-stream",
                          headers={"X-File-Size": str(info["size"])}, produce=produce)


def upload_file(c: Controller, req: Request) -> Response:
    sandbox_id = _sandbox_id(req)
    q = req.args(WRITE_QUERY, _where(req))
    agent = c.agent(sandbox_id)
    with agent_errors(sandbox_id, "write"):
        size = agent.write_file(q["path"], req.chunks(), mode=q["mode"],
                                make_parents=q["make_parents"])
    return Response(body={"path": q["path"], "size": size})


def remove_file(c: Controller, req: Request) -> Response:
    sandbox_id = _sandbox_id(req)
    c.remove_file(sandbox_id, req.args(REMOVE_QUERY, _where(req)))
    return Response(204)


def list_files(c: Controller, req: Request) -> Response:
    sandbox_id = _sandbox_id(req)
    return Response(body=c.list_files(sandbox_id, req.args(PATH_QUERY, _where(req))["path"]))


def stat_file(c: Controller, req: Request) -> Response:
    sandbox_id = _sandbox_id(req)
    return Response(body=c.stat_file(sandbox_id, req.args(PATH_QUERY, _where(req))["path"]))


# -- background processes and more file calls (E2B's surface, issue 15) ----------------


def _process_pid(req: Request) -> int:
    return int(req.params["pid"])


def _output_event(stream: str, offset: int, data: bytes, encoding: str) -> bytes:
    if encoding == "base64":
        return _sse(stream, {"offset": offset, "data_b64": base64.b64encode(data).decode()})
    return _sse(stream, {"offset": offset, "data": data.decode("utf-8", "replace")})


def start_process(c: Controller, req: Request) -> Response:
    """Start a background process (it outlives the call): 201 ``{pid, pty}``."""
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    body = req.json(PROCESS_START, _where(req))
    if (body["args"] is None) == (body["cmd"] is None):
        raise BadRequest(f"{_where(req)}: give exactly one of args (an argv array) and cmd "
                         "(a shell command line)")
    pty = body["pty"]
    agent = c.agent(sandbox_id)
    with agent_errors(sandbox_id, "start"):
        pid = agent.start(body["args"] if body["args"] is not None else body["cmd"],
                          env=body["env"], cwd=body["cwd"], stdin=body["stdin"],
                          timeout=body["timeout_secs"], tag=body["tag"],
                          pty=None if pty is None else (pty["rows"], pty["cols"]))
    return Response(201, {"pid": pid, "pty": pty is not None, "sandbox_id": sandbox_id})


def list_processes(c: Controller, req: Request) -> Response:
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    with agent_errors(sandbox_id, "ps"):
        processes = c.agent(sandbox_id).processes()
    return Response(body={"processes": [dataclasses.asdict(p) for p in processes]})


def process_output(c: Controller, req: Request) -> Response:
    """Server-sent events: the process's kept output from ``offset``, then live, as
    ``stdout``/``stderr``/``pty`` ({offset, data} or {offset, data_b64}), then ``exit``
    (``ProcessEnd``) or ``error``; a comment line every ``WATCH_HEARTBEAT_SECS`` while
    the process is silent (how a client that went away is noticed). Closing the
    stream detaches; the process goes on."""
    sandbox_id = _sandbox_id(req)
    pid = _process_pid(req)
    q = req.args(PROCESS_OUTPUT_QUERY, _where(req))
    agent = c.agent(sandbox_id)
    with agent_errors(sandbox_id, "ps"):
        known = {p.pid for p in agent.processes()}
    if pid not in known:  # a 404 while the status code can still say so
        raise NotFound(f"{_where(req)}: sandbox {sandbox_id} has no background process "
                       f"{pid} (GET /v1/sandboxes/{sandbox_id}/processes lists them)")

    def produce(write: Writer) -> None:
        offset = q["offset"]
        skipped = 0
        try:
            while True:
                # Each attach waits at most a heartbeat for the next frame; a silent
                # process is followed by reattaching from where the last one stopped.
                attach = agent.attach(pid, offset=offset, idle_timeout=WATCH_HEARTBEAT_SECS)
                try:
                    with agent_errors(sandbox_id, "attach"):
                        for item in attach:
                            if isinstance(item, ProcessEnd):
                                end = dataclasses.asdict(item)
                                # Counted from offsets: what no chunk ever covered.
                                end["skipped"] = skipped + max(0, item.offset - offset)
                                write(_sse("exit", end))
                                return
                            skipped += max(0, item.offset - offset)
                            write(_output_event(item.stream, item.offset, item.data,
                                                q["encoding"]))
                            offset = item.offset + len(item.data)
                except GatewayTimeout:
                    write(b": idle\n\n")
                finally:
                    attach.close()
        except ApiError as err:
            write(_sse("error", {**err.body(), "status": err.status}))

    return StreamResponse(200, content_type="text/event-stream",
                          headers={"Cache-Control": "no-cache"}, produce=produce)


def process_stdin(c: Controller, req: Request) -> Response:
    """The raw body (at most 1 MiB) goes to the process's stdin; ``?eof=true`` closes
    it afterwards."""
    sandbox_id = _sandbox_id(req)
    pid = _process_pid(req)
    q = req.args(PROCESS_STDIN_QUERY, _where(req))
    length = req.content_length or 0
    if length > MAX_STDIN_BODY:
        raise PayloadTooLarge(f"{_where(req)}: {length} bytes of stdin in one call; the "
                              f"limit is {MAX_STDIN_BODY} (send it in several calls)")
    data = b"".join(req.chunks()) if length else b""
    with agent_errors(sandbox_id, "send_stdin"):
        written = c.agent(sandbox_id).send_stdin(pid, data, eof=q["eof"])
    return Response(body={"pid": pid, "written": written, "closed": q["eof"]})


def signal_process(c: Controller, req: Request) -> Response:
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    pid = _process_pid(req)
    body = req.json(PROCESS_SIGNAL, _where(req))
    with agent_errors(sandbox_id, "signal"):
        delivered = c.agent(sandbox_id).signal(pid, body["signal"], group=body["group"])
    return Response(body={"pid": pid, "delivered": delivered})


def resize_process_pty(c: Controller, req: Request) -> Response:
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    pid = _process_pid(req)
    body = req.json(PTY_RESIZE, _where(req))
    with agent_errors(sandbox_id, "pty_resize"):
        c.agent(sandbox_id).resize_pty(pid, body["rows"], body["cols"])
    return Response(body={"pid": pid, "rows": body["rows"], "cols": body["cols"]})


def rename_file(c: Controller, req: Request) -> Response:
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    body = req.json(FILE_RENAME, _where(req))
    with agent_errors(sandbox_id, "rename"):
        c.agent(sandbox_id).rename(body["path"], body["new_path"], overwrite=body["overwrite"])
    return Response(body=c.stat_file(sandbox_id, body["new_path"]))


def make_dir(c: Controller, req: Request) -> Response:
    """201 with the directory's stat when it was made; 200 when ``parents`` accepted
    an existing one (E2B's ``make_dir`` returns whether it created it)."""
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    body = req.json(FILE_MKDIR, _where(req))
    agent = c.agent(sandbox_id)
    with agent_errors(sandbox_id, "mkdir"):
        try:
            existed = agent.stat(body["path"]).type == "dir"
        except AgentError as err:
            if err.code != "not_found":
                raise
            existed = False
        agent.mkdir(body["path"], parents=body["parents"], mode=body["mode"])
    return Response(200 if existed else 201,
                    {**c.stat_file(sandbox_id, body["path"]), "created": not existed})


def file_exists(c: Controller, req: Request) -> Response:
    sandbox_id = _sandbox_id(req)
    path = req.args(PATH_QUERY, _where(req))["path"]
    try:
        info = c.stat_file(sandbox_id, path)
    except NotFound:
        return Response(body={"path": path, "exists": False, "type": None})
    return Response(body={"path": path, "exists": True, "type": info["type"]})


def watch_dir(c: Controller, req: Request) -> Response:
    """Server-sent events: ``events`` ({events: [{name, type, is_dir}], overflow}) as
    the directory changes, a comment line every ``WATCH_HEARTBEAT_SECS`` while idle
    (which is also how a client that went away is noticed), ``end`` if the directory
    itself goes. Closing the stream stops the watch."""
    sandbox_id = _sandbox_id(req)
    q = req.args(WATCH_QUERY, _where(req))
    agent = c.agent(sandbox_id)
    with agent_errors(sandbox_id, "watch"):
        watch = agent.watch(q["path"], recursive=q["recursive"])

    def produce(write: Writer) -> None:
        try:
            write(_sse("watching", {"path": q["path"], "recursive": q["recursive"],
                                    "directories": watch.directories}))
            while not watch.ended:
                with agent_errors(sandbox_id, "watch"):
                    batch = watch.events(timeout=WATCH_HEARTBEAT_SECS)
                if batch:
                    write(_sse("events", {"events": [dataclasses.asdict(e) for e in batch],
                                          "overflow": watch.overflow}))
                elif not watch.ended:
                    write(b": idle\n\n")
            write(_sse("end", {"path": q["path"], "reason": "the directory was removed or "
                                                            "moved"}))
        except ApiError as err:
            write(_sse("error", {**err.body(), "status": err.status}))
        finally:
            watch.close()

    return StreamResponse(200, content_type="text/event-stream",
                          headers={"Cache-Control": "no-cache"}, produce=produce)


def list_ports(c: Controller, req: Request) -> Response:
    _no_query(req)
    return Response(body=c.list_ports(_sandbox_id(req)))


def expose_port(c: Controller, req: Request) -> Response:
    _no_query(req)
    body = req.json(PORT_EXPOSE, _where(req))
    return Response(201, c.expose_port(_sandbox_id(req), body))


def unexpose_port(c: Controller, req: Request) -> Response:
    q = req.args(PORT_QUERY, _where(req))
    c.unexpose_port(_sandbox_id(req), int(req.params["port"]), q["protocol"])
    return Response(204)


def set_egress(c: Controller, req: Request) -> Response:
    _no_query(req)
    body = req.json(EGRESS, _where(req))
    return Response(body=c.set_egress(_sandbox_id(req), body))


def list_images(c: Controller, req: Request) -> Response:
    _no_query(req)
    return Response(body=c.images.list_all())


def build_image(c: Controller, req: Request) -> Response:
    _no_query(req)
    body = req.json(IMAGE_BUILD, _where(req))
    req.image = body["name"]
    status, info = c.images.build(body["name"], body)
    return Response(status, info)


def import_image(c: Controller, req: Request) -> Response:
    _no_query(req)
    body = req.json(IMAGE_IMPORT, _where(req))
    req.image = body["name"]
    status, info = c.images.import_oci(body["name"], body)
    return Response(status, info)


def get_image(c: Controller, req: Request) -> Response:
    _no_query(req)
    req.image = req.params["image"]
    return Response(body=c.images.get(req.params["image"]))


def delete_image(c: Controller, req: Request) -> Response:
    _no_query(req)
    req.image = req.params["image"]
    c.images.delete(req.params["image"])
    return Response(204)


def list_workspaces(c: Controller, req: Request) -> Response:
    _no_query(req)
    return Response(body=c.list_workspaces())


def create_workspace(c: Controller, req: Request) -> Response:
    _no_query(req)
    body = req.json(WORKSPACE_CREATE, _where(req))
    req.snapshot_tag = body["snapshot_tag"]
    info = c.create_workspace(body)
    req.sandbox_ids = [info["sandbox_id"]]
    return Response(201, info)


def get_workspace(c: Controller, req: Request) -> Response:
    _no_query(req)
    return Response(body=c.get_workspace(req.params["name"]))


def delete_workspace(c: Controller, req: Request) -> Response:
    _no_query(req)
    c.delete_workspace(req.params["name"])
    return Response(204)


def suspend_workspace(c: Controller, req: Request) -> Response:
    _no_query(req)
    body = req.json(WORKSPACE_SUSPEND, _where(req))
    info = c.suspend_workspace(req.params["name"], body["diff"])
    req.snapshot_tag = info["suspended_snapshot"]
    return Response(body=info)


def resume_workspace(c: Controller, req: Request) -> Response:
    _no_query(req)
    req.json({}, _where(req))
    info = c.resume_workspace(req.params["name"])
    req.sandbox_ids = [info["sandbox_id"]]
    return Response(body=info)


ROUTES: tuple[Route, ...] = (
    Route("GET", "/healthz", healthz),
    Route("GET", "/version", version),
    Route("GET", "/metrics", metrics),
    Route("GET", "/openapi.json", openapi),
    Route("GET", "/v1/snapshots", list_snapshots),
    Route("POST", "/v1/snapshots", create_snapshot),
    Route("DELETE", "/v1/snapshots/{tag}", delete_snapshot),
    Route("GET", "/v1/snapshots/{tag}/info", snapshot_info),
    Route("POST", "/v1/snapshots/{tag}/compact", compact_snapshot),
    Route("GET", "/v1/sandboxes", list_sandboxes),
    Route("POST", "/v1/sandboxes", create_sandboxes),
    Route("GET", "/v1/sandboxes/{id}", get_sandbox),
    Route("DELETE", "/v1/sandboxes/{id}", delete_sandbox),
    Route("POST", "/v1/sandboxes/{id}/ping", ping_sandbox),
    Route("POST", "/v1/sandboxes/{id}/exec", exec_sandbox),
    Route("POST", "/v1/sandboxes/{id}/exec/stream", exec_stream),
    Route("POST", "/v1/sandboxes/{id}/eval", eval_sandbox),
    Route("POST", "/v1/sandboxes/{id}/branch", branch_sandbox),
    Route("GET", "/v1/sandboxes/{id}/files", download_file),
    Route("PUT", "/v1/sandboxes/{id}/files", upload_file),
    Route("DELETE", "/v1/sandboxes/{id}/files", remove_file),
    Route("GET", "/v1/sandboxes/{id}/files/list", list_files),
    Route("GET", "/v1/sandboxes/{id}/files/stat", stat_file),
    Route("GET", "/v1/sandboxes/{id}/files/exists", file_exists),
    Route("POST", "/v1/sandboxes/{id}/files/rename", rename_file),
    Route("POST", "/v1/sandboxes/{id}/files/mkdir", make_dir),
    Route("GET", "/v1/sandboxes/{id}/files/watch", watch_dir),
    Route("GET", "/v1/sandboxes/{id}/processes", list_processes),
    Route("POST", "/v1/sandboxes/{id}/processes", start_process),
    Route("GET", "/v1/sandboxes/{id}/processes/{pid}/output", process_output),
    Route("POST", "/v1/sandboxes/{id}/processes/{pid}/stdin", process_stdin),
    Route("POST", "/v1/sandboxes/{id}/processes/{pid}/signal", signal_process),
    Route("POST", "/v1/sandboxes/{id}/processes/{pid}/resize", resize_process_pty),
    Route("GET", "/v1/sandboxes/{id}/ports", list_ports),
    Route("POST", "/v1/sandboxes/{id}/ports", expose_port),
    Route("DELETE", "/v1/sandboxes/{id}/ports/{port}", unexpose_port),
    Route("PUT", "/v1/sandboxes/{id}/egress", set_egress),
    Route("GET", "/v1/images", list_images),
    Route("POST", "/v1/images", build_image),
    Route("POST", "/v1/images/import", import_image),
    Route("GET", "/v1/images/{image}", get_image),
    Route("DELETE", "/v1/images/{image}", delete_image),
    Route("GET", "/v1/workspaces", list_workspaces),
    Route("POST", "/v1/workspaces", create_workspace),
    Route("GET", "/v1/workspaces/{name}", get_workspace),
    Route("DELETE", "/v1/workspaces/{name}", delete_workspace),
    Route("POST", "/v1/workspaces/{name}/suspend", suspend_workspace),
    Route("POST", "/v1/workspaces/{name}/resume", resume_workspace),
)

def _check_path_pid(value: str) -> str:
    if not (value.isascii() and value.isdigit() and 1 <= int(value) <= (1 << 22)):
        raise BadRequest(f"invalid process id {value[:20]!r}: a pid is 1-{1 << 22}")
    return value


def _check_path_port(value: str) -> str:
    if not (value.isascii() and value.isdigit() and 1 <= int(value) <= 65535):
        raise BadRequest(f"invalid host port {value[:20]!r}: a port is 1-65535")
    return value


_PARAM_CHECKS: dict[str, Callable[[str], str]] = {
    "tag": check_path_tag, "id": check_sandbox_id, "name": check_workspace_name,
    "image": check_path_image, "port": _check_path_port, "pid": _check_path_pid}


def match(method: str, raw_path: str) -> tuple[Route, dict[str, str]]:
    """The route for ``method`` and the (percent-encoded) path, with its validated
    parameters. 404 if no template fits, 405 if one fits another method."""
    path = raw_path if raw_path == "/" else raw_path.rstrip("/") or "/"
    try:
        parts = [urllib.parse.unquote(p, errors="strict") for p in path.strip("/").split("/")]
    except UnicodeDecodeError:
        raise BadRequest(f"the path {raw_path[:100]!r} is not valid UTF-8 once "
                         "percent-decoded") from None
    allowed: list[str] = []
    for route in ROUTES:
        segments = route.segments
        if len(segments) != len(parts):
            continue
        params: dict[str, str] = {}
        for seg, part in zip(segments, parts, strict=True):
            if seg.startswith("{"):
                if not part:
                    break
                params[seg[1:-1]] = part
            elif seg != part:
                break
        else:
            if route.method != method:
                allowed.append(route.method)
                continue
            for name, value in params.items():
                params[name] = _PARAM_CHECKS[name](value)
            return route, params
    if allowed:
        raise MethodNotAllowed(f"{method} is not allowed on {raw_path}; allowed: "
                               f"{', '.join(sorted(set(allowed)))}",
                               headers={"Allow": ", ".join(sorted(set(allowed)))})
    raise NotFound(f"no route {method} {raw_path}; GET /openapi.json lists the API")


