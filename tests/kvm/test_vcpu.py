"""vCPU set-up, exits, the buses, pause/resume/kick, and how a VM ends."""

from __future__ import annotations

import time

from tests.kvm.tinyguest import Script, run_script, script_machine, wait_until
from vmfork.vmm.machine import Machine, MachineConfig

# out 'H','i','\n' to COM1, then pulse the i8042 reset line
SERIAL_HELLO = bytes.fromhex("66baf803b048eeb069eeb00aeeb0fee664f4ebfd")


def test_serial_output_and_reset_end_the_vm(tmp_path: object) -> None:
    log = f"{tmp_path}/console.log"
    with Machine(MachineConfig(payload=SERIAL_HELLO, mem_mib=32, rng=False,
                               console_log=log)) as m:
        m.start()
        exit_ = m.wait(10)
        assert exit_ is not None
        assert exit_.reason == "reset" and exit_.clean
        assert exit_.console_tail == "Hi"
        assert m.exit_profile()["by_reason"]["io"] == 4
    assert open(log).read() == "Hi\n"


def test_unmapped_port_reads_all_ones_and_is_counted() -> None:
    exit_, rec, m = run_script(Script().in8(0x99).in8(0x3F8 + 5))
    with m:
        assert exit_.reason == "reset"
        assert rec.writes[0] == b"\xff"          # unmapped port
        assert rec.writes[1][0] & 0x60 == 0x60   # COM1 LSR: transmitter empty
        assert m.pio_bus.unmapped_reads == 1


def test_unmapped_mmio_reads_all_ones_and_drops_writes() -> None:
    hole = 0xD0F0_0000  # in the MMIO hole, no device there
    exit_, rec, m = run_script(Script().write32(hole, 5).read32(hole))
    with m:
        assert exit_.reason == "reset"
        assert rec.u32s() == [0xFFFF_FFFF]
        assert m.mmio_bus.unmapped_writes == 1 and m.mmio_bus.unmapped_reads == 1


def test_guest_memory_round_trip_through_script() -> None:
    exit_, rec, m = run_script(Script().write32(0x300000, 0xDEADBEEF).read32(0x300000))
    with m:
        assert rec.u32s() == [0xDEADBEEF]
        assert m.memory.read_u32(0x300000) == 0xDEADBEEF


def test_pause_stops_the_guest_and_resume_continues_it() -> None:
    counter = 0x300000
    m, _ = script_machine(Script().count_forever(counter))
    with m:
        m.start()
        assert wait_until(lambda: m.memory.read_u64(counter) > 1000)
        m.pause()
        assert m.paused
        frozen = m.memory.read_u64(counter)
        time.sleep(0.2)
        assert m.memory.read_u64(counter) == frozen
        m.resume()
        assert wait_until(lambda: m.memory.read_u64(counter) > frozen)
        # Repeated pauses always land (pause raises if a kick is lost for 5 s).
        for _ in range(20):
            m.pause()
            assert m.paused
            m.resume()
        exit_ = m.stop()
        assert exit_.reason == "stopped"


def test_smp_machine_pauses_and_stops_every_vcpu() -> None:
    counter = 0x300000
    m, _ = script_machine(Script().count_forever(counter), vcpus=4)
    with m:
        m.start()
        assert wait_until(lambda: m.memory.read_u64(counter) > 0)
        m.pause()   # the APs wait for INIT/SIPI inside KVM_RUN: kicked out too
        assert m.paused
        m.resume()
        assert m.stop().reason == "stopped"
        for vcpu in m.vcpus:
            vcpu.join(5)
            assert vcpu.state.value == "stopped"


def test_triple_fault_ends_the_vm_with_shutdown() -> None:
    with Machine(MachineConfig(payload=bytes.fromhex("0f0b"), mem_mib=32, rng=False)) as m:
        m.start()   # ud2 with an empty IDT: #UD -> #DF -> triple fault
        exit_ = m.wait(10)
        assert exit_ is not None and exit_.reason == "shutdown" and not exit_.clean
