"""Fuzz targets over the parsers that read what a guest or a pack author wrote.

Each target takes the fuzzer's bytes, feeds them to the real parser the way its
input arrives, and lets through only the errors that parser documents for bad input
(anything else, or a hang, is a finding). ``SEEDS`` give each one a valid input to
start from, so that the fuzzer mutates structure rather than discovering it. Run by
``tests/fuzz/run.py`` under atheris (coverage-guided), a few seconds each.
"""

from __future__ import annotations

import hashlib
import io
import json
import socket
import struct
import sys
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path

# The device harness lives with the unit tests (a guest driver over real transports).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from vmfork.agent.client import AgentClient, AgentError  # noqa: E402
from vmfork.agent.protocol import ProtocolError, encode_frame  # noqa: E402
from vmfork.image import oci  # noqa: E402
from vmfork.image.errors import ImageBuildError, ImageError  # noqa: E402
from vmfork.image.tarstream import TarFormatError, TarStream  # noqa: E402
from vmfork.vmm.devices.virtio.queue import Virtqueue  # noqa: E402
from vmfork.vmm.errors import VirtqueueError  # noqa: E402
from vmfork.vmm.memory import GuestMemory  # noqa: E402

Target = Callable[[bytes], None]

# -- virtqueue descriptor chains ----------------------------------------------------------
# The input is the guest's rings: a descriptor table at 0, the available ring at 0x1000,
# buffers after; the native walk (virtq.rs, through GuestRam) pops and copies every chain
# it is offered, as a device's server does.
_QSIZE = 64
_MEMORY = GuestMemory.anonymous(1 << 20)


def virtqueue(data: bytes) -> None:
    _MEMORY.write(0, bytes(0x3000))
    _MEMORY.write(0, data[:0x3000])
    ram = _MEMORY.native
    assert ram is not None, "the native core is not built"
    queue = Virtqueue(_QSIZE)
    queue.desc_table, queue.avail_ring, queue.used_ring = 0, 0x1000, 0x2000
    queue.ready = True
    # EVENT_IDX as the input's last byte says, so the empty pop's avail_event is driven too.
    event_idx = bool(data[-1] & 1) if data else False
    try:
        queue.validate(_MEMORY)
        next_avail = next_used = 0
        for _ in range(_QSIZE + 1):
            chain = ram.pop(_QSIZE, 0, 0x1000, next_avail, 0x2000, event_idx)
            if chain is None:
                break
            next_avail = (next_avail + 1) & 0xFFFF
            head, readable, writable = chain
            readable_len = sum(n for _, n in readable)
            writable_len = sum(n for _, n in writable)
            assert len(ram.read(readable, 1 << 16)) == min(readable_len, 1 << 16)
            want = min(writable_len, 64)
            assert ram.write(writable, b"x" * want) == want
            next_used = ram.add_used(_QSIZE, 0x2000, next_used, head, 0)
    except VirtqueueError:
        pass


def _virtqueue_seed() -> bytes:
    mem = bytearray(0x3000)
    struct.pack_into("<QIHH", mem, 0, 0x4000, 16, 1, 1)       # readable, NEXT -> 1
    struct.pack_into("<QIHH", mem, 16, 0x5000, 32, 2, 0)      # writable, last
    struct.pack_into("<HHH", mem, 0x1000, 0, 1, 0)            # avail: idx 1, ring[0] = 0
    return bytes(mem)


# -- vsock packets ------------------------------------------------------------------------
# Through the real device and its virtio-mmio transport, the guest half of the unit
# tests' harness posting each input as one TX packet (header + payload).
_vsock_env = None


def _vsock() -> object:
    global _vsock_env
    if _vsock_env is None:
        from test_virtio_vsock import VsockEnv

        from vmfork.vmm.eventloop import new_event_loop
        loop = new_event_loop("fuzz-vsock")
        loop.start()
        _vsock_env = VsockEnv(loop)
    return _vsock_env


def vsock_packet(data: bytes) -> None:
    from vmfork.vmm.devices.virtio import vsock
    from vmfork.vmm.devices.virtio.device import run_on_loop

    env = _vsock()
    while len(env.tx.free) < 1:   # type: ignore[attr-defined]
        env.tx.take_used()        # type: ignore[attr-defined]
    env.tx.post(readable=[data[:64 * 1024]])   # type: ignore[attr-defined]
    env.driver.notify(vsock.TX_QUEUE)          # type: ignore[attr-defined]
    run_on_loop(env.loop, lambda: None)        # type: ignore[attr-defined]
    env.rx.take_used()                          # type: ignore[attr-defined]
    errors = env.loop.errors                   # type: ignore[attr-defined]
    if errors:
        raise AssertionError(f"an exception escaped the vsock device: {errors!r}")


def _vsock_seed() -> bytes:
    from test_virtio_vsock import pkt

    from vmfork.vmm.devices.virtio.vsock import Op
    return pkt(Op.REQUEST, 1024, 52).pack()


# -- agent replies ------------------------------------------------------------------------
# A hostile agent's whole reply to one call, read by the daemon's agent client.
def agent_reply(data: bytes) -> None:
    host, guest = socket.socketpair()

    def agent() -> None:
        try:
            guest.recv(1 << 16)
            guest.sendall(data)
        except OSError:
            pass
        finally:
            guest.close()

    thread = threading.Thread(target=agent)
    thread.start()
    client = AgentClient(lambda: host, io_timeout=5.0)
    try:
        selector = data[:1]
        if selector < b"\x40":
            client.stat("/x")
        elif selector < b"\x80":
            client.list_dir_bounded("/", 100)
        elif selector < b"\xc0":
            client.ping()
        else:
            client.read_file("/x")
    except (AgentError, ProtocolError):
        pass
    finally:
        host.close()
        thread.join()


def _agent_seed() -> bytes:
    return encode_frame({"type": "result", "ok": True, "path": "/x", "size": 3,
                         "mode": 0o644, "kind": "file", "mtime": 1.0})


# -- pack tar headers ---------------------------------------------------------------------
def pack_tar(data: bytes) -> None:
    stream = TarStream(io.BytesIO(data), max_header_bytes=64 << 10, max_name_bytes=1024)
    try:
        for _ in range(64):
            member = stream.next()
            if member is None:
                break
            stream.read(1 << 16)
    except TarFormatError:
        pass


def _tar_seed() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("kernel/" + "n" * 120)
        info.size = 5
        info.pax_headers = {"comment": "seed"}
        tar.addfile(info, io.BytesIO(b"hello"))
    return out.getvalue()


# -- OCI manifests, indexes and configs ---------------------------------------------------
# The input is the document a reference names (as a registry or a layout's blob would
# serve it), resolved through indexes to a manifest and its config as an import does;
# every blob it names by digest is served when it is the input itself.
class _FuzzSource(oci._Source):
    where = "fuzz"

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.digest = "sha256:" + hashlib.sha256(data).hexdigest()

    def top(self, limits: oci.Limits) -> tuple[list[oci.Descriptor] | None, bytes | None, str]:
        return None, self.data, ""

    def _open_blob(self, desc: oci.Descriptor) -> io.BytesIO:
        if desc.digest != self.digest:
            raise ImageBuildError("oci-verify", f"fuzz: no blob {desc.digest}")
        return io.BytesIO(self.data)


def oci_manifest(data: bytes) -> None:
    try:
        _FuzzSource(data).image(oci.Limits())
    except ImageError:
        pass
    try:
        oci._parse_config(data, "fuzz")
    except ImageError:
        pass


def _oci_seed() -> bytes:
    digest = "sha256:" + "a" * 64
    return json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": digest, "size": 10},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": digest, "size": 20}],
        "config_": {"Env": ["A=1"], "Cmd": ["/bin/sh"], "WorkingDir": "/"},
        "architecture": "amd64", "os": "linux"}).encode()


TARGETS: dict[str, Target] = {
    "virtqueue": virtqueue, "vsock_packet": vsock_packet, "agent_reply": agent_reply,
    "pack_tar": pack_tar, "oci_manifest": oci_manifest,
}
SEEDS: dict[str, Callable[[], bytes]] = {
    "virtqueue": _virtqueue_seed, "vsock_packet": _vsock_seed, "agent_reply": _agent_seed,
    "pack_tar": _tar_seed, "oci_manifest": _oci_seed,
}
