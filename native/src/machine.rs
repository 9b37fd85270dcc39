//! A machine assembled and run in Rust alone: what a child that runs no Python after
//! its fork will be (docs/native.md, "Where the line goes next").
//!
//! `NativeMachine::restore` builds, from plain values and with no Python object:
//!
//! 1. guest RAM: regions the caller mapped (a diff snapshot's premap, inherited from
//!    the zygote and adopted, `InheritedRam`), or a snapshot's memory file mapped here
//!    `MAP_PRIVATE` (the layout of `vmm/memory.py`'s `ram_layout`: RAM below the MMIO
//!    hole at 3 GiB, the rest from 4 GiB);
//! 2. the VM core (`vm.rs`): the VM, its slots, irqchip, PIT and vCPUs, and the
//!    snapshot's VM and vCPU state when there is one (`restore.rs`);
//! 3. the console (`console.rs`): COM1 raising its pin through an irqfd, its lines
//!    to the console log within the log's budget, its registers from the snapshot;
//! 4. the I/O loop (`NativeLoop`);
//! 5. each virtio device from its `DevicePlan` at its slot: its pin's irqfd
//!    (`KVM_IRQFD`, one line per pin, shared by the devices on it, as
//!    `Machine._irq_line` does), an ioeventfd per queue on the window's QueueNotify
//!    with the queue's index as datamatch (`KVM_IOEVENTFD`, as
//!    `Machine._mmio_transport` does; none for an empty volume slot,
//!    `DevicePlan::wants_ioeventfds`), its `NativeTransport` in the machine's
//!    `Windows` at `VIRTIO_MMIO_BASE + slot * 4 KiB` (`vmm/x86/layout.py`);
//! 6. a `VcpuThread` per vCPU with a `NativeHost` over those windows, all reporting
//!    to one `ExitSink`: the first exit of any vCPU is the machine's.
//!
//! The device list is a `Vec<SlotPlan>`: nothing here depends on a device's kind, so
//! a device gets its native transport by its arm in `transport.rs` alone.
//!
//! `stop` (and drop) tears down in the order the parts depend on each other: the vCPU
//! threads end and are joined (each held the VM core and its own vCPU descriptor),
//! the transports leave the loop (their servers with them), the loop ends, guest RAM
//! is closed to the device code, the VM core lets go of its descriptors, RAM mapped
//! here is unmapped, and every eventfd closes. A vCPU that did not stop in time keeps
//! the RAM mapped (leaked, not unmapped under a running guest).

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use std::mem::ManuallyDrop;

use kvm_ioctls::{IoEventAddress, Kvm};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::console::{log_budget, ConsoleDevices, IrqFd, SerialFields, SerialRegs};
use crate::control_serve::{MachineCounters, SharedSnapshotStatus, SnapshotStatus};
use crate::eventloop::NativeLoop;
use crate::guest_ram::{self, GuestRam};
use crate::log_budget::LogBudget;
use crate::mmio::{self, WINDOW_SIZE};
use crate::queue_server;
use crate::restore::{Failure, VcpuBuffers};
use crate::transport::{DeviceKind, DevicePlan, NativeTransport, Readers, Windows};
use crate::transport_py::{plan_from_py, NativeDevice, PyListener, PyPlan};
use crate::vcpu::{ExitSink, NativeHost, UnclaimedCounts, VcpuControl, VcpuThread};
use crate::vm::{Layout, Region, Restore, VmCore};
use crate::write_set;

/// `vmm/x86/layout.py`: where the virtio-mmio windows start, COM1's pin, the pins.
pub const VIRTIO_MMIO_BASE: u64 = 0xD000_0000;
pub const COM1_IRQ: u32 = 4;
const IOAPIC_PINS: u32 = 24;
/// `vmm/x86/layout.py`'s real-mode helper pages.
pub const LAYOUT: Layout = Layout {
    tss_addr: 0xFFFB_D000,
    identity_map_addr: 0xFFFB_C000,
};
/// `vmm/memory.py`: RAM below the hole, the rest from 4 GiB.
const MMIO_HOLE_START: u64 = 0xC000_0000;
const FOUR_GIB: u64 = 1 << 32;
const PAGE_SIZE: u64 = 4096;
/// Slots a machine may have: the windows up to the hole's IOAPIC (`layout.py` gives
/// each slot 4 KiB from `VIRTIO_MMIO_BASE`; far fewer are ever used).
const MAX_SLOTS: u32 = 4096;
/// How long `stop` waits for each vCPU to leave the guest.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where guest RAM comes from.
pub enum RamSource<'a> {
    /// Regions the caller mapped and keeps mapped until the machine is stopped (a
    /// diff snapshot's premap, `InheritedRam::adopt`).
    Mapped(Vec<Region>),
    /// A snapshot's memory file of `mem_size` bytes, mapped here `MAP_PRIVATE`: no
    /// page is read or copied, the machine's writes stay its own.
    File { fd: BorrowedFd<'a>, mem_size: u64 },
}

/// The console: its log (opened for appending) and the log's budget, and COM1's
/// registers from the snapshot (None: a chip just reset).
pub struct ConsolePlan {
    pub log: Option<File>,
    pub budget: LogBudget,
    pub serial: Option<SerialRegs>,
}

/// One virtio device at `virtio-mmio.<slot>`, raising IOAPIC pin `irq`.
pub struct SlotPlan {
    pub slot: u32,
    pub irq: u32,
    pub plan: DevicePlan,
}

/// Everything a machine is built from, as plain values.
pub struct MachinePlan<'a> {
    pub ram: RamSource<'a>,
    /// The vCPU indices (a restore's must be its snapshot's, in its order).
    pub vcpus: &'a [u32],
    pub restore: Option<Restore<'a>>,
    pub console: ConsolePlan,
    pub devices: Vec<SlotPlan>,
    /// The snapshot's write set (`write_set.rs`): guest runs copied for writing once
    /// the RAM is mapped, before a vCPU runs; empty for none.
    pub write_set: &'a [(u64, u64)],
    /// This process's `/proc/self/pagemap`, opened before its uid changed (a jailed
    /// child's jail opens it); None: opened when needed (`save_write_set`).
    pub pagemap: Option<OwnedFd>,
}

/// Guest RAM this machine mapped itself (unmapped when it is dropped).
struct OwnedRam {
    mappings: Vec<(usize, usize)>,
}

impl Drop for OwnedRam {
    fn drop(&mut self) {
        for &(addr, len) in &self.mappings {
            // SAFETY: a mapping `map_file` made, of this length, that nothing uses any
            // more: the VM is gone and the device code's `GuestRam` was closed first.
            unsafe { libc::munmap(addr as *mut libc::c_void, len) };
        }
    }
}

/// The regions of `mem_size` bytes of RAM (`ram_layout`): (guest address, size,
/// offset in the memory file).
pub(crate) fn ram_layout(mem_size: u64) -> Result<Vec<(u64, u64, u64)>, String> {
    if mem_size == 0 || !mem_size.is_multiple_of(PAGE_SIZE) {
        return Err(format!(
            "guest memory size {mem_size} is not a positive multiple of {PAGE_SIZE}"
        ));
    }
    let low = mem_size.min(MMIO_HOLE_START);
    let mut regions = vec![(0, low, 0)];
    if mem_size > low {
        regions.push((FOUR_GIB, mem_size - low, low));
    }
    Ok(regions)
}

/// Map a snapshot's memory file `MAP_PRIVATE`, region by region.
fn map_file(fd: BorrowedFd<'_>, mem_size: u64) -> Result<(Vec<Region>, OwnedRam), String> {
    let layout = ram_layout(mem_size)?;
    let file_size = File::from(
        fd.try_clone_to_owned()
            .map_err(|e| format!("dup the memory file: {e}"))?,
    )
    .metadata()
    .map_err(|e| format!("stat the memory file: {e}"))?
    .len();
    if file_size < mem_size {
        // `vmm/memory.py`'s words (`_short_memory_file`), so a caller sees one message
        // whichever child restored.
        return Err(format!(
            "the memory file is {file_size} bytes, shorter than the machine's {mem_size} \
             bytes of RAM: a damaged snapshot (take it again, or unpack it again from its pack)"
        ));
    }
    let mut owned = OwnedRam {
        mappings: Vec::new(),
    };
    let mut regions = Vec::new();
    for (guest_phys, size, offset) in layout {
        let len = usize::try_from(size).map_err(|_| format!("a region of {size} bytes"))?;
        let at = libc::off_t::try_from(offset).map_err(|_| format!("file offset {offset}"))?;
        // SAFETY: a new mapping at an address the kernel picks, of a file we hold open
        // for the call; checked below. Private: the guest's writes never reach the file.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_NORESERVE,
                fd.as_raw_fd(),
                at,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(format!(
                "mmap the memory file at {offset:#x}: {}",
                std::io::Error::last_os_error()
            ));
        }
        owned.mappings.push((addr as usize, len));
        regions.push(Region {
            guest_phys,
            size,
            host_addr: addr as u64,
        });
    }
    Ok((regions, owned))
}

/// The diff snapshots' RAM the zygote mapped before forking this process
/// (`vmm/memory.py`'s `PremappedRam`: a plan's base `MAP_PRIVATE` and every run of the
/// plan `MAP_FIXED` over it, `PROT_READ`, `MADV_DOFORK` for the batch's snapshots):
/// this machine's own, if its snapshot is a diff, and the batch's other snapshots',
/// which the fork copied too. Adopting it costs a `munmap` per other mapping and an
/// `mprotect` per region, whatever the plan's run count: no child maps a run of its
/// own (issue 19).
pub struct InheritedRam {
    mine: Option<Vec<Region>>,
    others: Vec<(usize, usize)>,
}

/// `host..host + len` as whole pages of this address space.
fn page_range(host: u64, len: u64) -> Result<(usize, usize), String> {
    match (
        usize::try_from(host),
        usize::try_from(len),
        host.checked_add(len),
    ) {
        (Ok(at), Ok(n), Some(_))
            if at != 0
                && n != 0
                && host.is_multiple_of(PAGE_SIZE)
                && len.is_multiple_of(PAGE_SIZE) =>
        {
            Ok((at, n))
        }
        _ => Err(format!(
            "a premapped range {host:#x}+{len:#x} is not whole pages"
        )),
    }
}

impl InheritedRam {
    /// `mine`: (guest address, size, host address) of each region of this machine's
    /// premap, which must be `ram_layout(mem_size)`'s, page-aligned; `others`: (host
    /// address, length) of each other inherited premap's mapping, page-aligned, none
    /// overlapping `mine`.
    pub fn new(
        mem_size: u64,
        mine: Option<&[(u64, u64, u64)]>,
        others: &[(u64, u64)],
    ) -> Result<Self, String> {
        let mine = mine.map(|mine| own_regions(mem_size, mine)).transpose()?;
        let mut unmapped = Vec::with_capacity(others.len());
        for &(host, len) in others {
            let range = page_range(host, len)?;
            if mine
                .iter()
                .flatten()
                .any(|r| host < r.host_addr + r.size && r.host_addr < host + len)
            {
                return Err(format!(
                    "another premap's {host:#x}+{len:#x} overlaps this machine's RAM"
                ));
            }
            unmapped.push(range);
        }
        Ok(InheritedRam {
            mine,
            others: unmapped,
        })
    }

    /// Unmap the other snapshots' premaps (a child maps no more than its own RAM) and
    /// make this machine's regions writable (still `MAP_PRIVATE`: each page the guest
    /// writes is copied into this process, the files and the siblings untouched).
    /// Its regions, for `RamSource::Mapped`; None without a premap of its own.
    ///
    /// # Safety
    ///
    /// Each range given to `new` must be a mapping this process inherited from the
    /// zygote's premaps (or made as one) that nothing else in it uses; the regions
    /// must stay mapped until the machine built on them is stopped.
    pub unsafe fn adopt(&self) -> Result<Option<Vec<Region>>, String> {
        for &(addr, len) in &self.others {
            // SAFETY: the caller's contract: another snapshot's premap, used by nothing.
            if unsafe { libc::munmap(addr as *mut libc::c_void, len) } != 0 {
                return Err(format!(
                    "unmap another snapshot's premap at {addr:#x}: {}",
                    std::io::Error::last_os_error()
                ));
            }
        }
        for r in self.mine.iter().flatten() {
            // SAFETY: the caller's contract: this process's premap of its own RAM,
            // `new` checked it is whole pages; only its protection changes.
            let made_writable = unsafe {
                libc::mprotect(
                    r.host_addr as *mut libc::c_void,
                    r.size as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                )
            };
            if made_writable != 0 {
                return Err(format!(
                    "make the premapped RAM at {:#x} writable: {}",
                    r.host_addr,
                    std::io::Error::last_os_error()
                ));
            }
        }
        Ok(self.mine.clone())
    }
}

/// A premap's regions, checked against the layout of `mem_size` bytes of RAM.
fn own_regions(mem_size: u64, mine: &[(u64, u64, u64)]) -> Result<Vec<Region>, String> {
    let layout = ram_layout(mem_size)?;
    if mine.len() != layout.len()
        || mine
            .iter()
            .zip(&layout)
            .any(|(&(gpa, size, _), &(want_gpa, want_size, _))| {
                (gpa, size) != (want_gpa, want_size)
            })
    {
        return Err(format!(
            "the premapped RAM {mine:x?} does not have the layout of {mem_size} bytes"
        ));
    }
    mine.iter()
        .map(|&(guest_phys, size, host_addr)| {
            page_range(host_addr, size)?;
            Ok(Region {
                guest_phys,
                size,
                host_addr,
            })
        })
        .collect()
}

fn failure_text(f: Failure) -> String {
    let err = std::io::Error::from_raw_os_error(f.errno);
    match f.vcpu {
        Some(index) => format!("{} (vCPU {index}): {err}", f.op),
        None => format!("{}: {err}", f.op),
    }
}

fn new_eventfd() -> Result<EventFd, String> {
    EventFd::new(EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(|e| format!("eventfd: {e}"))
}

fn owned(fd: EventFd) -> OwnedFd {
    // SAFETY: the descriptor `EventFd` owned, handed over whole.
    unsafe { OwnedFd::from_raw_fd(fd.into_raw_fd()) }
}

fn dup(fd: &OwnedFd) -> Result<OwnedFd, String> {
    fd.try_clone().map_err(|e| format!("dup eventfd: {e}"))
}

/// What runs until `stop`: every part, in the order of the module comment.
struct Parts {
    vcpus: Vec<VcpuThread>,
    unclaimed: Vec<Arc<Mutex<UnclaimedCounts>>>,
    sink: Arc<ExitSink>,
    windows: Arc<Windows>,
    transports: Vec<(SlotPlan, Arc<NativeTransport>)>,
    event_loop: Arc<NativeLoop>,
    console: Arc<ConsoleDevices>,
    ram: Arc<GuestRam>,
    core: Arc<VmCore>,
    owned_ram: Option<OwnedRam>,
    /// Each pin's irqfd and each queue's ioeventfd, registered with KVM (the parts
    /// above hold duplicates).
    eventfds: Vec<OwnedFd>,
}

/// What `stop` keeps of a machine for its reports: how it ended, its console's tail.
#[derive(Default)]
struct Kept {
    exit: Option<(&'static str, String)>,
    console_tail: String,
}

/// A machine assembled in Rust (see the module comment).
pub struct NativeMachine {
    parts: Mutex<Option<Parts>>,
    controls: Vec<VcpuControl>,
    kept: Mutex<Kept>,
    /// Guest RAM's regions: (guest address, size, host address).
    regions: Vec<(u64, u64, u64)>,
    /// The copy of the snapshot's write set: at the start gate, or beside the guest.
    write_ahead: write_set::WriteAhead,
    pagemap: Option<OwnedFd>,
}

/// A native machine's counters for `exits`: each vCPU host's unclaimed accesses, and
/// per interrupt pin (ascending) the native transports raising it, held weakly so the
/// control server does not keep a stopped machine's devices (a device gone counts
/// nothing). COM1's pin is not listed: the console does not count its interrupts.
#[derive(Default)]
pub struct NativeCounters {
    pub unclaimed: Vec<Arc<Mutex<UnclaimedCounts>>>,
    pub pins: Vec<(u32, Vec<Weak<NativeTransport>>)>,
}

impl NativeCounters {
    fn sum(hosts: &[Arc<Mutex<UnclaimedCounts>>]) -> UnclaimedCounts {
        let mut all = UnclaimedCounts::default();
        for counts in hosts {
            let c = *lock(counts);
            all.pio_reads += c.pio_reads;
            all.pio_writes += c.pio_writes;
            all.mmio_reads += c.mmio_reads;
            all.mmio_writes += c.mmio_writes;
        }
        all
    }
}

impl MachineCounters for NativeCounters {
    fn counts(&self) -> Result<(UnclaimedCounts, Vec<(u32, u64)>), String> {
        let irqs = self
            .pins
            .iter()
            .map(|(pin, transports)| {
                let raised = transports
                    .iter()
                    .filter_map(Weak::upgrade)
                    .map(|transport| transport.stats().interrupts)
                    .sum();
                (*pin, raised)
            })
            .collect();
        Ok((NativeCounters::sum(&self.unclaimed), irqs))
    }
}

/// A device as the machine's report shows it: its slot and pin, the window's magic,
/// device id and status registers as the guest reads them, and whether it serves.
pub struct DeviceReport {
    pub slot: u32,
    pub irq: u32,
    pub magic: u32,
    pub device_id: u32,
    pub status: u32,
    pub active: bool,
}

impl NativeMachine {
    /// Build the machine of `plan` on `kvm` (borrowed for the call); nothing runs
    /// until `start`. `mark` is told the end of each step that costs (`machine_*`: a
    /// native child's phases, `spawn_profile.rs`).
    ///
    /// # Safety
    ///
    /// With `RamSource::Mapped`, each region must stay mapped, readable and writable
    /// until this machine is stopped or dropped.
    pub unsafe fn restore(
        kvm: &Kvm,
        plan: MachinePlan<'_>,
        mark: &dyn Fn(&'static str),
    ) -> Result<Self, String> {
        let MachinePlan {
            ram,
            vcpus,
            restore,
            console,
            devices,
            write_set,
            pagemap,
        } = plan;
        // 1. guest RAM
        let (regions, owned_ram) = match ram {
            RamSource::Mapped(regions) => (regions, None),
            RamSource::File { fd, mem_size } => {
                let (regions, owned) = map_file(fd, mem_size)?;
                (regions, Some(owned))
            }
        };
        mark("machine_ram");
        // (guest address, size, host address): the machine's `regions`.
        let ram_regions: Vec<(u64, u64, u64)> = regions
            .iter()
            .map(|r| (r.guest_phys, r.size, r.host_addr))
            .collect();
        // SAFETY: the regions are mapped readable and writable (this function's
        // contract, or mapped above) until the machine stops, which cancels the copy
        // first; no vCPU exists yet.
        let write_ahead = unsafe { write_set::WriteAhead::new(&ram_regions, write_set) };
        if write_ahead.copied() > 0 {
            // Copied in place (a kernel without MADV_POPULATE_WRITE).
            mark("machine_write_set");
        }
        // 2. the VM core
        // SAFETY: the regions are this function's contract's, or mapped above and
        // unmapped only after the core is gone (`Parts` drops `core` before
        // `owned_ram`, and `stop` keeps them when a vCPU did not stop).
        let (core, _report) = unsafe { VmCore::create(kvm, &regions, LAYOUT, vcpus, restore) }
            .map_err(failure_text)?;
        mark("machine_vm");
        let core = Arc::new(core);
        let guest_regions = regions
            .iter()
            .map(|r| guest_ram::Region {
                gpa: r.guest_phys,
                size: r.size,
                host: r.host_addr as usize,
            })
            .collect();
        // SAFETY: as for the VM core; `stop` closes it before any region is unmapped.
        let ram = Arc::new(unsafe { GuestRam::new(guest_regions) });
        let mut eventfds = Vec::new();
        // Each pin's irqfd, by its place in `eventfds` (which keeps it): a part on the
        // pin gets a duplicate of it.
        let mut lines: HashMap<u32, usize> = HashMap::new();
        let mut line = |gsi: u32, eventfds: &mut Vec<OwnedFd>| -> Result<OwnedFd, String> {
            if gsi >= IOAPIC_PINS {
                return Err(format!(
                    "IRQ {gsi} is not an IOAPIC pin (0..{})",
                    IOAPIC_PINS - 1
                ));
            }
            if let Some(&at) = lines.get(&gsi) {
                return dup(&eventfds[at]);
            }
            let fd = new_eventfd()?;
            core.vm()
                .register_irqfd(&fd, gsi)
                .map_err(|e| format!("KVM_IRQFD on pin {gsi}: {e}"))?;
            let fd = owned(fd);
            let handed = dup(&fd)?;
            lines.insert(gsi, eventfds.len());
            eventfds.push(fd);
            Ok(handed)
        };
        // 3. the console
        let devices_console = Arc::new(ConsoleDevices::new(
            IrqFd::new(line(COM1_IRQ, &mut eventfds)?),
            console.log,
            console.budget,
        ));
        if let Some(serial) = console.serial {
            devices_console.restore(serial)?;
        }
        // 4. the I/O loop
        let event_loop =
            Arc::new(NativeLoop::new("vmm-io".into()).map_err(|e| format!("the I/O loop: {e}"))?);
        // 5. the virtio devices
        let windows = Arc::new(Windows::new());
        let mut transports = Vec::with_capacity(devices.len());
        for device in devices {
            if device.slot >= MAX_SLOTS {
                return Err(format!(
                    "virtio-mmio.{}: at most {MAX_SLOTS} slots",
                    device.slot
                ));
            }
            let base = VIRTIO_MMIO_BASE + u64::from(device.slot) * WINDOW_SIZE;
            let irq = line(device.irq, &mut eventfds)?;
            let mut notify = Vec::with_capacity(device.plan.max_sizes.len());
            for queue in 0..device.plan.max_sizes.len() {
                if !device.plan.wants_ioeventfds() {
                    notify.push(None);
                    continue;
                }
                let fd = new_eventfd()?;
                let at = IoEventAddress::Mmio(base + mmio::REG_QUEUE_NOTIFY);
                core.vm()
                    .register_ioevent(&fd, &at, queue as u32)
                    .map_err(|e| {
                        format!(
                            "KVM_IOEVENTFD for virtio-mmio.{} queue {queue}: {e}",
                            device.slot
                        )
                    })?;
                let fd = owned(fd);
                notify.push(Some(dup(&fd)?));
                eventfds.push(fd);
            }
            let transport = NativeTransport::restore(
                &device.plan,
                ram.clone(),
                event_loop.clone() as Arc<dyn Readers>,
                irq,
                notify,
            )
            .map_err(|e| format!("virtio-mmio.{}: {e}", device.slot))?;
            windows.add(base, transport.registers(), transport.clone())?;
            transports.push((device, transport));
        }
        mark("machine_devices");
        // 6. the vCPU loops
        let sink = ExitSink::new().map_err(|e| format!("the exit's eventfd: {e}"))?;
        let mut threads = Vec::with_capacity(core.vcpu_count());
        let mut unclaimed = Vec::with_capacity(core.vcpu_count());
        for position in 0..core.vcpu_count() {
            let (host, counts) = NativeHost::new(sink.clone(), Some(windows.clone()));
            let thread = VcpuThread::build(
                core.clone(),
                position,
                Box::new(host),
                Some(devices_console.clone()),
            )
            .map_err(failure_text)?;
            threads.push(thread);
            unclaimed.push(counts);
        }
        let controls = threads.iter().map(VcpuThread::control).collect();
        Ok(NativeMachine {
            parts: Mutex::new(Some(Parts {
                vcpus: threads,
                unclaimed,
                sink,
                windows,
                transports,
                event_loop,
                console: devices_console,
                ram,
                core,
                owned_ram,
                eventfds,
            })),
            controls,
            kept: Mutex::new(Kept::default()),
            regions: ram_regions,
            write_ahead,
            pagemap,
        })
    }

    /// Start the I/O loop and the vCPU threads; with `paused`, the vCPUs park
    /// before entering the guest (`resume` lets them in).
    pub fn start(&self, paused: bool) -> Result<(), String> {
        let parts = lock(&self.parts);
        let parts = parts.as_ref().ok_or("the machine is stopped")?;
        parts
            .event_loop
            .start()
            .map_err(|e| format!("the I/O loop: {e:?}"))?;
        for vcpu in &parts.vcpus {
            vcpu.start(paused)?;
        }
        if !paused {
            self.write_ahead.begin();
        }
        Ok(())
    }

    /// Let every parked vCPU back into the guest (the first time, the copy of the
    /// write set begins with it).
    pub fn resume(&self) {
        for control in &self.controls {
            control.resume();
        }
        self.write_ahead.begin();
    }

    /// Park every vCPU (kicking each out of the guest), within `timeout` in all;
    /// false if one did not park in time.
    pub fn pause(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        self.controls.iter().all(|control| {
            let left = deadline.saturating_duration_since(Instant::now());
            control.pause(left)
        })
    }

    /// Pause and resume handles, one per vCPU (for a control server's thread).
    pub fn vcpu_controls(&self) -> Vec<VcpuControl> {
        self.controls.clone()
    }

    /// Whether every vCPU is parked.
    pub fn paused(&self) -> bool {
        self.controls.iter().all(VcpuControl::is_paused)
    }

    /// Guest RAM's regions: (guest address, size, host address), mapped while the
    /// machine runs.
    pub fn ram_regions(&self) -> &[(u64, u64, u64)] {
        &self.regions
    }

    /// The copy of the snapshot's write set: made at a batch's start gate
    /// (`WriteAhead::copy_here`), else begun with the guest.
    pub fn write_ahead(&self) -> &write_set::WriteAhead {
        &self.write_ahead
    }

    /// Write the guest pages this process holds copies of, its write set so far
    /// (`write_set.rs`), as `path`; the pages written.
    pub fn save_write_set(&self, path: &std::path::Path) -> Result<u64, String> {
        let opened;
        let pagemap = match &self.pagemap {
            Some(fd) => fd.as_raw_fd(),
            None => {
                opened = File::open("/proc/self/pagemap")
                    .map_err(|e| format!("/proc/self/pagemap: {e}"))?;
                opened.as_raw_fd()
            }
        };
        let runs = write_set::written_runs(pagemap, &self.regions)?;
        write_set::save(path, &runs)?;
        Ok(write_set::pages(&runs))
    }

    /// Keep the device servers on the I/O loop still (`Loop::hold`) until
    /// `release_devices`, so that, with the vCPUs parked, nothing touches guest RAM or
    /// a device's state; false if the loop's turn did not end within `timeout` (or
    /// the machine is stopped).
    pub fn hold_devices(&self, timeout: Duration) -> bool {
        let event_loop = lock(&self.parts).as_ref().map(|p| p.event_loop.clone());
        event_loop.is_some_and(|l| l.hold(timeout))
    }

    /// Let the device servers run again after `hold_devices`.
    pub fn release_devices(&self) {
        let event_loop = lock(&self.parts).as_ref().map(|p| p.event_loop.clone());
        if let Some(event_loop) = event_loop {
            event_loop.release();
        }
    }

    /// The virtio devices' transports: (slot, IOAPIC pin, transport), in plan order.
    pub fn transports(&self) -> Vec<(u32, u32, Arc<NativeTransport>)> {
        lock(&self.parts).as_ref().map_or_else(Vec::new, |parts| {
            parts
                .transports
                .iter()
                .map(|(device, transport)| (device.slot, device.irq, transport.clone()))
                .collect()
        })
    }

    /// COM1's registers (`SerialState`'s fields); None once stopped.
    pub fn serial(&self) -> Option<SerialFields> {
        let console = lock(&self.parts).as_ref().map(|p| p.console.clone());
        console.map(|c| c.save())
    }

    /// Readable once the machine ended (a vCPU's exit: reset, shutdown, an error);
    /// the machine's, not to be closed by the caller; -1 once stopped.
    pub fn exit_fd(&self) -> RawFd {
        lock(&self.parts)
            .as_ref()
            .map_or(-1, |parts| parts.sink.event_fd())
    }

    /// How the machine ended: (reason, detail) of its first vCPU exit.
    pub fn exit(&self) -> Option<(&'static str, String)> {
        match lock(&self.parts).as_ref() {
            Some(parts) => parts.sink.exit(),
            None => lock(&self.kept).exit.clone(),
        }
    }

    /// The console's last lines and the line being written.
    pub fn console_tail(&self) -> String {
        match lock(&self.parts).as_ref() {
            Some(parts) => parts.console.tail_text(),
            None => lock(&self.kept).console_tail.clone(),
        }
    }

    /// The VM core (its descriptors are the machine's); None once stopped.
    pub fn core(&self) -> Option<Arc<VmCore>> {
        lock(&self.parts).as_ref().map(|parts| parts.core.clone())
    }

    /// Each vCPU's state: "created", "running", "paused" or "stopped".
    pub fn vcpu_states(&self) -> Vec<&'static str> {
        match lock(&self.parts).as_ref() {
            Some(parts) => parts.vcpus.iter().map(VcpuThread::state).collect(),
            None => vec!["stopped"; self.controls.len()],
        }
    }

    /// VM exits of all vCPUs, by reason.
    pub fn exits(&self) -> HashMap<&'static str, u64> {
        let mut all = HashMap::new();
        if let Some(parts) = lock(&self.parts).as_ref() {
            for vcpu in &parts.vcpus {
                for (reason, n) in vcpu.exits() {
                    *all.entry(reason).or_insert(0) += n;
                }
            }
        }
        all
    }

    /// Accesses no device claimed, over all vCPUs.
    pub fn unclaimed(&self) -> UnclaimedCounts {
        lock(&self.parts)
            .as_ref()
            .map_or_else(UnclaimedCounts::default, |parts| {
                NativeCounters::sum(&parts.unclaimed)
            })
    }

    /// The counters `exits` reports besides the vCPUs' own (a control server's).
    pub fn counters(&self) -> Arc<dyn MachineCounters> {
        let parts = lock(&self.parts);
        let Some(parts) = parts.as_ref() else {
            return Arc::new(NativeCounters::default());
        };
        let mut pins: Vec<(u32, Vec<Weak<NativeTransport>>)> = Vec::new();
        for (device, transport) in &parts.transports {
            match pins.iter_mut().find(|(pin, _)| *pin == device.irq) {
                Some((_, on_pin)) => on_pin.push(Arc::downgrade(transport)),
                None => pins.push((device.irq, vec![Arc::downgrade(transport)])),
            }
        }
        pins.sort_by_key(|(pin, _)| *pin);
        Arc::new(NativeCounters {
            unclaimed: parts.unclaimed.clone(),
            pins,
        })
    }

    /// The transport at virtio-mmio `slot`, if the machine has a device there.
    pub fn transport(&self, slot: u32) -> Option<Arc<NativeTransport>> {
        lock(&self.parts).as_ref().and_then(|parts| {
            parts
                .transports
                .iter()
                .find(|(device, _)| device.slot == slot)
                .map(|(_, transport)| transport.clone())
        })
    }

    /// The virtio devices, in slot order, their registers read through the windows
    /// as the guest reads them.
    /// The balloon's transport, if the machine has one (its counters are `status`'s).
    pub fn balloon(&self) -> Option<Arc<NativeTransport>> {
        lock(&self.parts).as_ref().and_then(|parts| {
            parts
                .transports
                .iter()
                .find(|(device, _)| matches!(device.plan.kind, DeviceKind::Balloon { .. }))
                .map(|(_, transport)| transport.clone())
        })
    }

    pub fn devices(&self) -> Vec<DeviceReport> {
        // Cloned out: no machine lock is held while a window is read.
        let (windows, transports) = match lock(&self.parts).as_ref() {
            Some(parts) => (
                parts.windows.clone(),
                parts
                    .transports
                    .iter()
                    .map(|(device, transport)| (device.slot, device.irq, transport.clone()))
                    .collect::<Vec<_>>(),
            ),
            None => return Vec::new(),
        };
        transports
            .iter()
            .map(|(slot, irq, transport)| {
                let base = VIRTIO_MMIO_BASE + u64::from(*slot) * WINDOW_SIZE;
                let register = |offset: u64| {
                    let mut value = [0u8; 4];
                    match windows.serve_read(base + offset, &mut value) {
                        Some(Ok(())) => u32::from_le_bytes(value),
                        _ => u32::MAX,
                    }
                };
                DeviceReport {
                    slot: *slot,
                    irq: *irq,
                    magic: register(mmio::REG_MAGIC),
                    device_id: register(mmio::REG_DEVICE_ID),
                    status: register(mmio::REG_STATUS),
                    active: transport.active(),
                }
            })
            .collect()
    }

    /// End the machine: the vCPUs stopped and joined, the loop stopped, every
    /// descriptor closed and RAM mapped here unmapped. Idempotent; also on drop.
    pub fn stop(&self) {
        let Some(parts) = lock(&self.parts).take() else {
            return;
        };
        // Nothing may touch RAM mapped here once it is unmapped below.
        self.write_ahead.cancel();
        *lock(&self.kept) = Kept {
            exit: parts.sink.exit(),
            console_tail: parts.console.tail_text(),
        };
        let Parts {
            vcpus,
            unclaimed,
            sink,
            windows,
            transports,
            event_loop,
            console,
            ram,
            core,
            owned_ram,
            eventfds,
        } = parts;
        let mut all_stopped = true;
        for vcpu in &vcpus {
            all_stopped &= vcpu.stop(STOP_TIMEOUT) && vcpu.join_if_stopped();
            vcpu.release();
        }
        drop(vcpus);
        drop(unclaimed);
        // The windows and transports hold the devices: dropping the last transport
        // takes its server's readers off the loop.
        drop(windows);
        drop(transports);
        event_loop.stop();
        drop(event_loop);
        drop(console);
        ram.close();
        drop(ram);
        drop(core);
        if !all_stopped {
            // A vCPU still in the guest may still touch RAM: it stays mapped.
            std::mem::forget(owned_ram);
        } else {
            drop(owned_ram);
        }
        drop(eventfds);
        drop(sink);
    }
}

impl Drop for NativeMachine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `_core.NativeMachine`: a machine restored and run by `machine.rs` alone; Python
/// only hands it the plain values and reads its reports.
#[pyclass(frozen, name = "NativeMachine", module = "vmfork._core")]
pub struct PyNativeMachine {
    machine: Arc<NativeMachine>,
    /// What `status` says of snapshots: a native child's control server's
    /// (`native_fork::forked_machine`), else this handle's own.
    snapshots: SharedSnapshotStatus,
}

impl PyNativeMachine {
    /// A handle on a machine someone else runs (a native child's life).
    pub fn shared(machine: Arc<NativeMachine>, snapshots: SharedSnapshotStatus) -> Self {
        PyNativeMachine { machine, snapshots }
    }
}

#[pymethods]
impl PyNativeMachine {
    /// Restore the snapshot `prepared` on `kvm_fd` (borrowed for the call) with its
    /// memory file `memory_fd` (`mem_size` bytes, mapped `MAP_PRIVATE`, the fd
    /// borrowed for the call), COM1's registers `serial` (`SerialState`'s fields),
    /// the console log `console_log_fd` (duplicated) within its budget, and the
    /// virtio devices `devices`: (slot, IOAPIC pin, plan as `vmm/devices/plan.py`
    /// builds it), a vsock's host side `vsock_listener` as `NativeDevice.restore`
    /// takes it (the socket path, its bound listening fd, duplicated, or None to bind
    /// the path here), each disk's file in `disk_files` by slot (duplicated; an empty
    /// volume slot has none), each net device's tap in `tap_fds` by slot (duplicated;
    /// none: no tap). The GIL is released for the build; nothing runs until
    /// `start`.
    #[new]
    #[pyo3(signature = (kvm_fd, memory_fd, mem_size, prepared, *, devices, serial = None,
                        console_log_fd = None, log_burst, log_per_second, log_total_bytes,
                        vsock_listener = None, disk_files = HashMap::new(),
                        tap_fds = HashMap::new()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        kvm_fd: RawFd,
        memory_fd: RawFd,
        mem_size: u64,
        prepared: &Bound<'_, crate::PreparedRestore>,
        devices: Vec<(u32, u32, PyPlan)>,
        serial: Option<SerialFields>,
        console_log_fd: Option<RawFd>,
        log_burst: u32,
        log_per_second: f64,
        log_total_bytes: u64,
        vsock_listener: Option<PyListener>,
        disk_files: HashMap<u32, RawFd>,
        tap_fds: HashMap<u32, RawFd>,
    ) -> PyResult<Self> {
        let budget = log_budget(log_burst, log_per_second, log_total_bytes)
            .map_err(PyValueError::new_err)?;
        let devices = devices
            .into_iter()
            .map(|(slot, irq, plan)| {
                Ok(SlotPlan {
                    slot,
                    irq,
                    plan: plan_from_py(
                        plan,
                        vsock_listener.clone(),
                        disk_files.get(&slot).copied(),
                        tap_fds.get(&slot).copied(),
                    )?,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let log = console_log_fd
            .map(|fd| queue_server::dup(fd).map(File::from))
            .transpose()?;
        let serial = serial.map(SerialRegs::from_fields);
        let prepared = prepared.get();
        let states: Vec<&VcpuBuffers> = prepared.vcpus.iter().map(|v| &v.get().inner).collect();
        let indices: Vec<u32> = states.iter().map(|s| s.index()).collect();
        // SAFETY: Python holds `kvm_fd` open for the length of this call (an argument
        // of it); the wrapper is never dropped, so the caller's descriptor stays open.
        let kvm = ManuallyDrop::new(unsafe { Kvm::from_raw_fd(kvm_fd) });
        // SAFETY: as `kvm_fd`; the mappings made from it outlive the borrow.
        let memory = unsafe { BorrowedFd::borrow_raw(memory_fd) };
        let plan = MachinePlan {
            ram: RamSource::File {
                fd: memory,
                mem_size,
            },
            vcpus: &indices,
            restore: Some(Restore {
                vm: &prepared.vm,
                vcpus: &states,
            }),
            console: ConsolePlan {
                log,
                budget,
                serial,
            },
            devices,
            write_set: &[],
            pagemap: None,
        };
        // SAFETY: the RAM is a file mapping the machine makes and owns.
        let machine = py
            .detach(|| unsafe { NativeMachine::restore(&kvm, plan, &|_| {}) })
            .map_err(PyRuntimeError::new_err)?;
        Ok(PyNativeMachine::shared(
            Arc::new(machine),
            SharedSnapshotStatus::default(),
        ))
    }

    /// Start the I/O loop and the vCPUs; with `paused`, the vCPUs park first.
    #[pyo3(signature = (paused = false))]
    fn start(&self, py: Python<'_>, paused: bool) -> PyResult<()> {
        py.detach(|| self.machine.start(paused))
            .map_err(PyRuntimeError::new_err)
    }

    /// Park every vCPU; false if one did not within `timeout` seconds.
    #[pyo3(signature = (timeout = 5.0))]
    fn pause(&self, py: Python<'_>, timeout: f64) -> bool {
        let timeout = Duration::from_secs_f64(timeout.max(0.0));
        py.detach(|| self.machine.pause(timeout))
    }

    fn resume(&self) {
        self.machine.resume();
    }

    /// Whether every vCPU is parked.
    #[getter]
    fn paused(&self) -> bool {
        self.machine.paused()
    }

    /// Guest RAM's regions: (guest address, size, host address), the machine's
    /// mappings (not to be unmapped).
    fn ram_regions(&self) -> Vec<(u64, u64, u64)> {
        self.machine.ram_regions().to_vec()
    }

    /// Each vCPU's (index, descriptor), in the machine's order (the machine's
    /// descriptors: not to be closed); empty once stopped.
    fn vcpu_fds(&self) -> Vec<(u32, RawFd)> {
        let Some(core) = self.machine.core() else {
            return Vec::new();
        };
        (0..core.vcpu_count())
            .filter_map(|position| core.vcpu(position))
            .map(|(index, fd)| (index, fd.as_raw_fd()))
            .collect()
    }

    /// Keep the device servers still (`NativeMachine::hold_devices`) for at most
    /// `timeout` seconds of waiting; false if they did not stop in time.
    #[pyo3(signature = (timeout = 5.0))]
    fn hold_devices(&self, py: Python<'_>, timeout: f64) -> bool {
        let timeout = Duration::from_secs_f64(timeout.max(0.0));
        py.detach(|| self.machine.hold_devices(timeout))
    }

    fn release_devices(&self) {
        self.machine.release_devices();
    }

    /// The virtio devices: (slot, IOAPIC pin, `NativeDevice` handle), in plan order.
    fn transports(&self) -> Vec<(u32, u32, NativeDevice)> {
        self.machine
            .transports()
            .into_iter()
            .map(|(slot, irq, transport)| (slot, irq, NativeDevice { transport }))
            .collect()
    }

    /// COM1's registers as `SerialState`'s fields; None once stopped.
    fn serial(&self) -> Option<SerialFields> {
        self.machine.serial()
    }

    /// What `status` says of snapshots from now on: `bases` as `(tag, kind)`, newest
    /// first, and the tracking in use (`ControlServe.set_snapshot_status`).
    fn set_snapshot_status(&self, bases: Vec<(Option<String>, String)>, tracking: Option<String>) {
        *lock(&self.snapshots) = SnapshotStatus { bases, tracking };
    }

    /// What `status` says of snapshots: (bases, tracking).
    fn snapshot_status(&self) -> (Vec<(Option<String>, String)>, Option<String>) {
        let status = lock(&self.snapshots);
        (status.bases.clone(), status.tracking.clone())
    }

    /// End the machine and close everything it holds. Idempotent.
    fn stop(&self, py: Python<'_>) {
        py.detach(|| self.machine.stop());
    }

    /// (reason, detail) once the machine ended, else None.
    #[getter]
    fn exit(&self) -> Option<(&'static str, String)> {
        self.machine.exit()
    }

    /// Readable once the machine ended (the machine's: not to be closed); -1 once
    /// stopped.
    #[getter]
    fn exit_fd(&self) -> RawFd {
        self.machine.exit_fd()
    }

    /// The VM's descriptor (the machine's: not to be closed); None once stopped.
    #[getter]
    fn vm_fd(&self) -> Option<RawFd> {
        self.machine.core().map(|core| core.vm().as_raw_fd())
    }

    fn console_tail(&self) -> String {
        self.machine.console_tail()
    }

    /// Each vCPU's state: "created", "running", "paused" or "stopped".
    fn vcpu_states(&self) -> Vec<&'static str> {
        self.machine.vcpu_states()
    }

    /// VM exits of all vCPUs by reason (KVM's names, lower case; "intr" for kicks).
    fn exits(&self) -> HashMap<&'static str, u64> {
        self.machine.exits()
    }

    /// Accesses no device claimed: {"pio_reads", "pio_writes", "mmio_reads",
    /// "mmio_writes"}.
    fn unclaimed(&self) -> HashMap<&'static str, u64> {
        let c = self.machine.unclaimed();
        HashMap::from([
            ("pio_reads", c.pio_reads),
            ("pio_writes", c.pio_writes),
            ("mmio_reads", c.mmio_reads),
            ("mmio_writes", c.mmio_writes),
        ])
    }

    /// The virtio devices: (slot, irq, magic, device id, status, active), their
    /// registers read through the windows as the guest reads them.
    fn devices(&self) -> Vec<(u32, u32, u32, u32, u32, bool)> {
        self.machine
            .devices()
            .into_iter()
            .map(|d| (d.slot, d.irq, d.magic, d.device_id, d.status, d.active))
            .collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! Machines assembled in this test binary, which links no libpython: any path
    //! into Python would not even link. Each runs in a forked child of its own, so
    //! that counting `/proc/self/fd` sees no other test's descriptors come and go.

    use super::*;
    use crate::vm::test_ram_with;
    use kvm_bindings::kvm_segment;
    use std::io::Read;
    use std::os::unix::fs::FileExt;
    use std::sync::OnceLock;

    const RNG_SLOT: u32 = 0;
    const RNG_IRQ: u32 = 5;
    const ENTRY: u64 = 0x1000;
    const RAM_SIZE: usize = 1 << 20;
    /// How long a guest of a few instructions may take before the test calls it hung.
    const HANG_GUARD_MS: i32 = 60_000;

    /// 32-bit flat protected mode at `ENTRY`: read the rng window's magic and device
    /// id and a window nobody claims (virtio-mmio.16); only if they read "virt", 4
    /// and all ones, print "ok" on COM1; then pulse the i8042's reset line.
    ///
    /// ```text
    ///  0: mov eax, [0xD0000000]   ; magic
    ///  5: cmp eax, 0x74726976
    /// 10: jne reset
    /// 12: mov eax, [0xD0000008]   ; device id
    /// 17: cmp eax, 4
    /// 20: jne reset
    /// 22: mov eax, [0xD0010000]   ; an unclaimed window
    /// 27: cmp eax, -1
    /// 30: jne reset
    /// 32: mov dx, 0x3f8
    /// 36: mov al, 'o' / out dx, al / mov al, 'k' / out / mov al, '\n' / out
    /// 45: reset: mov al, 0xfe / out 0x64, al / hlt
    /// ```
    const READ_RNG_PRINT_RESET: [u8; 50] = [
        0xA1, 0x00, 0x00, 0x00, 0xD0, 0x3D, 0x76, 0x69, 0x72, 0x74, 0x75, 0x21, 0xA1, 0x08, 0x00,
        0x00, 0xD0, 0x83, 0xF8, 0x04, 0x75, 0x17, 0xA1, 0x00, 0x00, 0x01, 0xD0, 0x83, 0xF8, 0xFF,
        0x75, 0x0D, 0x66, 0xBA, 0xF8, 0x03, 0xB0, 0x6F, 0xEE, 0xB0, 0x6B, 0xEE, 0xB0, 0x0A, 0xEE,
        0xB0, 0xFE, 0xE6, 0x64, 0xF4,
    ];
    /// `jmp $`: a guest that runs until it is stopped.
    const SPIN: [u8; 2] = [0xEB, 0xFE];

    /// Run `body` in a forked child and fail with what it reported. The child is
    /// single-threaded when it starts, so its descriptors are its own to count.
    pub(crate) fn in_child(body: fn() -> Result<(), String>) {
        let mut pipe = [0; 2];
        // SAFETY: two ints for pipe2 to fill; checked.
        assert_eq!(
            unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) },
            0
        );
        // SAFETY: the child only runs `body` (Rust code of this crate, no lock another
        // test thread could hold: glibc's malloc is reset for a forked child) and
        // leaves with `_exit`, running no destructor of the parent's.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            let outcome = std::panic::catch_unwind(body)
                .unwrap_or_else(|_| Err("the child panicked (its message is above)".into()));
            let code = match outcome {
                Ok(()) => 0,
                Err(why) => {
                    // SAFETY: the message's bytes, to the pipe's write end we own.
                    unsafe { libc::write(pipe[1], why.as_ptr().cast(), why.len()) };
                    1
                }
            };
            // SAFETY: leaves the child at once, as `fork`'s contract asks.
            unsafe { libc::_exit(code) };
        }
        // SAFETY: the write end, ours to close in the parent; the read end becomes a File.
        unsafe { libc::close(pipe[1]) };
        // SAFETY: the read end, owned by nothing else.
        let mut from_child = unsafe { File::from_raw_fd(pipe[0]) };
        let mut why = String::new();
        let _ = from_child.read_to_string(&mut why);
        let mut status = 0;
        // SAFETY: our own child, and a status to fill.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the machine's test failed: {why}"
        );
    }

    fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
        if ok {
            Ok(())
        } else {
            Err(what())
        }
    }

    fn open_fds() -> Result<usize, String> {
        Ok(std::fs::read_dir("/proc/self/fd")
            .map_err(|e| format!("/proc/self/fd: {e}"))?
            .count())
    }

    /// A machine on `ram` (its code at `ENTRY`), rng at virtio-mmio.0 as a boot has
    /// it, one vCPU in 32-bit flat protected mode at `ENTRY`, the console logged to
    /// `log`.
    fn machine(kvm: &Kvm, ram: Region, log: Option<File>) -> Result<NativeMachine, String> {
        let rng = DeviceKind::Rng {
            max_requests: 64,
            max_bytes: 64 * 1024,
        };
        let plan = MachinePlan {
            ram: RamSource::Mapped(vec![ram]),
            vcpus: &[0],
            restore: None,
            console: ConsolePlan {
                log,
                budget: LogBudget::new("console", 100, 100.0, 1 << 20),
                serial: None,
            },
            devices: vec![SlotPlan {
                slot: RNG_SLOT,
                irq: RNG_IRQ,
                plan: DevicePlan::fresh(rng, mmio::VIRTIO_F_VERSION_1, vec![256])?,
            }],
            write_set: &[],
            pagemap: None,
        };
        // SAFETY: the RAM is never unmapped in the child.
        let machine = unsafe { NativeMachine::restore(kvm, plan, &|_| {}) }?;
        let core = machine.core().ok_or("no core")?;
        let (_, vcpu) = core.vcpu(0).ok_or("no vCPU 0")?;
        let mut sregs = vcpu.get_sregs().map_err(|e| format!("sregs: {e}"))?;
        let code_segment = kvm_segment {
            base: 0,
            limit: 0xFFFF_FFFF,
            selector: 0x8,
            type_: 0xB,
            present: 1,
            db: 1,
            s: 1,
            g: 1,
            ..Default::default()
        };
        let data_segment = kvm_segment {
            selector: 0x10,
            type_: 0x3,
            ..code_segment
        };
        sregs.cs = code_segment;
        sregs.ds = data_segment;
        sregs.es = data_segment;
        sregs.ss = data_segment;
        sregs.cr0 |= 1; // protected mode, no paging
        vcpu.set_sregs(&sregs)
            .map_err(|e| format!("set sregs: {e}"))?;
        let mut regs = vcpu.get_regs().map_err(|e| format!("regs: {e}"))?;
        regs.rip = ENTRY;
        regs.rflags = 2;
        vcpu.set_regs(&regs).map_err(|e| format!("set regs: {e}"))?;
        Ok(machine)
    }

    /// Wait until the machine ended (its exit fd readable), at most `HANG_GUARD_MS`.
    fn wait_for_exit(machine: &NativeMachine) -> Result<(), String> {
        let mut ended = libc::pollfd {
            fd: machine.exit_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, live for the call.
        let n = unsafe { libc::poll(&mut ended, 1, HANG_GUARD_MS) };
        check(n == 1, || format!("the exit fd was not readable: {n}"))
    }

    fn kvm() -> Option<Kvm> {
        let kvm = Kvm::new().ok();
        if kvm.is_none() {
            eprintln!("skipped: no usable /dev/kvm");
        }
        kvm
    }

    #[test]
    fn a_machine_serves_its_rng_window_and_console_and_ends_on_a_reset() {
        if kvm().is_none() {
            return;
        }
        in_child(|| {
            let kvm = Kvm::new().map_err(|e| format!("/dev/kvm: {e}"))?;
            let log_path = std::env::temp_dir()
                .join(format!("vmfork-machine-test-{}.log", std::process::id()));
            let _ = std::fs::remove_file(&log_path);
            let before = open_fds()?;
            let log = File::options()
                .create(true)
                .append(true)
                .open(&log_path)
                .map_err(|e| format!("{}: {e}", log_path.display()))?;
            let ram = test_ram_with(RAM_SIZE, ENTRY as usize, &READ_RNG_PRINT_RESET);
            let machine = machine(&kvm, ram, Some(log))?;
            check(machine.exit().is_none(), || "an exit before start".into())?;
            machine.start(false)?;
            wait_for_exit(&machine)?;
            let exit = machine.exit();
            check(
                exit == Some(("reset", "the guest pulsed the i8042 reset line".into())),
                || format!("exit {exit:?}; console {:?}", machine.console_tail()),
            )?;
            let tail = machine.console_tail();
            check(tail == "ok", || format!("console tail {tail:?}"))?;
            let unclaimed = machine.unclaimed();
            check(
                (unclaimed.mmio_reads, unclaimed.mmio_writes) == (1, 0),
                || {
                    format!(
                        "unclaimed MMIO {}, {}",
                        unclaimed.mmio_reads, unclaimed.mmio_writes
                    )
                },
            )?;
            let devices = machine.devices();
            let rng = devices.first().ok_or("no device")?;
            check(
                (
                    rng.slot,
                    rng.irq,
                    rng.magic,
                    rng.device_id,
                    rng.status,
                    rng.active,
                ) == (RNG_SLOT, RNG_IRQ, mmio::MAGIC, 4, 0, false),
                || "the rng window read wrong from the host".into(),
            )?;
            machine.stop();
            let after = open_fds()?;
            check(after == before, || {
                format!("{before} descriptors before the machine, {after} after stop")
            })?;
            // What stop kept, and what the guest wrote through the log.
            check(machine.exit().is_some_and(|(r, _)| r == "reset"), || {
                "the exit was lost at stop".into()
            })?;
            check(machine.console_tail() == "ok", || {
                "the tail was lost".into()
            })?;
            check(machine.exit_fd() == -1, || "an exit fd after stop".into())?;
            let logged = std::fs::read_to_string(&log_path).map_err(|e| e.to_string())?;
            let _ = std::fs::remove_file(&log_path);
            check(logged == "ok\n", || format!("console log {logged:?}"))
        });
    }

    #[test]
    fn a_running_machine_pauses_resumes_and_stops_without_leaking() {
        if kvm().is_none() {
            return;
        }
        in_child(|| {
            let kvm = Kvm::new().map_err(|e| format!("/dev/kvm: {e}"))?;
            let before = open_fds()?;
            let machine = machine(&kvm, test_ram_with(RAM_SIZE, ENTRY as usize, &SPIN), None)?;
            check(machine.vcpu_states() == ["created"], || {
                "not created".into()
            })?;
            machine.start(true)?;
            check(machine.pause(Duration::from_secs(10)), || {
                "a vCPU started paused never parked".into()
            })?;
            check(machine.vcpu_states() == ["paused"], || {
                format!("{:?} after a paused start", machine.vcpu_states())
            })?;
            machine.resume();
            let in_guest = Instant::now() + Duration::from_secs(10);
            while machine.vcpu_states() != ["running"] && Instant::now() < in_guest {
                std::thread::sleep(Duration::from_millis(1));
            }
            check(machine.vcpu_states() == ["running"], || "never ran".into())?;
            let controls = machine.vcpu_controls();
            check(controls.len() == 1 && controls[0].index() == 0, || {
                "one control for vCPU 0".into()
            })?;
            check(machine.pause(Duration::from_secs(10)), || {
                "a spinning guest was not paused".into()
            })?;
            check(controls[0].is_paused(), || "the control disagrees".into())?;
            machine.resume();
            // Not paused from the resume on, whether or not its thread woke yet: a
            // `status` after a `resume`'s reply must not say paused.
            check(!controls[0].is_paused(), || {
                "paused after the resume".into()
            })?;
            check(machine.exit().is_none(), || {
                "a spinning guest exited".into()
            })?;
            machine.stop();
            machine.stop();
            check(machine.vcpu_states() == ["stopped"], || {
                "not stopped".into()
            })?;
            let after = open_fds()?;
            check(after == before, || {
                format!("{before} descriptors before the machine, {after} after stop")
            })
        });
    }

    /// What `a_child_adopts_its_inherited_premap_and_unmaps_the_others` mapped before
    /// its fork, as the zygote does: (this snapshot's RAM, another snapshot's premap),
    /// their host addresses.
    static PREMAPS: OnceLock<(usize, usize)> = OnceLock::new();
    const OTHER_PREMAP_LEN: usize = 2 * PAGE_SIZE as usize;
    /// A byte of the base the child writes, never the file.
    const WRITTEN_AT: usize = 0x10;

    fn map(at: usize, len: usize, flags: i32, fd: RawFd) -> usize {
        // SAFETY: a new read-only mapping, at `at` only over one this test made.
        let addr = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_NORESERVE | flags,
                fd,
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED, "mmap");
        addr as usize
    }

    fn is_mapped(addr: usize, len: usize) -> bool {
        let mut resident = vec![0u8; len.div_ceil(PAGE_SIZE as usize)];
        // SAFETY: a vector of one byte per page of the range for mincore to fill.
        let rc = unsafe { libc::mincore(addr as *mut libc::c_void, len, resident.as_mut_ptr()) };
        rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ENOMEM)
    }

    /// The premap as `PremappedRam.map` makes it, here of a base of zeros and one run
    /// from a layer file, the guest's code at `ENTRY`; the zygote makes it before it
    /// forks (here: before `in_child`'s fork), read-only; the child adopts it.
    #[test]
    fn a_child_adopts_its_inherited_premap_and_unmaps_the_others() {
        if kvm().is_none() {
            return;
        }
        let dir = std::env::temp_dir();
        let base_path = dir.join(format!("vmfork-premap-base-{}", std::process::id()));
        let layer_path = dir.join(format!("vmfork-premap-layer-{}", std::process::id()));
        let base = File::create(&base_path).unwrap();
        base.set_len(RAM_SIZE as u64).unwrap();
        let layer = File::create(&layer_path).unwrap();
        layer.set_len(PAGE_SIZE).unwrap();
        layer.write_all_at(&READ_RNG_PRINT_RESET, 0).unwrap();
        let base = File::open(&base_path).unwrap();
        let layer = File::open(&layer_path).unwrap();
        let mine = map(0, RAM_SIZE, 0, base.as_raw_fd());
        map(
            mine + ENTRY as usize,
            PAGE_SIZE as usize,
            libc::MAP_FIXED,
            layer.as_raw_fd(),
        );
        let other = map(0, OTHER_PREMAP_LEN, libc::MAP_ANONYMOUS, -1);
        drop((base, layer)); // the mappings hold the files
        let _ = std::fs::remove_file(&base_path);
        let _ = std::fs::remove_file(&layer_path);
        assert!(PREMAPS.set((mine, other)).is_ok());
        in_child(|| {
            let &(mine, other) = PREMAPS.get().ok_or("no premap")?;
            let inherited = InheritedRam::new(
                RAM_SIZE as u64,
                Some(&[(0, RAM_SIZE as u64, mine as u64)]),
                &[(other as u64, OTHER_PREMAP_LEN as u64)],
            )?;
            check(is_mapped(other, OTHER_PREMAP_LEN), || {
                "the other premap was not inherited".into()
            })?;
            // SAFETY: both mapped by the test before this fork, used by nothing else.
            let regions = unsafe { inherited.adopt() }?.ok_or("no own premap")?;
            check(!is_mapped(other, OTHER_PREMAP_LEN), || {
                "the other snapshot's premap is still mapped".into()
            })?;
            let ram = *regions.first().ok_or("no region")?;
            // SAFETY: inside the adopted region, now writable; a fault here fails the test.
            unsafe { *((ram.host_addr as usize + WRITTEN_AT) as *mut u8) = 0xA5 };
            let kvm = Kvm::new().map_err(|e| format!("/dev/kvm: {e}"))?;
            let machine = machine(&kvm, ram, None)?;
            machine.start(false)?;
            wait_for_exit(&machine)?;
            // The run's page (the code) reached the guest through KVM's slot.
            let tail = machine.console_tail();
            check(tail == "ok", || {
                format!("console tail {tail:?}, exit {:?}", machine.exit())
            })
        });
        // The child's writes were its own: the premap still reads the file.
        // SAFETY: this process's read-only mapping made above.
        let byte = unsafe { *((mine + WRITTEN_AT) as *const u8) };
        assert_eq!(byte, 0, "the child's write reached the zygote's premap");
        assert!(is_mapped(other, OTHER_PREMAP_LEN));
    }

    #[test]
    fn an_inherited_premap_must_have_the_snapshots_layout() {
        let size = RAM_SIZE as u64;
        let host = 0x7f00_0000_0000;
        let fits = InheritedRam::new(size, Some(&[(0, size, host)]), &[(host + size, 4096)]);
        assert!(fits.is_ok());
        let flat = InheritedRam::new(size, None, &[(host, 4096)]);
        assert!(flat.is_ok());
        for (mine, others) in [
            (vec![(0, size / 2, host)], vec![]),  // not the layout's size
            (vec![(0x1000, size, host)], vec![]), // nor its address
            (vec![(0, size, host + 1)], vec![]),  // not page-aligned
            (vec![(0, size, 0)], vec![]),         // no mapping
            (vec![(0, size, host)], vec![(host + 4096, 4096)]), // overlaps this RAM
            (vec![(0, size, host)], vec![(host - 4096, 100)]), // not whole pages
            (vec![(0, size, host)], vec![(u64::MAX - 4095, 8192)]), // wraps
        ] {
            assert!(
                InheritedRam::new(size, Some(&mine), &others).is_err(),
                "{mine:x?} {others:x?} accepted"
            );
        }
    }
}
