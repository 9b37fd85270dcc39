"""Types of the native core (``native/``, built into ``vmfork/_core.abi3.so``)."""

class IoctlError(OSError):
    """A KVM ioctl of a native call failed; ``args`` is (errno, op, vCPU index or None)."""

class PreparedVcpu:
    def __init__(self, *, index: int, cpuid: bytes, tsc_khz: int, mp_state: int, regs: bytes,
                 sregs: bytes, xsave: bytes, xcrs: bytes, debugregs: bytes, lapic: bytes,
                 msrs: list[tuple[int, int]], vcpu_events: bytes) -> None: ...
    @property
    def index(self) -> int: ...

class PreparedRestore:
    def __init__(self, *, pit: bytes, clock: int, irqchips: tuple[bytes, bytes, bytes],
                 vcpus: list[PreparedVcpu]) -> None: ...
    @property
    def vcpu_count(self) -> int: ...

def restore(kvm_fd: int, vm_fd: int, vcpu_fds: list[int], prepared: PreparedRestore,
            ) -> tuple[list[list[int]], list[tuple[int, int, int, int]]]: ...
