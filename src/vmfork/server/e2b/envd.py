"""envd, E2B's in-sandbox daemon, emulated by the host daemon on top of vmfork's guest
agent: its Connect services ``process.Process`` and ``filesystem.Filesystem`` and its
HTTP routes ``/files`` and ``/health``.

Each RPC is a translation onto the agent calls the REST routes make (``api.py``'s
``/v1/sandboxes/{id}/processes…`` and ``files…`` handlers): background processes by
pid (output kept in the agent and replayed on ``Connect``), stdin, signals, PTYs,
inotify watches. What the agent does not have — a process selected by tag — is
mapped as the docstrings say. envd's users (``Authorization: Basic`` on an RPC,
``?username=`` on ``/files``) become the agent's ``user``: processes run as that user
and what it writes is its own; no user is ``user`` where the guest has it (E2B's
templates' default; root otherwise, and ``root`` asks for root), and relative paths
resolve against the user's home (``GUEST_HOME`` for root). ``/files`` without an
``X-Access-Token`` must be a signed URL (``file_signature``), as envd requires on a
secured sandbox.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import posixpath
import secrets
import stat as stat_module
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

from vmfork.agent.client import (
    AgentClient,
    AgentError,
    AgentTimeout,
    AgentUnavailable,
    DirWatch,
    FileInfo,
    ProcessEnd,
)
from vmfork.server import api
from vmfork.server.controller import Controller, agent_errors
from vmfork.server.e2b import connect, multipart
from vmfork.server.e2b.connect import ConnectError
from vmfork.server.errors import ApiError, BadRequest, GatewayTimeout
from vmfork.server.validation import MAX_GUEST_PATH

ENVD_VERSION = "0.5.7"
"""The envd version reported to the SDKs, which gate features on it: 0.5.7 is the
first with octet-stream uploads and has stdin on ``Start`` and ``CloseStdin``; later
versions add entry metadata and entries in watch events, which are not emulated."""
GUEST_HOME = "/root"
DEFAULT_USER = "user"
"""E2B's templates run commands and write files as ``user`` (uid 1000) unless a call
says ``root``; so does this envd, where the guest has that user."""
MAX_PASSWD_BYTES = 1 << 20
MAX_DEFAULTS_KNOWN = 4096
USER_HOMES = "/home"
"""A non-root envd user's home is ``/home/<name>`` (as in E2B's templates and the
default image's ``user``): where its relative paths and its processes start."""
KEEPALIVE_SECS = 15.0
"""A silent stream sends a keep-alive event this often (or at the client's
``Keepalive-Ping-Interval``, if shorter); it is also how a client that went away is
noticed, as on the REST streams."""
MAX_WATCHERS = 64
"""``CreateWatcher`` watches held for polling clients, daemon-wide."""
WATCHER_IDLE_SECS = 120.0
"""A watcher not polled for this long is removed (its client went away)."""
MAX_WATCHER_EVENTS = 10_000
MAX_LIST_DEPTH = 8
SIGNALS = {"SIGNAL_SIGKILL": "SIGKILL", "SIGNAL_SIGTERM": "SIGTERM", 9: "SIGKILL",
           15: "SIGTERM"}
_FILE_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY",
               "symlink": "FILE_TYPE_SYMLINK"}
_EVENT_TYPES = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE",
                "remove": "EVENT_TYPE_REMOVE", "rename_from": "EVENT_TYPE_RENAME",
                "rename_to": "EVENT_TYPE_CREATE", "chmod": "EVENT_TYPE_CHMOD"}
"""inotify's two halves of a rename as envd reports them: the old name renamed, the
new one created."""
_AGENT_CODES = {"not_found": "not_found", "exists": "already_exists",
                "unknown_user": "invalid_argument", "unsupported": "failed_precondition",
                "permission_denied": "permission_denied",
                "not_a_directory": "invalid_argument", "is_a_directory": "invalid_argument",
                "not_empty": "failed_precondition", "invalid": "invalid_argument"}


@dataclasses.dataclass
class _Watcher:
    sandbox_id: str
    path: str
    watch: DirWatch
    polled: float
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class Envd:
    """The envd of every sandbox: stateless except for polled watchers.
    ``access_token(sandbox_id)`` is the sandbox's ``envdAccessToken``, which signed
    ``/files`` URLs are signed with."""

    def __init__(self, access_token: Callable[[str], str]) -> None:
        self._lock = threading.Lock()
        self._watchers: dict[str, _Watcher] = {}
        self._access_token = access_token
        self._defaults: dict[str, _Who] = {}   # sandbox id -> its default user

    def _default_user(self, c: Controller, sandbox_id: str) -> Callable[[], _Who]:
        """How a call that names no user learns the sandbox's default (asked only
        then): ``DEFAULT_USER`` when the guest has it in ``/etc/passwd`` and its agent
        can act as a user (protocol 3), else root (an image without it, an older
        snapshot's agent: as before). Asked of the guest once per sandbox; the cache is
        bounded (oldest dropped first)."""
        def resolve() -> _Who:
            with self._lock:
                known = self._defaults.get(sandbox_id)
            if known is not None:
                return known
            agent = c.agent(sandbox_id)
            with _agent(sandbox_id, "ping"):
                protocol = agent.ping().protocol
            who = _ROOT
            if protocol >= 3:
                with _agent(sandbox_id, "read"):
                    try:
                        passwd = agent.read_file("/etc/passwd", length=MAX_PASSWD_BYTES)
                    except AgentError as err:
                        if err.code != "not_found":
                            raise
                        passwd = b""
                home = _passwd_home(passwd, DEFAULT_USER)
                if home is not None:
                    who = _Who(DEFAULT_USER, home)
            with self._lock:
                while len(self._defaults) >= MAX_DEFAULTS_KNOWN:
                    self._defaults.pop(next(iter(self._defaults)))
                self._defaults[sandbox_id] = who
            return who
        return resolve

    # -- dispatch ----------------------------------------------------------------------

    def handle(self, c: Controller, req: api.Request, sandbox_id: str) -> api.Response:
        where = f"{req.method} {req.path} (sandbox {sandbox_id})"
        if req.path == "/health":
            c.agent(sandbox_id)   # 404/409 for a sandbox that is gone
            return api.Response(204)
        if req.path == "/files":
            return self._files(c, req, sandbox_id, where)
        service, _, method = req.path.strip("/").partition("/")
        rpc = _RPCS.get((service, method))
        if rpc is None:
            return connect.unary_error(ConnectError(
                "unimplemented", f"{req.path}: not an envd call this server has"))
        if req.method != "POST":
            return connect.unary_error(ConnectError("unimplemented", f"{where}: use POST"))
        handler, streaming = rpc
        try:
            if streaming:
                message = connect.read_stream_request(req, where)
                stream: api.Response = handler(self, c, sandbox_id, message, where, req)
                return stream
            message = connect.read_unary(req, where)
            return connect.unary_response(handler(self, c, sandbox_id, message, where, req))
        except ConnectError as err:
            return _error(err, streaming)
        except ApiError as err:
            return _error(ConnectError.from_api(err), streaming)

    # -- process.Process ---------------------------------------------------------------

    def start(self, c: Controller, sandbox_id: str, m: dict[str, Any], where: str,
              req: api.Request) -> api.Response:
        config = connect.obj(m, "process", where) or {}
        cmd = connect.string(config, "cmd", where)
        if not cmd:
            raise ConnectError("invalid_argument", f"{where}: process.cmd is empty")
        args = connect.field(config, "args") or []
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ConnectError("invalid_argument", f"{where}: process.args must be strings")
        envs = connect.field(config, "envs") or {}
        if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
            raise ConnectError("invalid_argument", f"{where}: process.envs must map names "
                               "to strings")
        cwd = connect.field(config, "cwd")
        who = _rpc_user(req, where, self._default_user(c, sandbox_id))
        cwd = who.home if cwd in (None, "") else _path(cwd, where, who.home)
        pty_size = None
        pty = connect.obj(m, "pty", where)
        if pty is not None:
            size = connect.obj(pty, "size", where) or {}
            rows = connect.uint(size, "rows", where, api.MAX_PTY_SIZE) or 24
            cols = connect.uint(size, "cols", where, api.MAX_PTY_SIZE) or 80
            pty_size = (rows, cols)
        tag = connect.string(m, "tag", where) or None
        timeout = _timeout_ms(req)
        agent = c.agent(sandbox_id)
        with _agent(sandbox_id, "start"):
            pid = agent.start([cmd, *args], env=_command_env(c, sandbox_id, envs), cwd=cwd,
                              stdin=connect.boolean(m, "stdin", where), tag=tag,
                              timeout=None if timeout is None else timeout / 1000,
                              pty=pty_size, user=who.name)
        return connect.stream_response(
            lambda: self._follow(agent, sandbox_id, pid, _keepalive(req), started=True))

    def connect_process(self, c: Controller, sandbox_id: str, m: dict[str, Any], where: str,
                        req: api.Request) -> api.Response:
        agent = c.agent(sandbox_id)
        pid = self._pid(agent, sandbox_id, m, where)
        with _agent(sandbox_id, "ps"):
            known = {p.pid for p in agent.processes()}
        if pid not in known:   # said before the stream starts
            raise ConnectError("not_found", f"{where}: no process {pid}")
        return connect.stream_response(
            lambda: self._follow(agent, sandbox_id, pid, _keepalive(req), started=True))

    def _follow(self, agent: AgentClient, sandbox_id: str, pid: int, keepalive: float, *,
                started: bool) -> Generator[dict[str, Any], None, None]:
        """Start (pid), the process's output from the beginning of what the agent kept,
        then its end; keep-alives while it is silent (each attach waits at most that
        long, and the next one goes on from the offset reached)."""
        if started:
            yield {"event": {"start": {"pid": pid}}}
        offset = 0
        while True:
            attach = agent.attach(pid, offset=offset, idle_timeout=keepalive)
            try:
                with _agent(sandbox_id, "attach"):
                    for item in attach:
                        if isinstance(item, ProcessEnd):
                            yield {"event": {"end": _end(item)}}
                            return
                        yield {"event": {"data": {item.stream: connect.b64(item.data)}}}
                        offset = item.offset + len(item.data)
            except ConnectError as err:
                if err.code != "deadline_exceeded":
                    raise
                yield {"event": {"keepalive": {}}}
            finally:
                attach.close()

    def list_processes(self, c: Controller, sandbox_id: str, m: dict[str, Any], where: str,
                       req: api.Request) -> dict[str, Any]:
        with _agent(sandbox_id, "ps"):
            processes = c.agent(sandbox_id).processes()
        out = []
        for p in processes:
            if not p.running:
                continue   # envd lists running processes only
            info: dict[str, Any] = {"pid": p.pid, "config": {
                "cmd": p.argv[0] if p.argv else "", "args": p.argv[1:], "envs": {},
                **({"cwd": p.cwd} if p.cwd else {})}}
            if p.tag:
                info["tag"] = p.tag
            out.append(info)
        return {"processes": out}

    def send_input(self, c: Controller, sandbox_id: str, m: dict[str, Any], where: str,
                   req: api.Request) -> dict[str, Any]:
        agent = c.agent(sandbox_id)
        pid = self._pid(agent, sandbox_id, m, where)
        given = connect.obj(m, "input", where) or {}
        data = connect.data(given, "pty" if "pty" in given else "stdin", where)
        with _agent(sandbox_id, "send_stdin"):
            agent.send_stdin(pid, data)
        return {}

    def close_stdin(self, c: Controller, sandbox_id: str, m: dict[str, Any], where: str,
                    req: api.Request) -> dict[str, Any]:
        agent = c.agent(sandbox_id)
        pid = self._pid(agent, sandbox_id, m, where)
        with _agent(sandbox_id, "send_stdin"):
            agent.close_stdin(pid)
        return {}

    def send_signal(self, c: Controller, sandbox_id: str, m: dict[str, Any], where: str,
                    req: api.Request) -> dict[str, Any]:
        agent = c.agent(sandbox_id)
        pid = self._pid(agent, sandbox_id, m, where)
        name = SIGNALS.get(connect.field(m, "signal"))
        if name is None:
            raise ConnectError("invalid_argument", f"{where}: signal must be SIGNAL_SIGKILL "
                               "or SIGNAL_SIGTERM")
        with _agent(sandbox_id, "signal"):
            agent.signal(pid, name)
        return {}

    def update(self, c: Controller, sandbox_id: str, m: dict[str, Any], where: str,
               req: api.Request) -> dict[str, Any]:
        agent = c.agent(sandbox_id)
        pid = self._pid(agent, sandbox_id, m, where)
        pty = connect.obj(m, "pty", where)
        size = None if pty is None else connect.obj(pty, "size", where)
        if size is None:
            raise ConnectError("invalid_argument", f"{where}: only a PTY resize (pty.size) "
                               "can be updated")
        rows = connect.uint(size, "rows", where, api.MAX_PTY_SIZE)
        cols = connect.uint(size, "cols", where, api.MAX_PTY_SIZE)
        if not rows or not cols:
            raise ConnectError("invalid_argument", f"{where}: a PTY is 1-{api.MAX_PTY_SIZE} "
                               "rows and columns")
        with _agent(sandbox_id, "pty_resize"):
            agent.resize_pty(pid, rows, cols)
        return {}

    def _pid(self, agent: AgentClient, sandbox_id: str, m: dict[str, Any],
             where: str) -> int:
        """The pid a ``ProcessSelector`` names: by pid, or by tag among the running."""
        selector = connect.obj(m, "process", where) or {}
        if "tag" in selector:
            tag = connect.string(selector, "tag", where)
            with _agent(sandbox_id, "ps"):
                found = [p.pid for p in agent.processes() if p.tag == tag and p.running]
            if not found:
                raise ConnectError("not_found", f"{where}: no running process tagged "
                                   f"{tag[:80]!r}")
            return found[-1]
        pid = connect.uint(selector, "pid", where, 1 << 22)
        if not pid:
            raise ConnectError("invalid_argument", f"{where}: process.pid (or tag) is "
                               "required")
        return pid

    # -- filesystem.Filesystem ---------------------------------------------------------

    def stat(self, c: Controller, sandbox_id: str, m: dict[str, Any], where: str,
             req: api.Request) -> dict[str, Any]:
        path = _path(connect.string(m, "path", where), where, _rpc_user(req, where, self._default_user(c, sandbox_id)).home)
        with _agent(sandbox_id, "stat"):
            info = c.agent(sandbox_id).stat(path, follow_symlinks=False)
        return {"entry": _entry(info, path)}

    def make_dir(self, c: Controller, sandbox_id: str, m: dict[str, Any], where: str,
                 req: api.Request) -> dict[str, Any]:
        """envd makes the parents too, and answers ALREADY_EXISTS for an existing
        directory (the SDK's ``make_dir`` then returns False)."""
        who = _rpc_user(req, where, self._default_user(c, sandbox_id))
        path = _path(connect.string(m, "path", where), where, who.home)
        agent = c.agent(sandbox_id)
        with _agent(sandbox_id, "mkdir"):
            try:
                agent.stat(path)
                raise ConnectError("already_exists", f"{where}: {path} already exists")
            except AgentError as err:
                if err.code != "not_found":
                    raise
            agent.mkdir(path, parents=True, user=who.name)
            info = agent.stat(path, follow_symlinks=False)
        return {"entry": _entry(info, path)}

    def move(self, c: Controller, sandbox_id: str, m: dict[str, Any], where: str,
             req: api.Request) -> dict[str, Any]:
        home = _rpc_user(req, where, self._default_user(c, sandbox_id)).home
        source = _path(connect.string(m, "source", where), where, home)
        destination = _path(connect.string(m, "destination", where), where, home)
        agent = c.agent(sandbox_id)
        with _agent(sandbox_id, "rename"):
            agent.rename(source, destination, overwrite=True)   # rename(2), as envd
            info = agent.stat(destination, follow_symlinks=False)
        return {"entry": _entry(info, destination)}

    def list_dir(self, c: Controller, sandbox_id: str, m: dict[str, Any], where: str,
                 req: api.Request) -> dict[str, Any]:
        path = _path(connect.string(m, "path", where), where, _rpc_user(req, where, self._default_user(c, sandbox_id)).home)
        depth = connect.uint(m, "depth", where, MAX_LIST_DEPTH) or 1
        limit = c.limits.list_entries
        agent = c.agent(sandbox_id)
        entries: list[dict[str, Any]] = []
        level = [path]
        with _agent(sandbox_id, "list"):
            if agent.stat(path).type != "dir":
                raise ConnectError("invalid_argument", f"{where}: {path} is not a directory")
            for _ in range(depth):
                deeper: list[str] = []
                for directory in level:
                    for info in agent.list_dir_bounded(directory, limit).entries:
                        full = posixpath.join(directory, info.name)
                        entries.append(_entry(info, full))
                        if info.type == "dir":
                            deeper.append(full)
                        if len(entries) > limit:
                            raise ConnectError("resource_exhausted", f"{where}: more than "
                                               f"{limit} entries; list with less depth")
                level = deeper
        return {"entries": entries}

    def remove(self, c: Controller, sandbox_id: str, m: dict[str, Any], where: str,
               req: api.Request) -> dict[str, Any]:
        path = _path(connect.string(m, "path", where), where, _rpc_user(req, where, self._default_user(c, sandbox_id)).home)
        with _agent(sandbox_id, "remove"):
            c.agent(sandbox_id).remove(path, recursive=True)
        return {}

    def watch_dir(self, c: Controller, sandbox_id: str, m: dict[str, Any], where: str,
                  req: api.Request) -> api.Response:
        path = _path(connect.string(m, "path", where), where, _rpc_user(req, where, self._default_user(c, sandbox_id)).home)
        agent = c.agent(sandbox_id)
        with _agent(sandbox_id, "watch"):
            watch = agent.watch(path, recursive=connect.boolean(m, "recursive", where))
        keepalive = _keepalive(req)

        def events() -> Generator[dict[str, Any], None, None]:
            try:
                yield {"start": {}}
                while not watch.ended:
                    with _agent(sandbox_id, "watch"):
                        batch = watch.events(timeout=keepalive)
                    for event in batch:
                        yield {"filesystem": _fs_event(event)}
                    if not batch:
                        yield {"keepalive": {}}
            finally:
                watch.close()

        return connect.stream_response(events)

    def create_watcher(self, c: Controller, sandbox_id: str, m: dict[str, Any], where: str,
                       req: api.Request) -> dict[str, Any]:
        path = _path(connect.string(m, "path", where), where, _rpc_user(req, where, self._default_user(c, sandbox_id)).home)
        self._expire_watchers()
        with self._lock:
            if len(self._watchers) >= MAX_WATCHERS:
                raise ConnectError("resource_exhausted", f"{where}: {MAX_WATCHERS} watchers "
                                   "are open; remove one (RemoveWatcher) first")
        agent = c.agent(sandbox_id)
        with _agent(sandbox_id, "watch"):
            watch = agent.watch(path, recursive=connect.boolean(m, "recursive", where))
        watcher_id = secrets.token_hex(12)
        with self._lock:
            self._watchers[watcher_id] = _Watcher(sandbox_id, path, watch, time.monotonic())
        return {"watcherId": watcher_id}

    def get_watcher_events(self, c: Controller, sandbox_id: str, m: dict[str, Any],
                           where: str, req: api.Request) -> dict[str, Any]:
        watcher = self._watcher(sandbox_id, m, where)
        events: list[dict[str, Any]] = []
        with watcher.lock:
            watcher.polled = time.monotonic()
            with _agent(sandbox_id, "watch"):
                while len(events) < MAX_WATCHER_EVENTS:
                    batch = watcher.watch.events(timeout=0.05)
                    if not batch:
                        break
                    events.extend(_fs_event(e) for e in batch)
        return {"events": events}

    def remove_watcher(self, c: Controller, sandbox_id: str, m: dict[str, Any], where: str,
                       req: api.Request) -> dict[str, Any]:
        watcher = self._watcher(sandbox_id, m, where)
        with self._lock:
            self._watchers.pop(connect.string(m, "watcher_id", where), None)
        watcher.watch.close()
        return {}

    def _watcher(self, sandbox_id: str, m: dict[str, Any], where: str) -> _Watcher:
        watcher_id = connect.string(m, "watcher_id", where)
        with self._lock:
            watcher = self._watchers.get(watcher_id)
        if watcher is None or watcher.sandbox_id != sandbox_id:
            raise ConnectError("not_found", f"{where}: no watcher {watcher_id[:40]!r}")
        return watcher

    def _expire_watchers(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [k for k, w in self._watchers.items()
                     if now - w.polled > WATCHER_IDLE_SECS]
            gone = [self._watchers.pop(k) for k in stale]
        for watcher in gone:
            watcher.watch.close()

    def forget_sandbox(self, sandbox_id: str) -> None:
        """Close the watchers of a sandbox that was killed."""
        with self._lock:
            keys = [k for k, w in self._watchers.items() if w.sandbox_id == sandbox_id]
            gone = [self._watchers.pop(k) for k in keys]
        for watcher in gone:
            watcher.watch.close()

    # -- /files ------------------------------------------------------------------------

    def _files(self, c: Controller, req: api.Request, sandbox_id: str,
               where: str) -> api.Response:
        try:
            if req.method not in ("GET", "POST"):
                return _files_error(405, f"{where}: /files takes GET and POST")
            if req.headers.get("x-access-token") is None:   # checked before, if given
                refused = self._check_signature(req, sandbox_id, where)
                if refused is not None:
                    return refused
            if req.method == "GET":
                return self._download(c, req, sandbox_id, where)
            if req.method == "POST":
                return self._upload(c, req, sandbox_id, where)
        except ApiError as err:
            return _files_error(err.status, str(err.body().get("error", err)))
        except ConnectError as err:
            return _files_error(connect._STATUS[err.code], err.message)
        return _files_error(405, f"{where}: /files takes GET and POST")

    def _check_signature(self, req: api.Request, sandbox_id: str,
                         where: str) -> api.Response | None:
        """A signed URL (the SDK's ``download_url``/``upload_url``), checked as envd
        checks one on a secured sandbox (every sandbox here is): ``signature`` must be
        ``file_signature`` of the URL's own ``path`` and ``username``, the operation
        (GET reads, POST writes) and, if the URL has one, ``signature_expiration``,
        which must not have passed. None when it holds; a 401 saying why when not."""
        signature = req.query.get("signature", [None])[0]
        if signature is None:
            return _files_error(401, f"{where}: missing signature query parameter (a "
                                "/files call needs the X-Access-Token header or a signed "
                                "URL: download_url/upload_url)")
        raw_expiration = req.query.get("signature_expiration", [None])[0]
        expiration = None
        if raw_expiration is not None:
            digits = raw_expiration.removeprefix("-")
            if not (digits.isascii() and digits.isdigit() and len(digits) <= 19):
                return _files_error(400, f"{where}: signature_expiration "
                                    f"{raw_expiration[:24]!r} is not a Unix time")
            expiration = int(raw_expiration)
        expected = file_signature(req.query.get("path", [""])[0],
                                  "read" if req.method == "GET" else "write",
                                  req.query.get("username", [""])[0],
                                  self._access_token(sandbox_id), expiration)
        if not secrets.compare_digest(signature.encode("utf-8", "surrogateescape"),
                                      expected.encode()):
            return _files_error(401, f"{where}: invalid signature (not this sandbox's, or "
                                "for another path, user, operation or expiration)")
        if expiration is not None and expiration < time.time():
            return _files_error(401, f"{where}: signature is already expired (at "
                                f"{expiration}, now {int(time.time())})")
        return None

    def _download(self, c: Controller, req: api.Request, sandbox_id: str,
                  where: str) -> api.Response:
        path = _path(_query(req, "path", where), where, _files_user(req, where, self._default_user(c, sandbox_id)).home)
        agent = c.agent(sandbox_id)
        with _agent(sandbox_id, "stat"):
            info = agent.stat(path)
        if info.type != "file":
            raise ConnectError("invalid_argument", f"{where}: {path} is a {info.type}, not "
                               "a regular file")

        def produce(write: api.Writer) -> None:
            with agent_errors(sandbox_id, "read"):
                agent.read_file_to(path, _Sink(write))  # type: ignore[arg-type]

        return api.StreamResponse(200, content_type="application/octet-stream",
                                  produce=produce)

    def _upload(self, c: Controller, req: api.Request, sandbox_id: str,
                where: str) -> api.Response:
        """Multipart (one part per file, its filename the path; ``?path=`` names a lone
        file) or ``application/octet-stream`` (the body is the file at ``?path=``).
        Parents are made, as envd does. Streamed to the agent, never held whole."""
        who = _files_user(req, where, self._default_user(c, sandbox_id))
        agent = c.agent(sandbox_id)
        kind = req.headers.get("content-type", "")
        written: list[dict[str, str]] = []
        given = req.query.get("path", [None])[0]
        if kind.split(";")[0].strip().lower() == "multipart/form-data":
            for part in multipart.parts(req, kind, where):
                target = given if given is not None else part.filename
                if not target:
                    raise BadRequest(f"{where}: a part has no filename and there is no "
                                     "?path=")
                path = _path(target, where, who.home)
                with _agent(sandbox_id, "write"):
                    agent.write_file(path, part.chunks(), make_parents=True, user=who.name)
                written.append({"name": posixpath.basename(path), "type": "file",
                                "path": path})
        else:
            if req.headers.get("content-encoding", "identity").lower() != "identity":
                raise BadRequest(f"{where}: compressed uploads are not accepted; send the "
                                 "file as it is")
            path = _path(_query(req, "path", where), where, who.home)
            with _agent(sandbox_id, "write"):
                agent.write_file(path, req.chunks(), make_parents=True, user=who.name)
            written.append({"name": posixpath.basename(path), "type": "file", "path": path})
        if not written:
            raise BadRequest(f"{where}: the upload holds no file")
        return api.Response(200, written)


class _Sink:
    def __init__(self, write: api.Writer) -> None:
        self._write = write

    def write(self, data: bytes) -> int:
        self._write(bytes(data))
        return len(data)


_RPCS: dict[tuple[str, str], tuple[Callable[..., Any], bool]] = {
    ("process.Process", "Start"): (Envd.start, True),
    ("process.Process", "Connect"): (Envd.connect_process, True),
    ("process.Process", "List"): (Envd.list_processes, False),
    ("process.Process", "SendInput"): (Envd.send_input, False),
    ("process.Process", "CloseStdin"): (Envd.close_stdin, False),
    ("process.Process", "SendSignal"): (Envd.send_signal, False),
    ("process.Process", "Update"): (Envd.update, False),
    ("filesystem.Filesystem", "Stat"): (Envd.stat, False),
    ("filesystem.Filesystem", "MakeDir"): (Envd.make_dir, False),
    ("filesystem.Filesystem", "Move"): (Envd.move, False),
    ("filesystem.Filesystem", "ListDir"): (Envd.list_dir, False),
    ("filesystem.Filesystem", "Remove"): (Envd.remove, False),
    ("filesystem.Filesystem", "WatchDir"): (Envd.watch_dir, True),
    ("filesystem.Filesystem", "CreateWatcher"): (Envd.create_watcher, False),
    ("filesystem.Filesystem", "GetWatcherEvents"): (Envd.get_watcher_events, False),
    ("filesystem.Filesystem", "RemoveWatcher"): (Envd.remove_watcher, False),
}
"""Every envd call served, and whether it is a server stream. ``StreamInput`` (a
client stream) is not: the SDKs send stdin with ``SendInput``."""


def is_rpc(path: str) -> bool:
    service, _, method = path.strip("/").partition("/")
    return (service, method) in _RPCS


class _agent:
    """``agent_errors`` for RPCs: the agent's own error codes become Connect codes
    (``exists`` → ALREADY_EXISTS ...), the rest map as the REST routes map them."""

    def __init__(self, sandbox_id: str, op: str) -> None:
        self._sandbox_id = sandbox_id
        self._op = op

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, err: BaseException | None, tb: Any) -> None:
        if err is None or isinstance(err, ConnectError):
            return
        if isinstance(err, AgentTimeout):
            raise ConnectError("deadline_exceeded", f"{self._op} in sandbox "
                               f"{self._sandbox_id}: {err.message}") from err
        if isinstance(err, AgentUnavailable):
            raise ConnectError("unavailable", f"{self._op}: the agent of sandbox "
                               f"{self._sandbox_id} cannot be reached: {err.message}") from err
        if isinstance(err, AgentError) and err.code in _AGENT_CODES:
            raise ConnectError(_AGENT_CODES[err.code], f"{self._op} in sandbox "
                               f"{self._sandbox_id}: {err.message}") from err
        if isinstance(err, GatewayTimeout):
            raise ConnectError("deadline_exceeded", str(err)) from err
        if isinstance(err, AgentError):
            try:
                with agent_errors(self._sandbox_id, self._op):
                    raise err
            except ApiError as mapped:
                raise ConnectError.from_api(mapped) from err


def _error(err: ConnectError, streaming: bool) -> api.Response:
    if not streaming:
        return connect.unary_error(err)
    # A stream's error before its first message still goes in the end-of-stream
    # envelope, with status 200 (the Connect protocol's rule for streams).
    return api.Response(200, connect.end_of_stream(err), content_type=connect.STREAM_TYPE)


def file_signature(path: str, operation: str, user: str, access_token: str,
                   expiration: int | None) -> str:
    """envd's v1 signature of a ``/files`` URL, as the SDKs make it (``get_signature``):
    ``v1_`` and the unpadded base64 of SHA-256 over
    ``path:operation:user:access-token[:expiration]`` (``user`` empty for the default
    user, ``operation`` ``read`` or ``write``)."""
    raw = f"{path}:{operation}:{user}:{access_token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode("utf-8", "surrogateescape")).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


def _files_error(status: int, message: str) -> api.Response:
    return api.Response(status, {"code": status, "message": message})


@dataclasses.dataclass(frozen=True)
class _Who:
    """The envd user a call is made as: ``name`` for the agent (None: root, the
    guest's default) and the home relative paths resolve against."""

    name: str | None
    home: str


_ROOT = _Who(None, GUEST_HOME)


def _user(name: str | None, where: str, default: Callable[[], _Who]) -> _Who:
    """envd's ``user``: none or empty is the default user (``default``: ``user``, as in
    E2B's templates, where the guest has one; see ``Envd._default_user``), ``root`` is
    root; another name must be a user in the guest, which the agent checks
    (``unknown_user``)."""
    if name is None or name == "":
        return default()
    if name == "root":
        return _ROOT
    if len(name) > 32 or not all(c.isalnum() or c in "._-" for c in name) or name[0] == "-":
        raise ConnectError("invalid_argument", f"{where}: the user {name[:40]!r} is not a "
                           "user name")
    return _Who(name, f"{USER_HOMES}/{name}")


def _passwd_home(passwd: bytes, name: str) -> str | None:
    """``name``'s home in an ``/etc/passwd`` (None: no such user)."""
    for line in passwd.decode("utf-8", "replace").splitlines():
        fields = line.split(":")
        if len(fields) >= 7 and fields[0] == name:
            return fields[5] or f"{USER_HOMES}/{name}"
    return None


def _rpc_user(req: api.Request, where: str, default: Callable[[], _Who]) -> _Who:
    """The user of an RPC: the SDK sends ``Authorization: Basic base64(<user>:)``."""
    header = req.headers.get("authorization")
    if header is None:
        return default()
    scheme, _, encoded = header.strip().partition(" ")
    try:
        if scheme.lower() != "basic" or len(encoded) > 256:
            raise ValueError(scheme)
        name, sep, _password = base64.b64decode(encoded.strip(), validate=True).decode(
            "utf-8").partition(":")
        if not sep:
            raise ValueError("no colon")
    except (ValueError, UnicodeDecodeError) as err:
        raise ConnectError("invalid_argument", f"{where}: the Authorization header must be "
                           "'Basic ' and base64 of '<user>:' (how the SDK names the user)"
                           ) from err
    return _user(name, where, default)


def _files_user(req: api.Request, where: str, default: Callable[[], _Who]) -> _Who:
    return _user(req.query.get("username", [None])[0], where, default)


def _path(value: Any, where: str, home: str = GUEST_HOME) -> str:
    if not isinstance(value, str) or not value:
        raise ConnectError("invalid_argument", f"{where}: a path is required")
    if "\0" in value or len(value.encode("utf-8", "surrogateescape")) > MAX_GUEST_PATH:
        raise ConnectError("invalid_argument", f"{where}: the path is not valid (NUL, or "
                           f"over {MAX_GUEST_PATH} bytes)")
    if value.startswith("~/") or value == "~":
        value = home + value[1:]
    return posixpath.normpath(posixpath.join(home, value))


def _query(req: api.Request, name: str, where: str) -> str:
    values = req.query.get(name)
    if not values or not values[0]:
        raise ConnectError("invalid_argument", f"{where}: ?{name}= is required")
    return values[0]


def _command_env(c: Controller, sandbox_id: str, envs: dict[str, str]) -> dict[str, Any]:
    """The sandbox's own ``envs`` (given at spawn) under the command's, as ``/v1``'s
    process routes do, on a daemon with lifecycles (``Controller.command_env``)."""
    command_env = getattr(c, "command_env", None)
    if command_env is None:
        return dict(envs)
    merged: dict[str, Any] = command_env(sandbox_id, envs) or {}
    return merged


def _timeout_ms(req: api.Request) -> int | None:
    raw = req.headers.get("connect-timeout-ms")
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit() and 0 < len(raw) <= 10):
        raise ConnectError("invalid_argument", f"Connect-Timeout-Ms {raw[:20]!r} is not a "
                           "positive integer of at most 10 digits")
    return int(raw)


def _keepalive(req: api.Request) -> float:
    raw = req.headers.get("keepalive-ping-interval", "")
    if raw.isascii() and raw.isdigit() and 0 < int(raw):
        return min(float(raw), KEEPALIVE_SECS)
    return KEEPALIVE_SECS


def _end(end: ProcessEnd) -> dict[str, Any]:
    if end.signal:
        status = f"signal: {_signal_name(end.signal)}"
        exit_code = -1
    else:
        status = f"exit status {end.exit_code}"
        exit_code = end.exit_code
    event: dict[str, Any] = {"exitCode": exit_code, "exited": not end.signal,
                             "status": status}
    if end.timed_out:
        event["error"] = "the process timed out and was killed"
    return event


def _signal_name(number: int) -> str:
    import signal as signals
    try:
        return signals.Signals(number).name.removeprefix("SIG").lower()
    except ValueError:
        return str(number)


def _entry(info: FileInfo, path: str) -> dict[str, Any]:
    kind = _FILE_TYPES.get(info.type, "FILE_TYPE_UNSPECIFIED")
    entry: dict[str, Any] = {
        "name": posixpath.basename(path) or "/", "type": kind, "path": path,
        "size": str(info.size), "mode": info.mode, "permissions":
        stat_module.filemode(info.mode | _TYPE_BITS.get(info.type, 0)),
        "owner": "root" if info.uid in (None, 0) else str(info.uid),
        "group": "root" if info.gid in (None, 0) else str(info.gid),
        "modifiedTime": connect.timestamp(info.mtime),
    }
    if info.type == "symlink" and info.target is not None:
        entry["symlinkTarget"] = info.target
    return entry


_TYPE_BITS = {"file": stat_module.S_IFREG, "dir": stat_module.S_IFDIR,
              "symlink": stat_module.S_IFLNK}


def _fs_event(event: Any) -> dict[str, Any]:
    return {"name": event.name, "type": _EVENT_TYPES.get(event.type,
                                                         "EVENT_TYPE_UNSPECIFIED")}

