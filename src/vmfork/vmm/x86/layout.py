"""Fixed guest-physical addresses used at boot (all below 1 MiB unless noted).

They follow the conventional PC layout that Linux expects: the zero page and
the command line low, the MP table in the last KiB of base memory (where Linux's
``smp_scan_config`` looks), the kernel at its link address (16 MiB), and the
initrd at the top of low RAM.
"""

GDT_ADDR = 0x500
IDT_ADDR = 0x520
ZERO_PAGE_ADDR = 0x7000
BOOT_STACK_TOP = 0x8FF0
PML4_ADDR = 0x9000
PDPT_ADDR = 0xA000
PD_ADDR = 0xB000                  # four pages: 0xB000-0xEFFF
CMDLINE_ADDR = 0x20000
CMDLINE_MAX = 4096
MPTABLE_ADDR = 0x9FC00            # EBDA: the last KiB of base memory
BASE_MEMORY_END = 0xA0000         # 640 KiB; VGA and BIOS area above it
HIGH_MEMORY_START = 0x100000      # 1 MiB
KERNEL_MIN_ADDR = 0x100000

IOAPIC_ADDR = 0xFEC0_0000
LAPIC_ADDR = 0xFEE0_0000
TSS_ADDR = 0xFFFB_D000            # KVM needs three pages for the real-mode TSS
IDENTITY_MAP_ADDR = 0xFFFB_C000   # and one for the EPT identity map

VIRTIO_MMIO_BASE = 0xD000_0000    # one 4 KiB window per virtio device
VIRTIO_MMIO_SIZE = 0x1000
FIRST_DEVICE_IRQ = 5              # IRQs 0-4 are PIT, keyboard, cascade, COM2, COM1
IOAPIC_PINS = 24

COM1_PORT = 0x3F8
COM1_IRQ = 4
I8042_DATA_PORT = 0x60
I8042_COMMAND_PORT = 0x64
