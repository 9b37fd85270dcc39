//! Python's handle on the native virtio-mmio register file (`native/src/mmio.rs`):
//! `_core.MmioRegisters`, a register file of its own (its rules' contract tests) or
//! a native device's (`NativeDevice.registers`), and `_core.MmioWindows`, the MMIO
//! bus's map of native devices' windows that the vCPU loop serves without the GIL.
//!
//! Locks and the GIL. A register file is one `Mutex`. Python threads (tests, a
//! machine reading a device's registers) call in with the GIL and take it: GIL, then
//! the Rust lock. A vCPU thread takes it without the GIL; every window's host is a
//! `NativeTransport`, so no register access takes the GIL (the Python transport that
//! did is deleted, session 22).

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::mmio::{Event, QueueRegs, Read, Registers, Saved};
use crate::transport::Windows;
use crate::transport_py::NativeDevice;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// (kind, number, number, detail): the Python twin returns the same tuples.
type PyEvent = (&'static str, u64, u64, Detail);

/// An event's text (a reason) or bytes (a config write's data).
pub enum Detail {
    Text(String),
    Bytes(Vec<u8>),
}

impl<'py> IntoPyObject<'py> for Detail {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        Ok(match self {
            Detail::Text(s) => s.into_pyobject(py)?.into_any(),
            Detail::Bytes(b) => PyBytes::new(py, &b).into_any(),
        })
    }
}

fn py_event(e: Event) -> PyEvent {
    let none = || Detail::Text(String::new());
    match e {
        Event::Reset => ("reset", 0, 0, none()),
        Event::FeaturesOk(f) => ("features_ok", f, 0, none()),
        Event::FeaturesRefused(r) => ("features_refused", 0, 0, Detail::Text(r)),
        Event::Activate(epoch) => ("activate", epoch, 0, none()),
        Event::NeedsReset(r) => ("needs_reset", 0, 0, Detail::Text(r)),
        Event::Notify(index, epoch) => ("notify", u64::from(index), epoch, none()),
        Event::ConfigWrite(offset, data) => {
            ("config_write", u64::from(offset), 0, Detail::Bytes(data))
        }
    }
}

/// (max_size, size, ready, desc, avail, used)
pub(crate) type PyQueue = (u32, u32, bool, u64, u64, u64);

fn py_queue(q: &QueueRegs) -> PyQueue {
    (q.max_size, q.size, q.ready, q.desc, q.avail, q.used)
}

/// (status, device_features_sel, driver_features_sel, driver_features,
///  driver_features_bad, queue_sel, interrupt_status, config_generation, queues)
pub(crate) type PySaved = (u32, u32, u32, u64, bool, u32, u32, u32, Vec<PyQueue>);

pub(crate) fn py_saved(s: &Saved) -> PySaved {
    (
        s.status,
        s.device_features_sel,
        s.driver_features_sel,
        s.driver_features,
        s.driver_features_bad,
        s.queue_sel,
        s.interrupt_status,
        s.config_generation,
        s.queues.iter().map(py_queue).collect(),
    )
}

pub(crate) fn saved_from_py(saved: PySaved) -> Saved {
    let (status, dfs, drfs, df, bad, qsel, isr, cg, queues) = saved;
    Saved {
        status,
        device_features_sel: dfs,
        driver_features_sel: drfs,
        driver_features: df,
        driver_features_bad: bad,
        queue_sel: qsel,
        interrupt_status: isr,
        config_generation: cg,
        queues: queues
            .into_iter()
            .map(|(max_size, size, ready, desc, avail, used)| QueueRegs {
                max_size,
                size,
                ready,
                desc,
                avail,
                used,
            })
            .collect(),
    }
}

/// One virtio-mmio register file. A thin handle over the `Arc`'d register file, which
/// the device servers and the MMIO windows hold themselves, with no Python object.
#[pyclass(frozen, module = "vmfork._core")]
pub struct MmioRegisters {
    pub(crate) regs: Arc<Mutex<Registers>>,
}

#[pymethods]
impl MmioRegisters {
    /// `config`: the device's config bytes if they are plain (served here), else
    /// None (config accesses go to the device).
    #[new]
    #[pyo3(signature = (device_type, features, max_sizes, config = None))]
    fn new(
        device_type: u32,
        features: u64,
        max_sizes: Vec<u32>,
        config: Option<Vec<u8>>,
    ) -> PyResult<Self> {
        let regs = Registers::new(device_type, features, &max_sizes, config)
            .map_err(PyValueError::new_err)?;
        Ok(MmioRegisters {
            regs: Arc::new(Mutex::new(regs)),
        })
    }

    /// The bytes a guest read gets, or None for a config read the device answers.
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: u64,
        size: usize,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        if size > 8 {
            return Err(PyValueError::new_err(format!("a {size}-byte MMIO read")));
        }
        let mut buf = [0u8; 8];
        let done = matches!(lock(&self.regs).read(offset, &mut buf[..size]), Read::Done);
        Ok(done.then(|| PyBytes::new(py, &buf[..size])))
    }

    /// Apply a guest write; the events it caused, in order.
    fn write(&self, offset: u64, data: &[u8]) -> PyResult<Vec<PyEvent>> {
        if data.len() > 8 {
            return Err(PyValueError::new_err(format!(
                "a {}-byte MMIO write",
                data.len()
            )));
        }
        let mut events = Vec::new();
        lock(&self.regs).write(offset, data, &mut events);
        Ok(events.into_iter().map(py_event).collect())
    }

    fn raise_interrupt(&self, bits: u32, epoch: u64) -> bool {
        lock(&self.regs).raise(bits, epoch)
    }

    fn failed_in(&self, epoch: u64) -> bool {
        lock(&self.regs).failed_in(epoch)
    }

    fn device_error(&self, reason: String, epoch: u64) -> bool {
        lock(&self.regs).device_error(reason, epoch)
    }

    #[pyo3(signature = (config = None))]
    fn config_changed(&self, config: Option<Vec<u8>>) -> bool {
        lock(&self.regs).config_changed(config)
    }

    #[pyo3(signature = (config = None))]
    fn set_config(&self, config: Option<Vec<u8>>) {
        lock(&self.regs).config = config;
    }

    fn running_epoch(&self) -> Option<u64> {
        lock(&self.regs).running_epoch()
    }

    fn activation(&self, epoch: u64) -> Option<Vec<PyQueue>> {
        lock(&self.regs)
            .activation(epoch)
            .map(|qs| qs.iter().map(py_queue).collect())
    }

    fn queues(&self) -> Vec<PyQueue> {
        lock(&self.regs).queues.iter().map(py_queue).collect()
    }

    fn save(&self) -> PySaved {
        py_saved(&lock(&self.regs).save())
    }

    /// Load `save()`'s tuple (a new epoch); returns (epoch, live).
    fn restore(&self, saved: PySaved) -> PyResult<(u64, bool)> {
        lock(&self.regs)
            .restore(&saved_from_py(saved))
            .map_err(PyValueError::new_err)
    }

    #[getter]
    fn epoch(&self) -> u64 {
        lock(&self.regs).epoch
    }
    #[getter]
    fn status(&self) -> u32 {
        lock(&self.regs).status
    }
    #[getter]
    fn interrupt_status(&self) -> u32 {
        lock(&self.regs).interrupt_status
    }
    #[getter]
    fn device_features_sel(&self) -> u32 {
        lock(&self.regs).device_features_sel
    }
    #[getter]
    fn driver_features_sel(&self) -> u32 {
        lock(&self.regs).driver_features_sel
    }
    #[getter]
    fn driver_features(&self) -> u64 {
        lock(&self.regs).driver_features
    }
    #[getter]
    fn driver_features_bad(&self) -> bool {
        lock(&self.regs).driver_features_bad
    }
    #[getter]
    fn queue_sel(&self) -> u32 {
        lock(&self.regs).queue_sel
    }
    #[getter]
    fn config_generation(&self) -> u32 {
        lock(&self.regs).config_generation
    }
    #[getter]
    fn ignored_writes(&self) -> u64 {
        lock(&self.regs).ignored_writes
    }
    #[getter]
    fn bad_accesses(&self) -> u64 {
        lock(&self.regs).bad_accesses
    }
    #[getter]
    fn device_errors(&self) -> u64 {
        lock(&self.regs).device_errors
    }
    #[getter]
    fn last_device_error(&self) -> Option<String> {
        lock(&self.regs).last_device_error.clone()
    }
}

/// The MMIO bus's register files by window (`transport::Windows`), for the native
/// vCPU loop; a machine adds each native device's window here (`add_native`).
#[pyclass(frozen, module = "vmfork._core")]
pub struct MmioWindows {
    pub(crate) windows: Windows,
}

#[pymethods]
impl MmioWindows {
    #[new]
    fn new() -> Self {
        MmioWindows {
            windows: Windows::new(),
        }
    }

    /// Serve `[base, base + 0x1000)` with a device whose transport is native.
    fn add_native(&self, base: u64, device: &Bound<'_, NativeDevice>) -> PyResult<()> {
        let transport = device.get().transport.clone();
        self.windows
            .add(base, transport.registers(), transport)
            .map_err(PyValueError::new_err)
    }

    fn __len__(&self) -> usize {
        self.windows.len()
    }

    /// A guest's read of `size` (1, 2, 4 or 8) bytes at `addr`, served as the vCPU
    /// loop serves it (a window's host called if it must): the bytes, or None if no
    /// window holds `addr`. For a driver in a test; the vCPU loop reads without Python.
    fn read<'py>(
        &self,
        py: Python<'py>,
        addr: u64,
        size: usize,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        if !matches!(size, 1 | 2 | 4 | 8) {
            return Err(PyValueError::new_err(format!("a read of {size} bytes")));
        }
        let mut data = [0u8; 8];
        match self.windows.serve_read(addr, &mut data[..size]) {
            None => Ok(None),
            Some(Ok(())) => Ok(Some(PyBytes::new(py, &data[..size]))),
            Some(Err(failure)) => Err(PyValueError::new_err(failure.detail)),
        }
    }

    /// A guest's write of `data` at `addr`, its events applied by the window's host:
    /// False if no window holds `addr`.
    fn write(&self, addr: u64, data: &[u8]) -> PyResult<bool> {
        match self.windows.serve_write(addr, data) {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(failure)) => Err(PyValueError::new_err(failure.detail)),
        }
    }
}
