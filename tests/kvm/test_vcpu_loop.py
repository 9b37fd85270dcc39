"""The vCPU loop (``vmfork._core.VcpuLoop`` behind ``vcpu.Vcpu``): what the rest of
tests/kvm (exits, buses, pause/kick, shutdown, all on it) does not cover."""

from __future__ import annotations

import pytest

from vmfork.vmm.machine import Machine, MachineConfig
from vmfork.vmm.native import CORE_BUILT

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
