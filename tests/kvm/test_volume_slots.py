"""A machine booted with disks in its volume slots shows each disk's capacity in the
slot's config space from the start: the driver probes it once, at boot, and an empty
capacity then (0 sectors) is what the guest keeps until a configuration change."""

from __future__ import annotations

import struct
from pathlib import Path

from tests.kvm.tinyguest import Script, script_machine
from vmfork.vmm.devices.virtio.blk import SECTOR_SIZE
from vmfork.vmm.devices.virtio.mmio import CONFIG_SPACE
from vmfork.vmm.machine import VolumeMedia

KEY = "ab" * 16


def test_a_booted_machines_volume_slots_show_their_disks(tmp_path: Path) -> None:
    disk = tmp_path / "volume.img"
    disk.write_bytes(bytes(48 * SECTOR_SIZE))
    media = VolumeMedia(1, str(disk), KEY, True, "/data")
    machine, _ = script_machine(Script(), volume_slots=2, volumes=(media,))
    with machine:
        capacities = []
        for slot in machine.volumes:
            config = slot.device.registers.read(CONFIG_SPACE, 8)
            assert config is not None   # a disk's config is plain bytes
            capacities.append(struct.unpack("<Q", config)[0])
    assert capacities == [0, 48]
