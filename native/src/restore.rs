//! The restore of one machine's VM and vCPU state: every SET ioctl, from buffers
//! built once per snapshot.
//!
//! Python owns the state format and its preparation (`vmfork.vmm.vmstate`): it
//! decodes `state.bin`, checks it, orders the MSRs, and hands the raw KVM structs
//! to [`PreparedRestore::new`] once per snapshot, in the zygote. A forked child
//! then calls [`apply`] once: no decoding, no allocation on the common path, no
//! Python between the ioctls.
//!
//! Ordering requirements (the same as `vmstate.apply_vm` / `apply_vcpu`, which
//! give the reasons in full):
//!
//! 1. VM-wide state first: PIT, kvmclock (value only; the TSC-stable flag
//!    describes the source host), then the PIC master, PIC slave and IOAPIC.
//! 2. Per vCPU, in index order: CPUID first (KVM derives what the other SET
//!    ioctls accept from it); the TSC frequency if the source host's differs;
//!    MP_STATE, REGS, SREGS, XSAVE before XCRS (XCR0 must allow what the XSAVE
//!    area holds), DEBUGREGS; LAPIC after SREGS (APIC base) and before the
//!    MSRs (TSC deadline needs the LAPIC in TSC-deadline mode); MSRs with
//!    IA32_TSC first and IA32_TSC_DEADLINE last (Python ordered them);
//!    VCPU_EVENTS last (they refer to the restored RIP); KVMCLOCK_CTRL.

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
    CpuId, Msrs, KVM_MAX_MSR_ENTRIES,
};
use kvm_ioctls::{VcpuFd, VmFd};
use zerocopy::FromBytes;

/// A failed step of a restore: the ioctl (or the set-up step) and the kernel's errno.
#[derive(Debug)]
pub struct Failure {
    pub op: &'static str,
    pub errno: i32,
    /// The vCPU index, for per-vCPU ioctls.
    pub vcpu: Option<u32>,
}

/// A snapshot field that cannot be a KVM struct of its type.
#[derive(Debug)]
pub struct BadField {
    pub field: &'static str,
    pub got: usize,
    pub expected: usize,
    /// What `got` and `expected` count: "bytes", or "entries" (at most `expected`).
    pub unit: &'static str,
}

impl std::fmt::Display for BadField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.unit == "entries" {
            write!(
                f,
                "snapshot {}: {} entries, at most {}",
                self.field, self.got, self.expected
            )
        } else {
            write!(
                f,
                "snapshot {}: {} {}, expected {}",
                self.field, self.got, self.unit, self.expected
            )
        }
    }
}

fn load<T: FromBytes>(field: &'static str, data: &[u8]) -> Result<T, BadField> {
    T::read_from_bytes(data).map_err(|_| BadField {
        field,
        got: data.len(),
        expected: std::mem::size_of::<T>(),
        unit: "bytes",
    })
}

/// The VM-wide state as the buffers its SET ioctls take.
pub struct VmBuffers {
    pit: kvm_pit_state2,
    clock: kvm_clock_data,
    irqchips: [kvm_irqchip; 3],
}

impl VmBuffers {
    pub fn new(pit: &[u8], clock: u64, irqchips: [&[u8]; 3]) -> Result<Self, BadField> {
        Ok(VmBuffers {
            pit: load("pit", pit)?,
            clock: kvm_clock_data {
                clock,
                ..Default::default()
            },
            irqchips: [
                load("pic_master", irqchips[0])?,
                load("pic_slave", irqchips[1])?,
                load("ioapic", irqchips[2])?,
            ],
        })
    }
}

/// The raw fields of one vCPU's state, as the snapshot holds them.
pub struct VcpuFields<'a> {
    pub index: u32,
    pub cpuid: &'a [u8],
    pub tsc_khz: u32,
    pub mp_state: u32,
    pub regs: &'a [u8],
    pub sregs: &'a [u8],
    pub xsave: &'a [u8],
    pub xcrs: &'a [u8],
    pub debugregs: &'a [u8],
    pub lapic: &'a [u8],
    /// (index, value), already in restore order.
    pub msrs: &'a [(u32, u64)],
    pub vcpu_events: &'a [u8],
}

/// One vCPU's state as the buffers its SET ioctls take.
pub struct VcpuBuffers {
    index: u32,
    cpuid: CpuId,
    tsc_khz: u32,
    mp_state: kvm_mp_state,
    regs: kvm_regs,
    sregs: kvm_sregs,
    xsave: kvm_xsave,
    xcrs: kvm_xcrs,
    debugregs: kvm_debugregs,
    lapic: kvm_lapic_state,
    /// Every MSR, in restore order, as one `kvm_msrs` buffer.
    msrs: Msrs,
    vcpu_events: kvm_vcpu_events,
}

impl VcpuBuffers {
    pub fn new(f: &VcpuFields<'_>) -> Result<Self, BadField> {
        let entry = std::mem::size_of::<kvm_cpuid_entry2>();
        if !f.cpuid.len().is_multiple_of(entry) {
            return Err(BadField {
                field: "cpuid",
                got: f.cpuid.len(),
                expected: f.cpuid.len() / entry * entry,
                unit: "bytes (a whole number of kvm_cpuid_entry2)",
            });
        }
        let entries: Vec<kvm_cpuid_entry2> = f
            .cpuid
            .chunks_exact(entry)
            .map(|chunk| load("cpuid", chunk))
            .collect::<Result<_, _>>()?;
        let cpuid = CpuId::from_entries(&entries).map_err(|_| BadField {
            field: "cpuid",
            got: entries.len(),
            expected: kvm_bindings::KVM_MAX_CPUID_ENTRIES,
            unit: "entries",
        })?;
        // The kernel takes at most KVM_MAX_MSR_ENTRIES per KVM_SET_MSRS (E2BIG).
        let msrs: Vec<kvm_msr_entry> = f
            .msrs
            .iter()
            .map(|&(index, data)| kvm_msr_entry {
                index,
                data,
                ..Default::default()
            })
            .collect();
        Ok(VcpuBuffers {
            index: f.index,
            cpuid,
            tsc_khz: f.tsc_khz,
            mp_state: kvm_mp_state {
                mp_state: f.mp_state,
            },
            regs: load("regs", f.regs)?,
            sregs: load("sregs", f.sregs)?,
            xsave: load("xsave", f.xsave)?,
            xcrs: load("xcrs", f.xcrs)?,
            debugregs: load("debugregs", f.debugregs)?,
            lapic: load("lapic", f.lapic)?,
            msrs: Msrs::from_entries(&msrs).map_err(|_| BadField {
                field: "msrs",
                got: msrs.len(),
                expected: KVM_MAX_MSR_ENTRIES,
                unit: "entries",
            })?,
            vcpu_events: load("vcpu_events", f.vcpu_events)?,
        })
    }

    pub fn index(&self) -> u32 {
        self.index
    }
}

/// (vCPU index, wanted kHz, host kHz, errno): a TSC frequency this host could not set.
pub type TscNotScaled = (u32, u32, u32, i32);

/// What a restore did that is worth saying but is not a failure.
#[derive(Debug, Default)]
pub struct Report {
    /// Per vCPU, the MSRs KVM refused (skipped; the rest were set).
    pub refused_msrs: Vec<Vec<u32>>,
    /// Per vCPU whose source host's TSC frequency this host could not set.
    pub tsc_not_scaled: Vec<TscNotScaled>,
}

/// `r`, its error named by the ioctl `op` (and the vCPU it was for).
pub(crate) fn step<T>(
    op: &'static str,
    vcpu: Option<u32>,
    r: Result<T, kvm_ioctls::Error>,
) -> Result<T, Failure> {
    r.map_err(|e| Failure {
        op,
        errno: e.errno(),
        vcpu,
    })
}

/// Set the VM-wide state (see the ordering requirements).
pub fn apply_vm(vm: &VmFd, state: &VmBuffers) -> Result<(), Failure> {
    step("KVM_SET_PIT2", None, vm.set_pit2(&state.pit))?;
    step("KVM_SET_CLOCK", None, vm.set_clock(&state.clock))?;
    for chip in &state.irqchips {
        step("KVM_SET_IRQCHIP", None, vm.set_irqchip(chip))?;
    }
    Ok(())
}

/// `KVM_SET_MSRS` stops at the first MSR it refuses and returns how many it set;
/// skip that one and set the rest. The prepared buffer is only read (it is shared
/// copy-on-write with the zygote): a retry builds a private one, from the rest.
/// Returns the refused indices.
fn set_msrs(vcpu: &VcpuFd, index: u32, prepared: &Msrs) -> Result<Vec<u32>, Failure> {
    let entries = prepared.as_slice();
    let mut refused = Vec::new();
    let mut done = step("KVM_SET_MSRS", Some(index), vcpu.set_msrs(prepared))?;
    while done < entries.len() {
        refused.push(entries[done].index);
        done += 1;
        if done == entries.len() {
            break;
        }
        let rest = Msrs::from_entries(&entries[done..])
            .expect("a tail of a list the wrapper accepted fits the wrapper");
        done += step("KVM_SET_MSRS", Some(index), vcpu.set_msrs(&rest))?;
    }
    Ok(refused)
}

const EINVAL: i32 = 22;

/// Set one vCPU's state (see the ordering requirements). `host_tsc_khz` is the
/// frequency this host gives new vCPUs.
pub fn apply_vcpu(
    vcpu: &VcpuFd,
    state: &VcpuBuffers,
    host_tsc_khz: u32,
    report: &mut Report,
) -> Result<(), Failure> {
    let at = Some(state.index);
    step("KVM_SET_CPUID2", at, vcpu.set_cpuid2(&state.cpuid))?;
    if state.tsc_khz != 0 && state.tsc_khz != host_tsc_khz {
        if let Err(e) = vcpu.set_tsc_khz(state.tsc_khz) {
            report
                .tsc_not_scaled
                .push((state.index, state.tsc_khz, host_tsc_khz, e.errno()));
        }
    }
    step("KVM_SET_MP_STATE", at, vcpu.set_mp_state(state.mp_state))?;
    step("KVM_SET_REGS", at, vcpu.set_regs(&state.regs))?;
    step("KVM_SET_SREGS", at, vcpu.set_sregs(&state.sregs))?;
    // SAFETY: KVM_SET_XSAVE reads the guest FPU's user-ABI size, which exceeds the
    // 4096 bytes of `kvm_xsave` only for dynamically enabled XSAVE features (AMX),
    // and those need ARCH_REQ_XCOMP_GUEST_PERM, which this process never asks for.
    step("KVM_SET_XSAVE", at, unsafe { vcpu.set_xsave(&state.xsave) })?;
    step("KVM_SET_XCRS", at, vcpu.set_xcrs(&state.xcrs))?;
    step(
        "KVM_SET_DEBUGREGS",
        at,
        vcpu.set_debug_regs(&state.debugregs),
    )?;
    step("KVM_SET_LAPIC", at, vcpu.set_lapic(&state.lapic))?;
    report
        .refused_msrs
        .push(set_msrs(vcpu, state.index, &state.msrs)?);
    step(
        "KVM_SET_VCPU_EVENTS",
        at,
        vcpu.set_vcpu_events(&state.vcpu_events),
    )?;
    match vcpu.kvmclock_ctrl() {
        // EINVAL: the guest has not set up its kvmclock page yet.
        Err(e) if e.errno() == EINVAL => {}
        r => step("KVM_KVMCLOCK_CTRL", at, r)?,
    }
    Ok(())
}

/// A whole restore: the VM, then every vCPU in order. `vcpus[i]` gets
/// `states[i]`; the caller checked the lengths match.
pub fn apply(
    vm: &VmFd,
    vcpus: &[&VcpuFd],
    vm_state: &VmBuffers,
    states: &[&VcpuBuffers],
) -> Result<Report, Failure> {
    let mut report = Report::default();
    apply_vm(vm, vm_state)?;
    let mut host_tsc_khz = None;
    for (vcpu, state) in vcpus.iter().zip(states) {
        let host = match host_tsc_khz {
            Some(khz) => khz,
            None => {
                let khz = vcpu.get_tsc_khz().map_err(|_| Failure {
                    op: "KVM_GET_TSC_KHZ",
                    errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
                    vcpu: Some(state.index),
                })?;
                host_tsc_khz = Some(khz);
                khz
            }
        };
        apply_vcpu(vcpu, state, host, &mut report)?;
    }
    Ok(report)
}
