//! A one-vCPU machine running a real-mode program, built in Rust alone: the VM core
//! (`vm.rs`), COM1 and the i8042 (`console.rs`), and a vCPU loop on the native host
//! (`vcpu.rs`). It is the machine a child's life (`child_life.rs`) and the native
//! fork (`native_fork.rs`) are tested on, in a cargo test and through `_core`, until
//! `NativeMachine` (a restored snapshot) is the one a spawn forks.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvm_ioctls::Kvm;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::child_life::ChildMachine;
use crate::console::{ConsoleDevices, IrqFd};
use crate::control_serve::MachineCounters;
use crate::log_budget::LogBudget;
use crate::machine::NativeCounters;
use crate::transport::NativeTransport;
use crate::vcpu::{ExitSink, NativeHost, UnclaimedCounts, VcpuControl, VcpuThread};
use crate::vm::{Layout, Region, VmCore};

/// Where the program is loaded and starts (CS = 0, IP = this).
pub const ENTRY: usize = 0x1000;
/// The machine's RAM: guest-physical 0 up to this.
pub const RAM_BYTES: usize = 1 << 20;
const LAYOUT: Layout = Layout {
    tss_addr: 0xFFFB_D000,
    identity_map_addr: 0xFFFB_C000,
};
/// How long a vCPU may take to stop when the child ends.
const STOP_TIMEOUT: Duration = Duration::from_secs(2);

/// The program a tiny machine runs, checked to fit.
#[pyclass(frozen, module = "vmfork._core")]
#[derive(Clone)]
pub struct TinyMachinePlan {
    code: Vec<u8>,
}

impl TinyMachinePlan {
    pub fn new(code: Vec<u8>) -> Result<Self, String> {
        if code.is_empty() || code.len() > RAM_BYTES - ENTRY {
            return Err(format!(
                "a real-mode program of 1 to {} bytes, got {}",
                RAM_BYTES - ENTRY,
                code.len()
            ));
        }
        Ok(TinyMachinePlan { code })
    }

    /// The machine, its vCPU not started.
    pub fn build(&self) -> Result<TinyMachine, String> {
        let kvm = Kvm::new().map_err(|e| format!("/dev/kvm: {e}"))?;
        // SAFETY: an anonymous private mapping with no address hint, checked; never
        // unmapped (the machine lives as long as its process), so it outlives the VM.
        let ram = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                RAM_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ram == libc::MAP_FAILED {
            return Err(format!("guest RAM: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: ENTRY + the code's length fits the mapping (checked by `new`).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.code.as_ptr(),
                ram.cast::<u8>().add(ENTRY),
                self.code.len(),
            )
        };
        let region = Region {
            guest_phys: 0,
            size: RAM_BYTES as u64,
            host_addr: ram as u64,
        };
        // SAFETY: the mapping is never unmapped (above).
        let (core, _) = unsafe { VmCore::create(&kvm, &[region], LAYOUT, &[0], None) }
            .map_err(|f| format!("{}: errno {}", f.op, f.errno))?;
        let (_, vcpu) = core.vcpu(0).ok_or("no vCPU 0")?;
        let mut sregs = vcpu
            .get_sregs()
            .map_err(|e| format!("KVM_GET_SREGS: {e}"))?;
        sregs.cs.base = 0;
        sregs.cs.selector = 0;
        vcpu.set_sregs(&sregs)
            .map_err(|e| format!("KVM_SET_SREGS: {e}"))?;
        let mut regs = vcpu.get_regs().map_err(|e| format!("KVM_GET_REGS: {e}"))?;
        regs.rip = ENTRY as u64;
        regs.rflags = 2;
        vcpu.set_regs(&regs)
            .map_err(|e| format!("KVM_SET_REGS: {e}"))?;
        // SAFETY: eventfd2 with constant flags, checked before it is owned.
        let irq = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if irq < 0 {
            return Err(format!("eventfd: {}", std::io::Error::last_os_error()));
        }
        let console = Arc::new(ConsoleDevices::new(
            // SAFETY: the new eventfd above, ours alone.
            IrqFd::new(unsafe { OwnedFd::from_raw_fd(irq) }),
            None,
            LogBudget::new("console", 0, 0.0, 0),
        ));
        let sink = ExitSink::new().map_err(|e| format!("eventfd: {e}"))?;
        let (host, unclaimed) = NativeHost::new(sink.clone(), None);
        let vcpu = VcpuThread::build(Arc::new(core), 0, Box::new(host), Some(console.clone()))
            .map_err(|f| format!("{}: errno {}", f.op, f.errno))?;
        Ok(TinyMachine {
            vcpu,
            sink,
            console,
            unclaimed,
        })
    }
}

#[pymethods]
impl TinyMachinePlan {
    /// `code`: the real-mode program, loaded at 0x1000 and run from there.
    #[new]
    fn py_new(code: Vec<u8>) -> PyResult<Self> {
        TinyMachinePlan::new(code).map_err(PyValueError::new_err)
    }
}

/// A running tiny machine.
pub struct TinyMachine {
    vcpu: VcpuThread,
    sink: Arc<ExitSink>,
    console: Arc<ConsoleDevices>,
    unclaimed: Arc<Mutex<UnclaimedCounts>>,
}

impl ChildMachine for TinyMachine {
    fn start(&self, paused: bool) -> Result<(), String> {
        self.vcpu.start(paused)
    }

    fn resume(&self) {
        self.vcpu.control().resume();
    }

    fn pause(&self, timeout: Duration) -> bool {
        self.vcpu.control().pause(timeout)
    }

    fn vcpu_controls(&self) -> Vec<VcpuControl> {
        vec![self.vcpu.control()]
    }

    fn exit_fd(&self) -> RawFd {
        self.sink.event_fd()
    }

    fn exit(&self) -> Option<(&'static str, String)> {
        self.sink.exit()
    }

    fn console_tail(&self) -> String {
        self.console.tail_text()
    }

    fn balloon(&self) -> Option<Arc<NativeTransport>> {
        None // a console and a vCPU: no devices
    }

    fn counters(&self) -> Arc<dyn MachineCounters> {
        Arc::new(NativeCounters {
            unclaimed: vec![self.unclaimed.clone()],
            pins: Vec::new(),
        })
    }

    fn stop(&self) {
        self.vcpu.stop(STOP_TIMEOUT);
    }
}
