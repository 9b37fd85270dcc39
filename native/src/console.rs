//! The legacy devices a guest's console and reboot use, served on the vCPU thread
//! without Python: COM1 (vm-superio's 16550A `Serial`) and the i8042's CPU reset line.
//!
//! COM1's output is cut into lines (at most `LINE_MAX` bytes each; the rest of a
//! longer line is dropped): each goes to the console log (one `write` per line,
//! within the log's budget: a rate with drop markers and a total cap, since the
//! guest decides how much it prints), into the last-`TAIL_LINES` ring that errors
//! quote, and, only while Python listeners are registered (a booting parent waiting
//! for its agent), to them.
//! Its interrupt is the line's eventfd (KVM_IRQFD), written from here.
//!
//! The i8042 at 0x60/0x64 reads as an idle controller with no data; command 0xFE
//! on 0x64 (Linux's `reboot=k`) pulses the CPU reset line, which ends the VM.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::os::fd::{BorrowedFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{Serial, Trigger};

use crate::log_budget::LogBudget;

pub const COM1_BASE: u16 = 0x3F8;
pub const COM1_LEN: u16 = 8;
pub const I8042_DATA: u16 = 0x60;
pub const I8042_COMMAND: u16 = 0x64;
const I8042_RESET_CPU: u8 = 0xFE;

const TAIL_LINES: usize = 50;
const LINE_MAX: usize = 4096;
/// vm-superio's receive FIFO: a snapshot's pending input beyond it is dropped.
const FIFO_SIZE: usize = 64;

const IIR_NONE: u8 = 0x01;
const IIR_THR_EMPTY: u8 = 0x02;
const IIR_RDA: u8 = 0x04;
const LSR_DATA_READY: u8 = 0x01;
const LSR_THR_EMPTY: u8 = 0x20;
const LSR_IDLE: u8 = 0x40;
const MSR_IDLE: u8 = 0x10 | 0x20 | 0x80; // CTS, DSR, DCD

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// COM1's interrupt: the eventfd its GSI is bound to with KVM_IRQFD.
pub struct IrqFd(OwnedFd);

impl IrqFd {
    pub fn new(eventfd: OwnedFd) -> Self {
        IrqFd(eventfd)
    }
}

impl Trigger for IrqFd {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local buffer to a descriptor we own.
        let n = unsafe {
            libc::write(
                std::os::fd::AsRawFd::as_raw_fd(&self.0),
                one.as_ptr().cast(),
                8,
            )
        };
        // EAGAIN: the counter is at its maximum, so an interrupt is pending anyway.
        if n == 8 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EAGAIN) {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
}

/// Where COM1's bytes go.
pub struct ConsoleOut {
    line: Vec<u8>,
    tail: VecDeque<String>,
    log: Option<File>,
    budget: LogBudget,
    /// Lines for the Python listeners, handed over after the device lock is released.
    pending: Vec<String>,
    listening: bool,
}

impl ConsoleOut {
    fn new(log: Option<File>, budget: LogBudget) -> Self {
        ConsoleOut {
            line: Vec::new(),
            tail: VecDeque::new(),
            log,
            budget,
            pending: Vec::new(),
            listening: false,
        }
    }
}

impl Write for ConsoleOut {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        for &byte in buf {
            if byte == b'\n' {
                let text = String::from_utf8_lossy(&self.line)
                    .trim_end_matches('\r')
                    .to_string();
                self.line.clear();
                if let Some(log) = self.log.as_mut() {
                    let mut out = text.clone().into_bytes();
                    out.push(b'\n');
                    let (allowed, marker) = self.budget.take(out.len());
                    // A console log that cannot be written loses lines, never the VM.
                    if let Some(marker) = marker {
                        let _ = log.write_all(format!("{marker}\n").as_bytes());
                    }
                    if allowed {
                        let _ = log.write_all(&out);
                    }
                }
                if self.listening {
                    self.pending.push(text.clone());
                }
                if self.tail.len() == TAIL_LINES {
                    self.tail.pop_front();
                }
                self.tail.push_back(text);
            } else if self.line.len() < LINE_MAX {
                self.line.push(byte);
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

type Uart = Serial<IrqFd, NoEvents, ConsoleOut>;

/// COM1 and the i8042 as a Rust value, shared by a machine's vCPU loops (each holds
/// an `Arc`), so a loop serves them with no Python object in hand.
pub struct ConsoleDevices {
    uart: Mutex<Uart>,
    /// Where finished lines go while someone listens (a booting parent waiting for
    /// its agent); called with no lock held.
    line_sink: Mutex<Option<LineSink>>,
}

/// A receiver of console lines, called on a vCPU thread.
pub type LineSink = Arc<dyn Fn(&[String]) + Send + Sync>;

/// `_core.Console`: the PyO3 wrapper of [`ConsoleDevices`] (`devices/serial.py`
/// wraps it as the machine's `serial`).
#[pyclass(frozen, module = "vmfork._core")]
pub struct Console {
    devices: Arc<ConsoleDevices>,
    /// The Python line listeners, behind the devices' line sink once one is added.
    listeners: Arc<Mutex<Vec<Py<PyAny>>>>,
}

/// COM1's registers as `SerialState`'s fields cross from Python: (dll, dlm, ier, lcr,
/// mcr, scr, thre_pending, rx).
pub type SerialFields = (u8, u8, u8, u8, u8, u8, bool, Vec<u8>);

/// COM1's registers as a snapshot keeps them (`devices/serial.py`'s `SerialState`).
pub struct SerialRegs {
    pub dll: u8,
    pub dlm: u8,
    pub ier: u8,
    pub lcr: u8,
    pub mcr: u8,
    pub scr: u8,
    pub thre_pending: bool,
    pub rx: Vec<u8>,
}

impl SerialRegs {
    pub fn from_fields(fields: SerialFields) -> Self {
        let (dll, dlm, ier, lcr, mcr, scr, thre_pending, rx) = fields;
        SerialRegs {
            dll,
            dlm,
            ier,
            lcr,
            mcr,
            scr,
            thre_pending,
            rx,
        }
    }
}

/// The console log's budget (`LogBudget`): `burst` lines, then `per_second`, and
/// `total_bytes` in all; a rate that is not a finite number >= 0 is refused.
pub fn log_budget(burst: u32, per_second: f64, total_bytes: u64) -> Result<LogBudget, String> {
    if !(per_second.is_finite() && per_second >= 0.0) {
        return Err(format!(
            "log_per_second must be a finite rate >= 0, not {per_second}"
        ));
    }
    Ok(LogBudget::new("console", burst, per_second, total_bytes))
}

/// What a port access to the console devices asks of the vCPU loop.
pub enum Served {
    Done,
    Reset,
}

impl ConsoleDevices {
    /// COM1 raising `irq`, its lines written to `log` within `budget`, and the i8042.
    pub fn new(irq: IrqFd, log: Option<File>, budget: LogBudget) -> Self {
        ConsoleDevices {
            uart: Mutex::new(Serial::new(irq, ConsoleOut::new(log, budget))),
            line_sink: Mutex::new(None),
        }
    }

    /// Send every console line from now on to `sink` too.
    pub fn set_line_sink(&self, sink: LineSink) {
        *lock(&self.line_sink) = Some(sink);
        lock(&self.uart).writer_mut().listening = true;
    }

    /// Serve a port access if it is ours (`None` if it is not).
    /// `data` is `size`-byte elements (string I/O has several); like the chips, the
    /// devices see the low byte of each and read as one byte, zero-extended.
    pub fn pio(&self, port: u16, data: &mut [u8], size: usize, write: bool) -> Option<Served> {
        if (COM1_BASE..COM1_BASE + COM1_LEN).contains(&port) {
            let offset = (port - COM1_BASE) as u8;
            if write {
                let lines = {
                    let mut uart = lock(&self.uart);
                    for chunk in data.chunks_exact(size) {
                        // An interrupt that cannot be raised loses that interrupt only.
                        let _ = uart.write(offset, chunk[0]);
                    }
                    std::mem::take(&mut uart.writer_mut().pending)
                };
                if !lines.is_empty() {
                    self.tell_listeners(lines);
                }
            } else {
                let mut uart = lock(&self.uart);
                for chunk in data.chunks_exact_mut(size) {
                    chunk.fill(0);
                    chunk[0] = uart.read(offset);
                }
            }
            return Some(Served::Done);
        }
        if port == I8042_DATA || port == I8042_COMMAND {
            if write {
                if port == I8042_COMMAND && data.chunks_exact(size).any(|c| c[0] == I8042_RESET_CPU)
                {
                    return Some(Served::Reset);
                }
            } else {
                data.fill(0); // idle, no data
            }
            return Some(Served::Done);
        }
        None
    }

    /// The last lines of output and the line being written, joined by newlines.
    pub fn tail_text(&self) -> String {
        let uart = lock(&self.uart);
        let out = uart.writer();
        let mut lines: Vec<String> = out.tail.iter().cloned().collect();
        if !out.line.is_empty() {
            lines.push(String::from_utf8_lossy(&out.line).into_owned());
        }
        lines.join("\n")
    }

    /// COM1's registers as `SerialState`'s fields: (dll, dlm, ier, lcr, mcr, scr,
    /// thre_pending, rx).
    pub fn save(&self) -> SerialFields {
        let s = lock(&self.uart).state();
        (
            s.baud_divisor_low,
            s.baud_divisor_high,
            s.interrupt_enable,
            s.line_control,
            s.modem_control,
            s.scratch,
            s.interrupt_identification & IIR_THR_EMPTY != 0,
            s.in_buffer,
        )
    }

    /// Set COM1's registers from a snapshot's (`SerialState`); pending input beyond
    /// the 64-byte FIFO is dropped. The writer (log, budget, tail, listeners) carries
    /// over to the restored chip.
    pub fn restore(&self, regs: SerialRegs) -> Result<(), String> {
        let mut in_buffer = regs.rx;
        in_buffer.truncate(FIFO_SIZE);
        let mut iir = if regs.thre_pending { IIR_THR_EMPTY } else { 0 };
        if !in_buffer.is_empty() {
            iir |= IIR_RDA;
        }
        let state = SerialState {
            baud_divisor_low: regs.dll,
            baud_divisor_high: regs.dlm,
            interrupt_enable: regs.ier & 0x0F,
            interrupt_identification: if iir == 0 { IIR_NONE } else { iir },
            line_control: regs.lcr,
            line_status: LSR_THR_EMPTY
                | LSR_IDLE
                | if in_buffer.is_empty() {
                    0
                } else {
                    LSR_DATA_READY
                },
            modem_control: regs.mcr & 0x1F,
            modem_status: MSR_IDLE,
            scratch: regs.scr,
            in_buffer,
        };
        let mut uart = lock(&self.uart);
        let trigger = IrqFd(
            uart.interrupt_evt()
                .0
                .try_clone()
                .map_err(|e| format!("dup COM1's irqfd: {e}"))?,
        );
        let out = std::mem::replace(
            uart.writer_mut(),
            ConsoleOut::new(None, LogBudget::new("console", 0, 0.0, 0)),
        );
        *uart = Serial::from_state(&state, trigger, NoEvents, out)
            .map_err(|e| format!("serial state: {e:?}"))?;
        Ok(())
    }

    fn tell_listeners(&self, lines: Vec<String>) {
        let sink = lock(&self.line_sink).clone();
        if let Some(sink) = sink {
            sink(&lines);
        }
    }
}

/// Call each Python listener with each line, the GIL taken (and no Rust lock held
/// when a listener runs).
fn tell_python(listeners: &Mutex<Vec<Py<PyAny>>>, lines: &[String]) {
    Python::attach(|py| {
        let listeners: Vec<Py<PyAny>> = lock(listeners).iter().map(|l| l.clone_ref(py)).collect();
        for line in lines {
            for listener in &listeners {
                if let Err(err) = listener.call1(py, (line.as_str(),)) {
                    err.write_unraisable(py, Some(listener.bind(py)));
                }
            }
        }
    });
}

impl Console {
    /// The devices, for a vCPU loop to serve.
    pub fn devices(&self) -> Arc<ConsoleDevices> {
        self.devices.clone()
    }
}

#[pymethods]
impl Console {
    /// `irq_fd`: COM1's interrupt eventfd (duplicated); `log_fd`: the console log,
    /// opened for appending (duplicated), or None; the log's budget: `log_burst`
    /// lines, then `log_per_second`, and `log_total_bytes` in all (serial.py's
    /// `CONSOLE_*` constants are the machine's).
    #[new]
    #[pyo3(signature = (irq_fd, log_fd = None, *, log_burst = 2000, log_per_second = 100.0,
                        log_total_bytes = 8 << 20))]
    fn new(
        irq_fd: RawFd,
        log_fd: Option<RawFd>,
        log_burst: u32,
        log_per_second: f64,
        log_total_bytes: u64,
    ) -> PyResult<Self> {
        let budget = log_budget(log_burst, log_per_second, log_total_bytes)
            .map_err(PyValueError::new_err)?;
        let irq = IrqFd(dup(irq_fd)?);
        let log = match log_fd {
            Some(fd) => Some(File::from(dup(fd)?)),
            None => None,
        };
        Ok(Console {
            devices: Arc::new(ConsoleDevices::new(irq, log, budget)),
            listeners: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// COM1's register `offset` as a bus device reads it (`Bus` protocol): one byte,
    /// zero-extended to `size` (at most 8).
    fn read<'py>(&self, py: Python<'py>, offset: u16, size: usize) -> Bound<'py, PyBytes> {
        let mut data = vec![0xFF; size.clamp(1, 8)];
        if offset < COM1_LEN {
            let width = data.len();
            self.devices
                .pio(COM1_BASE + offset, &mut data, width, false);
        }
        PyBytes::new(py, &data)
    }

    /// A write of `data` (its first byte) to COM1's register `offset` (`Bus` protocol).
    fn write(&self, offset: u16, data: &[u8]) {
        if offset < COM1_LEN && !data.is_empty() {
            let mut byte = [data[0]];
            self.devices.pio(COM1_BASE + offset, &mut byte, 1, true);
        }
    }

    /// Console log lines dropped so far (over the rate, or past the cap).
    #[getter]
    fn log_dropped(&self) -> u64 {
        lock(&self.devices.uart).writer().budget.dropped
    }

    /// Call `listener(line)` for every console line from now on (on a vCPU thread).
    fn add_line_listener(&self, listener: Py<PyAny>) {
        let first = {
            let mut listeners = lock(&self.listeners);
            listeners.push(listener);
            listeners.len() == 1
        };
        if first {
            let listeners = self.listeners.clone();
            self.devices
                .set_line_sink(Arc::new(move |lines: &[String]| {
                    tell_python(&listeners, lines)
                }));
        }
    }

    /// The last lines of output and the line being written, joined by newlines.
    fn tail_text(&self) -> String {
        self.devices.tail_text()
    }

    /// COM1's registers as `SerialState`'s fields: (dll, dlm, ier, lcr, mcr, scr,
    /// thre_pending, rx).
    fn save(&self) -> SerialFields {
        self.devices.save()
    }

    /// Set COM1's registers from `SerialState`'s fields (as `save` gives them);
    /// pending input beyond the 64-byte FIFO is dropped.
    #[allow(clippy::too_many_arguments)]
    fn restore(
        &self,
        dll: u8,
        dlm: u8,
        ier: u8,
        lcr: u8,
        mcr: u8,
        scr: u8,
        thre_pending: bool,
        rx: Vec<u8>,
    ) -> PyResult<()> {
        let regs = SerialRegs::from_fields((dll, dlm, ier, lcr, mcr, scr, thre_pending, rx));
        self.devices.restore(regs).map_err(PyValueError::new_err)
    }

    /// Queue host input for the guest (at most the FIFO's free room); returns how
    /// many bytes were queued.
    fn queue_input(&self, data: &[u8]) -> usize {
        let mut uart = lock(&self.devices.uart);
        let room = uart.fifo_capacity().min(data.len());
        uart.enqueue_raw_bytes(&data[..room]).unwrap_or(0)
    }
}

fn dup(fd: RawFd) -> PyResult<OwnedFd> {
    // SAFETY: Python holds `fd` open for the length of this call (an argument of it).
    unsafe { BorrowedFd::borrow_raw(fd) }
        .try_clone_to_owned()
        .map_err(|e| PyOSError::new_err(format!("dup: {e}")))
}
