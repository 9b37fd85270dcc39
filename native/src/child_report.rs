//! A spawned child's status reports (`vmmchild.main`'s `report`): `status.json`
//! replaced atomically, then one `<vm_id> <state>\n` line to the spawner's FIFO.
//!
//! The paths are C strings built once, before the fork where the zygote can
//! (`vmmchild.prefork`), so a report costs the child no Python beyond handing over
//! its fields; the file and the FIFO are written with the GIL released. The file
//! keeps the keys and value types the Python writer wrote (`json.dumps` of the
//! same dict, in its order): the spawner (`server/spawner.py`) and the tests read it.
//!
//! No fsync: the file describes this live process and its directory is removed
//! when the process ends, so surviving a host crash is worth nothing here.

use std::ffi::CString;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

/// Nested values deeper than this are refused: a status is two levels deep.
const MAX_DEPTH: usize = 8;

/// One child's report targets: `run_dir/.status.json.tmp`, `run_dir/status.json`,
/// the FIFO (if the spawner gave one) and the vm id its lines start with.
#[pyclass(frozen, module = "vmfork._core")]
pub struct ChildReporter {
    tmp: CString,
    status: CString,
    notify: Option<CString>,
    vm_id: String,
}

#[pymethods]
impl ChildReporter {
    #[new]
    #[pyo3(signature = (run_dir, vm_id, notify_path=None))]
    fn new(run_dir: &str, vm_id: &str, notify_path: Option<&str>) -> PyResult<Self> {
        Self::at(run_dir, vm_id, notify_path).map_err(PyValueError::new_err)
    }

    /// Write `status` (a dict with a str `state`) to status.json, then the FIFO line;
    /// a `failed` status's `reason` also goes to stderr (the zygote passes the log's
    /// tail on with the exit, after it removed the run directory). Raises `OSError`
    /// if status.json cannot be written; the FIFO is best effort, as before.
    fn report(&self, py: Python<'_>, status: &Bound<'_, PyDict>) -> PyResult<()> {
        let mut json = String::with_capacity(256);
        write_value(&mut json, status.as_any(), 0)?;
        let state: String = status
            .get_item("state")?
            .ok_or_else(|| PyValueError::new_err("a status needs a 'state'"))?
            .extract()?;
        let failure = if state == "failed" {
            let reason = status.get_item("reason")?.map(|r| r.to_string());
            Some(self.failure_line(&reason.unwrap_or_default()))
        } else {
            None
        };
        py.detach(|| self.write(&state, json.as_bytes(), failure.as_deref()))
            .map_err(|e| PyOSError::new_err((e.raw_os_error().unwrap_or(0), e.to_string())))
    }
}

impl ChildReporter {
    /// The targets of the child whose run directory is `run_dir`; an error names a
    /// path holding a NUL byte.
    pub fn at(run_dir: &str, vm_id: &str, notify_path: Option<&str>) -> Result<Self, String> {
        let c = |path: &str| CString::new(path).map_err(|_| format!("a NUL byte in {path:?}"));
        let dir = run_dir.trim_end_matches('/');
        Ok(Self {
            tmp: c(&format!("{dir}/.status.json.tmp"))?,
            status: c(&format!("{dir}/status.json"))?,
            notify: notify_path.map(c).transpose()?,
            vm_id: vm_id.to_owned(),
        })
    }

    /// Write one status already encoded (`json`, whose `state` is `state`) to
    /// status.json, then the FIFO line, then `failure` (with its newline) to stderr:
    /// the one writer of both the Python and the native child's reports.
    pub fn write(&self, state: &str, json: &[u8], failure: Option<&str>) -> io::Result<()> {
        let written = replace_file(&self.tmp, &self.status, json);
        if let Some(fifo) = &self.notify {
            notify(fifo, format!("{} {}\n", self.vm_id, state).as_bytes());
        }
        if let Some(text) = failure {
            write_stderr(text.as_bytes());
        }
        written
    }

    /// `vmfork vmm <vm_id>: <reason>`, the line a failed status also writes to stderr.
    pub fn failure_line(&self, reason: &str) -> String {
        format!("vmfork vmm {}: {}\n", self.vm_id, reason)
    }
}

/// `value` as JSON, in the dict's own order, with the types `json.dumps` gives it:
/// None, bool, int, float, str, and lists, tuples and dicts (str keys) of them.
fn write_value(out: &mut String, value: &Bound<'_, PyAny>, depth: usize) -> PyResult<()> {
    if depth > MAX_DEPTH {
        return Err(PyValueError::new_err("a status nested too deep"));
    }
    if value.is_none() {
        out.push_str("null");
    } else if let Ok(b) = value.cast::<PyBool>() {
        out.push_str(if b.is_true() { "true" } else { "false" });
    } else if value.cast::<PyInt>().is_ok() {
        // Any size, as Python writes it.
        out.push_str(&value.str()?.to_cow()?);
    } else if let Ok(f) = value.cast::<PyFloat>() {
        let v = f.value();
        if v.is_finite() {
            out.push_str(&serde_json::to_string(&v).map_err(json_error)?);
        } else {
            // json.dumps's spelling (its reader, and the spawner's, take it back).
            out.push_str(if v.is_nan() {
                "NaN"
            } else if v > 0.0 {
                "Infinity"
            } else {
                "-Infinity"
            });
        }
    } else if let Ok(s) = value.cast::<PyString>() {
        out.push_str(&serde_json::to_string(&s.to_string_lossy()).map_err(json_error)?);
    } else if let Ok(d) = value.cast::<PyDict>() {
        out.push('{');
        for (i, (k, v)) in d.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            let key = k
                .cast::<PyString>()
                .map_err(|_| PyValueError::new_err("a status key must be a str"))?;
            out.push_str(&serde_json::to_string(&key.to_string_lossy()).map_err(json_error)?);
            out.push_str(": ");
            write_value(out, &v, depth + 1)?;
        }
        out.push('}');
    } else if value.cast::<PyList>().is_ok() || value.cast::<PyTuple>().is_ok() {
        out.push('[');
        for (i, item) in value.try_iter()?.enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            write_value(out, &item?, depth + 1)?;
        }
        out.push(']');
    } else {
        return Err(PyValueError::new_err(format!(
            "a status value of type {} is not JSON",
            value.get_type().name()?
        )));
    }
    Ok(())
}

fn json_error(err: serde_json::Error) -> PyErr {
    PyValueError::new_err(err.to_string())
}

fn open(path: &CString, flags: i32) -> io::Result<OwnedFd> {
    // SAFETY: `path` is a NUL-terminated C string that outlives the call.
    let fd = unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC, 0o644) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened here and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn write_all(fd: &OwnedFd, mut data: &[u8]) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    while !data.is_empty() {
        // SAFETY: `data` is a live slice; write reads at most its length.
        let n = unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::WriteZero));
        }
        data = &data[n as usize..];
    }
    Ok(())
}

/// Replace `path` with `data`: write `tmp`, rename it over.
pub(crate) fn replace_file(tmp: &CString, path: &CString, data: &[u8]) -> io::Result<()> {
    let fd = open(tmp, libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC)?;
    write_all(&fd, data)?;
    drop(fd);
    // SAFETY: both are NUL-terminated C strings that outlive the call.
    if unsafe { libc::rename(tmp.as_ptr(), path.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// One line to the spawner's FIFO; a line under PIPE_BUF is written whole. Never
/// blocks, never fails: if the spawner is gone or its FIFO full, it still polls
/// the files.
fn notify(fifo: &CString, line: &[u8]) {
    if let Ok(fd) = open(fifo, libc::O_WRONLY | libc::O_NONBLOCK) {
        let _ = write_all(&fd, line);
    }
}

fn write_stderr(text: &[u8]) {
    // SAFETY: fd 2 is borrowed for the one call; a failed write has nowhere to go.
    let _ = unsafe { libc::write(2, text.as_ptr().cast(), text.len()) };
}
