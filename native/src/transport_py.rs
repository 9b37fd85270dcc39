//! Python's handle on a device whose transport is native (`transport.rs`):
//! `_core.NativeDevice`, restored from the plan `vmfork.vmm.devices.plan` builds from a
//! decoded `DeviceState`, and giving the same plan back (`plan`) for a snapshot.
//!
//! The plan crosses as plain tuples (the register image as `MmioRegisters.save` gives
//! it), so the state format keeps its one reader in Python and this side only checks
//! values. No Python object is held: the device runs with or without the GIL.

use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::eventloop::EventLoop;
use crate::mmio_py::{py_saved, saved_from_py, MmioRegisters, PySaved};
use crate::queue_server::dup;
use crate::transport::{
    BlkDisk, DeviceKind, DevicePlan, NativeTransport, NetTap, Readers, VsockListener,
};
use crate::virtio_py::GuestRam;

/// A device's kind as Python's plan gives it: ("rng", max_requests, max_bytes, 0),
/// ("balloon", max_chains, advice, actual) or ("vsock", guest_cid, connect timeout
/// ms, reset ack wait ms); or a disk: ("blk" | "volume", disk key, capacity bytes,
/// read-only, a volume's guest path ("" for the root disk)); or ("net", MAC as
/// `NetState.mac` writes it, "aa:bb:cc:dd:ee:ff").
#[derive(FromPyObject, IntoPyObject)]
pub(crate) enum PyKind {
    Numbers(String, u64, i64, u32),
    Disk(String, String, u64, bool, String),
    Net(String, String),
}

/// The numbers of a kind that is not a disk's.
type PyNumbers = (String, u64, i64, u32);

/// A vsock's host side: (socket path, its bound listening fd or None to bind it).
pub(crate) type PyListener = (String, Option<RawFd>);

/// A vsock kind: its plan's numbers and the listener `NativeDevice.restore` was given.
fn vsock_kind(kind: PyNumbers, listener: Option<PyListener>) -> PyResult<DeviceKind> {
    let (_, guest_cid, connect_ms, reset_ack_ms) = kind;
    let Some((path, bound)) = listener else {
        return Err(PyValueError::new_err(
            "a vsock device needs its listener (vsock_listener)",
        ));
    };
    let connect_ms = u64::try_from(connect_ms)
        .map_err(|_| PyValueError::new_err(format!("vsock: connect timeout {connect_ms} ms")))?;
    Ok(DeviceKind::Vsock {
        guest_cid,
        connect_timeout: Duration::from_millis(connect_ms),
        reset_ack_wait: Duration::from_millis(u64::from(reset_ack_ms)),
        listener: VsockListener { path, bound },
    })
}

/// (kind, features, max_sizes, register image, each queue's (next_avail, next_used)).
pub(crate) type PyPlan = (PyKind, u64, Vec<u32>, PySaved, Vec<(u16, u16)>);

/// A disk's kind: its plan's values and its file (`disk_file`, borrowed for the
/// restore; None for an empty slot).
fn disk_kind(
    (name, key, capacity, read_only, guest_path): (String, String, u64, bool, String),
    file: Option<RawFd>,
) -> PyResult<DeviceKind> {
    let volume = match name.as_str() {
        "blk" if guest_path.is_empty() => None,
        "blk" => {
            return Err(PyValueError::new_err(
                "a root disk has no guest path (a volume slot's)",
            ))
        }
        "volume" => Some(guest_path),
        other => {
            return Err(PyValueError::new_err(format!(
                "no native transport for a {other:.40} disk"
            )))
        }
    };
    Ok(DeviceKind::Blk(BlkDisk {
        key,
        capacity,
        read_only,
        volume,
        file,
    }))
}

/// A net kind: its MAC and its tap (`tap`, borrowed for the restore; None: no tap).
fn net_kind((name, mac): (String, String), tap: Option<RawFd>) -> PyResult<DeviceKind> {
    if name != "net" {
        return Err(PyValueError::new_err(format!(
            "no native transport for a {name:.40} device"
        )));
    }
    Ok(DeviceKind::Net(NetTap {
        mac: parse_mac(&mac)?,
        tap,
    }))
}

/// `net.py`'s `parse_mac` on the text form: six hex pairs joined by ':' (the
/// unicast check is the plan's, `NetTap::check`).
fn parse_mac(text: &str) -> PyResult<[u8; 6]> {
    let bad = || PyValueError::new_err(format!("{text:.40?} is not a MAC address"));
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next().ok_or_else(bad)?;
        if part.len() != 2 {
            return Err(bad());
        }
        *byte = u8::from_str_radix(part, 16).map_err(|_| bad())?;
    }
    if parts.next().is_some() {
        return Err(bad());
    }
    Ok(mac)
}

fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

fn kind_from_py(kind: PyKind) -> PyResult<DeviceKind> {
    match kind {
        // The listener is not a plan value (`plan_to_py` drops it): `restore` is given
        // the device's.
        PyKind::Numbers(name, cid, connect, reset) if name == "vsock" => {
            vsock_kind((name, cid, connect, reset), Some((String::new(), None)))
        }
        PyKind::Numbers(name, budget, second, actual) => numbers_kind(name, budget, second, actual),
        // A fresh plan is values only: the file comes with the restore.
        PyKind::Disk(name, key, capacity, read_only, guest_path) => {
            disk_kind((name, key, capacity, read_only, guest_path), None)
        }
        PyKind::Net(name, mac) => net_kind((name, mac), None),
    }
}

fn numbers_kind(name: String, budget: u64, second: i64, actual: u32) -> PyResult<DeviceKind> {
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

/// The plan `vmm/devices/plan.py` builds, as the Rust value: a vsock's also takes its
/// listener, a disk its file, a net device its tap (each None for the others).
pub(crate) fn plan_from_py(
    plan: PyPlan,
    vsock_listener: Option<PyListener>,
    disk_file: Option<RawFd>,
    tap: Option<RawFd>,
) -> PyResult<DevicePlan> {
    let (kind, features, max_sizes, registers, indices) = plan;
    let kind = match kind {
        PyKind::Numbers(name, cid, connect, reset) if name == "vsock" => {
            vsock_kind((name, cid, connect, reset), vsock_listener)?
        }
        PyKind::Numbers(name, budget, second, actual) => {
            numbers_kind(name, budget, second, actual)?
        }
        PyKind::Disk(name, key, capacity, read_only, guest_path) => {
            disk_kind((name, key, capacity, read_only, guest_path), disk_file)?
        }
        PyKind::Net(name, mac) => net_kind((name, mac), tap)?,
    };
    Ok(DevicePlan {
        kind,
        features,
        max_sizes,
        registers: saved_from_py(registers),
        indices,
    })
}

fn kind_to_py(kind: &DeviceKind) -> PyKind {
    let (name, first, second, third) = match *kind {
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
        DeviceKind::Vsock {
            guest_cid,
            connect_timeout,
            reset_ack_wait,
            ..
        } => (
            "vsock".into(),
            guest_cid,
            i64::try_from(connect_timeout.as_millis()).unwrap_or(i64::MAX),
            u32::try_from(reset_ack_wait.as_millis()).unwrap_or(u32::MAX),
        ),
        DeviceKind::Blk(ref disk) => {
            return PyKind::Disk(
                if disk.volume.is_some() {
                    "volume"
                } else {
                    "blk"
                }
                .into(),
                disk.key.clone(),
                disk.capacity,
                disk.read_only,
                disk.volume.clone().unwrap_or_default(),
            )
        }
        DeviceKind::Net(ref net) => return PyKind::Net("net".into(), format_mac(&net.mac)),
    };
    PyKind::Numbers(name, first, second, third)
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
    /// (or None), all duplicated. A vsock also takes `vsock_listener`: (the socket
    /// path, its bound listening fd, duplicated, or None to bind the path here); a
    /// disk `disk_file`, its file (duplicated; None for an empty volume slot); a net
    /// device `tap_fd`, its tap (duplicated; None: no tap).
    /// Re-activated at once if the driver had it running.
    #[staticmethod]
    #[pyo3(signature = (plan, ram, event_loop, irq_fd, notify_fds, vsock_listener=None,
                        disk_file=None, tap_fd=None))]
    #[allow(clippy::too_many_arguments)]
    fn restore(
        py: Python<'_>,
        plan: PyPlan,
        ram: &Bound<'_, GuestRam>,
        event_loop: &Bound<'_, EventLoop>,
        irq_fd: RawFd,
        notify_fds: Vec<Option<RawFd>>,
        vsock_listener: Option<PyListener>,
        disk_file: Option<RawFd>,
        tap_fd: Option<RawFd>,
    ) -> PyResult<Self> {
        let plan = plan_from_py(plan, vsock_listener, disk_file, tap_fd)?;
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

    /// A disk's requests served over its life, as `BlkCounters`' fields: (name, n).
    fn blk_counters(&self) -> Vec<(&'static str, u64)> {
        self.transport.stats().blk.named()
    }

    /// A net device's frames over its life, as `NetCounters`' fields: (name, n).
    fn net_counters(&self) -> Vec<(&'static str, u64)> {
        self.transport.stats().net.named()
    }

    /// Give an empty volume slot its disk (`Machine.attach_volume`): its file
    /// `disk_file` (duplicated, checked to be `capacity` bytes), the volume's `key`
    /// (GET_ID's answer), whether it is `read_only`, the `guest_path` it is mounted
    /// at, and the queue's ioeventfd `notify_fd` (duplicated; None: the slot keeps
    /// the one it had, or none). `ValueError` if refused; nothing changed then. Then
    /// `config_changed` tells the driver.
    #[pyo3(signature = (disk_file, key, capacity, read_only, guest_path, notify_fd=None))]
    #[allow(clippy::too_many_arguments)]
    fn insert_media(
        &self,
        py: Python<'_>,
        disk_file: RawFd,
        key: String,
        capacity: u64,
        read_only: bool,
        guest_path: String,
        notify_fd: Option<RawFd>,
    ) -> PyResult<()> {
        let notify = notify_fd.map(dup).transpose()?;
        let media = BlkDisk {
            key,
            capacity,
            read_only,
            volume: Some(guest_path),
            file: Some(disk_file),
        };
        let transport = self.transport.clone();
        // Rust locks only; a wake of the slot's old server is waited out.
        py.detach(move || transport.insert_media(media, notify))
            .map_err(PyValueError::new_err)
    }

    /// The config space changed (after `insert_media`): a new generation and, if the
    /// driver runs, the configuration-change interrupt; true if it was raised.
    fn config_changed(&self) -> bool {
        self.transport.config_changed()
    }

    /// A vsock device's refusal counters (`vsock.py`'s fixed keys): (key, n); empty for
    /// another kind.
    fn vsock_errors(&self) -> Vec<(&'static str, u64)> {
        self.transport
            .vsock()
            .map(|server| server.errors())
            .unwrap_or_default()
    }

    /// A vsock device's (connections established or being requested, accepted host
    /// sockets still owing their CONNECT line); zeros for another kind.
    fn vsock_connections(&self) -> (usize, usize) {
        self.transport
            .vsock()
            .map(|server| (server.connection_count(), server.pending_count()))
            .unwrap_or_default()
    }

    /// A vsock device: drop every connection and tell the guest
    /// (EVENT_TRANSPORT_RESET); host connection requests are held until it handled it.
    fn transport_reset(&self, py: Python<'_>) -> PyResult<()> {
        let server = self
            .transport
            .vsock()
            .ok_or_else(|| PyValueError::new_err("not a running vsock device"))?;
        // A guest fault goes to the native transport's events, which hand no work back.
        if let Some(work) = py.detach(move || server.transport_reset()) {
            work(py);
        }
        Ok(())
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
