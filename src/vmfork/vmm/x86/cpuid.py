"""The guest CPUID: what KVM supports, filtered to what our guest may use.

We start from ``KVM_GET_SUPPORTED_CPUID`` (what this host's KVM can virtualise)
and then, per vCPU:

* give each vCPU its own APIC id (leaf 1 EBX[31:24], leaf 0xB/0x1F EDX) and a
  topology of one thread per core, one core per vCPU;
* set the hypervisor bit (leaf 1 ECX[31]) so the guest looks for KVM's
  paravirtual leaves (kvmclock), which KVM reports at 0x40000000;
* hide what must not leak into a microVM that may be snapshotted and restored on
  another host of the same kind: nested virtualisation (VMX, SVM), the
  architectural PMU (leaf 0xA), and MONITOR/MWAIT; and hide the TSC-deadline
  and x2APIC features only if KVM did not offer them (it never lies here).

The filter is a table, so that what we hide and why is in one place.
"""

from __future__ import annotations

from vmfork.kvm.structs import kvm_cpuid_entry2

# (leaf, register, bit, reason)
HIDDEN = [
    (0x1, "ecx", 3, "MONITOR/MWAIT: idle must exit to the VMM, not spin in the guest"),
    (0x1, "ecx", 5, "VMX: no nested virtualisation in sandboxes"),
    (0x80000001, "ecx", 2, "SVM: no nested virtualisation in sandboxes"),
    (0x1, "ecx", 15, "PDCM: no performance capabilities MSR"),
    (0x7, "ebx", 2, "SGX: not virtualised"),
    (0x7, "ecx", 30, "SGX launch control: not virtualised"),
]

HYPERVISOR_BIT = 31


def _clear(entry: kvm_cpuid_entry2, reg: str, bit: int) -> None:
    setattr(entry, reg, getattr(entry, reg) & ~(1 << bit))


def guest_cpuid(supported: list[kvm_cpuid_entry2], vcpu_index: int,
                num_vcpus: int) -> list[kvm_cpuid_entry2]:
    entries = []
    for src in supported:
        e = kvm_cpuid_entry2()
        for name, *_ in kvm_cpuid_entry2._fields_:
            if name != "padding":
                setattr(e, name, getattr(src, name))
        for leaf, reg, bit, _reason in HIDDEN:
            if e.function == leaf:
                _clear(e, reg, bit)
        if e.function == 0x1:
            e.ecx |= 1 << HYPERVISOR_BIT
            # APIC id, logical processor count, CLFLUSH line size (8 * 8 bytes).
            e.ebx = (vcpu_index << 24) | (max(num_vcpus, 1) << 16) | (8 << 8)
            if num_vcpus > 1:
                e.edx |= 1 << 28  # HTT: the count in EBX[23:16] is valid
        elif e.function == 0xA:
            e.eax = e.ebx = e.ecx = e.edx = 0  # no architectural PMU
        elif e.function in (0xB, 0x1F):
            # Extended topology: level 0 = SMT (1 thread per core), level 1 = core.
            e.edx = vcpu_index
            if e.index == 0:
                e.eax, e.ebx, e.ecx = 0, 1, (1 << 8) | 0
            elif e.index == 1:
                shift = max(num_vcpus - 1, 0).bit_length()
                e.eax, e.ebx, e.ecx = shift, num_vcpus, (2 << 8) | 1
            else:
                e.eax, e.ebx, e.ecx = 0, 0, e.index
        elif e.function == 0x4:
            # Deterministic cache parameters: cores sharing the cache (EAX[31:26]).
            e.eax = (e.eax & 0x03FF_FFFF) | ((max(num_vcpus - 1, 0) & 0x3F) << 26)
        elif e.function == 0x8000001E:
            e.eax = vcpu_index  # extended APIC id
            e.ebx = (e.ebx & ~0xFF) | vcpu_index  # compute unit id
        entries.append(e)
    return entries
