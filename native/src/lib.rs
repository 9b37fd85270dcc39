//! `vmfork._core`: vmfork's native per-sandbox core, driven from Python.
//!
//! The boundary (docs/design-notes.md, "Native core"): Python owns state formats,
//! their preparation and all orchestration; this module owns what a forked child
//! runs per sandbox: the restore (every SET ioctl of a snapshot's VM and vCPU
//! state, issued by one call with the GIL released), the vCPU loop with COM1 and
//! the i8042, and the split virtqueue (chain walks, used ring, copies) with the
//! rng device's serving loop over guest RAM.
//!
//! File descriptors stay Python's: a call borrows them, duplicates the ones it
//! hands to `kvm-ioctls` (whose wrappers own and close their fd) while it holds
//! the GIL, and closes its duplicates before it returns. The exception is the VM
//! core (`vm.rs`): the VM and vCPU descriptors it creates are its own, read (never
//! closed) by Python, and kept open by each vCPU loop until its thread ends.

mod agent_frame;
mod agent_handshake;
mod balloon_serve;
mod blk;
mod blk_serve;
mod child;
mod child_heap;
mod child_life;
mod child_report;
mod console;
mod control_serve;
mod eventloop;
mod forker;
mod forker_spare;
mod guest_ram;
mod log_budget;
mod machine;
mod machine_plan;
mod mmio;
mod mmio_py;
mod native_fork;
#[cfg(test)]
mod native_wiring;
mod net;
mod net_serve;
mod queue_server;
mod restore;
mod rng_serve;
mod spawn_profile;
mod tiny_machine;
mod transport;
mod transport_py;
mod vcpu;
mod virtio_py;
mod virtq;
mod vm;
mod vsock_connect_line;
mod vsock_io;
mod vsock_packet;
mod vsock_serve;
mod write_set;

use std::os::fd::{BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};

use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use pyo3::create_exception;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;

create_exception!(
    vmfork._core,
    IoctlError,
    PyOSError,
    "A KVM ioctl of a native call failed: args are (errno, op, vcpu index or None)."
);

pub(crate) fn ioctl_error(f: restore::Failure) -> PyErr {
    IoctlError::new_err((f.errno, f.op, f.vcpu))
}

fn bad_field(b: restore::BadField) -> PyErr {
    PyValueError::new_err(b.to_string())
}

/// One vCPU's restore buffers, built once per snapshot.
#[pyclass(frozen, module = "vmfork._core")]
pub(crate) struct PreparedVcpu {
    pub(crate) inner: restore::VcpuBuffers,
}

#[pymethods]
impl PreparedVcpu {
    /// Check each field's size and build the KVM structs. `cpuid` is the raw
    /// `kvm_cpuid_entry2` array; `msrs` are (index, value) in restore order.
    #[new]
    #[pyo3(signature = (*, index, cpuid, tsc_khz, mp_state, regs, sregs, xsave, xcrs,
                        debugregs, lapic, msrs, vcpu_events))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        index: u32,
        cpuid: &[u8],
        tsc_khz: u32,
        mp_state: u32,
        regs: &[u8],
        sregs: &[u8],
        xsave: &[u8],
        xcrs: &[u8],
        debugregs: &[u8],
        lapic: &[u8],
        msrs: Vec<(u32, u64)>,
        vcpu_events: &[u8],
    ) -> PyResult<Self> {
        let fields = restore::VcpuFields {
            index,
            cpuid,
            tsc_khz,
            mp_state,
            regs,
            sregs,
            xsave,
            xcrs,
            debugregs,
            lapic,
            msrs: &msrs,
            vcpu_events,
        };
        Ok(PreparedVcpu {
            inner: restore::VcpuBuffers::new(&fields).map_err(bad_field)?,
        })
    }

    #[getter]
    fn index(&self) -> u32 {
        self.inner.index()
    }
}

/// A machine's restore buffers (VM-wide state and its vCPUs), built once per snapshot.
#[pyclass(frozen, module = "vmfork._core")]
pub(crate) struct PreparedRestore {
    pub(crate) vm: restore::VmBuffers,
    pub(crate) vcpus: Vec<Py<PreparedVcpu>>,
}

#[pymethods]
impl PreparedRestore {
    /// `irqchips` are the PIC master, PIC slave and IOAPIC `kvm_irqchip` bytes.
    #[new]
    #[pyo3(signature = (*, pit, clock, irqchips, vcpus))]
    fn new(
        pit: &[u8],
        clock: u64,
        irqchips: (Vec<u8>, Vec<u8>, Vec<u8>),
        vcpus: Vec<Py<PreparedVcpu>>,
    ) -> PyResult<Self> {
        let vm = restore::VmBuffers::new(pit, clock, [&irqchips.0, &irqchips.1, &irqchips.2])
            .map_err(bad_field)?;
        Ok(PreparedRestore { vm, vcpus })
    }

    #[getter]
    fn vcpu_count(&self) -> usize {
        self.vcpus.len()
    }
}

/// Duplicate a descriptor that Python owns, close-on-exec.
fn dup(fd: RawFd, what: &'static str) -> PyResult<OwnedFd> {
    // SAFETY: the caller holds the GIL and Python holds `fd` open for the length
    // of this call (it is an argument of it); the borrow ends within this function.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    borrowed
        .try_clone_to_owned()
        .map_err(|e| IoctlError::new_err((e.raw_os_error().unwrap_or(0), what, None::<u32>)))
}

/// The VM as kvm-ioctls' `VmFd`, on a copy of Python's descriptor.
pub(crate) fn open_vm(kvm_fd: RawFd, vm_fd: RawFd) -> PyResult<VmFd> {
    let kvm_dup = dup(kvm_fd, "dup /dev/kvm fd")?;
    // SAFETY: `kvm_dup` is an open descriptor we own; the caller says it is /dev/kvm
    // (if not, the ioctls below fail with ENOTTY, nothing else). Ownership moves.
    let kvm = unsafe { Kvm::from_raw_fd(kvm_dup.into_raw_fd()) };
    let vm_dup = dup(vm_fd, "dup VM fd")?;
    // SAFETY: as above, for a VM fd; `kvm` only supplies the vCPU mmap size.
    unsafe { kvm.create_vmfd_from_rawfd(vm_dup.into_raw_fd()) }
        .map_err(|e| IoctlError::new_err((e.errno(), "KVM_GET_VCPU_MMAP_SIZE", None::<u32>)))
}

/// The vCPUs `(fd, index)` of the VM `vm_fd` as kvm-ioctls' `VcpuFd`s, each on a
/// copy of Python's descriptor with its own `kvm_run` mapping; dropping one closes
/// its copy and unmaps.
pub(crate) fn open_vcpus(vm: &VmFd, fds: &[(RawFd, u32)]) -> PyResult<Vec<VcpuFd>> {
    let mut vcpus = Vec::with_capacity(fds.len());
    for &(fd, index) in fds {
        let raw = dup(fd, "dup vCPU fd")?.into_raw_fd();
        // SAFETY: an open vCPU descriptor we own (a wrong kind of fd fails the
        // mmap of its run structure or its ioctls). Ownership moves to the call:
        // the VcpuFd unmaps and closes on drop, and on an error the call closes it.
        let vcpu = unsafe { vm.create_vcpu_from_rawfd(raw) }
            .map_err(|e| IoctlError::new_err((e.errno(), "mmap kvm_run", Some(index))))?;
        vcpus.push(vcpu);
    }
    Ok(vcpus)
}

/// Restore a snapshot's VM and vCPU state: every SET ioctl, in the order the
/// module `restore` gives, in one call with the GIL released. `vcpu_fds[i]`
/// gets `prepared`'s vCPU `i`. Returns (MSRs KVM refused, per vCPU;
/// (vCPU index, wanted kHz, host kHz, errno) for each TSC frequency this host
/// could not set). Raises `IoctlError` naming the failed ioctl.
#[pyfunction(name = "restore")]
fn restore_machine(
    py: Python<'_>,
    kvm_fd: RawFd,
    vm_fd: RawFd,
    vcpu_fds: Vec<RawFd>,
    prepared: &Bound<'_, PreparedRestore>,
) -> PyResult<(Vec<Vec<u32>>, Vec<restore::TscNotScaled>)> {
    let prepared = prepared.get();
    if vcpu_fds.len() != prepared.vcpus.len() {
        return Err(PyValueError::new_err(format!(
            "{} vCPU fds for a snapshot of {} vCPUs",
            vcpu_fds.len(),
            prepared.vcpus.len()
        )));
    }
    let states: Vec<&restore::VcpuBuffers> =
        prepared.vcpus.iter().map(|v| &v.get().inner).collect();
    let fds: Vec<(RawFd, u32)> = vcpu_fds
        .iter()
        .zip(&states)
        .map(|(&fd, state)| (fd, state.index()))
        .collect();
    let vm = open_vm(kvm_fd, vm_fd)?;
    let vcpus = open_vcpus(&vm, &fds)?;
    let vcpus: Vec<&VcpuFd> = vcpus.iter().collect();
    let report = py
        .detach(|| restore::apply(&vm, &vcpus, &prepared.vm, &states))
        .map_err(ioctl_error)?;
    Ok((report.refused_msrs, report.tsc_not_scaled))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PreparedVcpu>()?;
    m.add_class::<PreparedRestore>()?;
    m.add_class::<vcpu::VcpuLoop>()?;
    m.add_class::<vm::PyVmCore>()?;
    m.add_class::<machine::PyNativeMachine>()?;
    m.add_class::<console::Console>()?;
    m.add_class::<control_serve::ControlServe>()?;
    m.add_class::<eventloop::EventLoop>()?;
    m.add_class::<virtio_py::GuestRam>()?;
    m.add_class::<mmio_py::MmioRegisters>()?;
    m.add_class::<mmio_py::MmioWindows>()?;
    m.add_class::<transport_py::NativeDevice>()?;
    m.add_class::<child::ChildPlan>()?;
    m.add_class::<child_report::ChildReporter>()?;
    m.add_class::<agent_handshake::AgentTarget>()?;
    m.add_function(wrap_pyfunction!(agent_handshake::agent_after_fork, m)?)?;
    m.add_function(wrap_pyfunction!(
        agent_handshake::py_clock_exchange_step,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(restore_machine, m)?)?;
    m.add_function(wrap_pyfunction!(control_serve::exits_reply_line, m)?)?;
    m.add_function(wrap_pyfunction!(child::py_let_go_of_host_root, m)?)?;
    m.add_function(wrap_pyfunction!(child::py_open_tap, m)?)?;
    m.add_function(wrap_pyfunction!(child::jail_base, m)?)?;
    m.add_function(wrap_pyfunction!(child::die_with_parent, m)?)?;
    m.add_function(wrap_pyfunction!(child::fork_single_threaded, m)?)?;
    m.add_class::<native_fork::ChildLife>()?;
    m.add_class::<tiny_machine::TinyMachinePlan>()?;
    m.add_class::<machine_plan::SnapshotMachinePlan>()?;
    m.add_class::<machine_plan::ChildMachinePlan>()?;
    m.add_class::<native_fork::NativeFork>()?;
    m.add_function(wrap_pyfunction!(native_fork::fork_native_batch, m)?)?;
    m.add_function(wrap_pyfunction!(native_fork::forked_machine, m)?)?;
    m.add_function(wrap_pyfunction!(forker::start_forker, m)?)?;
    m.add_function(wrap_pyfunction!(machine_plan::kept_snapshot_plans, m)?)?;
    m.add("IoctlError", m.py().get_type::<IoctlError>())?;
    m.add("CHILD_HEAP_BYTES", child_heap::REGION_BYTES)?;
    Ok(())
}
