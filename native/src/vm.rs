//! The VM core of one machine, assembled in one native call: the VM, its memory
//! slots, the TSS and identity-map pages, the in-kernel irqchip and PIT, the vCPUs,
//! and, for a restore, every SET ioctl of the snapshot (`restore.rs`, the one
//! implementation of the restore).
//!
//! `VmCore` is a plain Rust value: a native child can build and own it without any
//! Python object. `_core.VmCore` is its thin PyO3 wrapper for the machine Python
//! builds today (`vmm/machine.py`), which reads the descriptors (`vm_fd`,
//! `vcpu_fd`) for the ioctls it still makes itself (boot set-up, snapshots, irqfds,
//! ioeventfds) but never closes them.
//!
//! Who owns what: the core owns the VM and vCPU descriptors it creates (kvm-ioctls'
//! `VmFd`/`VcpuFd`, closed when the last holder drops them). `/dev/kvm` stays the
//! caller's (a jailed VMM's was opened before the drop): it is borrowed for the
//! call. Guest RAM stays the caller's mapping; KVM's slots only name its addresses.
//! Closing is ordered by construction: a vCPU loop holds an `Arc` of the core, so
//! the VM's descriptors outlive every vCPU thread, whatever order Python closes in.

use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};

use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::restore::{self, step, Failure, Report, VcpuBuffers, VmBuffers};

/// KVM's limit on vCPU ids for this VMM (`machine.MAX_VCPUS`).
const MAX_VCPUS: usize = 16;
/// Guest RAM is at most two regions today (below and above the 32-bit hole); a few
/// more slots are allowed, not an unbounded list.
const MAX_REGIONS: usize = 8;

/// One guest RAM region as KVM's memory slot `slot` takes it.
#[derive(Clone, Copy, Debug)]
pub struct Region {
    pub guest_phys: u64,
    pub size: u64,
    pub host_addr: u64,
}

/// Where the real-mode helper pages go (`vmm/x86/layout.py`).
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub tss_addr: u64,
    pub identity_map_addr: u64,
}

/// A snapshot to restore onto the new VM: the VM-wide buffers and one per vCPU,
/// in the order of the vCPU indices given.
pub struct Restore<'a> {
    pub vm: &'a VmBuffers,
    pub vcpus: &'a [&'a VcpuBuffers],
}

/// The VM and its vCPUs.
pub struct VmCore {
    vm: VmFd,
    /// (index, vCPU), in the order asked.
    vcpus: Vec<(u32, VcpuFd)>,
}

impl VmCore {
    /// Create the VM on `kvm`, its memory slots (slot `i` is `regions[i]`), the TSS
    /// and identity map, the irqchip and PIT2 (in that order, as KVM wants the
    /// irqchip before the vCPUs and the PIT after the irqchip), then the vCPUs
    /// `vcpu_indices`; then, with `restore`, the snapshot's state on them.
    ///
    /// # Safety
    ///
    /// Each region's `host_addr..host_addr + size` must stay mapped (or be
    /// unmapped only after the VM is gone or never run again): KVM reads and writes
    /// guest RAM there.
    pub unsafe fn create(
        kvm: &Kvm,
        regions: &[Region],
        layout: Layout,
        vcpu_indices: &[u32],
        restore: Option<Restore<'_>>,
    ) -> Result<(Self, Option<Report>), Failure> {
        let vm = step("KVM_CREATE_VM", None, kvm.create_vm())?;
        for (slot, region) in regions.iter().enumerate() {
            let slot_region = kvm_userspace_memory_region {
                slot: slot as u32,
                flags: 0,
                guest_phys_addr: region.guest_phys,
                memory_size: region.size,
                userspace_addr: region.host_addr,
            };
            // SAFETY: the caller keeps the region mapped for the VM's life (this
            // function's contract); the slot numbers are distinct.
            step("KVM_SET_USER_MEMORY_REGION", None, unsafe {
                vm.set_user_memory_region(slot_region)
            })?;
        }
        step(
            "KVM_SET_TSS_ADDR",
            None,
            vm.set_tss_address(layout.tss_addr as usize),
        )?;
        step(
            "KVM_SET_IDENTITY_MAP_ADDR",
            None,
            vm.set_identity_map_address(layout.identity_map_addr),
        )?;
        step("KVM_CREATE_IRQCHIP", None, vm.create_irq_chip())?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        step("KVM_CREATE_PIT2", None, vm.create_pit2(pit))?;
        let mut vcpus = Vec::with_capacity(vcpu_indices.len());
        for &index in vcpu_indices {
            let vcpu = step(
                "KVM_CREATE_VCPU",
                Some(index),
                vm.create_vcpu(u64::from(index)),
            )?;
            vcpus.push((index, vcpu));
        }
        let core = VmCore { vm, vcpus };
        let report = match restore {
            Some(r) => Some(core.restore(&r)?),
            None => None,
        };
        Ok((core, report))
    }

    fn restore(&self, r: &Restore<'_>) -> Result<Report, Failure> {
        let vcpus: Vec<&VcpuFd> = self.vcpus.iter().map(|(_, v)| v).collect();
        restore::apply(&self.vm, &vcpus, r.vm, r.vcpus)
    }

    pub fn vm(&self) -> &VmFd {
        &self.vm
    }

    pub fn vcpu_count(&self) -> usize {
        self.vcpus.len()
    }

    /// The vCPU at `position` (the order the indices were given): its index and fd.
    pub fn vcpu(&self, position: usize) -> Option<(u32, &VcpuFd)> {
        self.vcpus.get(position).map(|(i, v)| (*i, v))
    }

    /// A vCPU for a run loop: a copy of the descriptor at `position` with its own
    /// `kvm_run` mapping, so the loop's thread owns what it runs on (KVM_RUN needs
    /// the run page mutably) while the core's descriptor stays open for the state
    /// ioctls the host makes.
    pub fn vcpu_for_loop(&self, position: usize) -> Result<(u32, VcpuFd), Failure> {
        let (index, vcpu) = self.vcpu(position).ok_or(Failure {
            op: "vCPU position",
            errno: libc::EINVAL,
            vcpu: None,
        })?;
        // SAFETY: `vcpu` is an open descriptor the core owns for the length of this
        // borrow; F_DUPFD_CLOEXEC only reads it.
        let copy = unsafe { libc::fcntl(vcpu.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
        if copy < 0 {
            return Err(Failure {
                op: "dup vCPU fd",
                errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
                vcpu: Some(index),
            });
        }
        // SAFETY: `copy` is a new descriptor of a vCPU that nothing else owns;
        // ownership moves to the VcpuFd (closed and unmapped on drop, also on the
        // error path inside kvm-ioctls).
        let loop_vcpu = step("mmap kvm_run", Some(index), unsafe {
            self.vm.create_vcpu_from_rawfd(copy)
        })?;
        Ok((index, loop_vcpu))
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `_core.VmCore`: the VM core built by one call (see the module comment).
#[pyclass(frozen, name = "VmCore", module = "vmfork._core")]
pub struct PyVmCore {
    /// None once closed; a vCPU loop keeps its own `Arc`.
    core: Mutex<Option<Arc<VmCore>>>,
    /// (MSRs KVM refused per vCPU, TSC frequencies not scaled), for a restore.
    report: Option<(Vec<Vec<u32>>, Vec<restore::TscNotScaled>)>,
}

impl PyVmCore {
    pub(crate) fn get(&self) -> PyResult<Arc<VmCore>> {
        lock(&self.core)
            .clone()
            .ok_or_else(|| PyRuntimeError::new_err("the VM core is closed"))
    }
}

#[pymethods]
impl PyVmCore {
    /// Create the VM on `kvm_fd` (borrowed for the call), a memory slot per
    /// `(guest_phys, size, host_addr)` region (mappings the caller keeps until the
    /// core is closed), the TSS and identity map at `tss_addr`/`identity_map_addr`,
    /// the irqchip and PIT2, and the vCPUs `vcpus` (indices); with `prepared`
    /// (whose vCPU indices must be `vcpus`), restore it. All of it in one call, the
    /// GIL released. Raises `IoctlError(errno, op, vcpu index or None)`.
    #[new]
    #[pyo3(signature = (kvm_fd, regions, *, tss_addr, identity_map_addr, vcpus, prepared = None))]
    fn new(
        py: Python<'_>,
        kvm_fd: RawFd,
        regions: Vec<(u64, u64, u64)>,
        tss_addr: u64,
        identity_map_addr: u64,
        vcpus: Vec<u32>,
        prepared: Option<&Bound<'_, crate::PreparedRestore>>,
    ) -> PyResult<Self> {
        if regions.is_empty() || regions.len() > MAX_REGIONS {
            return Err(PyValueError::new_err(format!(
                "{} guest RAM regions: 1..{MAX_REGIONS} are allowed",
                regions.len()
            )));
        }
        if vcpus.is_empty() || vcpus.len() > MAX_VCPUS {
            return Err(PyValueError::new_err(format!(
                "{} vCPUs: 1..{MAX_VCPUS} are allowed",
                vcpus.len()
            )));
        }
        let regions: Vec<Region> = regions
            .into_iter()
            .map(|(guest_phys, size, host_addr)| Region {
                guest_phys,
                size,
                host_addr,
            })
            .collect();
        let layout = Layout {
            tss_addr,
            identity_map_addr,
        };
        let prepared = prepared.map(|p| p.get());
        let states: Vec<&VcpuBuffers> = match prepared {
            Some(p) => p.vcpus.iter().map(|v| &v.get().inner).collect(),
            None => Vec::new(),
        };
        if prepared.is_some() {
            let indices: Vec<u32> = states.iter().map(|s| s.index()).collect();
            if indices != vcpus {
                return Err(PyValueError::new_err(format!(
                    "vCPUs {vcpus:?} for a snapshot of vCPUs {indices:?}"
                )));
            }
        }
        // SAFETY: Python holds `kvm_fd` open for the length of this call (it is an
        // argument of it); the wrapper is never dropped, so the caller's descriptor
        // is not closed. A descriptor that is not /dev/kvm fails KVM_CREATE_VM.
        let kvm = ManuallyDrop::new(unsafe { Kvm::from_raw_fd(kvm_fd) });
        let restore = prepared.map(|p| Restore {
            vm: &p.vm,
            vcpus: &states,
        });
        let built = py.detach(|| {
            // SAFETY: the regions are the caller's live mappings (`GuestMemory`),
            // unmapped only after `close` (machine.py's closers run it first).
            unsafe { VmCore::create(&kvm, &regions, layout, &vcpus, restore) }
        });
        let (core, report) = built.map_err(crate::ioctl_error)?;
        Ok(PyVmCore {
            core: Mutex::new(Some(Arc::new(core))),
            report: report.map(|r| (r.refused_msrs, r.tsc_not_scaled)),
        })
    }

    /// The VM's descriptor (the core's: not to be closed by the caller).
    #[getter]
    fn vm_fd(&self) -> PyResult<RawFd> {
        Ok(self.get()?.vm().as_raw_fd())
    }

    /// The descriptor of the vCPU at `position` (the order of `vcpus`).
    fn vcpu_fd(&self, position: usize) -> PyResult<RawFd> {
        let core = self.get()?;
        let (_, vcpu) = core
            .vcpu(position)
            .ok_or_else(|| PyValueError::new_err(format!("no vCPU at position {position}")))?;
        Ok(vcpu.as_raw_fd())
    }

    #[getter]
    fn vcpu_count(&self) -> PyResult<usize> {
        Ok(self.get()?.vcpu_count())
    }

    /// For a restore: (MSRs KVM refused, per vCPU; (vCPU index, wanted kHz, host
    /// kHz, errno) per TSC frequency this host could not set). None for a boot.
    #[getter]
    fn restore_report(&self) -> Option<(Vec<Vec<u32>>, Vec<restore::TscNotScaled>)> {
        self.report.clone()
    }

    /// Let go of the VM and vCPU descriptors: closed now, or when the last vCPU
    /// loop holding them ends. Idempotent.
    fn close(&self) {
        let core = lock(&self.core).take();
        drop(core);
    }
}

/// `size` bytes of fresh anonymous RAM as guest address 0, holding `code` at `entry`:
/// a test guest's. Never unmapped (the test's process keeps it for its life).
#[cfg(test)]
pub(crate) fn test_ram_with(size: usize, entry: usize, code: &[u8]) -> Region {
    assert!(entry + code.len() <= size);
    // SAFETY: a fresh anonymous mapping with no address hint; checked below.
    let ram = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(ram, libc::MAP_FAILED);
    // SAFETY: `entry + code.len()` is inside the mapping made above (asserted).
    unsafe {
        std::ptr::copy_nonoverlapping(code.as_ptr(), ram.cast::<u8>().add(entry), code.len())
    };
    Region {
        guest_phys: 0,
        size: size as u64,
        host_addr: ram as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This host's KVM; None (the test says so and checks nothing) where there is
    /// none, as in a build container.
    fn kvm() -> Option<Kvm> {
        let kvm = Kvm::new().ok();
        if kvm.is_none() {
            eprintln!("skipped: no usable /dev/kvm");
        }
        kvm
    }

    fn ram(size: usize) -> u64 {
        // SAFETY: an anonymous private mapping with no address hint; checked below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        addr as u64
    }

    /// 2 MiB of fresh anonymous RAM as guest-physical 0.
    fn two_mib_at_zero() -> Region {
        let size = 2 << 20;
        Region {
            guest_phys: 0,
            size: size as u64,
            host_addr: ram(size),
        }
    }

    const LAYOUT: Layout = Layout {
        tss_addr: 0xFFFB_D000,
        identity_map_addr: 0xFFFB_C000,
    };

    #[test]
    fn a_core_has_its_vcpus_in_the_order_asked_and_a_loop_gets_its_own_copy() {
        let Some(kvm) = kvm() else { return };
        let region = two_mib_at_zero();
        // SAFETY: the mapping is never unmapped in this test process.
        let (core, report) = unsafe { VmCore::create(&kvm, &[region], LAYOUT, &[1, 0], None) }
            .expect("a VM on this host's KVM");
        assert!(report.is_none());
        assert_eq!(core.vcpu_count(), 2);
        assert_eq!(core.vcpu(0).map(|(i, _)| i), Some(1));
        assert_eq!(core.vcpu(1).map(|(i, _)| i), Some(0));
        let (index, copy) = core.vcpu_for_loop(1).expect("a copy");
        assert_eq!(index, 0);
        assert_ne!(copy.as_raw_fd(), core.vcpu(1).unwrap().1.as_raw_fd());
        assert!(core.vcpu_for_loop(2).is_err());
    }

    #[test]
    fn each_failed_step_names_its_ioctl() {
        let Some(kvm) = kvm() else { return };
        let region = two_mib_at_zero();
        // A host address that is not page aligned: KVM refuses the slot.
        let unaligned = Region {
            host_addr: region.host_addr + 1,
            ..region
        };
        // SAFETY: the mapping is never unmapped in this test process.
        let failure = unsafe { VmCore::create(&kvm, &[unaligned], LAYOUT, &[0], None) }
            .err()
            .expect("an unaligned slot is refused");
        assert_eq!(failure.op, "KVM_SET_USER_MEMORY_REGION");
        assert_eq!(failure.errno, libc::EINVAL);
        // The same vCPU id twice: KVM refuses the second.
        // SAFETY: as above.
        let failure = unsafe { VmCore::create(&kvm, &[region], LAYOUT, &[0, 0], None) }
            .err()
            .expect("a duplicate vCPU id is refused");
        assert_eq!((failure.op, failure.vcpu), ("KVM_CREATE_VCPU", Some(0)));
        assert_eq!(failure.errno, libc::EEXIST);
    }
}
