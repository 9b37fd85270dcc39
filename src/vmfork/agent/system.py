"""Kernel-facing helpers of the agent: clocks, RNG reseeding, power, and the system
calls PID 1 needs to set up a userland (stdlib only: ``ctypes`` for the calls Python
does not wrap).

Reseeding after a fork. Every child of a snapshot resumes with the parent's kernel
CRNG state and the parent's ``random`` module state, so without help they all draw the
same "random" numbers (TLS keys, UUIDs, temp names). The host sends fresh bytes per
child; ``reseed`` writes them into the input pool with RNDADDENTROPY (which credits
``entropy_bits``) and then forces RNDRESEEDCRNG, because since Linux 5.18 crediting
entropy into an already-initialised pool does not by itself reseed the CRNG that
``getrandom``/``/dev/urandom`` read from (it would happen on the next periodic reseed,
up to a minute later). Python's ``random`` is reseeded from the same bytes mixed with
the (now reseeded) kernel RNG.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import random
import socket
import struct
import time
from typing import Any

from vmfork.agent.conn import Conn
from vmfork.agent.protocol import MAX_PAYLOAD
from vmfork.agent.request import OpError, get_int, os_error


def _ioc(direction: int, kind: str, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (ord(kind) << 8) | nr


_IOC_WRITE = 1
RNDADDENTROPY = _ioc(_IOC_WRITE, "R", 0x03, 8)  # _IOW('R', 0x03, int[2]) = 0x40085203
RNDRESEEDCRNG = _ioc(0, "R", 0x07, 0)  # _IO('R', 0x07) = 0x5207

RB_AUTOBOOT = 0x01234567
RB_POWER_OFF = 0x4321FEDC

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
_IFREQ_FLAGS = struct.Struct("16sh22x")  # struct ifreq: name[IFNAMSIZ] + short flags, 40 bytes

MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8

_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


# -- facts -------------------------------------------------------------------------


def uptime() -> float:
    """Seconds since boot (CLOCK_BOOTTIME: no /proc needed, counts suspended time)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


_boot_id: str | None = None


def boot_id() -> str | None:
    """The kernel's boot id, read once: it is fixed at boot, and a child restored from a
    snapshot runs the same boot of the same kernel. Every ``after_fork`` answers it, and
    opening a text file is one of the costliest things a restored child's Python can do
    (each object it touches is a page the child faults in)."""
    global _boot_id
    if _boot_id is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", "rb") as f:
                _boot_id = f.read().decode("ascii", "replace").strip()
        except OSError:
            return None
    return _boot_id


# -- ops ---------------------------------------------------------------------------


def reseed(req: dict[str, Any], data: bytes) -> dict[str, Any]:
    if not data:
        raise OpError("bad_request", "reseed: the frame payload must carry the random bytes")
    bits = get_int(req, "entropy_bits", 8 * len(data))
    assert bits is not None
    if bits > 8 * len(data):
        raise OpError("bad_request", f"reseed: entropy_bits {bits} is more than the "
                                     f"{8 * len(data)} bits of data sent")
    assert len(data) <= MAX_PAYLOAD
    info = bytearray(struct.pack("ii", bits, len(data)) + data)  # struct rand_pool_info
    try:
        fd = os.open("/dev/random", os.O_WRONLY | os.O_CLOEXEC)
    except OSError as err:
        raise os_error(err, "reseed: open", "/dev/random") from err
    try:
        try:
            fcntl.ioctl(fd, RNDADDENTROPY, info)
        except OSError as err:
            raise os_error(err, "reseed: ioctl RNDADDENTROPY", "/dev/random") from err
        try:
            fcntl.ioctl(fd, RNDRESEEDCRNG)
            kernel_reseeded = True
        except OSError:
            kernel_reseeded = False  # CRNG not initialised yet: the credit above does it
    finally:
        os.close(fd)
    # An int seeds the Mersenne Twister with every bit of it (``init_by_array``); a
    # bytes seed would first be hashed with SHA-512, which in a restored child is
    # OpenSSL's digest machinery faulted in page by page for nothing.
    random.seed(int.from_bytes(data + os.urandom(32), "big"))
    return {"bytes": len(data), "entropy_bits": bits, "kernel_reseeded": kernel_reseeded}


def set_time_op(conn: Conn, req: dict[str, Any]) -> None:
    ns = get_int(req, "ns", None, minimum=1)
    offset = get_int(req, "offset_ns", None, minimum=-(1 << 62))
    if (ns is None) == (offset is None):
        raise OpError("bad_request", "set_time: give 'ns' (nanoseconds since the epoch) or "
                                     "'offset_ns' (a step from the current time), not both")
    previous = time.clock_gettime_ns(time.CLOCK_REALTIME)
    if offset is not None:
        if offset == 0:
            conn.result(previous_ns=previous, ns=previous)
            return
        ns = previous + offset
    assert ns is not None
    conn.result(**set_time(ns, previous))


def set_time(ns: int, previous: int | None = None) -> dict[str, int]:
    """Set CLOCK_REALTIME to ``ns``; ``{previous_ns, ns}``."""
    if previous is None:
        previous = time.clock_gettime_ns(time.CLOCK_REALTIME)
    try:
        time.clock_settime_ns(time.CLOCK_REALTIME, ns)
    except OSError as err:
        raise os_error(err, "set_time: clock_settime(CLOCK_REALTIME)") from err
    return {"previous_ns": previous, "ns": ns}


def power_off(reboot: bool) -> None:
    """sync(2), then reboot(2). Only returns if reboot(2) failed (not PID 1's
    namespace, no CAP_SYS_BOOT)."""
    lib = libc()
    lib.sync()
    _check(lib.reboot(ctypes.c_int(RB_AUTOBOOT if reboot else RB_POWER_OFF)), "reboot(2)")


# -- PID 1 set-up ------------------------------------------------------------------


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    _check(libc().mount(source.encode(), target.encode(), fstype.encode(),
                        ctypes.c_ulong(flags), data.encode() if data else None),
           f"mount -t {fstype} {source} {target}")


def interface_up(name: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        req = _IFREQ_FLAGS.pack(name.encode(), 0)
        flags = _IFREQ_FLAGS.unpack(fcntl.ioctl(sock, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, _IFREQ_FLAGS.pack(name.encode(), flags | IFF_UP))
