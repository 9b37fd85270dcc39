//! Python's handle on the native virtqueue code: `_core.GuestRam`, built by
//! `GuestMemory` over the regions it mapped, with the split-queue operations and
//! the rng and blk devices' serving loops on it. Python keeps the queue registers (the
//! transport's `Virtqueue` and its `QueueState`), so state stays one plain record;
//! each call takes the numbers it needs and returns what changed.
//!
//! `pop`, `add_used`, `read` and `write` have no caller in the VMM: every device walks
//! its rings inside its native server. They are how the hostile-descriptor properties
//! (`tests/unit/test_virtio_queue.py`) and the atheris target (`tests/fuzz/targets.py`)
//! reach `virtq.rs`'s walk, used ring and copies, and are kept for that alone; the
//! same holds for `vsock_tx_classify`/`vsock_rx_packet` and `vsock_packet.rs`
//! (`tests/unit/test_virtio_vsock_native.py`).
//!
//! Errors are the Python hierarchy's own (`vmfork.vmm.errors`): a guest fault is a
//! `VirtqueueError` or `GuestMemoryError` (the transport turns either into
//! DEVICE_NEEDS_RESET), a closed memory a `HostError`.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::blk::{self, Disk, Warning};
use crate::guest_ram::{GuestRam as Ram, Ram as Locked, RamError, Region};
use crate::virtq::{self, Chain, QueueError, Rings};
use crate::vsock_packet::{self, Header, Verdict};

pub(crate) fn py_error(py: Python<'_>, e: QueueError) -> PyErr {
    let (class, msg) = match e {
        QueueError::Virtqueue(m) => ("VirtqueueError", m),
        QueueError::Memory(RamError::OutOfRange(m)) => ("GuestMemoryError", m),
        QueueError::Memory(RamError::Closed) => ("HostError", RamError::Closed.to_string()),
    };
    match py
        .import("vmfork.vmm.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.call1((msg,)))
    {
        Ok(err) => PyErr::from_value(err),
        Err(import_failed) => import_failed,
    }
}

type Segments = Vec<(u64, u32)>;
/// A vsock header's ten fields, in `struct virtio_vsock_hdr`'s order.
type HeaderFields = (u64, u64, u32, u32, u32, u16, u16, u32, u32, u32);

fn header_fields(h: &Header) -> HeaderFields {
    (
        h.src_cid,
        h.dst_cid,
        h.src_port,
        h.dst_port,
        h.len,
        h.type_,
        h.op,
        h.flags,
        h.buf_alloc,
        h.fwd_cnt,
    )
}

/// Guest RAM for the native device code. Only `GuestMemory` makes one, over
/// mappings it keeps until after it called `close()`. A thin handle: the device
/// servers hold the `Arc`'d regions themselves (`ram()`), so Rust code can hold and
/// share guest RAM with no Python object.
#[pyclass(frozen, module = "vmfork._core")]
pub struct GuestRam {
    ram: Arc<Ram>,
}

impl GuestRam {
    /// The regions, for a device server to hold.
    pub(crate) fn ram(&self) -> Arc<Ram> {
        self.ram.clone()
    }

    /// Run `op` with the regions locked, and build a Python error (which runs Python
    /// code, so the GIL may pass to a thread that wants to `close()`) only after the
    /// lock is released.
    fn with<T>(
        &self,
        py: Python<'_>,
        op: impl FnOnce(&Locked<'_>) -> Result<T, QueueError>,
    ) -> PyResult<T> {
        let result = match self.ram.lock() {
            Ok(ram) => op(&ram),
            Err(e) => Err(e.into()),
        };
        result.map_err(|e| py_error(py, e))
    }

    fn rings(size: u16, desc: u64, avail: u64, used: u64) -> Rings {
        Rings {
            size,
            desc,
            avail,
            used,
            event_idx: false,
        }
    }
}

#[pymethods]
impl GuestRam {
    /// `regions`: (guest physical address, size, host address) of each mapping.
    #[new]
    fn new(regions: Vec<(u64, u64, usize)>) -> Self {
        let regions = regions
            .into_iter()
            .map(|(gpa, size, host)| Region { gpa, size, host })
            .collect();
        // SAFETY: the one caller, `GuestMemory.__init__`, passes the addresses of
        // mappings it owns (`ctypes.addressof` of each region's mmap) and calls
        // `close()` before it unmaps any of them (`GuestMemory.close`).
        GuestRam {
            ram: Arc::new(unsafe { Ram::new(regions) }),
        }
    }

    /// Forget the regions; later calls raise `HostError`. Waits for calls in flight.
    fn close(&self) {
        self.ram.close();
    }

    /// Check a queue's size, alignment and placement (at DRIVER_OK).
    fn validate(
        &self,
        py: Python<'_>,
        size: u16,
        desc: u64,
        avail: u64,
        used: u64,
        max_size: u32,
    ) -> PyResult<()> {
        self.with(py, |ram| {
            virtq::validate(ram, &Self::rings(size, desc, avail, used), max_size)
        })
    }

    /// The chain at `next_avail`: None, or (head, readable, writable). With
    /// `event_idx`, an empty ring gets `avail_event` (in the used ring at `used`) set to
    /// `next_avail` and is looked at again (`virtq::pop`).
    #[pyo3(signature = (size, desc, avail, next_avail, used = 0, event_idx = false))]
    #[allow(clippy::too_many_arguments)]
    fn pop(
        &self,
        py: Python<'_>,
        size: u16,
        desc: u64,
        avail: u64,
        next_avail: u16,
        used: u64,
        event_idx: bool,
    ) -> PyResult<Option<(u16, Segments, Segments)>> {
        let rings = Rings {
            event_idx,
            ..Self::rings(size, desc, avail, used)
        };
        let chain = self.with(py, |ram| virtq::pop(ram, &rings, next_avail))?;
        Ok(chain.map(
            |Chain {
                 head,
                 readable,
                 writable,
             }| (head, readable, writable),
        ))
    }

    /// Whether the driver wants an interrupt for a batch that moved the used index
    /// from `old_used` to `new_used` (`virtq::needs_interrupt`: `used_event` with
    /// `event_idx`, else the avail ring's NO_INTERRUPT flag).
    fn needs_interrupt(
        &self,
        py: Python<'_>,
        size: u16,
        avail: u64,
        old_used: u16,
        new_used: u16,
        event_idx: bool,
    ) -> PyResult<bool> {
        let rings = Rings {
            event_idx,
            ..Self::rings(size, 0, avail, 0)
        };
        self.with(py, |ram| {
            virtq::needs_interrupt(ram, &rings, old_used, new_used)
        })
    }

    /// Return `head` to the driver with `written` bytes; returns the new next_used.
    fn add_used(
        &self,
        py: Python<'_>,
        size: u16,
        used: u64,
        next_used: u16,
        head: u16,
        written: u32,
    ) -> PyResult<u16> {
        self.with(py, |ram| {
            virtq::add_used(
                ram,
                &Self::rings(size, 0, 0, used),
                next_used,
                head,
                written,
            )
        })
    }

    /// Up to `limit` bytes of `segments`, from `offset` bytes in.
    #[pyo3(signature = (segments, limit, offset = 0))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        segments: Segments,
        limit: usize,
        offset: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let data = self.with(py, |ram| {
            virtq::read_segments(ram, &segments, limit, offset)
        })?;
        Ok(PyBytes::new(py, &data))
    }

    /// Scatter `data` into `segments` from `offset`; returns bytes written.
    #[pyo3(signature = (segments, data, offset = 0))]
    fn write(
        &self,
        py: Python<'_>,
        segments: Segments,
        data: &[u8],
        offset: u64,
    ) -> PyResult<usize> {
        self.with(py, |ram| {
            virtq::write_segments(ram, &segments, data, offset)
        })
    }

    /// virtio-rng's request queue: serve at most `max_requests` chains, each filled
    /// with at most `max_bytes` of getrandom(2) output straight into guest RAM.
    /// Returns (next_avail, next_used, chains served, bytes written). A guest fault
    /// raises; the transport then fails the device until the driver resets it, and
    /// the reset drops the queue indices, so those of the chains served before the
    /// fault are not needed.
    #[allow(clippy::too_many_arguments)]
    fn serve_rng(
        &self,
        py: Python<'_>,
        size: u16,
        desc: u64,
        avail: u64,
        used: u64,
        next_avail: u16,
        next_used: u16,
        max_requests: u32,
        max_bytes: usize,
    ) -> PyResult<(u16, u16, u32, u64)> {
        let rings = Self::rings(size, desc, avail, used);
        self.with(py, |ram| {
            let (mut next_avail, mut next_used) = (next_avail, next_used);
            let (mut served, mut bytes) = (0u32, 0u64);
            while served < max_requests {
                let Some(chain) = virtq::pop(ram, &rings, next_avail)? else {
                    break;
                };
                next_avail = next_avail.wrapping_add(1);
                let want = (virtq::total(&chain.writable) as usize).min(max_bytes);
                let written = virtq::fill_random(ram, &chain.writable, want)?;
                next_used = virtq::add_used(ram, &rings, next_used, chain.head, written as u32)?;
                served += 1;
                bytes += written as u64;
            }
            Ok((next_avail, next_used, served, bytes))
        })
    }

    /// virtio-blk's request queue (`blk.rs`): serve at most `max_requests` chains,
    /// stopping once `max_bytes` were written to guest buffers, on the disk `fd`
    /// (negative: none, as after `detach`) of `capacity` bytes. Returns (next_avail,
    /// next_used, served, bytes written, whether the budget ran out first, the
    /// counters' increments as (name, n), the host failures to log as (kind, a, b, c),
    /// the guest fault that ended the call or None). A fault is returned, not raised,
    /// so the caller keeps the counters and the log of the requests served before it.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn serve_blk(
        &self,
        py: Python<'_>,
        size: u16,
        desc: u64,
        avail: u64,
        used: u64,
        next_avail: u16,
        next_used: u16,
        fd: i32,
        capacity: u64,
        read_only: bool,
        disk_id: &[u8],
        max_requests: u32,
        max_bytes: u64,
    ) -> PyResult<(
        u16,
        u16,
        u32,
        u64,
        bool,
        Vec<(&'static str, u64)>,
        Vec<(&'static str, u64, u64, i64)>,
        Option<Py<PyAny>>,
    )> {
        let rings = Self::rings(size, desc, avail, used);
        let disk = Disk {
            fd: (fd >= 0).then_some(fd),
            capacity,
            read_only,
            id: &disk_id[..disk_id.len().min(blk::ID_BYTES)],
        };
        // The lock is dropped at the end of the arm, before any Python error is built.
        let s = match self.ram.lock() {
            Ok(ram) => blk::serve(
                &ram,
                &rings,
                next_avail,
                next_used,
                &disk,
                max_requests,
                max_bytes,
            ),
            Err(e) => return Err(py_error(py, e.into())),
        };
        let counters = s.counters.named();
        let warnings = s.warnings.iter().map(Warning::as_tuple).collect();
        let error = s.error.map(|e| py_error(py, e).into_value(py).into_any());
        Ok((
            s.next_avail,
            s.next_used,
            s.served,
            s.moved,
            s.more,
            counters,
            warnings,
            error,
        ))
    }

    /// vsock: parse and check the packet in a tx chain's readable `segments` for the
    /// guest `guest_cid` (`vsock_packet.rs`: the header copied once, `vsock.py`'s
    /// rules in its order). Returns (verdict, counter key, header fields, op):
    /// ("drop", key, None, None) for a short header or wrong CIDs, ("refuse", key,
    /// header, None) for a bad length or type, ("packet", None, header, op or None
    /// for an op virtio does not define).
    #[allow(clippy::type_complexity)]
    fn vsock_tx_classify(
        &self,
        py: Python<'_>,
        segments: Segments,
        guest_cid: u64,
    ) -> PyResult<(
        &'static str,
        Option<&'static str>,
        Option<HeaderFields>,
        Option<u16>,
    )> {
        let verdict = self.with(py, |ram| {
            vsock_packet::classify_tx(ram, &segments, guest_cid)
        })?;
        Ok(match verdict {
            Verdict::Drop(key) => ("drop", Some(key), None, None),
            Verdict::Refuse(key, h) => ("refuse", Some(key), Some(header_fields(&h)), None),
            Verdict::Packet(h, op) => (
                "packet",
                None,
                Some(header_fields(&h)),
                op.map(|o| o as u16),
            ),
        })
    }

    /// vsock: write one packet into the popped rx chain `head` (`writable` its
    /// buffers): the header `fields` encoded, then `payload` from byte 44 on, each cut
    /// at the chain's end, then the used entry. Returns the new next_used.
    #[allow(clippy::too_many_arguments)]
    fn vsock_rx_packet(
        &self,
        py: Python<'_>,
        size: u16,
        used: u64,
        next_used: u16,
        head: u16,
        writable: Segments,
        fields: HeaderFields,
        payload: &[u8],
    ) -> PyResult<u16> {
        let (src_cid, dst_cid, src_port, dst_port, len, type_, op, flags, buf_alloc, fwd_cnt) =
            fields;
        let hdr = Header {
            src_cid,
            dst_cid,
            src_port,
            dst_port,
            len,
            type_,
            op,
            flags,
            buf_alloc,
            fwd_cnt,
        };
        let rings = Self::rings(size, 0, 0, used);
        self.with(py, |ram| {
            vsock_packet::deliver_rx(ram, &rings, next_used, head, &writable, &hdr, payload)
        })
    }
}
