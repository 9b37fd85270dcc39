//! The plan of the `NativeMachine` a native child restores (`native_fork.rs`): built
//! by the zygote before the fork, built into a machine by the child after its set-up
//! and jail, with no Python.
//!
//! Two parts, so that what costs is paid once per snapshot:
//! * `SnapshotMachinePlan`: a snapshot's machine as plain values (the memory file's
//!   path and size, the prepared restore, COM1's registers, the console's budget, the
//!   virtio devices' plans), built once per snapshot (`vmmchild._snapshot_machine`);
//! * `ChildMachinePlan`: one child's, `SnapshotMachinePlan.for_child`: its run
//!   directory (the console log and the vsock listener go there), for a jailed
//!   child where its jail's opened descriptors hold the memory file and `/dev/kvm`,
//!   and the zygote's premaps it inherits (`machine::InheritedRam`, as plain values,
//!   `vmmchild.inherited_ram` finds them): a diff snapshot's RAM, and the batch's
//!   other snapshots', which it unmaps.
//!
//! The child opens all it needs itself (its set-up's `close_range` closed the zygote's
//! descriptors): `/dev/kvm`, for a flat snapshot the memory file, and each disk (from
//! the jail's, once its uid may not open them), the console log, and its vsock device
//! binds `<run_dir>/vsock.sock`. A diff snapshot's RAM is the inherited premap,
//! adopted (no file opened, no run mapped). A read-only disk's path is the zygote's
//! (from its content key in the snapshot's record), never one the guest gives; each is
//! opened read-only. A child's own volumes (`ChildVolume`, given at its spawn) are the
//! exception by design: a read-write volume the snapshot's slot holds (its sandbox's
//! own file, opened read-write), and new volumes in the snapshot's empty slots, put in
//! at the restore and announced to the driver by the configuration-change interrupt
//! once the machine is built (`NativeTransport::config_changed`); the child's agent
//! mounts them after its `after_fork` (`child_life.rs`, `agent_handshake::mount_volume`).

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use kvm_ioctls::Kvm;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::child::{self, Opened};
use crate::console::{log_budget, SerialFields, SerialRegs};
use crate::machine::{
    ram_layout, ConsolePlan, InheritedRam, MachinePlan, NativeMachine, RamSource, SlotPlan,
};
use crate::restore::VcpuBuffers;
use crate::transport::{BlkDisk, DeviceKind, DevicePlan, VsockListener};
use crate::transport_py::{plan_from_py, PyPlan};
use crate::vm::Restore;
use crate::write_set;
use crate::PreparedRestore;

/// The console log's mode when the child creates it (as `Machine`'s, the VMM's own).
const CONSOLE_LOG_MODE: u32 = 0o600;

/// A snapshot's machine as plain values (module comment).
#[pyclass(frozen, module = "vmfork._core")]
pub struct SnapshotMachinePlan {
    /// This plan's number in this process (`number`), never reused.
    number: u64,
    memory_path: PathBuf,
    mem_size: u64,
    prepared: Py<PreparedRestore>,
    /// (slot, pin, plan); a vsock's listener path is set per child (`for_child`), a
    /// disk's file is opened by the child (`disks`).
    devices: Vec<(u32, u32, DevicePlan)>,
    /// Each disk's file by slot (an empty volume slot has none).
    disks: HashMap<u32, PathBuf>,
    serial: Option<SerialFields>,
    log_budget: (u32, f64, u64),
    /// Its write set once learnt (`learn_write_set`; `write_set.rs`).
    write_set: OnceLock<Arc<[(u64, u64)]>>,
}

#[pymethods]
impl SnapshotMachinePlan {
    /// The machine of a snapshot: its memory file `memory_path` (`mem_size` bytes,
    /// mapped `MAP_PRIVATE` by each child), its restore buffers `prepared`, COM1's
    /// registers `serial` (`SerialState`'s fields), the console log's budget, the
    /// virtio devices `devices`: (slot, IOAPIC pin, plan as `plan.machine_plan`
    /// builds them), and each disk's file `disks` by slot (read-only disks only).
    /// `ValueError` for a plan that does not fit its device, or a disk without its
    /// file.
    #[new]
    #[pyo3(signature = (memory_path, mem_size, prepared, *, devices, serial, log_burst,
                        log_per_second, log_total_bytes, disks = HashMap::new()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        memory_path: PathBuf,
        mem_size: u64,
        prepared: Py<PreparedRestore>,
        devices: Vec<(u32, u32, PyPlan)>,
        serial: Option<SerialFields>,
        log_burst: u32,
        log_per_second: f64,
        log_total_bytes: u64,
        disks: HashMap<u32, PathBuf>,
    ) -> PyResult<Self> {
        log_budget(log_burst, log_per_second, log_total_bytes).map_err(PyValueError::new_err)?;
        let devices = devices
            .into_iter()
            .map(|(slot, irq, plan)| {
                // Any path: each child's is its own run directory's (`ChildMachinePlan`).
                let listener = Some((String::new(), None));
                let plan = plan_from_py(plan, listener, None, None)?;
                // A read-write volume's file is each child's own (`ChildVolume`).
                if let DeviceKind::Blk(disk) = &plan.kind {
                    if disk.capacity > 0 && disk.read_only && !disks.contains_key(&slot) {
                        return Err(PyValueError::new_err(format!(
                            "virtio-mmio.{slot}: the disk {} has no file",
                            disk.key
                        )));
                    }
                    if !disk.read_only && disks.contains_key(&slot) {
                        return Err(PyValueError::new_err(format!(
                            "virtio-mmio.{slot}: the disk {} is read-write: its file is \
                             each child's own",
                            disk.key
                        )));
                    }
                }
                Ok((slot, irq, plan))
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(SnapshotMachinePlan {
            number: NEXT_NUMBER.fetch_add(1, Ordering::Relaxed),
            memory_path,
            mem_size,
            prepared,
            devices,
            disks,
            serial,
            log_budget: (log_burst, log_per_second, log_total_bytes),
            write_set: OnceLock::new(),
        })
    }

    /// Take the write set a learner child saved as `path` (`write_set.rs`): each child
    /// planned from now on copies its pages for writing at its restore. Returns the
    /// pages of the set kept (a set larger than the bounds is cut); `ValueError` for a
    /// file that is not a valid set, with why. A plan that has a set keeps it.
    fn learn_write_set(&self, path: PathBuf) -> PyResult<u64> {
        if let Some(runs) = self.write_set.get() {
            return Ok(write_set::pages(runs));
        }
        let regions: Vec<(u64, u64, u64)> = ram_layout(self.mem_size)
            .map_err(PyValueError::new_err)?
            .into_iter()
            .map(|(gpa, size, _)| (gpa, size, 0))
            .collect();
        let runs = write_set::load(&path, &regions).map_err(PyValueError::new_err)?;
        Ok(write_set::pages(self.write_set.get_or_init(|| runs.into())))
    }

    /// The pages of the write set its children copy at their restore; None before
    /// one is learnt.
    #[getter]
    fn write_set_pages(&self) -> Option<u64> {
        self.write_set.get().map(|runs| write_set::pages(runs))
    }

    /// One child's plan: its `run_dir`; for a jailed child, the index of the memory
    /// file and of each disk (by slot) among the jail's read-only opened files
    /// (`JailSpec.preopen`) and of `/dev/kvm` among its devices (`JailSpec.devices`).
    /// `premapped`: the RAM the child inherits instead of mapping the memory file,
    /// (guest address, size, host address) per region of the snapshot's layout (the
    /// memory file is then not needed); `other_premaps`: (host address, length) of each
    /// other premap the fork copies, which the child unmaps; `volumes`: the child's own
    /// (slot, path, key, capacity, read-only, guest path, index among the jail's
    /// opened files: its read-only ones or, for a read-write volume, its read-write
    /// ones), each a read-write volume its slot holds or a new one for an empty slot.
    /// `tap`: for an unjailed child, the tap its net device attaches to, opened by the
    /// child in the network namespace its set-up joined (`ChildPlan`'s `netns`; a
    /// jailed child's jail opens it), a Linux interface name (checked by the caller,
    /// `vmmchild._native_machine`). `ValueError` for ranges that do not fit, or a
    /// volume that does not fit its slot.
    #[pyo3(signature = (run_dir, *, jail_memory = None, jail_kvm = None,
                        jail_disks = HashMap::new(), premapped = None,
                        other_premaps = Vec::new(), volumes = Vec::new(), tap = None))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn for_child(
        slf: Py<Self>,
        run_dir: PathBuf,
        jail_memory: Option<usize>,
        jail_kvm: Option<usize>,
        jail_disks: HashMap<u32, usize>,
        premapped: Option<Vec<(u64, u64, u64)>>,
        other_premaps: Vec<(u64, u64)>,
        volumes: Vec<ChildVolumeArgs>,
        tap: Option<String>,
    ) -> PyResult<ChildMachinePlan> {
        let args = ForChildArgs {
            run_dir,
            jail_memory,
            jail_kvm,
            jail_disks,
            premapped,
            other_premaps,
            volumes,
            tap,
        };
        SnapshotMachinePlan::child_plan(slf, args).map_err(PyValueError::new_err)
    }

    /// This plan's number in this process; from the first read on, a process cloned
    /// from this one finds the plan by it (`kept_plan`: the forker, `forker.rs`) for
    /// as long as the plan lives here.
    #[getter]
    fn number(slf: &Bound<'_, Self>) -> u64 {
        let number = slf.get().number;
        let mut kept = KEPT_PLANS.lock().unwrap_or_else(|e| e.into_inner());
        if !kept.iter().any(|(n, _)| *n == number) {
            kept.push((number, slf.as_ptr() as usize));
        }
        number
    }
}

/// A child volume as `for_child` takes it: (slot, path, key, capacity, read-only,
/// guest path, index among the jail's opened files).
type ChildVolumeArgs = (u32, PathBuf, String, u64, bool, String, Option<usize>);

/// `for_child`'s arguments as plain values (its docstring says what each is): what
/// the forker (`forker.rs`) reads from JSON.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForChildArgs {
    run_dir: PathBuf,
    #[serde(default)]
    jail_memory: Option<usize>,
    #[serde(default)]
    jail_kvm: Option<usize>,
    #[serde(default)]
    jail_disks: HashMap<u32, usize>,
    #[serde(default)]
    premapped: Option<Vec<(u64, u64, u64)>>,
    #[serde(default)]
    other_premaps: Vec<(u64, u64)>,
    #[serde(default)]
    volumes: Vec<ChildVolumeArgs>,
    #[serde(default)]
    tap: Option<String>,
}

static NEXT_NUMBER: AtomicU64 = AtomicU64::new(1);

/// (number, the plan's Python object) of each plan whose `number` was read, while it
/// lives (`Drop` takes it out).
static KEPT_PLANS: Mutex<Vec<(u64, usize)>> = Mutex::new(Vec::new());

impl Drop for SnapshotMachinePlan {
    fn drop(&mut self) {
        let number = self.number;
        KEPT_PLANS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(n, _)| *n != number);
    }
}

/// The plan `number` (`SnapshotMachinePlan.number`), if it lives in this process: in
/// a forker, one its zygote had when it cloned it.
pub(crate) fn kept_plan(py: Python<'_>, number: u64) -> Option<Py<SnapshotMachinePlan>> {
    let kept = KEPT_PLANS.lock().unwrap_or_else(|e| e.into_inner());
    let &(_, object) = kept.iter().find(|(n, _)| *n == number)?;
    // SAFETY: `object` is a live `SnapshotMachinePlan`'s Python object: its `number`
    // getter put it here and its `Drop`, which runs before the object is freed, takes
    // it out under the same lock.
    let bound = unsafe { Bound::from_borrowed_ptr(py, object as *mut pyo3::ffi::PyObject) };
    // SAFETY: only `SnapshotMachinePlan`s are put here.
    Some(unsafe { bound.cast_into_unchecked::<SnapshotMachinePlan>() }.unbind())
}

/// `_core.kept_snapshot_plans()`: the numbers `kept_plan` finds in this process.
#[pyfunction]
pub fn kept_snapshot_plans() -> Vec<u64> {
    KEPT_PLANS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(n, _)| *n)
        .collect()
}

impl SnapshotMachinePlan {
    /// One child's plan (`for_child`'s checks), its refusals as text.
    pub fn child_plan(slf: Py<Self>, args: ForChildArgs) -> Result<ChildMachinePlan, String> {
        let inherited = InheritedRam::new(
            slf.get().mem_size,
            args.premapped.as_deref(),
            &args.other_premaps,
        )?;
        let volumes = args
            .volumes
            .into_iter()
            .map(
                |(slot, path, key, capacity, read_only, guest_path, jail_index)| {
                    let volume = ChildVolume {
                        slot,
                        path,
                        disk: BlkDisk {
                            key,
                            capacity,
                            read_only,
                            volume: Some(guest_path),
                            file: None,
                        },
                        jail_index,
                    };
                    volume.fits(&slf.get().devices)?;
                    Ok(volume)
                },
            )
            .collect::<Result<Vec<_>, String>>()?;
        for (slot, _, plan) in &slf.get().devices {
            if let DeviceKind::Blk(disk) = &plan.kind {
                if !disk.read_only && !volumes.iter().any(|v| v.slot == *slot) {
                    return Err(format!(
                        "the snapshot's read-write volume {} (virtio-mmio.{slot}) needs its \
                         file",
                        disk.key
                    ));
                }
            }
        }
        Ok(ChildMachinePlan {
            snapshot: slf,
            run_dir: args.run_dir,
            jail_memory: args.jail_memory,
            jail_kvm: args.jail_kvm,
            jail_disks: args.jail_disks,
            inherited,
            volumes,
            tap: args.tap,
        })
    }
}

/// A volume of one child, given at its spawn: a read-write volume the snapshot's slot
/// holds (the same disk, its sandbox's own file), or a new one for an empty slot.
struct ChildVolume {
    slot: u32,
    path: PathBuf,
    /// The media (`file` None: opened by the child).
    disk: BlkDisk,
    /// Where the jail opened it: among its read-only or its read-write files.
    jail_index: Option<usize>,
}

impl ChildVolume {
    /// The slot is a volume slot of the snapshot, empty (a new volume) or holding
    /// this very read-write disk (key, size).
    fn fits(&self, devices: &[(u32, u32, DevicePlan)]) -> Result<(), String> {
        let slot = self.slot;
        let held = devices.iter().find_map(|(at, _, plan)| match &plan.kind {
            DeviceKind::Blk(disk) if *at == slot && disk.volume.is_some() => Some(disk),
            _ => None,
        });
        let Some(held) = held else {
            return Err(format!("virtio-mmio.{slot} is not a volume slot"));
        };
        if self.disk.capacity == 0 {
            return Err(format!("volume {}: no bytes", self.disk.key));
        }
        if held.capacity == 0 {
            return Ok(());
        }
        if held.read_only
            || held.key != self.disk.key
            || held.capacity != self.disk.capacity
            || self.disk.read_only
        {
            return Err(format!(
                "virtio-mmio.{slot} holds {} ({} bytes{}): not the volume {} given",
                held.key,
                held.capacity,
                if held.read_only { ", read-only" } else { "" },
                self.disk.key
            ));
        }
        Ok(())
    }

    /// Its file: the jail's descriptor (`opened`), or opened here (read-write for a
    /// read-write volume).
    fn open(&self, opened: Option<&Opened>) -> Result<File, String> {
        match opened {
            Some((ro, rw, ..)) => {
                let at = self
                    .jail_index
                    .ok_or_else(|| format!("the jail opened no {}", self.path.display()))?;
                let fds = if self.disk.read_only { ro } else { rw };
                Ok(File::from(jail_fd(fds, at, "volume")?))
            }
            None => File::options()
                .read(true)
                .write(!self.disk.read_only)
                .open(&self.path)
                .map_err(|e| format!("{}: {e}", self.path.display())),
        }
    }
}

/// One child's machine (module comment).
#[pyclass(frozen, module = "vmfork._core")]
pub struct ChildMachinePlan {
    snapshot: Py<SnapshotMachinePlan>,
    run_dir: PathBuf,
    jail_memory: Option<usize>,
    jail_kvm: Option<usize>,
    jail_disks: HashMap<u32, usize>,
    inherited: InheritedRam,
    volumes: Vec<ChildVolume>,
    /// An unjailed child's tap name (`for_child`).
    tap: Option<String>,
}

/// The descriptor at `index` of `fds`, the jail's opened `what`, owned from here.
/// A duplicate of the descriptor the jail opened at `index` of `fds`: the jail's own
/// stays open, for the hand-over's Python, which adopts them all (`jail.adopt`: a
/// capture reads the memory file and `/dev/kvm` through them).
fn jail_fd(fds: &[RawFd], index: usize, what: &str) -> Result<OwnedFd, String> {
    let fd = match fds.get(index) {
        Some(&fd) if fd >= 0 => fd,
        _ => return Err(format!("the jail opened no {what}")),
    };
    // SAFETY: the jail opened `fd` for this process and keeps it open for its life;
    // borrowed for the duplicate only.
    unsafe { BorrowedFd::borrow_raw(fd) }
        .try_clone_to_owned()
        .map_err(|e| format!("the jail's {what}: {e}"))
}

impl ChildMachinePlan {
    /// The snapshot's memory file: the jail's descriptor (`opened`), or opened here.
    fn memory_file(&self, opened: Option<&Opened>) -> Result<File, String> {
        match opened {
            Some((ro, ..)) => {
                let memory_at = self
                    .jail_memory
                    .ok_or("a jailed child needs its memory file opened by the jail")?;
                Ok(File::from(jail_fd(ro, memory_at, "memory file")?))
            }
            None => {
                let path = &self.snapshot.get().memory_path;
                File::open(path).map_err(|e| format!("{}: {e}", path.display()))
            }
        }
    }

    /// The machine, nothing running yet; `opened`: what the child's jail opened
    /// (None unjailed); `mark`: told the end of each step (`machine_opened`, then
    /// `NativeMachine::restore`'s). Runs in the forked child, without Python.
    pub fn build(
        &self,
        opened: Option<&Opened>,
        mark: &dyn Fn(&'static str),
    ) -> Result<NativeMachine, String> {
        let snapshot = self.snapshot.get();
        let kvm = match opened {
            Some((_, _, _, devices, _)) => {
                let kvm_at = self.jail_kvm.ok_or("a jailed child needs its /dev/kvm")?;
                let kvm = jail_fd(devices, kvm_at, "/dev/kvm")?;
                // SAFETY: a descriptor of /dev/kvm that is ours alone (`jail_fd`).
                unsafe { Kvm::from_raw_fd(kvm.into_raw_fd()) }
            }
            None => Kvm::new().map_err(|e| format!("/dev/kvm: {e}"))?,
        };
        let memory;
        // SAFETY: `for_child`'s ranges are the zygote's premaps this child inherited
        // (`vmmchild.inherited_ram`), which nothing else in it uses; its own stays
        // mapped for the child's life (it leaves through `_exit`).
        let ram = match unsafe { self.inherited.adopt() }? {
            Some(regions) => RamSource::Mapped(regions),
            None => {
                memory = self.memory_file(opened)?;
                RamSource::File {
                    fd: memory.as_fd(),
                    mem_size: snapshot.mem_size,
                }
            }
        };
        let log_path = self.run_dir.join("console.log");
        let log = File::options()
            .create(true)
            .append(true)
            .mode(CONSOLE_LOG_MODE)
            .custom_flags(libc::O_CLOEXEC)
            .open(&log_path)
            .map_err(|e| format!("{}: {e}", log_path.display()))?;
        let (burst, per_second, total) = snapshot.log_budget;
        let vsock_path = self.run_dir.join("vsock.sock");
        let vsock_path = vsock_path
            .to_str()
            .ok_or_else(|| format!("{} is not UTF-8", vsock_path.display()))?;
        // Each disk file open until the machine is built (its transport keeps a
        // duplicate), once per path: two slots may hold one read-only disk, and the
        // jail opened it once.
        let mut files: HashMap<&PathBuf, File> = HashMap::with_capacity(snapshot.disks.len());
        for (slot, path) in &snapshot.disks {
            if files.contains_key(path) {
                continue;
            }
            let file = match opened {
                Some((ro, ..)) => {
                    let at = self
                        .jail_disks
                        .get(slot)
                        .ok_or_else(|| format!("the jail opened no {}", path.display()))?;
                    File::from(jail_fd(ro, *at, "disk")?)
                }
                None => File::open(path).map_err(|e| format!("{}: {e}", path.display()))?,
            };
            files.insert(path, file);
        }
        // The tap: the one the child's jail opened in its network namespace
        // (`Jail::enter`, before the privilege drop), duplicated (`jail_fd`), or an
        // unjailed child's, opened here in the namespace its set-up joined; closed when
        // the machine is built (its transport keeps its own).
        let tap_file = match (opened, &self.tap) {
            (Some((.., Some(fd))), _) => Some(jail_fd(&[*fd], 0, "tap")?),
            (None, Some(name)) => {
                let fd = child::open_tap(name)
                    .map_err(|f| format!("tap {name}: {}: {}", f.step, child::strerror(f.errno)))?;
                // SAFETY: `open_tap` returns a descriptor it opened for the caller alone.
                Some(unsafe { OwnedFd::from_raw_fd(fd) })
            }
            _ => None,
        };
        let tap = tap_file.as_ref().map(AsRawFd::as_raw_fd);
        let volume_files = self
            .volumes
            .iter()
            .map(|v| Ok((v.slot, v.open(opened)?)))
            .collect::<Result<HashMap<u32, File>, String>>()?;
        let disk_file = |slot: &u32| {
            let path = snapshot.disks.get(slot)?;
            files.get(path).map(File::as_raw_fd)
        };
        let devices = snapshot
            .devices
            .iter()
            .map(|(slot, irq, plan)| {
                let mut plan = plan.clone();
                match &mut plan.kind {
                    DeviceKind::Vsock { listener, .. } => {
                        *listener = VsockListener {
                            path: vsock_path.to_owned(),
                            bound: None,
                        };
                    }
                    DeviceKind::Blk(disk) => match self.volumes.iter().find(|v| v.slot == *slot) {
                        Some(volume) => {
                            *disk = BlkDisk {
                                file: volume_files.get(slot).map(File::as_raw_fd),
                                ..volume.disk.clone()
                            }
                        }
                        None => disk.file = disk_file(slot),
                    },
                    DeviceKind::Net(net) => net.tap = tap,
                    _ => {}
                }
                SlotPlan {
                    slot: *slot,
                    irq: *irq,
                    plan,
                }
            })
            .collect();
        mark("machine_opened");
        let prepared = snapshot.prepared.get();
        let states: Vec<&VcpuBuffers> = prepared.vcpus.iter().map(|v| &v.get().inner).collect();
        let indices: Vec<u32> = states.iter().map(|s| s.index()).collect();
        let plan = MachinePlan {
            ram,
            vcpus: &indices,
            restore: Some(Restore {
                vm: &prepared.vm,
                vcpus: &states,
            }),
            console: ConsolePlan {
                log: Some(log),
                budget: log_budget(burst, per_second, total)?,
                serial: snapshot.serial.clone().map(SerialRegs::from_fields),
            },
            devices,
            write_set: snapshot.write_set.get().map_or(&[], |runs| runs),
            pagemap: match opened {
                Some((_, _, (pagemap, _), ..)) => Some(jail_fd(&[*pagemap], 0, "pagemap")?),
                None => None,
            },
        };
        // SAFETY: the RAM is a file mapping the machine makes and owns, or the adopted
        // premap, mapped until this process exits.
        let machine = unsafe { NativeMachine::restore(&kvm, plan, mark) }?;
        // A new volume's slot was empty when the guest's driver last read its config:
        // the change tells it to read the capacity again (raised before any vCPU runs,
        // delivered when one does).
        for (slot, _, plan) in &snapshot.devices {
            let empty = matches!(&plan.kind, DeviceKind::Blk(disk) if disk.capacity == 0);
            if empty && self.volumes.iter().any(|v| v.slot == *slot) {
                machine
                    .transport(*slot)
                    .ok_or_else(|| format!("virtio-mmio.{slot}: no transport"))?
                    .config_changed();
            }
        }
        Ok(machine)
    }
}
