"""The VMM process of one sandbox: restore a snapshot, make the guest unique, serve.

Runs as the entry of a process forked by the zygote (``runtime.zygote``), so the
imports are already done and a spawn pays only for the restore. Contract:

* ``args``: ``snapshot_dir`` (holds ``state.bin`` and ``memory.bin``),
  ``run_dir`` (this sandbox's private directory: ``vsock.sock``,
  ``control.sock``, ``console.log``, ``status.json``), ``vm_id``,
  ``mem_mib``/``vcpus`` (checked against the snapshot).
* The guest is restored and resumed, then made a new machine: the host mixes
  fresh bytes into the guest kernel's CRNG and the agent's ``random``, and sets
  its wall clock -- two children of one snapshot must never share random
  streams or a stale clock.
* ``status.json`` is written atomically at each stage (``restored``, ``ready``
  with timings, or ``failed`` with the reason); the spawner reads it.
* ``netns``/``net_tap`` (optional): the child's network namespace, entered before
  anything else, and the tap in it that its virtio-net device attaches to. A
  restored guest with a network device is told it was forked (``net_refresh``:
  inherited connections aborted, neighbours flushed) once it answers.
* ``control.sock`` takes JSON-lines requests: ``status``, ``pause``,
  ``resume``, ``snapshot {memory_path, state_path, resume}``, ``exits``, ``stop``.
* The process exits when the guest stops (status 0 for a clean stop, 3 when the
  guest died: panic, triple fault, KVM error -- the reason is in status.json and
  the console log), or on SIGTERM/SIGKILL from the spawner.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from vmfork.agent.client import AgentClient, AgentTimeout, AgentUnavailable, vsock_uds_connector
from vmfork.agent.protocol import AGENT_PORT
from vmfork.runtime.network import enter_netns
from vmfork.vmm.machine import Machine, MachineConfig
from vmfork.vmm.stateformat import encode_state, read_state_file, write_file_atomic
from vmfork.vmm.vmstate import MachineState

log = logging.getLogger(__name__)

RESEED_BYTES = 64
READY_TIMEOUT = 120.0
CONNECT_TIMEOUT = 20.0   # per connection: a guest starved of CPU answers slowly
EXIT_GUEST_DIED = 3


def _write_status(run_dir: Path, status: dict[str, Any]) -> None:
    write_file_atomic(str(run_dir / "status.json"), json.dumps(status).encode())


def make_unique(agent: AgentClient, timeout: float = READY_TIMEOUT) -> dict[str, float]:
    """Reseed the guest and set its clock; returns timings in seconds.

    Each step opens its own connection; a connection the guest could not take
    yet (``AgentUnavailable``: a starved guest, its vsock still resetting) is
    retried until ``timeout``.
    """
    started = time.monotonic()
    deadline = started + timeout
    agent.wait_until_ready(timeout)
    connected = time.monotonic()
    for step in (lambda: agent.reseed(os.urandom(RESEED_BYTES)), agent.sync_clock):
        while True:
            try:
                step()
                break
            except (AgentUnavailable, AgentTimeout):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    return {"agent_ready": connected - started, "reseed_and_clock": time.monotonic() - connected}


def restore(snapshot_dir: str, run_dir: Path, vm_id: str,
            net_tap: str | None = None) -> tuple[Machine, MachineState]:
    state = read_state_file(os.path.join(snapshot_dir, "state.bin"), MachineState)
    config = MachineConfig(
        restore_state=state, memory_file=os.path.join(snapshot_dir, "memory.bin"),
        mem_mib=state.mem_size >> 20, vcpus=len(state.vcpus),
        vsock_uds=str(run_dir / "vsock.sock") if state.vsock is not None else None,
        rng=state.rng is not None, guest_cid=state.guest_cid,
        console_log=str(run_dir / "console.log"), vm_id=vm_id, memfd=False,
        net_tap=net_tap)
    return Machine(config), state


class ControlServer:
    """JSON-lines control socket; one thread, requests handled in order."""

    def __init__(self, machine: Machine, path: str, on_stop: threading.Event) -> None:
        self.machine = machine
        self.on_stop = on_stop
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.bind(path)
        self.sock.listen(8)
        self._thread = threading.Thread(target=self._serve, name="control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        buffers: dict[socket.socket, bytes] = {}
        while not self.on_stop.is_set():
            for key, _ in sel.select(0.5):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self.sock:
                    conn, _ = self.sock.accept()
                    sel.register(conn, selectors.EVENT_READ)
                    buffers[conn] = b""
                    continue
                data = sock.recv(65536)
                if not data:
                    sel.unregister(sock)
                    buffers.pop(sock, None)
                    sock.close()
                    continue
                buffers[sock] += data
                while b"\n" in buffers[sock]:
                    line, buffers[sock] = buffers[sock].split(b"\n", 1)
                    sock.sendall(json.dumps(self._handle(line)).encode() + b"\n")

    def _handle(self, line: bytes) -> dict[str, Any]:
        try:
            req = json.loads(line)
            op = req.get("op")
            m = self.machine
            if op == "status":
                exit_ = m.exit
                return {"ok": True, "paused": m.paused,
                        "exit": None if exit_ is None else exit_.reason}
            if op == "pause":
                m.pause()
                return {"ok": True}
            if op == "resume":
                m.resume()
                return {"ok": True}
            if op == "exits":
                return {"ok": True, "profile": m.exit_profile()}
            if op == "snapshot":
                state, timings = m.snapshot(req["memory_path"], resume=req.get("resume", True))
                write_file_atomic(req["state_path"], encode_state(state))
                return {"ok": True, "timings": timings}
            if op == "stop":
                self.on_stop.set()
                return {"ok": True}
            return {"ok": False, "error": f"unknown op {op!r}"}
        except Exception as err:  # reported to the caller, never fatal to the VMM
            return {"ok": False, "error": f"{type(err).__name__}: {err}"}

    def close(self) -> None:
        self.on_stop.set()
        self._thread.join(2)
        self.sock.close()


def main(args: dict[str, Any]) -> int:
    started = time.monotonic()
    run_dir = Path(args["run_dir"])
    vm_id = str(args["vm_id"])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        if args.get("netns"):
            enter_netns(str(args["netns"]))  # before any thread: they inherit it
        machine, state = restore(args["snapshot_dir"], run_dir, vm_id, args.get("net_tap"))
    except Exception as err:
        _write_status(run_dir, {"state": "failed", "reason": f"restore: {err}"})
        return 1
    with machine:
        machine.start()
        restored = time.monotonic() - started
        _write_status(run_dir, {"state": "restored", "pid": os.getpid(), "restore_s": restored})
        control = ControlServer(machine, str(run_dir / "control.sock"), stop)
        try:
            agent = AgentClient(vsock_uds_connector(str(run_dir / "vsock.sock"), AGENT_PORT,
                                                    timeout=CONNECT_TIMEOUT))
            unique = make_unique(agent, float(args.get("ready_timeout", READY_TIMEOUT)))
            if state.net is not None:
                refreshed = time.monotonic()
                while True:  # retried like make_unique's steps: a starved guest answers late
                    try:
                        agent.net_refresh()
                        break
                    except (AgentUnavailable, AgentTimeout):
                        if time.monotonic() - refreshed > READY_TIMEOUT:
                            raise
                        time.sleep(0.05)
                unique["net_refresh"] = time.monotonic() - refreshed
        except Exception as err:
            exit_ = machine.exit
            reason = f"guest not ready: {err}" + (f" ({exit_.reason})" if exit_ else "")
            _write_status(run_dir, {"state": "failed", "reason": reason,
                                    "console_tail": machine.serial.tail_text()})
            control.close()
            return EXIT_GUEST_DIED
        _write_status(run_dir, {"state": "ready", "pid": os.getpid(), "restore_s": restored,
                                "ready_s": time.monotonic() - started, **unique})
        while not stop.is_set():
            exit_ = machine.wait(0.2)
            if exit_ is not None:
                _write_status(run_dir, {"state": "exited", "reason": exit_.reason,
                                        "detail": exit_.detail, "panicked": exit_.panicked,
                                        "console_tail": exit_.console_tail})
                control.close()
                return 0 if exit_.clean else EXIT_GUEST_DIED
        control.close()
    return 0
