"""The vCPU loop (``vmfork._core.VcpuLoop`` behind ``vcpu.Vcpu``): what the rest of
tests/kvm (exits, buses, pause/kick, shutdown, all on it) does not cover."""

from __future__ import annotations

import ctypes
import errno
import gc
import mmap
import os
import select

import pytest

from vmfork.kvm import api
from vmfork.vmm import vmstate
from vmfork.vmm.machine import Machine, MachineConfig
from vmfork.vmm.native import CORE_BUILT
from vmfork.vmm.x86 import layout as L

if CORE_BUILT:
    from vmfork import _core

pytestmark = pytest.mark.skipif(not CORE_BUILT, reason="the native core is not built "
                                "(scripts/lib.sh setup_native)")

# xor edx,edx; 1: in al,dx; inc dx; jnz 1b; mov al,0xfe; out 0x64,al (i8042 reset); hlt
EVERY_PORT_THEN_RESET = bytes.fromhex("31d2" "ec" "66ffc2" "75fa" "b0fe" "e664" "f4")
# mov al,1; out 0xe9,al; hlt
OUT_E9 = bytes.fromhex("b001e6e9f4")
MAX_IO_KEYS = 4096


class Broken:
    def read(self, offset: int, size: int) -> bytes:
        return b"\xff" * size

    def write(self, offset: int, data: bytes) -> None:
        raise RuntimeError("device failure")


def test_machines_run_their_vcpus_natively() -> None:
    from vmfork.vmm.vcpu import Vcpu
    with Machine(MachineConfig(payload=OUT_E9, mem_mib=32, rng=False)) as m:
        assert all(isinstance(v, Vcpu) for v in m.vcpus)


def test_a_bus_handler_that_raises_ends_the_vm_as_a_vmm_error() -> None:
    with Machine(MachineConfig(payload=OUT_E9, mem_mib=32, rng=False)) as m:
        m.pio_bus.register(0xE9, 1, Broken())
        m.start()
        exit_ = m.wait(30)
        assert exit_ is not None and exit_.reason == "vmm_error"
        assert "device failure" in exit_.detail
        error = m.vcpus[0].error
        assert isinstance(error, RuntimeError) and str(error) == "device failure"


def test_per_address_io_counters_are_bounded() -> None:
    with Machine(MachineConfig(payload=EVERY_PORT_THEN_RESET, mem_mib=32, rng=False)) as m:
        m.start()
        exit_ = m.wait(300)
        assert exit_ is not None and exit_.reason == "reset"
        io = m.vcpus[0].io_exits
        assert len(io) == MAX_IO_KEYS + 1
        # Ports served inside KVM (PIT, PICs, ...) never exit; every other one did,
        # the first MAX_IO_KEYS by address, the rest under one key.
        assert io[("other", 0)] > 60_000 - MAX_IO_KEYS
        assert sum(io.values()) == m.vcpus[0].exits["io"]


# in al,0xe9; inc al; jnz 1f; out 0xe9,al; 1: mov al,0xfe; out 0x64,al (i8042 reset); hlt
# The write to 0xe9 happens only if the unclaimed read gave all ones.
READ_E9_THEN_RESET = bytes.fromhex("e4e9" "fec0" "7502" "e6e9" "b0fe" "e664" "f4")


def test_a_vcpu_runs_with_no_python_host() -> None:
    """A loop with the native host (no Python object: no buses, no on_exit) on the
    machine's VM core: an unclaimed port reads as all ones, writes are dropped and
    counted, the console's i8042 resets the guest, and the exit is recorded with the
    eventfd made readable."""
    with Machine(MachineConfig(payload=READ_E9_THEN_RESET, mem_mib=32, rng=False)) as m:
        loop = _core.VcpuLoop.native(m.core, 0, m.serial.console)
        assert loop.exit is None and loop.exit_fd is not None
        assert not select.select([loop.exit_fd], [], [], 0)[0]
        loop.start()
        assert select.select([loop.exit_fd], [], [], 300)[0], "no exit within 300 s"
        loop.join(30)
        assert loop.state == "stopped"
        assert loop.exit == ("reset", "the guest pulsed the i8042 reset line")
        assert loop.unclaimed() == {"pio_reads": 1, "pio_writes": 1, "mmio_reads": 0,
                                    "mmio_writes": 0}
        assert loop.error is None
        loop.close()


def test_a_running_vcpu_keeps_the_vm_core_open_after_close() -> None:
    """Closing the core lets go of its descriptors, but a loop built on it holds them
    until its thread ends: a vCPU never runs on a closed (or reused) descriptor."""
    with Machine(MachineConfig(payload=READ_E9_THEN_RESET, mem_mib=32, rng=False)) as m:
        loop = _core.VcpuLoop.native(m.core, 0, m.serial.console)
        loop.start(paused=True)
        assert loop.pause(30)
        m.core.close()
        with pytest.raises(RuntimeError, match="closed"):
            m.core.vcpu_fd(0)
        loop.resume()
        assert select.select([loop.exit_fd], [], [], 300)[0], "no exit within 300 s"
        assert loop.exit is not None and loop.exit[0] == "reset"
        loop.close()


def test_the_vm_core_names_the_ioctl_that_failed() -> None:
    """A failed step of the one native assembly keeps the op name and errno the Python
    wrappers gave (``KvmError``, which Machine raises)."""
    kvm = api.open_kvm()
    ram = mmap.mmap(-1, 2 << 20)
    try:
        host = ctypes.addressof(ctypes.c_char.from_buffer(ram))
        with pytest.raises(_core.IoctlError) as caught:   # not page aligned
            _core.VmCore(kvm, [(0, 2 << 20, host + 1)], tss_addr=L.TSS_ADDR,
                         identity_map_addr=L.IDENTITY_MAP_ADDR, vcpus=[0])
        err = vmstate.kvm_error(caught.value)
        assert (err.op, err.errno) == ("KVM_SET_USER_MEMORY_REGION", errno.EINVAL)
        with pytest.raises(_core.IoctlError) as caught:   # one vCPU id twice
            _core.VmCore(kvm, [(0, 2 << 20, host)], tss_addr=L.TSS_ADDR,
                         identity_map_addr=L.IDENTITY_MAP_ADDR, vcpus=[0, 0])
        err = vmstate.kvm_error(caught.value)
        assert (err.op, err.errno) == ("KVM_CREATE_VCPU", errno.EEXIST)
        assert str(err) == f"[Errno {errno.EEXIST}] KVM_CREATE_VCPU: File exists (vcpu0)"
        core = _core.VmCore(kvm, [(0, 2 << 20, host)], tss_addr=L.TSS_ADDR,
                            identity_map_addr=L.IDENTITY_MAP_ADDR, vcpus=[1, 0])
        assert core.vcpu_count == 2 and core.restore_report is None
        assert len({core.vm_fd, core.vcpu_fd(0), core.vcpu_fd(1)}) == 3
        with pytest.raises(ValueError, match="no vCPU at position 2"):
            core.vcpu_fd(2)
        core.close()
    finally:
        os.close(kvm)
        # The mapping outlives every core made on it (closed above, or never made).
        gc.collect()
        ram.close()
