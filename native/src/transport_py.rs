//! Python's handle on a device whose transport is native (`transport.rs`):
//! `_core.NativeDevice`, restored from the plan `vmfork.vmm.devices.plan` builds from a
//! decoded `DeviceState`, and giving the same plan back (`plan`) for a snapshot.
//!
//! The plan crosses as plain tuples (the register image as `MmioRegisters.save` gives
//! it), so the state format keeps its one reader in Python and this side only checks
//! values. No Python object is held: the device runs with or without the GIL.

use std::os::fd::RawFd;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::eventloop::EventLoop;
use crate::mmio_py::{py_saved, saved_from_py, MmioRegisters, PySaved};
use crate::queue_server::dup;
use crate::transport::{DeviceKind, DevicePlan, NativeTransport, Readers};
use crate::virtio_py::GuestRam;

/// ("rng", max_requests, max_bytes, 0) or ("balloon", max_chains, advice, actual).
type PyKind = (String, u64, i64, u32);

/// (kind, features, max_sizes, register image, each queue's (next_avail, next_used)).
type PyPlan = (PyKind, u64, Vec<u32>, PySaved, Vec<(u16, u16)>);

fn kind_from_py(kind: PyKind) -> PyResult<DeviceKind> {
    let (name, budget, second, actual) = kind;
    let budget = u32::try_from(budget)
        .map_err(|_| PyValueError::new_err(format!("{name}: budget {budget} too large")))?;
    match name.as_str() {
        "rng" => Ok(DeviceKind::Rng {
            max_requests: budget,
            max_bytes: usize::try_from(second)
                .map_err(|_| PyValueError::new_err(format!("rng: max bytes {second}")))?,
        }),
        "balloon" => Ok(DeviceKind::Balloon {
            max_chains: budget,
            advice: i32::try_from(second)
                .map_err(|_| PyValueError::new_err(format!("balloon: advice {second}")))?,
            actual,
        }),
        other => Err(PyValueError::new_err(format!(
            "no native transport for a {other:.40} device"
        ))),
    }
}

fn kind_to_py(kind: &DeviceKind) -> PyKind {
    match *kind {
        DeviceKind::Rng {
            max_requests,
            max_bytes,
        } => ("rng".into(), u64::from(max_requests), max_bytes as i64, 0),
        DeviceKind::Balloon {
            max_chains,
            advice,
            actual,
        } => (
            "balloon".into(),
            u64::from(max_chains),
            i64::from(advice),
            actual,
        ),
    }
}

/// A virtio device served by a native transport: its events acted on in Rust.
#[pyclass(frozen, module = "vmfork._core")]
pub struct NativeDevice {
    pub(crate) transport: Arc<NativeTransport>,
}

#[pymethods]
impl NativeDevice {
    /// Restore the device from `plan` over `ram`, its server on `event_loop` while it
    /// runs; `irq_fd` is the interrupt's eventfd, `notify_fds` each queue's ioeventfd
    /// (or None), all duplicated. Re-activated at once if the driver had it running.
    #[staticmethod]
    fn restore(
        py: Python<'_>,
        plan: PyPlan,
        ram: &Bound<'_, GuestRam>,
        event_loop: &Bound<'_, EventLoop>,
        irq_fd: RawFd,
        notify_fds: Vec<Option<RawFd>>,
    ) -> PyResult<Self> {
        let (kind, features, max_sizes, registers, indices) = plan;
        let plan = DevicePlan {
            kind: kind_from_py(kind)?,
            features,
            max_sizes,
            registers: saved_from_py(registers),
            indices,
        };
        let irq = dup(irq_fd)?;
        let notify = notify_fds
            .into_iter()
            .map(|fd| fd.map(dup).transpose())
            .collect::<PyResult<Vec<_>>>()?;
        let ram = ram.get().ram();
        let readers = event_loop.get().inner.clone() as Arc<dyn Readers>;
        // Rust locks only (the transport's, RAM's, the register file's, the loop's):
        // the vCPU and loop threads run meanwhile.
        let transport = py
            .detach(move || NativeTransport::restore(&plan, ram, readers, irq, notify))
            .map_err(PyValueError::new_err)?;
        Ok(NativeDevice { transport })
    }

    /// The plan of a device of `kind` offering `features` and queues of `max_sizes`
    /// before any driver touched it: what a booted machine's device starts from.
    #[staticmethod]
    fn fresh_plan(kind: PyKind, features: u64, max_sizes: Vec<u32>) -> PyResult<PyPlan> {
        let plan = DevicePlan::fresh(kind_from_py(kind)?, features, max_sizes)
            .map_err(PyValueError::new_err)?;
        Ok(plan_to_py(&plan))
    }

    /// The plan again: what a snapshot saves (the vCPUs paused).
    fn plan(&self, py: Python<'_>) -> PyPlan {
        let transport = self.transport.clone();
        plan_to_py(&py.detach(move || transport.plan()))
    }

    /// A handle on the register file (the machine's stats, tests).
    #[getter]
    fn registers(&self) -> MmioRegisters {
        MmioRegisters {
            regs: self.transport.registers(),
        }
    }

    #[getter]
    fn active(&self) -> bool {
        self.transport.active()
    }

    #[getter]
    fn acked_features(&self) -> u64 {
        self.transport.acked_features()
    }

    /// Used-buffer interrupts raised over the device's life (its irq line's count).
    #[getter]
    fn interrupts(&self) -> u64 {
        self.transport.stats().interrupts
    }

    /// An rng's (requests, bytes) served over its life.
    fn rng_served(&self) -> (u64, u64) {
        let stats = self.transport.stats();
        (stats.requests, stats.bytes)
    }

    /// A balloon's (reports, bytes_discarded, discard_errors, ignored_buffers,
    /// discards_held, seconds since the last report or None) over its life.
    fn balloon_stats(&self) -> (u64, u64, u64, u64, u64, Option<f64>) {
        let stats = self.transport.stats();
        let c = stats.balloon;
        (
            c.reports,
            c.bytes_discarded,
            c.discard_errors,
            c.ignored_buffers,
            c.discards_held,
            stats.last_report.map(|t| t.elapsed().as_secs_f64()),
        )
    }

    /// A capture is in flight: a balloon keeps reported pages until `release`.
    fn hold(&self) {
        self.transport.hold();
    }

    fn release(&self) {
        self.transport.release();
    }

    /// Serve no more (the machine's close): the server leaves the loop.
    fn close(&self, py: Python<'_>) {
        let transport = self.transport.clone();
        py.detach(move || transport.close());
    }

    /// (faults, reports, details, last fault) over the device's life.
    fn record(&self) -> (u64, u64, u64, Option<String>) {
        let r = self.transport.record();
        (r.faults, r.reports, r.details, r.last_fault)
    }
}

fn plan_to_py(plan: &DevicePlan) -> PyPlan {
    (
        kind_to_py(&plan.kind),
        plan.features,
        plan.max_sizes.clone(),
        py_saved(&plan.registers),
        plan.indices.clone(),
    )
}
