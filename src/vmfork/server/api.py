"""The REST routes: forkd v0.5.3's ``/v1`` surface plus vmfork's extensions.

One table (``ROUTES``) lists every route with its method, path template, handler
and accepted query parameters; the HTTP layer routes on it (Starlette routes made
from it, ``server/http.py``) and the OpenAPI contract test compares it with
``openapi.json``, so a route cannot exist without being documented. Handlers
validate everything first (path parameters by the router, with ``PARAM_CHECKS``;
bodies and queries by their ``Field`` specs), then call the controller.

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
from vmfork.server import ui
from vmfork.server.console import MAX_TAIL, ConsoleUnavailable, console_tail
from vmfork.server.controller import Controller, agent_errors
from vmfork.server.errors import (
    ApiError,
    BadRequest,
    GatewayTimeout,
    NotFound,
    PayloadTooLarge,
)
from vmfork.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from vmfork.server.requests import (
    Branch,
    Egress,
    Eval,
    Exec,
    PortExpose,
    RemoveFile,
    SandboxCreate,
    SnapshotCreate,
    WorkspaceCreate,
)
from vmfork.server.transfers import check_ref, optional_path, transfers_of
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
MAX_TIMEOUT_SECS = 30 * 86400  # a sandbox's lifetime (timeout_secs at spawn, set_timeout)
# Metadata (labels to find sandboxes by) and sandbox-wide environment variables.
MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY = 128
MAX_METADATA_VALUE = 1024
MAX_ENVS_ENTRIES = 256
MAX_ENV_NAME = 256
MAX_ENVS_BYTES = 64 << 10      # names and values together
SANDBOX_STATES = ("running", "paused", "exited", "lost")


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
    chunked: bool = False
    """The body is ``Transfer-Encoding: chunked`` (``content_length`` is None): its
    reader ends at the last chunk, and each consumer reads at most its own limit."""
    # Filled by handlers for the audit log.
    sandbox_ids: list[str] = field(default_factory=list)
    snapshot_tag: str | None = None
    image: str | None = None

    def json(self, spec: dict[str, Field], where: str) -> dict[str, Any]:
        raw = self.read_all(MAX_JSON_BODY, where, "the JSON body")
        return validate_fields(parse_json_object(raw, where), spec, where)

    def read_all(self, limit: int, where: str, what: str = "the body") -> bytes:
        """The whole body, refused (413) past ``limit`` bytes: by its Content-Length
        before any of it is read, or, chunked, as soon as more than that arrived."""
        if self.chunked:
            raw = self.body.read(limit + 1)
            while len(raw) <= limit:
                more = self.body.read(limit + 1 - len(raw))
                if not more:
                    break
                raw += more
            if len(raw) > limit:
                raise PayloadTooLarge(f"{where}: {what} is over {limit} bytes, the limit")
            return raw
        length = self.content_length or 0
        if length > limit:
            raise PayloadTooLarge(f"{where}: {what} is {length} bytes; the limit is {limit}")
        return b"".join(self.chunks()) if length else b""

    def args(self, spec: dict[str, Field], where: str) -> dict[str, Any]:
        return parse_query(self.query, spec, where)

    def chunks(self) -> Iterator[bytes]:
        """The raw body, streamed (a Content-Length, or chunked)."""
        if self.chunked:
            while chunk := self.body.read(STREAM_CHUNK):
                yield chunk
            return
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



# -- bodies ----------------------------------------------------------------------------

def check_metadata(value: Any) -> str | None:
    """A string map of at most 64 entries, keys 1-128 and values up to 1024 characters
    of printable Unicode."""
    if len(value) > MAX_METADATA_ENTRIES:
        return f"has {len(value)} entries; at most {MAX_METADATA_ENTRIES} are kept"
    for key, item in value.items():
        if not 1 <= len(key) <= MAX_METADATA_KEY or not key.isprintable():
            return (f"key {key[:40]!r} must be 1-{MAX_METADATA_KEY} printable characters")
        if not isinstance(item, str):
            return f"value of {key[:40]!r} must be a string"
        if len(item) > MAX_METADATA_VALUE or not item.isprintable():
            return (f"value of {key[:40]!r} must be at most {MAX_METADATA_VALUE} printable "
                    "characters")
    return check_string_map(value)


def check_envs(value: Any) -> str | None:
    """Environment variables every command of the sandbox gets: names as a shell's
    (letters, digits, underscore; not starting with a digit), string values."""
    if len(value) > MAX_ENVS_ENTRIES:
        return f"has {len(value)} variables; at most {MAX_ENVS_ENTRIES}"
    size = 0
    for key, item in value.items():
        if not (0 < len(key) <= MAX_ENV_NAME and key.isascii()
                and (key[0].isalpha() or key[0] == "_")
                and all(c.isalnum() or c == "_" for c in key)):
            return (f"has an invalid variable name {key[:40]!r} (letters, digits and _, "
                    f"not starting with a digit, at most {MAX_ENV_NAME})")
        if not isinstance(item, str) or "\0" in item:
            return f"value of {key!r} must be a string without NUL"
        size += len(key.encode()) + len(item.encode("utf-8", "surrogatepass"))
    if size > MAX_ENVS_BYTES:
        return f"is {size} bytes of names and values; the limit is {MAX_ENVS_BYTES}"
    return check_string_map(value)



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
    # vmfork's lifecycle (issue 15, docs/e2b.md): the sandbox ends timeout_secs after
    # it started (none: it runs until deleted), killed or, with on_timeout "pause",
    # paused; metadata to list it by; envs every command in it gets.
    "timeout_secs": Field((int, float), None, between(1, MAX_TIMEOUT_SECS), nullable=True),
    "on_timeout": Field(str, "kill", one_of("kill", "pause")),
    "metadata": Field(dict, None, check_metadata, nullable=True),
    "envs": Field(dict, None, check_envs, nullable=True),
}

SANDBOX_TIMEOUT = {
    "timeout_secs": Field((int, float), check=between(1, MAX_TIMEOUT_SECS), nullable=True),
}
SANDBOX_RESUME = {
    "timeout_secs": Field((int, float), None, between(1, MAX_TIMEOUT_SECS), nullable=True),
}
SANDBOX_LIST_QUERY = {
    # E2B's form: one parameter holding a URL-encoded query string, k1=v1&k2=v2; a
    # sandbox is listed when its metadata has every pair.
    "metadata": Field(str, None, text_up_to(8 << 10), nullable=True),
    # Comma-separated statuses (running,paused,exited,lost).
    "state": Field(str, None, text_up_to(64), nullable=True),
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
    # A diff first waits (3 s of quiet, 20 s at most) for the guest to report the pages
    # it freed, so they are not captured: what a build (snapshot-diff) wants.
    "settle_free_pages": Field(bool, False),
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


def ui_page(c: Controller, req: Request) -> Response:
    return _ui_file("index.html")


def ui_asset(c: Controller, req: Request) -> Response:
    return _ui_file(req.params["asset"])


def _ui_file(name: str) -> Response:
    found = ui.asset(name)
    if found is None:
        raise NotFound(f"no dashboard file {name!r}")
    data, content_type = found
    return Response(body=data, content_type=content_type, headers=dict(ui.HEADERS))


CONSOLE_QUERY = {"tail": Field(int, 16 << 10, between(1, MAX_TAIL))}


def sandbox_console(c: Controller, req: Request) -> Response:
    """The tail of the guest's console log (kernel messages, the agent's start-up), as
    text; a sandbox that ended keeps its log until its run directory is cleaned."""
    sandbox_id = _sandbox_id(req)
    q = req.args(CONSOLE_QUERY, _where(req))
    run_dir = c.sandbox_run_dir(sandbox_id)
    try:
        data = console_tail(run_dir, q["tail"])
    except ConsoleUnavailable as err:
        raise NotFound(f"sandbox {sandbox_id} has no console log to show: {err}") from err
    return Response(body=data, content_type="text/plain; charset=utf-8",
                    headers={"X-Content-Type-Options": "nosniff"})


def healthz(c: Controller, req: Request) -> Response:
    return Response(body={"ok": True})


def version(c: Controller, req: Request) -> Response:
    _no_query(req)
    return Response(body=c.version())


def metrics(c: Controller, req: Request) -> Response:
    return Response(body=c.metrics.render().encode(), content_type=METRICS_CONTENT_TYPE)


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
    return Response(201, c.create_snapshot(SnapshotCreate.of(body)))


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


PACK_QUERY = {"image": Field(bool, True)}


def pack_snapshot(c: Controller, req: Request) -> Response:
    """The chain ending at the tag as a pack (``vmfork pack``'s ``.tar.zst``, which
    ``vmfork unpack`` takes on another host), streamed; ``?image=false`` leaves the
    guest image out. Made whole before the first byte is sent, so a refusal is a
    proper error, and removed once sent (or not)."""
    tag = req.snapshot_tag = req.params["tag"]
    q = req.args(PACK_QUERY, _where(req))
    path = c.pack_snapshot(tag, with_image=q["image"])

    def produce(write: Writer) -> None:
        try:
            with open(path, "rb") as f:
                while chunk := f.read(STREAM_CHUNK):
                    write(chunk)
        finally:
            path.unlink(missing_ok=True)

    return StreamResponse(200, content_type="application/zstd",
                          headers={"Content-Disposition": f'attachment; filename="{tag}.tar.zst"'},
                          produce=produce)


def create_sandboxes(c: Controller, req: Request) -> Response:
    _no_query(req)
    body = req.json(SANDBOX_CREATE, _where(req))
    req.snapshot_tag = body["snapshot_tag"]
    infos = c.create_sandboxes(SandboxCreate.of(body))
    req.sandbox_ids = [i["id"] for i in infos]
    return Response(201, infos)


def _metadata_filter(raw: str | None, where: str) -> dict[str, str] | None:
    if raw is None:
        return None
    try:
        pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, strict_parsing=True,
                                       errors="strict", max_num_fields=MAX_METADATA_ENTRIES)
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"{where}: metadata must be a URL-encoded query string of key=value "
                         f"pairs (k1=v1&k2=v2, encoded once more as the parameter's value): "
                         f"{err}") from None
    wanted: dict[str, str] = {}
    for key, value in pairs:
        if key in wanted and wanted[key] != value:
            raise BadRequest(f"{where}: metadata filter gives {key[:40]!r} twice")
        wanted[key] = value
    return wanted


def _state_filter(raw: str | None, where: str) -> set[str] | None:
    if raw is None:
        return None
    states = {s.strip() for s in raw.split(",") if s.strip()}
    unknown = states - set(SANDBOX_STATES)
    if unknown or not states:
        raise BadRequest(f"{where}: state must be a comma-separated list of "
                         f"{', '.join(SANDBOX_STATES)}, not {raw[:40]!r}")
    return states


def list_sandboxes(c: Controller, req: Request) -> Response:
    where = _where(req)
    q = req.args(SANDBOX_LIST_QUERY, where)
    return Response(body=c.list_sandboxes(_metadata_filter(q["metadata"], where),
                                          _state_filter(q["state"], where)))


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


def set_sandbox_timeout(c: Controller, req: Request) -> Response:
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    body = req.json(SANDBOX_TIMEOUT, _where(req))
    return Response(body=c.set_timeout(sandbox_id, body["timeout_secs"]))


def pause_sandbox(c: Controller, req: Request) -> Response:
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    req.json({}, _where(req))
    info = c.pause_sandbox(sandbox_id)
    req.snapshot_tag = info["paused_snapshot"]
    return Response(body=info)


def resume_sandbox(c: Controller, req: Request) -> Response:
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    body = req.json(SANDBOX_RESUME, _where(req))
    return Response(body=c.resume_sandbox(sandbox_id, body["timeout_secs"]))


def connect_sandbox(c: Controller, req: Request) -> Response:
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    body = req.json(SANDBOX_RESUME, _where(req))
    return Response(body=c.connect_sandbox(sandbox_id, body["timeout_secs"]))


METRICS_QUERY = {"disk": Field(bool, True)}


def sandbox_metrics(c: Controller, req: Request) -> Response:
    """``?disk=false`` leaves out the guest's disk use, the one figure that costs a
    command in the guest (the dashboard's live table asks for the rest every poll)."""
    sandbox_id = _sandbox_id(req)
    q = req.args(METRICS_QUERY, _where(req))
    return Response(body=c.sandbox_metrics(sandbox_id, disk=q["disk"]))


def ping_sandbox(c: Controller, req: Request) -> Response:
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    req.json({}, _where(req))
    return Response(body=c.ping(sandbox_id))


def exec_sandbox(c: Controller, req: Request) -> Response:
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    return Response(body=c.exec(sandbox_id, Exec.of(req.json(EXEC, _where(req)))))


def branch_sandbox(c: Controller, req: Request) -> Response:
    _no_query(req)
    sandbox_id = _sandbox_id(req)
    body = req.json(BRANCH, _where(req))
    status, info = c.branch_sandbox(sandbox_id, Branch.of(body))
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
    body = Exec.of(req.json(EXEC, _where(req)))
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
    return Response(body=c.eval(sandbox_id, Eval.of(req.json(EVAL, _where(req)))))


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
    # The body is the file's first X-File-Size bytes: a file growing meanwhile (a log, a
    # counter) would otherwise send more than announced, which clients take for a broken
    # stream. Size 0 reads to the end (what /proc and /sys files say of themselves, and
    # a file being rewritten may say as it is truncated), and then no size is announced:
    # clients held such a body to 0 bytes and took every byte for a broken stream.
    length = info["size"] or None
    headers = {"X-File-Size": str(length)} if length else {}

    def produce(write: Writer) -> None:
        with agent_errors(sandbox_id, "read"):
            agent.read_file_to(path, _WriterFile(write),  # type: ignore[arg-type]
                               length=length)

    return StreamResponse(200, content_type="application/octet-stream",
                          headers=headers, produce=produce)


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
    c.remove_file(sandbox_id, RemoveFile.of(req.args(REMOVE_QUERY, _where(req))))
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
                          env=c.command_env(sandbox_id, body["env"]), cwd=body["cwd"],
                          stdin=body["stdin"],
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
    data = req.read_all(MAX_STDIN_BODY, _where(req), "stdin in one call (send it in "
                        "several calls)")
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
    return Response(201, c.expose_port(_sandbox_id(req), PortExpose.of(body)))


def unexpose_port(c: Controller, req: Request) -> Response:
    q = req.args(PORT_QUERY, _where(req))
    c.unexpose_port(_sandbox_id(req), int(req.params["port"]), q["protocol"])
    return Response(204)


def set_egress(c: Controller, req: Request) -> Response:
    _no_query(req)
    body = req.json(EGRESS, _where(req))
    return Response(body=c.set_egress(_sandbox_id(req), Egress.of(body)))


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
    info = c.create_workspace(WorkspaceCreate.of(body))
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


# Snapshots to and from OCI registries, as background jobs (server/transfers.py).
SNAPSHOT_PUSH = {"ref": Field(str, check=check_ref),
                 "sign_key": Field(str, None, check_host_path, nullable=True),
                 "auth_file": Field(str, None, check_host_path, nullable=True),
                 "insecure": Field(bool, False), "with_image": Field(bool, True)}
SNAPSHOT_PULL = {"ref": Field(str, check=check_ref),
                 "tag": Field(str, None, check_tag, nullable=True),
                 "force": Field(bool, False),
                 "verify_key": Field(str, None, check_host_path, nullable=True),
                 "auth_file": Field(str, None, check_host_path, nullable=True),
                 "insecure": Field(bool, False)}


def push_snapshot(c: Controller, req: Request) -> Response:
    from vmfork.store import distribution
    _no_query(req)
    tag = req.snapshot_tag = req.params["tag"]
    body = req.json(SNAPSHOT_PUSH, _where(req))
    if not c.store.exists(tag):
        raise NotFound(f"no snapshot {tag!r}")
    sign_key, auth_file = optional_path(body["sign_key"]), optional_path(body["auth_file"])
    job = transfers_of(c).start("push", body["ref"], tag, lambda progress: distribution.push(
        c.store, tag, body["ref"], sign_key=sign_key, auth_file=auth_file,
        insecure=body["insecure"], with_image=body["with_image"], progress=progress))
    return Response(202, job)


def pull_snapshot(c: Controller, req: Request) -> Response:
    from vmfork.store import distribution
    _no_query(req)
    body = req.json(SNAPSHOT_PULL, _where(req))
    req.snapshot_tag = body["tag"]
    verify_key, auth_file = optional_path(body["verify_key"]), optional_path(body["auth_file"])
    job = transfers_of(c).start("pull", body["ref"], body["tag"], lambda progress: (
        distribution.pull(c.store, body["ref"], head_tag=body["tag"], force=body["force"],
                          verify_key=verify_key, auth_file=auth_file,
                          insecure=body["insecure"], progress=progress)))
    return Response(202, job)


def list_transfers(c: Controller, req: Request) -> Response:
    _no_query(req)
    return Response(body=transfers_of(c).list())


def get_transfer(c: Controller, req: Request) -> Response:
    _no_query(req)
    return Response(body=transfers_of(c).get(req.params["job"]))


ROUTES: tuple[Route, ...] = (
    Route("GET", "/healthz", healthz),
    Route("GET", "/version", version),
    Route("GET", "/metrics", metrics),
    Route("GET", "/openapi.json", openapi),
    Route("GET", "/ui", ui_page),
    Route("GET", "/ui/{asset}", ui_asset),
    Route("GET", "/v1/snapshots", list_snapshots),
    Route("POST", "/v1/snapshots", create_snapshot),
    Route("DELETE", "/v1/snapshots/{tag}", delete_snapshot),
    Route("GET", "/v1/snapshots/{tag}/info", snapshot_info),
    Route("POST", "/v1/snapshots/{tag}/compact", compact_snapshot),
    Route("GET", "/v1/snapshots/{tag}/pack", pack_snapshot),
    Route("POST", "/v1/snapshots/{tag}/push", push_snapshot),
    Route("POST", "/v1/snapshots/pull", pull_snapshot),
    Route("GET", "/v1/transfers", list_transfers),
    Route("GET", "/v1/transfers/{job}", get_transfer),
    Route("GET", "/v1/sandboxes", list_sandboxes),
    Route("POST", "/v1/sandboxes", create_sandboxes),
    Route("GET", "/v1/sandboxes/{id}", get_sandbox),
    Route("DELETE", "/v1/sandboxes/{id}", delete_sandbox),
    Route("POST", "/v1/sandboxes/{id}/ping", ping_sandbox),
    Route("POST", "/v1/sandboxes/{id}/timeout", set_sandbox_timeout),
    Route("POST", "/v1/sandboxes/{id}/pause", pause_sandbox),
    Route("POST", "/v1/sandboxes/{id}/resume", resume_sandbox),
    Route("POST", "/v1/sandboxes/{id}/connect", connect_sandbox),
    Route("GET", "/v1/sandboxes/{id}/metrics", sandbox_metrics),
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
    Route("GET", "/v1/sandboxes/{id}/console", sandbox_console),
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


def _check_path_job(value: str) -> str:
    if not (len(value) == 16 and all(ch in "0123456789abcdef" for ch in value)):
        raise BadRequest(f"invalid transfer job id {value[:20]!r}: 16 hex digits")
    return value


def _check_path_asset(value: str) -> str:
    if value not in ui.ASSETS:
        raise NotFound(f"no dashboard file {value[:60]!r}; the dashboard is at /ui")
    return value


PARAM_CHECKS: dict[str, Callable[[str], str]] = {
    # Each path parameter's check, by its name in the templates (server/http.py matches).
    "tag": check_path_tag, "id": check_sandbox_id, "name": check_workspace_name,
    "image": check_path_image, "port": _check_path_port, "pid": _check_path_pid,
    "job": _check_path_job, "asset": _check_path_asset}
