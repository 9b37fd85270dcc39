//! What every device server on the native loop shares (`rng_serve.rs`, `net_serve.rs`,
//! `vsock_serve.rs`, `balloon_serve.rs`, `blk_serve.rs`): its queues as Python hands
//! them over, the used-buffer interrupt as the transport raises it, the eventfds it
//! duplicates and writes, and the call into Python that reports what needs the GIL.

use std::os::fd::{BorrowedFd, OwnedFd, RawFd};
use std::sync::Arc;

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;

use crate::eventloop::Deferred;
use crate::mmio::INT_USED_BUFFER;
use crate::mmio_py::MmioRegisters;
use crate::virtq::{QueueError, Rings};

/// (size, desc, avail, used, next_avail, next_used) of a ready queue, as Python's
/// `Virtqueue` holds it once `Virtqueue.validate` checked it.
pub type PyQueue = (u16, u64, u64, u64, u16, u16);

/// The rings of queue `name`; its size checked again (a power of 2 in 1..256).
pub fn rings(name: &str, q: PyQueue, event_idx: bool) -> PyResult<Rings> {
    let size = q.0;
    if size == 0 || size > 256 || !size.is_power_of_two() {
        return Err(PyValueError::new_err(format!(
            "{name} queue size {size} is not a power of 2 in 1..256"
        )));
    }
    Ok(Rings {
        size,
        desc: q.1,
        avail: q.2,
        used: q.3,
        event_idx,
    })
}

/// The used-buffer interrupt, as the transport's `trigger` raises it: InterruptStatus
/// for the activation's `epoch` (a reset in between drops it), then a write to the
/// interrupt's eventfd, the KVM irqfd. True if it was raised (for the line's count).
pub fn raise_used_buffer(registers: &Py<MmioRegisters>, epoch: u64, irq: RawFd) -> bool {
    let raised = registers
        .get()
        .regs
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .raise(INT_USED_BUFFER, epoch);
    if raised {
        write_eventfd(irq);
    }
    raised
}

/// A queue whose per-wake budget is spent is served again on a later loop turn: write
/// its ioeventfd, so the loop finds it readable after the other ready fds. False when
/// there is none (a server entered from Python: the caller serves again itself).
pub fn rearm(notify: Option<RawFd>) -> bool {
    match notify {
        Some(fd) => {
            write_eventfd(fd);
            true
        }
        None => false,
    }
}

/// Call `callback(*args)` with the GIL; an exception it raises is reported as
/// unraisable (the loop thread has no caller to hand it to).
pub fn call_python<'py, A>(py: Python<'py>, callback: &Py<PyAny>, args: A)
where
    A: pyo3::call::PyCallArgs<'py>,
{
    if let Err(failed) = callback.call1(py, args) {
        failed.write_unraisable(py, Some(callback.bind(py)));
    }
}

/// A wake's report for Python, to run with the GIL after the turn's native work:
/// `on_report(fault or None, details)`, or nothing when it has neither. `server` keeps
/// the callback (`on_report(server)`) alive until then.
pub fn report<S, T>(
    server: &Arc<S>,
    on_report: fn(&S) -> &Py<PyAny>,
    fault: Option<QueueError>,
    details: Vec<T>,
) -> Option<Deferred>
where
    S: Send + Sync + 'static,
    T: Send + 'static + for<'py> IntoPyObject<'py>,
{
    if fault.is_none() && details.is_empty() {
        return None;
    }
    let server = server.clone();
    Some(Box::new(move |py| {
        let fault = fault.map(|e| crate::virtio_py::py_error(py, e).into_value(py));
        call_python(py, on_report(&server), (fault, details));
    }))
}

pub(crate) fn write_eventfd(fd: RawFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: `fd` is an eventfd the server owns (a duplicate); 8 bytes from a live
    // buffer. A full counter (EAGAIN) still leaves the eventfd signalled.
    let _ = unsafe { libc::write(fd, one.as_ptr().cast(), one.len()) };
}

pub(crate) fn dup(fd: RawFd) -> PyResult<OwnedFd> {
    if fd < 0 {
        return Err(PyValueError::new_err(format!(
            "invalid file descriptor {fd}"
        )));
    }
    // SAFETY: the caller passes an fd it keeps open for the duration of this call.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    borrowed
        .try_clone_to_owned()
        .map_err(|e| PyOSError::new_err(format!("dup({fd}): {e}")))
}
