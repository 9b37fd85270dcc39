"""``Controller``: one method per REST call, with forkd's names and signatures
(REFERENCE-forkd.md, SDKs), so a forkd script runs by changing its import.

Results are the decoded JSON (dicts and lists), as forkd's SDK returns them; the
image calls, which forkd lacks, return typed ``ImageInfo`` records. Any non-2xx
answer raises ``ControllerError(status, body, url)``; a daemon that does not
answer raises ``ControllerError`` with status 0 and says how to start one.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import ssl
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import httpx

from vmfork.client.errors import ControllerError, ImageBuildFailed
from vmfork.client.images import FAILED, READY, ImageInfo
from vmfork.client.transport import SEND_BLOCK, Endpoint, tls_context

USER_AGENT = "vmfork-python"
STREAM_IDLE_TIMEOUT = 60.0
"""Seconds a process-output or watch stream may stay silent: the daemon sends a
heartbeat every 15 s, so a longer silence is a daemon that went away."""


def default_url() -> str:
    """``$VMFORK_URL``, ``$FORKD_URL``, else the Unix socket ``vmfork serve`` uses by
    default (``$VMFORK_STATE_DIR``/``$XDG_STATE_HOME/vmfork``/``~/.local/state/vmfork``
    + ``/api.sock``)."""
    for name in ("VMFORK_URL", "FORKD_URL"):
        if os.environ.get(name):
            return os.environ[name]
    state = os.environ.get("VMFORK_STATE_DIR")
    if not state:
        base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                ".local", "state")
        state = os.path.join(base, "vmfork")
    return "unix://" + os.path.join(os.path.abspath(state), "api.sock")



Egress = str | Sequence[str] | Mapping[str, Any]
# A volume: "SRC:GUEST_PATH[:ro|:rw]" (forkd's --volume), or {"source", "guest_path",
# "mode"} for a source whose name holds a colon. SRC is a path on the daemon's host.
Volume = str | Mapping[str, Any]
"""An egress policy: ``"allow"``, ``"deny"``, a list of allowed CIDRs and domain names,
or the API's object ``{"mode": ..., "cidrs": [...], "domains": [...]}``."""


def egress_policy(egress: Egress) -> dict[str, Any]:
    """The API's egress object for ``egress``; a list's entries that parse as IPv4
    networks are CIDRs, the others domain names (resolved by the daemon when set)."""
    if isinstance(egress, str):
        if egress in ("allow", "deny"):
            return {"mode": egress}
        egress = [e for e in egress.split(",") if e.strip()]
    if isinstance(egress, Mapping):
        return dict(egress)
    cidrs, domains = [], []
    for entry in (e.strip() for e in egress):
        try:
            ipaddress.IPv4Network(entry, strict=False)
            cidrs.append(entry)
        except ValueError:
            domains.append(entry)
    return {"mode": "allowlist", "cidrs": cidrs, "domains": domains}

Copy = str | tuple[str, str] | Mapping[str, str]
"""A file or directory to copy into an image: ``"SRC:DST"``, ``(src, dst)`` or
``{"src": ..., "dst": ...}``; ``src`` is a path on the daemon's host."""


def _copy_entry(entry: Copy) -> dict[str, str]:
    if isinstance(entry, str):
        src, sep, dst = entry.rpartition(":")   # the last ':' as the CLI: SRC may hold one
        if not sep:
            raise ValueError(f"copy entry {entry!r} is not SRC:DST")
    elif isinstance(entry, Mapping):
        src, dst = entry["src"], entry["dst"]
    else:
        src, dst = entry
    # A relative source means the caller's directory; the daemon has no such notion, so
    # it is made absolute here (right when the daemon runs on this host, its usual
    # place; a remote daemon needs paths of its own host anyway).
    return {"src": os.path.abspath(os.fspath(src)), "dst": dst}


class Controller:
    def __init__(self, base_url: str | None = None, token: str | None = None,
                 timeout: float = 60, ca_file: str | None = None) -> None:
        """``timeout`` (seconds) bounds each request; exec waits its own timeout on top.
        ``ca_file`` (default ``$VMFORK_CA_FILE``): the PEM certificate(s) an ``https://``
        daemon is verified against instead of the system's roots."""
        self.base_url = base_url or default_url()
        self.endpoint = Endpoint.parse(self.base_url)
        self.token = token if token is not None else (
            os.environ.get("VMFORK_TOKEN") or os.environ.get("FORKD_TOKEN"))
        self.timeout = timeout
        self.ca_file = ca_file or os.environ.get("VMFORK_CA_FILE") or None
        # Made once: loading the roots costs milliseconds, every request would pay it.
        self._tls = tls_context(self.ca_file) if self.endpoint.scheme == "https" else None
        self._http = self.endpoint.client(timeout, self._tls)

    def __repr__(self) -> str:
        return f"Controller({self.base_url!r})"

    def close(self) -> None:
        """Close the pooled connections (streams still open keep theirs)."""
        self._http.close()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def _url(self, path: str, query: Mapping[str, Any] | None = None) -> str:
        full = self.endpoint.prefix + path
        if query:
            full += "?" + urllib.parse.urlencode(
                {k: (str(v).lower() if isinstance(v, bool) else v)
                 for k, v in query.items() if v is not None})
        return full

    def _open(self, method: str, path: str, *, query: Mapping[str, Any] | None = None,
              body: bytes | BinaryIO | Iterable[bytes] | None = None,
              content_type: str | None = None, length: int | None = None,
              timeout: float | None = None) -> httpx.Response:
        """Send a request and return its response with the body unread (the caller
        reads it and closes the response); a status of 400 or more raises."""
        url = self._url(path, query)
        headers = self._headers(content_type)
        if length is not None:
            headers["Content-Length"] = str(length)
        request = self._http.build_request(
            method, url, content=_blocks(body), headers=headers,
            timeout=httpx.Timeout(self.timeout if timeout is None else timeout))
        try:
            response = self._http.send(request, stream=True)
        except httpx.TransportError as err:
            untrusted = _cause(err, ssl.SSLCertVerificationError)
            if untrusted is not None:
                raise ControllerError(0, f"the vmfork daemon at {self.base_url} has a "
                                      "certificate this client does not trust: "
                                      f"{untrusted.verify_message} (give its CA certificate "
                                      "with ca_file= or VMFORK_CA_FILE)",
                                      self.base_url + url) from err
            raise ControllerError(0, f"cannot reach the vmfork daemon at {self.base_url}: "
                                  f"{_describe(err)} (start it with `vmfork serve`, or set "
                                  "VMFORK_URL)", self.base_url + url) from err
        if response.status_code >= 400:
            try:
                raw = response.read()
            except httpx.HTTPError:
                raw = b""
            finally:
                response.close()
            try:
                decoded: Any = json.loads(raw)
            except ValueError:
                decoded = raw.decode("utf-8", "replace")
            raise ControllerError(response.status_code, decoded, self.base_url + url)
        return response

    def _call(self, method: str, path: str, payload: Mapping[str, Any] | None = None, *,
              query: Mapping[str, Any] | None = None, timeout: float | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        response = self._open(method, path, query=query, body=data,
                              content_type="application/json" if data is not None else None,
                              timeout=timeout)
        raw = _read_all(response, self.base_url + path)
        return json.loads(raw) if raw else None

    # -- service --------------------------------------------------------------------

    def healthz(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/healthz")
        return result

    def version(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/version")
        return result

    def metrics(self) -> str:
        response = self._open("GET", "/metrics")
        return _read_all(response, self.base_url + "/metrics").decode()

    # -- snapshots ------------------------------------------------------------------

    def list_snapshots(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/v1/snapshots")
        return result

    def create_snapshot(self, tag: str, *, image: str = "default", mem_mib: int = 256,
                        vcpus: int = 1, warm_code: str | None = None,
                        warm_cmd: str | None = None, network: bool = False,
                        timeout: float = 600,
                        egress: Egress | None = None, kernel: str | None = None,
                        rootfs: str | None = None,
                        volumes: Sequence[Volume] | None = None,
                        volume_slots: int | None = None) -> dict[str, Any]:
        """Boot ``image``, warm it, snapshot it as ``tag``; blocks until ready (``timeout``
        in seconds). ``network``: the parent gets a network device, connected through a
        namespace of its own (so the warm-up can download, under ``egress``, default
        allow), and sandboxes of the snapshot can be spawned with ``per_child_netns``.
        ``kernel`` + ``rootfs`` (forkd's body, paths on the daemon's host): boot that
        vmlinux with that ext4/squashfs/erofs image as the read-only root instead of
        ``image``. ``volumes``: read-only volumes (``"SRC:GUEST_PATH[:ro]"``, SRC a
        directory or image file on the daemon's host) mounted before the warm-up and in
        every child; ``volume_slots``: empty slots for volumes given at spawn (daemon
        default 4)."""
        body: dict[str, Any] = {"tag": tag, "image": image, "mem_mib": mem_mib, "vcpus": vcpus}
        if kernel is not None or rootfs is not None:
            body.update(kernel=kernel, rootfs=rootfs)
        if volumes:
            body["volumes"] = list(volumes)
        if volume_slots is not None:
            body["volume_slots"] = volume_slots
        if network:
            body["network"] = True
        if egress is not None:
            body["egress"] = egress_policy(egress)
        if warm_code is not None:
            body["warm_code"] = warm_code
        if warm_cmd is not None:
            body["warm_cmd"] = warm_cmd
        result: dict[str, Any] = self._call("POST", "/v1/snapshots", body, timeout=timeout)
        return result

    def snapshot_info(self, tag: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/v1/snapshots/{_seg(tag)}/info")
        return result

    def compact_snapshot(self, tag: str, to: str, timeout: float = 3600) -> dict[str, Any]:
        """Publish ``to``: snapshot ``tag``'s whole chain as one flat snapshot."""
        result: dict[str, Any] = self._call("POST", f"/v1/snapshots/{_seg(tag)}/compact",
                                            {"to": to}, timeout=timeout)
        return result

    # Snapshots to and from OCI registries (docs/distribution.md): background jobs.

    def push_snapshot(self, tag: str, ref: str, *, sign_key: str | None = None,
                      auth_file: str | None = None, insecure: bool = False,
                      with_image: bool = True) -> dict[str, Any]:
        """Start pushing ``tag``'s chain to ``ref``; returns the job (``wait_transfer``).
        Key and auth file paths are on the daemon's host."""
        body = {"ref": ref, "sign_key": sign_key, "auth_file": auth_file,
                "insecure": insecure, "with_image": with_image}
        result: dict[str, Any] = self._call("POST", f"/v1/snapshots/{_seg(tag)}/push", body)
        return result

    def pull_snapshot(self, ref: str, *, tag: str | None = None, force: bool = False,
                      verify_key: str | None = None, auth_file: str | None = None,
                      insecure: bool = False) -> dict[str, Any]:
        """Start pulling the chain ``ref`` names into the daemon's store; returns the job."""
        body = {"ref": ref, "tag": tag, "force": force, "verify_key": verify_key,
                "auth_file": auth_file, "insecure": insecure}
        result: dict[str, Any] = self._call("POST", "/v1/snapshots/pull", body)
        return result

    def get_transfer(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/v1/transfers/{_seg(job_id)}")
        return result

    def list_transfers(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/v1/transfers")
        return result

    def wait_transfer(self, job_id: str, timeout: float = 3600,
                      poll: float = 0.2) -> dict[str, Any]:
        """The job once it is done or failed (raises ``TimeoutError`` after ``timeout``)."""
        import time
        deadline = time.monotonic() + timeout
        while True:
            job = self.get_transfer(job_id)
            if job["status"] != "running":
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"transfer {job_id} still running after {timeout:.0f} s")
            time.sleep(poll)

    def delete_snapshot(self, tag: str, cascade: bool = False, force: bool = False) -> None:
        query = {k: True for k, v in (("cascade", cascade), ("force", force)) if v}
        self._call("DELETE", f"/v1/snapshots/{_seg(tag)}", query=query)

    # -- sandboxes ------------------------------------------------------------------

    def spawn_sandboxes(self, snapshot_tag: str, n: int = 1, per_child_netns: bool = False,
                        memory_limit_mib: int | None = None, prewarm: bool = False,
                        live_fork: bool = False, hugepages: bool = False,
                        timeout: float | None = None,
                        egress: Egress | None = None,
                        volumes: Sequence[Volume] | None = None, *,
                        timeout_secs: float | None = None, on_timeout: str = "kill",
                        metadata: Mapping[str, str] | None = None,
                        envs: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """``per_child_netns``: each sandbox gets a network of its own (the snapshot must
        have been created with ``network=True``); ``egress`` is its policy (see
        ``egress_policy``; default allow). ``volumes``: ``"SRC:GUEST_PATH[:ro|:rw]"``
        strings (or ``{source, guest_path, mode}``), attached in each sandbox's empty
        volume slots; a read-write one needs ``n=1`` and is 409 while another holds it.
        ``timeout`` is this HTTP call's; ``timeout_secs`` is the sandbox's lifetime
        (then it is killed, or paused with ``on_timeout="pause"``; default: none).
        ``metadata``: labels to list it by; ``envs``: every command's environment."""
        body: dict[str, Any] = {
            "snapshot_tag": snapshot_tag, "n": n, "per_child_netns": per_child_netns,
            "memory_limit_mib": memory_limit_mib, "prewarm": prewarm,
            "live_fork": live_fork, "hugepages": hugepages}
        if volumes:
            body["volumes"] = list(volumes)
        if egress is not None:
            body["egress"] = egress_policy(egress)
        # Lifecycle fields only when used: a forkd daemon knows none of them.
        if timeout_secs is not None:
            body["timeout_secs"] = timeout_secs
        if on_timeout != "kill":
            body["on_timeout"] = on_timeout
        if metadata:
            body["metadata"] = dict(metadata)
        if envs:
            body["envs"] = dict(envs)
        result: list[dict[str, Any]] = self._call(
            "POST", "/v1/sandboxes", body, timeout=timeout or max(self.timeout, 300.0))
        return result

    def list_sandboxes(self, metadata: Mapping[str, str] | None = None,
                       state: Sequence[str] | str | None = None) -> list[dict[str, Any]]:
        """All sandboxes, or those whose metadata has every pair of ``metadata`` and
        whose status is (one of) ``state``."""
        query: dict[str, Any] = {}
        if metadata:
            query["metadata"] = urllib.parse.urlencode(dict(metadata))
        if state:
            query["state"] = state if isinstance(state, str) else ",".join(state)
        result: list[dict[str, Any]] = self._call("GET", "/v1/sandboxes", query=query or None)
        return result

    def set_timeout(self, sandbox_id: str, timeout_secs: float | None) -> dict[str, Any]:
        """The sandbox ends ``timeout_secs`` from now (None: never); its info."""
        result: dict[str, Any] = self._call(
            "POST", f"/v1/sandboxes/{_seg(sandbox_id)}/timeout", {"timeout_secs": timeout_secs})
        return result

    def pause_sandbox(self, sandbox_id: str, timeout: float | None = None) -> dict[str, Any]:
        """Snapshot the sandbox and stop its VMM, keeping its id; its info (paused)."""
        result: dict[str, Any] = self._call(
            "POST", f"/v1/sandboxes/{_seg(sandbox_id)}/pause", {},
            timeout=timeout or max(self.timeout, 600.0))
        return result

    def resume_sandbox(self, sandbox_id: str, timeout_secs: float | None = None,
                       timeout: float | None = None) -> dict[str, Any]:
        """Run a paused sandbox again, same id; ``timeout_secs``: its new lifetime
        (default: the one it had)."""
        result: dict[str, Any] = self._call(
            "POST", f"/v1/sandboxes/{_seg(sandbox_id)}/resume",
            {"timeout_secs": timeout_secs}, timeout=timeout or max(self.timeout, 300.0))
        return result

    def connect_sandbox(self, sandbox_id: str, timeout_secs: float | None = None,
                        timeout: float | None = None) -> dict[str, Any]:
        """E2B's connect: resumes a paused sandbox; ``timeout_secs`` only extends."""
        result: dict[str, Any] = self._call(
            "POST", f"/v1/sandboxes/{_seg(sandbox_id)}/connect",
            {"timeout_secs": timeout_secs}, timeout=timeout or max(self.timeout, 300.0))
        return result

    def sandbox_metrics(self, sandbox_id: str) -> dict[str, Any]:
        """CPU seconds, memory (cgroup, RSS, private dirty) and disk use of a sandbox."""
        result: dict[str, Any] = self._call("GET",
                                            f"/v1/sandboxes/{_seg(sandbox_id)}/metrics")
        return result

    def get_sandbox(self, sandbox_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/v1/sandboxes/{_seg(sandbox_id)}")
        return result

    def kill_sandbox(self, sandbox_id: str) -> None:
        self._call("DELETE", f"/v1/sandboxes/{_seg(sandbox_id)}")

    # -- networks of sandboxes (vmfork's extension) ---------------------------------

    def list_ports(self, sandbox_id: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call(
            "GET", f"/v1/sandboxes/{_seg(sandbox_id)}/ports")
        return result

    def expose_port(self, sandbox_id: str, guest_port: int, host_port: int = 0,
                    protocol: str = "tcp") -> dict[str, Any]:
        """Publish ``guest_port`` on ``host_port`` of every host address (0: a free one);
        returns ``{"protocol", "host_port", "guest_port", "address"}``."""
        result: dict[str, Any] = self._call(
            "POST", f"/v1/sandboxes/{_seg(sandbox_id)}/ports",
            {"guest_port": guest_port, "host_port": host_port, "protocol": protocol})
        return result

    def unexpose_port(self, sandbox_id: str, host_port: int, protocol: str = "tcp") -> None:
        self._call("DELETE", f"/v1/sandboxes/{_seg(sandbox_id)}/ports/{int(host_port)}",
                   query={"protocol": protocol})

    def set_egress(self, sandbox_id: str, egress: Egress) -> dict[str, Any]:
        """Replace the sandbox's egress policy; returns its network description."""
        result: dict[str, Any] = self._call(
            "PUT", f"/v1/sandboxes/{_seg(sandbox_id)}/egress", egress_policy(egress))
        return result

    def ping_sandbox(self, sandbox_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/v1/sandboxes/{_seg(sandbox_id)}/ping")
        return result

    def branch_sandbox(self, sandbox_id: str, tag: str | None = None, diff: bool = False,
                       measure_diff: bool = False, mode: str | None = None, wait: bool = True,
                       *, live: bool = False, parent_tag: str | None = None,
                       settle_free_pages: bool = False,
                       timeout: float | None = None) -> dict[str, Any]:
        """Snapshot a running sandbox (``mode`` full, diff or live; forkd's ``diff``/``live``
        booleans are the legacy spelling). With ``wait=False`` the answer comes at once
        with status ``writing``; poll ``list_snapshots`` until ``ready`` or ``failed``.
        ``settle_free_pages`` (a diff after a build): wait seconds first for the guest to
        report what it freed, so the layer leaves it out."""
        body: dict[str, Any] = {"wait": wait}
        if tag is not None:
            body["tag"] = tag
        if mode is not None:
            body["mode"] = mode
        if diff:
            body["diff"] = True
        if live:
            body["live"] = True
        if measure_diff:
            body["measure_diff"] = True
        if parent_tag is not None:
            body["parent_tag"] = parent_tag
        if settle_free_pages:
            body["settle_free_pages"] = True
        result: dict[str, Any] = self._call(
            "POST", f"/v1/sandboxes/{_seg(sandbox_id)}/branch", body,
            timeout=timeout or max(self.timeout, 3600.0))
        return result

    def exec_command(self, sandbox_id: str, args: list[str], timeout_secs: float = 30, *,
                     env: Mapping[str, str | None] | None = None, cwd: str | None = None,
                     stdin: str | None = None) -> dict[str, Any]:
        """``{stdout, stderr, exit_code, …}``; a timeout raises ``ControllerError`` 504
        whose ``body`` holds ``timed_out`` and the output so far."""
        body = _exec_body(args, timeout_secs, env, cwd, stdin)
        result: dict[str, Any] = self._call("POST", f"/v1/sandboxes/{_seg(sandbox_id)}/exec",
                                            body, timeout=timeout_secs + self.timeout)
        return result

    def exec_stream(self, sandbox_id: str, args: list[str], timeout_secs: float = 30, *,
                    env: Mapping[str, str | None] | None = None, cwd: str | None = None,
                    stdin: str | None = None) -> ExecStream:
        """Server-sent events as ``(event, data)``: ``stdout``/``stderr`` chunks, then
        ``exit`` or ``error``. Iterate it; ``close()`` (from any thread) hangs up, and
        the guest kills the command when it next writes or at its timeout."""
        body = json.dumps(_exec_body(args, timeout_secs, env, cwd, stdin)).encode()
        response = self._open("POST", f"/v1/sandboxes/{_seg(sandbox_id)}/exec/stream",
                              body=body, content_type="application/json",
                              timeout=timeout_secs + self.timeout)
        return ExecStream(response)

    def eval_code(self, sandbox_id: str, code: str,
                  timeout_secs: float | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"code": code}
        if timeout_secs is not None:
            body["timeout_secs"] = timeout_secs
        result: dict[str, Any] = self._call(
            "POST", f"/v1/sandboxes/{_seg(sandbox_id)}/eval", body,
            timeout=(timeout_secs or 0) + self.timeout)
        return result

    # -- guest images (vmfork's extension) ------------------------------------------

    def build_image(self, name: str, *, base: str | None = None, apt: Iterable[str] = (),
                    pip: Iterable[str] = (), requirements: str | os.PathLike[str] | None = None,
                    pip_index_url: str | None = None, pip_find_links: Iterable[str] = (),
                    pip_no_index: bool = False, npm: Iterable[str] = (),
                    copy: Iterable[Copy] = (), env: Mapping[str, str] | None = None,
                    workdir: str | None = None, user: str | None = None,
                    disk_format: str | None = None, run: Iterable[str] = (),
                    egress: str | None = None, run_mem_mib: int | None = None,
                    wait: bool = True, timeout: float = 3600) -> ImageInfo:
        """Have the daemon build image ``name`` (as ``vmfork image build``): ``base``
        another image (default: the default one), Debian packages ``apt``, wheels ``pip``
        (and ``requirements``: a requirements file's text, or a path to one read here),
        ``npm`` packages, ``copy`` host files in, ``env``/``workdir``/``user`` for exec;
        then ``run``: shell commands, each run in a build VM booted from the image so far
        with a network under ``egress`` (``run_mem_mib`` of memory), its changes the next
        layer (a failing command fails the build with its stderr).

        ``wait=True`` blocks until it is ready (``timeout`` in seconds; a failed step
        raises ``ControllerError`` 422 naming it); ``wait=False`` returns the job
        (``status`` ``building``) at once: follow it with ``wait_image``."""
        body: dict[str, Any] = {"name": name, "wait": wait}
        if base is not None:
            body["from"] = base
        for key, items in (("apt", apt), ("pip", pip), ("pip_find_links", pip_find_links),
                           ("npm", npm), ("run", run)):
            if isinstance(items, str):
                raise TypeError(f"{key} takes a list of strings, not one string")
            if items:
                body[key] = list(items)
        if requirements is not None:
            body["requirements"] = (requirements if isinstance(requirements, str) else
                                    Path(requirements).read_text(encoding="utf-8"))
        if copy:
            body["copy"] = [_copy_entry(c) for c in copy]
        if env:
            body["env"] = dict(env)
        for key, value in (("pip_index_url", pip_index_url), ("workdir", workdir),
                           ("user", user), ("disk_format", disk_format),
                           ("egress", egress), ("run_mem_mib", run_mem_mib)):
            if value is not None:
                body[key] = value
        if pip_no_index:
            body["pip_no_index"] = True
        return ImageInfo.from_json(self._call("POST", "/v1/images", body, timeout=timeout))

    def import_image(self, name: str, ref: str, *, insecure: bool = False, wait: bool = True,
                     timeout: float = 3600) -> ImageInfo:
        """Import the OCI image ``ref`` (``HOST/REPO:TAG``, an OCI layout directory,
        ``oci-archive:PATH`` or ``docker-archive:PATH`` on the daemon's host) as image
        ``name``; ``wait`` and ``timeout`` as for ``build_image``."""
        body = {"name": name, "ref": ref, "insecure": insecure, "wait": wait}
        return ImageInfo.from_json(self._call("POST", "/v1/images/import", body,
                                              timeout=timeout))

    def list_images(self) -> list[ImageInfo]:
        """Built images and builds in flight or failed, by name."""
        return [ImageInfo.from_json(i) for i in self._call("GET", "/v1/images")]

    def get_image(self, name: str) -> ImageInfo:
        return ImageInfo.from_json(self._call("GET", f"/v1/images/{_seg(name)}"))

    def delete_image(self, name: str) -> None:
        """Remove image ``name``; 409 (``body["snapshots"]``) while snapshots use it."""
        self._call("DELETE", f"/v1/images/{_seg(name)}")

    def wait_image(self, name: str, timeout: float = 3600, poll: float = 1.0) -> ImageInfo:
        """Poll image ``name`` until its build is over (``timeout``, ``poll`` in seconds):
        the ready image, or ``ImageBuildFailed`` carrying the failed job."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.get_image(name)
            if info.status == READY:
                return info
            if info.status == FAILED:
                raise ImageBuildFailed(info, self.base_url + f"/v1/images/{_seg(name)}")
            if time.monotonic() + poll > deadline:
                last = info.progress[-1].message if info.progress else "no progress yet"
                raise TimeoutError(f"image {name!r} still {info.status} after {timeout:g} s "
                                   f"(last: {last}); pass a larger timeout to wait_image")
            time.sleep(poll)

    # -- workspaces -----------------------------------------------------------------

    def list_workspaces(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/v1/workspaces")
        return result

    def create_workspace(self, name: str, snapshot_tag: str, per_child_netns: bool = False,
                         memory_limit_mib: int | None = None,
                         volumes: Sequence[Volume] | None = None) -> dict[str, Any]:
        """``volumes`` as for ``spawn_sandboxes``; a read-write one stays held by the
        workspace while it is suspended and is reattached when it resumes."""
        body: dict[str, Any] = {"name": name, "snapshot_tag": snapshot_tag,
                                "per_child_netns": per_child_netns,
                                "memory_limit_mib": memory_limit_mib}
        if volumes:
            body["volumes"] = list(volumes)
        result: dict[str, Any] = self._call("POST", "/v1/workspaces", body,
                                            timeout=max(self.timeout, 300.0))
        return result

    def get_workspace(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/v1/workspaces/{_seg(name)}")
        return result

    def delete_workspace(self, name: str) -> None:
        self._call("DELETE", f"/v1/workspaces/{_seg(name)}")

    def suspend_workspace(self, name: str, diff: bool = False) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/v1/workspaces/{_seg(name)}/suspend",
                                            {"diff": diff}, timeout=max(self.timeout, 3600.0))
        return result

    def resume_workspace(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/v1/workspaces/{_seg(name)}/resume",
                                            timeout=max(self.timeout, 300.0))
        return result

    # -- files ----------------------------------------------------------------------

    def read_file_to(self, sandbox_id: str, path: str, out: BinaryIO) -> int:
        """Stream a guest file into ``out``; returns the number of bytes."""
        response = self._open("GET", f"/v1/sandboxes/{_seg(sandbox_id)}/files",
                              query={"path": path})
        total = 0
        try:
            for chunk in response.iter_raw(1 << 16):
                out.write(chunk)
                total += len(chunk)
        except httpx.HTTPError as err:
            raise ControllerError(502, f"read {path}: the stream was cut after {total} bytes "
                                  f"({_describe(err)})", self.base_url) from err
        finally:
            response.close()
        expected = response.headers.get("X-File-Size")
        if expected is not None and int(expected) != total:
            raise ControllerError(502, f"read {path}: got {total} of {expected} bytes (the "
                                  "stream was cut; see the daemon log)", self.base_url)
        return total

    def write_file(self, sandbox_id: str, path: str, data: bytes | BinaryIO, *,
                   length: int | None = None, mode: int = 0o644,
                   make_parents: bool = False) -> dict[str, Any]:
        """Replace a guest file with ``data`` (bytes, or a binary file streamed with
        ``length`` bytes; default: its size from ``fstat``)."""
        if isinstance(data, (bytes, bytearray, memoryview)):
            length = len(data)
        elif length is None:
            length = os.fstat(data.fileno()).st_size - data.tell()
        response = self._open("PUT", f"/v1/sandboxes/{_seg(sandbox_id)}/files",
                              query={"path": path, "mode": mode, "make_parents": make_parents},
                              body=data, content_type="application/octet-stream",
                              length=length)
        result: dict[str, Any] = json.loads(_read_all(response, self.base_url))
        return result

    def list_files(self, sandbox_id: str, path: str) -> list[dict[str, Any]]:
        result: dict[str, Any] = self._call("GET", f"/v1/sandboxes/{_seg(sandbox_id)}/files/list",
                                            query={"path": path})
        entries: list[dict[str, Any]] = result["entries"]
        return entries

    def stat_file(self, sandbox_id: str, path: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/v1/sandboxes/{_seg(sandbox_id)}/files/stat",
                                            query={"path": path})
        return result

    def remove_file(self, sandbox_id: str, path: str, *, recursive: bool = False,
                    missing_ok: bool = False) -> None:
        self._call("DELETE", f"/v1/sandboxes/{_seg(sandbox_id)}/files",
                   query={"path": path, "recursive": recursive, "missing_ok": missing_ok})


    # -- background processes and more file calls ------------------------------------

    def start_process(self, sandbox_id: str, cmd: str | Sequence[str], *,
                      env: Mapping[str, str | None] | None = None, cwd: str | None = None,
                      stdin: bool = False, timeout_secs: float | None = None,
                      pty: tuple[int, int] | None = None,
                      tag: str | None = None) -> dict[str, Any]:
        """Start a background process (a shell string or an argv list) that outlives
        the call: ``{pid, pty, sandbox_id}``. ``stdin`` keeps its stdin open for
        ``send_process_stdin``; ``pty=(rows, cols)`` runs it on a terminal."""
        body: dict[str, Any] = {"stdin": stdin, "timeout_secs": timeout_secs, "env": env,
                                "cwd": cwd, "tag": tag,
                                "pty": None if pty is None else {"rows": pty[0],
                                                                 "cols": pty[1]}}
        if isinstance(cmd, str):
            body["cmd"] = cmd
        else:
            body["args"] = list(cmd)
        result: dict[str, Any] = self._call(
            "POST", f"/v1/sandboxes/{_seg(sandbox_id)}/processes", body)
        return result

    def list_processes(self, sandbox_id: str) -> list[dict[str, Any]]:
        result: dict[str, Any] = self._call("GET",
                                            f"/v1/sandboxes/{_seg(sandbox_id)}/processes")
        processes: list[dict[str, Any]] = result["processes"]
        return processes

    def process_output(self, sandbox_id: str, pid: int, *, offset: int = 0,
                       encoding: str = "text") -> ExecStream:
        """Server-sent events as ``(event, data)``: ``stdout``/``stderr``/``pty``
        chunks ``{offset, data}`` (``data_b64`` with ``encoding="base64"``) from
        ``offset``, then ``exit`` or ``error``. ``close()`` detaches."""
        response = self._open("GET", f"/v1/sandboxes/{_seg(sandbox_id)}/processes/{pid}/output",
                              query={"offset": offset, "encoding": encoding},
                              timeout=max(self.timeout, STREAM_IDLE_TIMEOUT))
        return ExecStream(response)

    def send_process_stdin(self, sandbox_id: str, pid: int, data: bytes, *,
                           eof: bool = False) -> int:
        response = self._open("POST", f"/v1/sandboxes/{_seg(sandbox_id)}/processes/{pid}/stdin",
                              query={"eof": eof}, body=bytes(data),
                              content_type="application/octet-stream", length=len(data))
        result: dict[str, Any] = json.loads(_read_all(response, self.base_url))
        return int(result["written"])

    def signal_process(self, sandbox_id: str, pid: int, signal: str | int = "SIGKILL", *,
                       group: bool = True) -> bool:
        result: dict[str, Any] = self._call(
            "POST", f"/v1/sandboxes/{_seg(sandbox_id)}/processes/{pid}/signal",
            {"signal": signal, "group": group})
        return bool(result["delivered"])

    def resize_process_pty(self, sandbox_id: str, pid: int, rows: int, cols: int) -> None:
        self._call("POST", f"/v1/sandboxes/{_seg(sandbox_id)}/processes/{pid}/resize",
                   {"rows": rows, "cols": cols})

    def rename_file(self, sandbox_id: str, path: str, new_path: str, *,
                    overwrite: bool = False) -> dict[str, Any]:
        result: dict[str, Any] = self._call(
            "POST", f"/v1/sandboxes/{_seg(sandbox_id)}/files/rename",
            {"path": path, "new_path": new_path, "overwrite": overwrite})
        return result

    def make_dir(self, sandbox_id: str, path: str, *, parents: bool = False,
                 mode: int = 0o755) -> bool:
        """Make a guest directory; returns False if ``parents`` found it already there."""
        result: dict[str, Any] = self._call(
            "POST", f"/v1/sandboxes/{_seg(sandbox_id)}/files/mkdir",
            {"path": path, "parents": parents, "mode": mode})
        return bool(result["created"])

    def file_exists(self, sandbox_id: str, path: str) -> bool:
        result: dict[str, Any] = self._call(
            "GET", f"/v1/sandboxes/{_seg(sandbox_id)}/files/exists", query={"path": path})
        return bool(result["exists"])

    def watch_dir(self, sandbox_id: str, path: str, *, recursive: bool = False) -> ExecStream:
        """Server-sent events as ``(event, data)``: ``watching``, then ``events``
        (``{events: [{name, type, is_dir}], overflow}``), ``end`` if the directory
        goes. ``close()`` stops the watch."""
        response = self._open("GET", f"/v1/sandboxes/{_seg(sandbox_id)}/files/watch",
                              query={"path": path, "recursive": recursive},
                              timeout=max(self.timeout, STREAM_IDLE_TIMEOUT))
        return ExecStream(response)


class ExecStream:
    """The events of one streamed exec (see ``Controller.exec_stream``)."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        try:
            event = "message"
            data: list[str] = []
            try:
                for text in self._response.iter_lines():
                    if not text:
                        if data:
                            yield event, json.loads("\n".join(data))
                        event, data = "message", []
                    elif text.startswith("event:"):
                        event = text[6:].strip()
                    elif text.startswith("data:"):
                        data.append(text[5:].strip())
            except (httpx.HTTPError, httpx.StreamError, OSError, ValueError):
                return  # cut, or closed by ``close``
        finally:
            self._response.close()

    def close(self) -> None:
        """Hang up, from any thread: a reader blocked in another thread wakes."""
        stream = self._response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        else:
            self._response.close()


def _blocks(body: bytes | BinaryIO | Iterable[bytes] | None) -> bytes | Iterator[bytes] | None:
    """A request body as httpx takes it: a file is read in ``SEND_BLOCK`` pieces (httpx
    would iterate a binary file by lines)."""
    if body is None or isinstance(body, bytes):
        return body
    if isinstance(body, (bytearray, memoryview)):
        return bytes(body)
    if hasattr(body, "read"):
        reader: BinaryIO = body  # type: ignore[assignment]
        return iter(lambda: reader.read(SEND_BLOCK), b"")
    return iter(body)


def _read_all(response: httpx.Response, url: str) -> bytes:
    try:
        return response.read()
    except httpx.HTTPError as err:
        raise ControllerError(502, f"the daemon's answer was cut: {_describe(err)}",
                              url) from err
    finally:
        response.close()


E = TypeVar("E", bound=BaseException)


def _cause(err: BaseException, kind: type[E]) -> E | None:
    """The first exception of ``kind`` among ``err``'s causes and contexts (httpx wraps
    the ``ssl`` and ``OSError`` it met)."""
    seen: BaseException | None = err
    for _ in range(8):  # chains are short; a cycle must not loop
        if seen is None:
            return None
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _describe(err: httpx.HTTPError) -> str:
    """What went wrong in words: the OS error underneath if there is one."""
    os_error = _cause(err, OSError)
    return str(os_error) if os_error is not None else (str(err) or type(err).__name__)


def _seg(value: str) -> str:
    """One path segment, percent-encoded (the daemon validates it)."""
    return urllib.parse.quote(value, safe="")


def _exec_body(args: list[str], timeout_secs: float, env: Mapping[str, str | None] | None,
               cwd: str | None, stdin: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"args": list(args), "timeout_secs": timeout_secs}
    if env is not None:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    if stdin is not None:
        body["stdin"] = stdin
    return body


