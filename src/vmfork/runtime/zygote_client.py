"""Talking to the zygote: ``ZygoteClient`` (one connection) and ``start_zygote``.

Synchronous and stdlib-only. A client holds one connection and sends one request
at a time; use one client per thread. If a reply does not come within the
client's timeout the connection is dropped (a late reply would otherwise be read
as the answer to the next request) and the next call reconnects.
"""

from __future__ import annotations

import builtins
import json
import os
import signal as signal_mod
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from vmfork.runtime.zygote_protocol import (
    MAX_LINE,
    ChildInfo,
    ExitEvent,
    SpawnItem,
    SpawnManyResult,
    ZygoteError,
    ZygoteUnavailable,
    encode,
)

# glibc keeps an exited thread's stack for the process's next thread (up to 40 MiB of
# them). In the zygote that cache is memory a lone child pays for: its prefork's
# warm-up restore runs an I/O thread whose stack, ~1.4 MiB dirtied, goes into the
# cache; a native child's own I/O thread then starts on that inherited block, and the
# pages of it the zygote writes again after the fork become the child's (220 KiB of a
# lone child's own, measured: design notes, "A zygote that caches no thread stack").
# With no cache, each thread of the zygote and of a child gets a stack of its own and
# an exited thread's is unmapped. glibc reads its tunables once, at start-up, so the
# zygote is started with it.
NO_STACK_CACHE = "glibc.pthread.stack_cache_size=0"


def with_no_stack_cache(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``NO_STACK_CACHE`` added to its ``GLIBC_TUNABLES`` (kept otherwise)."""
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":")
                if t and not t.startswith("glibc.pthread.stack_cache_size=")]
    return {**env, "GLIBC_TUNABLES": ":".join([*tunables, NO_STACK_CACHE])}


class ZygoteClient:
    def __init__(self, socket_path: str | os.PathLike[str], timeout: float = 30.0) -> None:
        """``timeout`` (seconds) bounds each request; ``wait`` takes its own."""
        self.socket_path = os.fspath(socket_path)
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._reader: IO[bytes] | None = None

    def _connect(self) -> tuple[socket.socket, IO[bytes]]:
        if self._sock is None or self._reader is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.socket_path)
            except OSError as err:
                sock.close()
                raise ZygoteUnavailable(f"no zygote at {self.socket_path}: {err.strerror} "
                                        "(start one with start_zygote or python -m "
                                        "vmfork.runtime.zygote --socket PATH)",
                                        op="connect") from err
            self._sock, self._reader = sock, sock.makefile("rb")
        return self._sock, self._reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._reader = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def request(self, op: str, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one request and return its (successful) reply; errors raise ZygoteError."""
        sock, reader = self._connect()
        sock.settimeout(self.timeout if timeout is None else timeout)
        try:
            sock.sendall(encode({"op": op, **fields}))
            line = reader.readline(MAX_LINE)
        except TimeoutError as err:
            self.close()
            raise ZygoteError(f"{op}: no reply from the zygote at {self.socket_path} within "
                              f"{sock.gettimeout()} s", op=op, type="Timeout") from err
        except OSError as err:
            self.close()
            raise ZygoteUnavailable(f"{op}: connection to the zygote at {self.socket_path} "
                                    f"broke: {err}", op=op) from err
        if not line:
            self.close()
            raise ZygoteUnavailable(f"{op}: the zygote at {self.socket_path} closed the "
                                    "connection (it exited?)", op=op)
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            error = reply.get("error", {})
            raise ZygoteError(error.get("message", "unknown error"), op=op,
                              type=error.get("type", "ZygoteError"))
        return reply

    def ping(self) -> dict[str, Any]:
        return self.request("ping")

    def spawn(self, entry: str, args: dict[str, Any] | None = None, *, vm_id: str,
              memory_limit_mib: int | None = None,
              cgroup_parent: str | None = None,
              jail: dict[str, Any] | None = None) -> ChildInfo:
        """Fork one child running ``entry(args)``; returns once it is forked."""
        item = SpawnItem(vm_id, args or {}, memory_limit_mib, cgroup_parent, jail)
        return ChildInfo.from_json(self.request("spawn", entry=entry, **item.to_json())["child"])

    def spawn_many(self, entry: str, items: Iterable[SpawnItem],
                   timeout: float | None = None) -> SpawnManyResult:
        """Fork one child per item, back to back; the children run in parallel.
        ``timeout`` (seconds) replaces the client's for this request: forking
        many children on a loaded host can take longer than one request should."""
        reply = self.request("spawn_many", timeout=timeout, entry=entry,
                             items=[i.to_json() for i in items])
        cursor = reply.get("events_next")
        return SpawnManyResult([ChildInfo.from_json(c) for c in reply["children"]],
                               [(f["vm_id"], f["error"]) for f in reply["failed"]],
                               cursor if isinstance(cursor, int) else None)

    def kill(self, vm_id: str, signal: int = signal_mod.SIGKILL) -> None:
        """Signal the child and its process group; its exit arrives as an event."""
        self.request("kill", vm_id=vm_id, signal=int(signal))

    def wait(self, vm_id: str, timeout: float = 30.0) -> ExitEvent:
        """Block until the child has been reaped (and cleaned up); its exit event."""
        return ExitEvent.from_json(self.request("wait", timeout=timeout, vm_id=vm_id)["event"])

    def kill_and_wait(self, vm_id: str, signal: int = signal_mod.SIGKILL,
                      timeout: float = 30.0) -> ExitEvent:
        self.kill(vm_id, signal)
        return self.wait(vm_id, timeout)

    def list(self) -> list[ChildInfo]:
        return [ChildInfo.from_json(c) for c in self.request("list")["children"]]

    def events(self, since: int = 0) -> tuple[builtins.list[ExitEvent], int]:
        """Exit events newer than ``since``, and the cursor to pass next time."""
        reply = self.request("events", since=since)
        return [ExitEvent.from_json(e) for e in reply["events"]], int(reply["next"])

    def lease(self, seconds: float | None = None) -> dict[str, Any]:
        """Hold the zygote's lease on this connection (see ``runtime.zygote``); with
        ``seconds``, also set how long the zygote outlives its last holder."""
        fields = {} if seconds is None else {"seconds": seconds}
        return self.request("lease", **fields)

    def shutdown(self) -> int:
        """Kill every child, clean up, and stop the zygote. Returns how many were killed."""
        return int(self.request("shutdown")["children_killed"])


class ZygoteProcess:
    """A zygote started by ``start_zygote``; ``close()`` shuts it down and waits."""

    def __init__(self, proc: subprocess.Popen[bytes], socket_path: str, info: dict[str, Any]):
        self.proc = proc
        self.socket_path = socket_path
        self.info = info

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, timeout: float = 30.0) -> ZygoteClient:
        return ZygoteClient(self.socket_path, timeout)

    def close(self, timeout: float = 10.0) -> int:
        """Shut down (children are killed), wait up to ``timeout`` s, then SIGKILL."""
        if self.proc.poll() is None:
            try:
                with self.client(timeout) as c:
                    c.shutdown()
            except ZygoteError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> Self:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def start_zygote(socket_path: str | os.PathLike[str], preload: Sequence[str] = (), *,
                 stderr: IO[bytes] | int | None = None, die_with_parent: bool = True,
                 timeout: float = 120.0, env: dict[str, str] | None = None,
                 lease_s: float | None = None,
                 entries_modules: Sequence[str] = ()) -> ZygoteProcess:
    """Start ``python -m vmfork.runtime.zygote`` and wait until it answers ``ping``.

    ``preload`` names modules that must import (the defaults are always tried);
    ``entries_modules`` names modules whose ``ZYGOTE_ENTRIES`` the zygote registers
    besides the VMM's (it runs no other entry).
    With ``die_with_parent`` the zygote (and so every child) dies with this process.
    Without it the zygote runs in a session of its own (a terminal's Ctrl-C does not
    reach it) and outlives this process; pass ``lease_s`` so that it still stops
    once no client has held its lease for that long.
    ``timeout`` (seconds) is generous: its imports take ~1 s natively but took over
    30 s over the emulated test host's 9p on a loaded machine; a zygote that exits
    is reported at once, whatever the timeout.
    """
    path = os.fspath(socket_path)
    src = str(Path(__file__).resolve().parents[2])
    child_env = with_no_stack_cache(dict(os.environ if env is None else env))
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in [src, child_env.get("PYTHONPATH", "")] if p)
    cmd = [sys.executable, "-m", "vmfork.runtime.zygote", "--socket", path]
    for name in preload:
        cmd += ["--preload", name]
    for name in entries_modules:
        cmd += ["--entries-module", name]
    if die_with_parent:
        cmd += ["--parent-pid", str(os.getpid())]
    if lease_s is not None:
        cmd += ["--lease-s", repr(float(lease_s))]
    # A detached zygote must not hold the caller's terminal or working directory.
    detached = not die_with_parent
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL if detached else None, stderr=stderr,
                            env=child_env, cwd="/" if detached else None,
                            start_new_session=detached)
    deadline = time.monotonic() + timeout
    client = ZygoteClient(path, timeout=max(1.0, timeout))
    try:
        while True:
            if proc.poll() is not None:
                raise ZygoteUnavailable(f"the zygote exited with status {proc.returncode} "
                                        "before answering (see its stderr)", op="start")
            try:
                info = client.ping()
            except ZygoteUnavailable:
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    raise ZygoteUnavailable(f"the zygote did not answer on {path} within "
                                            f"{timeout} s", op="start") from None
                time.sleep(0.01)
                continue
            if info.get("pid") != proc.pid:
                proc.kill()
                proc.wait()
                raise ZygoteUnavailable(f"another zygote (pid {info.get('pid')}) already "
                                        f"serves {path}", op="start")
            return ZygoteProcess(proc, path, info)
    finally:
        client.close()
