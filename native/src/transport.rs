//! The virtio-mmio transport's device side, and a device restored from a plan, without
//! Python.
//!
//! The register file (`mmio.rs`) applies every register rule itself and hands back an
//! `Event` for what needs the device model. What acts on those events, and answers a
//! config read the register file does not serve, is a `TransportHost`, whose one
//! implementation (the Python transport that was the other is deleted) is
//! `NativeTransport`, here: at DRIVER_OK it builds the device's native server
//! (`rng_serve.rs`, `balloon_serve.rs`, `blk_serve.rs`, `net_serve.rs`) from the
//! register file (queue addresses and sizes, the ring indices) with a `NativeEvents`
//! sink, and registers it on the loop (`Readers`: a `NativeLoop`, or the Python
//! loop's native registration); at a reset it drops it (a disk's or net's server
//! retired first: it lets go of the file or the tap); a notify with no ioeventfd is
//! served on the writing thread; the device's config bytes are a Rust value (rng:
//! none; balloon: its 16 bytes, of which the driver writes `actual`; vsock: the guest
//! CID; blk: capacity, `SIZE_MAX`, `SEG_MAX`; net: the MAC, the link status; the last
//! three plain, served by the register file). A disk's file (`BlkDisk.file`) and
//! net's tap (`NetTap.tap`) come with the plan and are the transport's, duplicated,
//! until `close`; the tap is on the loop beside the ioeventfds while an activation
//! runs. vsock's server (`vsock_serve.rs`) lives as long as the device instead, as
//! its host listener does: built at the restore with its private epoll on the loop,
//! handed the queues at DRIVER_OK (`VsockServer::attach`) and let go of them at a
//! reset (`detach`); a restore arms the transport-reset event first, as `vsock.py`'s
//! restore does, so the guest drops the parent's connections.
//!
//! `Windows` is the MMIO bus's map of register files by window, a Rust value: the
//! native vCPU loop serves an access there and calls the window's host only for what
//! needs the device.
//!
//! A `DevicePlan` is one device's restore reduced to plain values: the transport's
//! register image (`mmio::Saved`), each queue's ring indices and the device's record
//! (what its native server takes). Python builds it once from the decoded
//! `MachineState` (the format keeps its one reader); `NativeTransport::restore` imports
//! the register image and, if the driver had the device running, re-activates it with
//! the saved indices; `NativeTransport::plan` exports the same values back (BRANCH).
//!
//! Locks, in this order: the transport's `state`, a server's state, guest RAM's, the
//! register file's; the loop's own lock is taken with the transport's held (to add or
//! remove a reader) and never the other way round. No Python anywhere in this file.

use std::any::Any;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use crate::balloon_serve::{BalloonServer, Counters, DiscardError};
use crate::blk::{self, Counters as BlkCounters, SECTOR_SIZE};
use crate::blk_serve::{BlkServer, MediaSpec, WarningFields};
use crate::eventloop::{Loop, LoopHost, NativeReader};
use crate::guest_ram::GuestRam;
use crate::mmio::{
    Event, QueueRegs, Read, Registers, Saved, STATUS_FEATURES_OK, VIRTIO_F_VERSION_1, WINDOW_SIZE,
};
use crate::net::Counters as NetCounters;
use crate::net_serve::{NetDetails, NetFds, NetServer};
use crate::queue_server::{write_eventfd, DeviceEvents, EventRecord, NativeEvents};
use crate::rng_serve::{RngServer, Served};
use crate::virtq::{self, QueueError, Rings};
use crate::vsock_serve::{self, Activation, VsockServer};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why a host could not act on an access: said in `detail`; `raised` is what the
/// Python transport raised (a `Py<PyAny>`, for `VcpuLoop.error`), None from a native
/// host. `Any`, so this trait names no Python type and a binary without libpython
/// links it.
pub struct TransportFailure {
    pub detail: String,
    pub raised: Option<Box<dyn Any + Send>>,
}

/// What a register access causes that the register file cannot do by itself. Called
/// on the accessing vCPU's thread, the register file's lock released.
pub trait TransportHost: Send + Sync {
    /// A config read the register file does not serve (the config is not plain bytes):
    /// fill `data` (1, 2, 4 or 8 bytes) from config offset `offset`.
    fn read_config(&self, offset: u64, data: &mut [u8]) -> Result<(), TransportFailure>;

    /// Act on the events one register write caused, in order.
    fn apply(&self, events: Vec<Event>) -> Result<(), TransportFailure>;
}

struct Window {
    base: u64,
    regs: Arc<Mutex<Registers>>,
    host: Arc<dyn TransportHost>,
}

/// A window found: the offset in it, its registers, its host.
type Found = (u64, Arc<Mutex<Registers>>, Arc<dyn TransportHost>);

/// What a read in a window asks of its caller.
pub enum ReadServed {
    Done,
    /// A config read the host answers: `host.read_config(offset, data)`.
    Device(Arc<dyn TransportHost>, u64),
}

/// What a write in a window asks of its caller.
pub enum WriteServed {
    Done,
    /// `host.apply(events)`.
    Events(Arc<dyn TransportHost>, Vec<Event>),
}

/// The MMIO bus's register files by window (each `WINDOW_SIZE` bytes).
#[derive(Default)]
pub struct Windows {
    windows: RwLock<Vec<Window>>,
}

impl Windows {
    pub fn new() -> Self {
        Windows::default()
    }

    /// Serve `[base, base + 0x1000)` with `regs`; `host` acts on their events.
    pub fn add(
        &self,
        base: u64,
        regs: Arc<Mutex<Registers>>,
        host: Arc<dyn TransportHost>,
    ) -> Result<(), String> {
        let mut windows = self.windows.write().unwrap_or_else(|p| p.into_inner());
        if windows
            .iter()
            .any(|w| base < w.base + WINDOW_SIZE && w.base < base.saturating_add(WINDOW_SIZE))
        {
            return Err(format!("MMIO window {base:#x} overlaps another"));
        }
        windows.push(Window { base, regs, host });
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.windows.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// The window holding `addr`: (offset in it, its registers, its host), cloned out
    /// so the map's lock is released before anything else happens.
    fn find(&self, addr: u64) -> Option<Found> {
        let windows = self.windows.read().unwrap_or_else(|p| p.into_inner());
        windows
            .iter()
            .find(|w| addr >= w.base && addr - w.base < WINDOW_SIZE)
            .map(|w| (addr - w.base, w.regs.clone(), w.host.clone()))
    }

    /// A guest read at `addr` if a window holds it (None if none does).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> Option<ReadServed> {
        let (offset, regs, host) = self.find(addr)?;
        let read = lock(&regs).read(offset, data);
        Some(match read {
            Read::Done => ReadServed::Done,
            Read::Device => ReadServed::Device(host, offset - crate::mmio::CONFIG_SPACE),
        })
    }

    /// A guest write at `addr` if a window holds it (None if none does).
    pub fn write(&self, addr: u64, data: &[u8]) -> Option<WriteServed> {
        let (offset, regs, host) = self.find(addr)?;
        let mut events = Vec::new();
        lock(&regs).write(offset, data, &mut events);
        Some(if events.is_empty() {
            WriteServed::Done
        } else {
            WriteServed::Events(host, events)
        })
    }

    /// A read served to the end, the host called if it must (a caller with no GIL to
    /// manage: the native vCPU host; or one whose hosts take it themselves:
    /// `_core.MmioWindows.read`).
    pub fn serve_read(&self, addr: u64, data: &mut [u8]) -> Option<Result<(), TransportFailure>> {
        Some(match self.read(addr, data)? {
            ReadServed::Done => Ok(()),
            ReadServed::Device(host, offset) => host.read_config(offset, data),
        })
    }

    /// A write served to the end, its events applied by the host.
    pub fn serve_write(&self, addr: u64, data: &[u8]) -> Option<Result<(), TransportFailure>> {
        Some(match self.write(addr, data)? {
            WriteServed::Done => Ok(()),
            WriteServed::Events(host, events) => host.apply(events),
        })
    }
}

/// Where a native transport registers its server's ioeventfds: a loop, whatever its
/// host (a `NativeLoop`, or the loop behind `_core.EventLoop`).
pub trait Readers: Send + Sync {
    fn add_reader(&self, fd: RawFd, handler: Arc<dyn NativeReader>) -> Result<(), String>;
    fn remove_reader(&self, fd: RawFd);
}

impl<H: LoopHost> Readers for Loop<H> {
    fn add_reader(&self, fd: RawFd, handler: Arc<dyn NativeReader>) -> Result<(), String> {
        self.add_native(fd, handler)
            .map_err(|e| format!("add reader {fd}: {e:?}"))
    }

    fn remove_reader(&self, fd: RawFd) {
        self.remove_native(fd);
    }
}

/// virtio-balloon's config space: num_pages, actual, free_page_hint_cmd_id, poison_val.
pub const BALLOON_CONFIG_SIZE: usize = 16;
const BALLOON_ACTUAL: u64 = 4;
const DEVICE_ID_NET: u32 = 1;
/// Interrupt and kick moderation (virtio 1.x, 2.7.10), which only net offers.
const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;
const DEVICE_ID_BLK: u32 = 2;
const DEVICE_ID_RNG: u32 = 4;
const DEVICE_ID_BALLOON: u32 = 5;
const DEVICE_ID_VSOCK: u32 = 19;

/// A device a native transport serves, and what its server takes beyond the rings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// virtio-rng (`rng.py`'s budget per notification).
    Rng { max_requests: u32, max_bytes: usize },
    /// virtio-balloon: the budget, the `madvise` advice that drops a page from this
    /// machine's RAM mapping, and the config's `actual` (the driver's to write).
    Balloon {
        max_chains: u32,
        advice: i32,
        actual: u32,
    },
    /// virtio-vsock: the guest's CID (the config bytes), `vsock.py`'s timeouts, and the
    /// host side (`plan()` gives it back as the restore was given it).
    Vsock {
        guest_cid: u64,
        connect_timeout: Duration,
        reset_ack_wait: Duration,
        listener: VsockListener,
    },
    /// virtio-blk: the root disk or a volume slot (`blk.py`).
    Blk(BlkDisk),
    /// virtio-net: its MAC and its tap (`net.py`).
    Net(NetTap),
}

/// `net.py`'s budget per wake (`MAX_FRAMES_PER_RUN`) and largest tx frame
/// (`MAX_TX_BYTES`: the virtio-net header, 64 KiB of IP packet, an Ethernet header
/// with a VLAN tag).
pub const NET_MAX_FRAMES: u32 = 256;
pub const NET_MAX_TX_BYTES: u64 = 12 + 65536 + 64;
/// `net.py`'s `LINK_UP`, the config's status word after the MAC.
const NET_LINK_UP: u16 = 1;
/// Feature bits the driver acks to receive offloaded frames (virtio 1.x, 5.1.3), and
/// the `<linux/if_tun.h>` offloads each lets the tap give (`tap_offloads`).
const NET_F_GUEST_CSUM: u64 = 1 << 1;
const NET_F_GUEST_TSO4: u64 = 1 << 7;
const NET_F_GUEST_TSO6: u64 = 1 << 8;
const NET_F_GUEST_ECN: u64 = 1 << 9;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54D0;
const TUN_F_CSUM: libc::c_uint = 0x01;
const TUN_F_TSO4: libc::c_uint = 0x02;
const TUN_F_TSO6: libc::c_uint = 0x04;
const TUN_F_TSO_ECN: libc::c_uint = 0x08;

/// A virtio-net device's MAC (`NetState.mac`) and its tap: borrowed for the restore
/// (duplicated there), None for a device without one (its tx frames are dropped, it
/// receives nothing), and in a plan given back. The tap is always a descriptor the
/// VMM opened (`child::open_tap`, a jail's), never a path from the guest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetTap {
    pub mac: [u8; 6],
    pub tap: Option<RawFd>,
}

impl NetTap {
    fn check(&self) -> Result<(), String> {
        // `net.py`'s `parse_mac`: a unicast address, not all zeros.
        if self.mac[0] & 1 != 0 || self.mac == [0; 6] {
            return Err(format!("MAC {:02x?} is not a unicast address", self.mac));
        }
        Ok(())
    }

    /// The config space `net.py` states: the MAC, then the link status (always up).
    fn config(&self) -> Vec<u8> {
        let mut config = self.mac.to_vec();
        config.extend_from_slice(&NET_LINK_UP.to_le_bytes());
        config
    }

    /// The tap, duplicated (None without one).
    fn open(&self) -> Result<Option<OwnedFd>, String> {
        let Some(fd) = self.tap else {
            return Ok(None);
        };
        // SAFETY: the plan's tap is open for the duration of the restore.
        unsafe { BorrowedFd::borrow_raw(fd) }
            .try_clone_to_owned()
            .map(Some)
            .map_err(|e| format!("net: dup tap {fd}: {e}"))
    }
}

/// The `TUN_F_*` offloads matching what the driver acked to receive.
fn tap_offloads(acked_features: u64) -> libc::c_uint {
    let mut flags = 0;
    if acked_features & NET_F_GUEST_CSUM != 0 {
        flags |= TUN_F_CSUM;
        if acked_features & NET_F_GUEST_TSO4 != 0 {
            flags |= TUN_F_TSO4;
        }
        if acked_features & NET_F_GUEST_TSO6 != 0 {
            flags |= TUN_F_TSO6;
        }
        if acked_features & (NET_F_GUEST_TSO4 | NET_F_GUEST_TSO6) != 0
            && acked_features & NET_F_GUEST_ECN != 0
        {
            flags |= TUN_F_TSO_ECN;
        }
    }
    flags
}

/// `blk.py`'s budget per notification: requests and bytes.
pub const BLK_MAX_REQUESTS: u32 = 64;
pub const BLK_MAX_BYTES: u64 = 4 * blk::MAX_BYTES_PER_REQUEST;
/// `blk.py`'s `SIZE_MAX` and `SEG_MAX`, in its config space after the capacity.
const BLK_SIZE_MAX: u32 = 64 * 1024;
const BLK_SEG_MAX: u32 = 128;
/// A ring holds at most this many chains: a notify served on the writing thread
/// (no ioeventfd) serves at most this many rounds, each of at least one chain.
const MAX_CHAINS_IN_RING: u32 = 256;

/// A virtio-blk device's disk: `BlkState` (and `VolumeSlotState`'s guest path) as
/// plain values, and the file. An empty volume slot has no disk: key "", capacity 0,
/// no file, until `NativeTransport::insert_media` gives it one (and
/// `config_changed` tells the driver).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlkDisk {
    /// The disk's content key ("" for an empty slot); the id GET_ID answers is its
    /// first 20 bytes, NUL-padded.
    pub key: String,
    /// In bytes, a multiple of 512 (0 for an empty slot).
    pub capacity: u64,
    pub read_only: bool,
    /// A volume slot's guest path (`Some("")` for an empty one); None: the root disk.
    pub volume: Option<String>,
    /// The disk file, borrowed for the restore (duplicated there, its size checked
    /// against `capacity`); None for an empty slot, and in a plan given back.
    pub file: Option<RawFd>,
}

impl BlkDisk {
    fn check(&self) -> Result<(), String> {
        // `blk.py`'s `validate_disk_key`: 8 to 64 lowercase hex digits, or none.
        let key_ok = self.key.is_empty()
            || ((8..=64).contains(&self.key.len())
                && self
                    .key
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        if !key_ok {
            return Err(format!("disk key {:.70?} is not a content key", self.key));
        }
        if !self.capacity.is_multiple_of(SECTOR_SIZE) {
            return Err(format!(
                "disk {}: capacity {} is not a multiple of {SECTOR_SIZE}",
                self.key, self.capacity
            ));
        }
        if self.key.is_empty() != (self.capacity == 0) {
            return Err(format!(
                "disk {:?} of {} bytes: only an empty volume slot has no key, and then \
                 no bytes",
                self.key, self.capacity
            ));
        }
        if self.capacity == 0 && self.volume.is_none() {
            return Err("a root disk cannot be empty".into());
        }
        if self.capacity == 0 && self.file.is_some() {
            return Err("an empty volume slot has no disk file".into());
        }
        Ok(())
    }

    /// The id GET_ID answers (`blk.py`'s `_id`).
    fn id(&self) -> Vec<u8> {
        let mut id = self.key.as_bytes()[..self.key.len().min(blk::ID_BYTES)].to_vec();
        id.resize(blk::ID_BYTES, 0);
        id
    }

    /// The config space, byte for byte `blk.py`'s `config_bytes`: capacity in
    /// sectors, `SIZE_MAX`, `SEG_MAX`.
    fn config(&self) -> Vec<u8> {
        let mut config = (self.capacity / SECTOR_SIZE).to_le_bytes().to_vec();
        config.extend_from_slice(&BLK_SIZE_MAX.to_le_bytes());
        config.extend_from_slice(&BLK_SEG_MAX.to_le_bytes());
        config
    }

    /// The file, duplicated, if its size is the capacity (a restore must be given
    /// the snapshot's very disk, as `OpenedDisk.check_restores` also checks).
    fn open(&self) -> Result<Option<OwnedFd>, String> {
        if self.capacity == 0 {
            return Ok(None);
        }
        let Some(fd) = self.file else {
            return Err(format!("disk {}: no file given", self.key));
        };
        // SAFETY: the plan's file is open for the duration of the restore.
        let owned = unsafe { BorrowedFd::borrow_raw(fd) }
            .try_clone_to_owned()
            .map_err(|e| format!("disk {}: dup {fd}: {e}", self.key))?;
        // The end, not fstat's size: a block device's st_size is 0 (as `open_disk`).
        // Only preadv/pwritev use the file, so its offset does not matter.
        // SAFETY: lseek on a descriptor owned here; no memory is involved.
        let size = unsafe { libc::lseek(owned.as_raw_fd(), 0, libc::SEEK_END) };
        if size < 0 {
            let err = std::io::Error::last_os_error();
            return Err(format!("disk {}: size: {err}", self.key));
        }
        if size as u64 != self.capacity {
            return Err(format!(
                "the disk {} had {} bytes, but its file has {size}: not the same disk",
                self.key, self.capacity
            ));
        }
        Ok(Some(owned))
    }
}

/// Where a native vsock device listens for host connections (Firecracker's convention:
/// a host process connects to `path` and writes `CONNECT <port>\n`; a guest connection
/// to port P goes to `<path>_<P>`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VsockListener {
    pub path: String,
    /// A listening socket already bound at `path` (the zygote binds a child's before
    /// the fork), duplicated by the restore and made non-blocking; None: the restore
    /// binds `path` itself and the device unlinks it when dropped.
    pub bound: Option<RawFd>,
}

impl DeviceKind {
    pub fn device_type(&self) -> u32 {
        match self {
            DeviceKind::Rng { .. } => DEVICE_ID_RNG,
            DeviceKind::Balloon { .. } => DEVICE_ID_BALLOON,
            DeviceKind::Vsock { .. } => DEVICE_ID_VSOCK,
            DeviceKind::Blk(_) => DEVICE_ID_BLK,
            DeviceKind::Net(_) => DEVICE_ID_NET,
        }
    }

    fn queue_count(&self) -> usize {
        match self {
            DeviceKind::Rng { .. } | DeviceKind::Blk(_) => 1,
            DeviceKind::Net(_) => 2,
            DeviceKind::Balloon { .. } | DeviceKind::Vsock { .. } => 3,
        }
    }
}

/// One device's restore as plain values (see the module comment).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevicePlan {
    pub kind: DeviceKind,
    /// The features the device offers, and each queue's largest size.
    pub features: u64,
    pub max_sizes: Vec<u32>,
    /// The transport's register image.
    pub registers: Saved,
    /// Each queue's (next_avail, next_used).
    pub indices: Vec<(u16, u16)>,
}

impl DevicePlan {
    /// A device's plan before any driver touched it (a boot): fresh registers.
    pub fn fresh(kind: DeviceKind, features: u64, max_sizes: Vec<u32>) -> Result<Self, String> {
        let registers = Registers::new(kind.device_type(), features, &max_sizes, None)?.save();
        let indices = vec![(0, 0); max_sizes.len()];
        Ok(DevicePlan {
            kind,
            features,
            max_sizes,
            registers,
            indices,
        })
    }

    fn check(&self) -> Result<(), String> {
        match &self.kind {
            DeviceKind::Blk(disk) => disk.check()?,
            DeviceKind::Net(net) => net.check()?,
            _ => {}
        }
        let n = self.kind.queue_count();
        if self.max_sizes.len() != n || self.indices.len() != n {
            return Err(format!(
                "device type {} has {n} queues: plan has {} sizes and {} index pairs",
                self.kind.device_type(),
                self.max_sizes.len(),
                self.indices.len()
            ));
        }
        if self.features & VIRTIO_F_VERSION_1 == 0 {
            return Err("a device must offer VIRTIO_F_VERSION_1".into());
        }
        if let DeviceKind::Vsock { guest_cid, .. } = self.kind {
            // vsock.py's range: above the host's CID 2, below the reserved 2**32 - 1.
            if guest_cid <= 2 || guest_cid >= u64::from(u32::MAX) {
                return Err(format!("guest CID {guest_cid} must be in 3..2**32-2"));
            }
        }
        Ok(())
    }

    /// Whether the machine gives the device's queues ioeventfds. An empty volume slot
    /// has nothing to serve (most never get a disk): the eventfds and `KVM_IOEVENTFD`s
    /// would be a spawn's system calls for nothing, and a guest's rare notify to it is
    /// served on the writing vCPU's thread (`Machine`'s rule, `blk.py`'s
    /// `wants_ioeventfds`).
    pub fn wants_ioeventfds(&self) -> bool {
        !matches!(&self.kind, DeviceKind::Blk(disk) if disk.capacity == 0)
    }
}

/// What a device did over its life (every activation), for the machine's stats and
/// the control socket's `status`.
#[derive(Default, Clone, Copy, Debug)]
pub struct DeviceStats {
    /// Used-buffer interrupts its servers raised (the irq line's count).
    pub interrupts: u64,
    /// rng: requests and bytes served.
    pub requests: u64,
    pub bytes: u64,
    /// balloon: its servers' counters, and when the guest last reported.
    pub balloon: Counters,
    pub last_report: Option<Instant>,
    /// blk: the requests served (`BlkCounters`).
    pub blk: BlkCounters,
    /// net: the frames moved and dropped.
    pub net: NetCounters,
}

impl DeviceStats {
    /// `self` (earlier activations) and `later` (the one after them) added.
    fn plus(self, later: DeviceStats) -> DeviceStats {
        let mut blk = self.blk;
        blk.add(&later.blk);
        DeviceStats {
            blk,
            net: {
                let mut net = self.net;
                net.add(&later.net);
                net
            },
            interrupts: self.interrupts + later.interrupts,
            requests: self.requests + later.requests,
            bytes: self.bytes + later.bytes,
            balloon: self.balloon.plus(later.balloon),
            last_report: later.last_report.or(self.last_report),
        }
    }
}

/// The server of one activation.
#[derive(Clone)]
enum Server {
    Rng(Arc<RngServer>),
    Balloon(Arc<BalloonServer>),
    /// The device's one vsock server, attached to this activation's queues.
    Vsock(Arc<VsockServer>),
    Blk(Arc<BlkServer>),
    Net(Arc<NetServer>),
}

impl Server {
    fn reader(&self) -> Arc<dyn NativeReader> {
        match self {
            Server::Rng(s) => s.clone(),
            Server::Balloon(s) => s.clone(),
            Server::Vsock(s) => s.clone(),
            Server::Blk(s) => s.clone(),
            Server::Net(s) => s.clone(),
        }
    }

    /// The fd the server reads besides the queues' ioeventfds: a net server's tap
    /// (its duplicate, registered on the loop while the activation runs).
    fn tap_fd(&self) -> Option<RawFd> {
        match self {
            Server::Net(s) => s.tap_fd(),
            _ => None,
        }
    }

    /// The activation ends: a blk server stops using the disk file, a net server its
    /// tap and eventfds (each waiting out a wake in progress), so no wake the loop had
    /// begun to dispatch uses them after the transport closes them.
    fn retire(&self) {
        match self {
            Server::Blk(s) => s.retire(),
            Server::Net(s) => s.retire(),
            _ => {}
        }
    }

    /// Each queue's (next_avail, next_used); waits out a serve in flight (the
    /// server's own lock), so after a reset's removal nothing more touches the rings.
    fn indices(&self) -> Vec<(u16, u16)> {
        match self {
            Server::Rng(s) => {
                let (next_avail, next_used, ..) = s.sync();
                vec![(next_avail, next_used)]
            }
            Server::Balloon(s) => s.indices().to_vec(),
            Server::Vsock(s) => s.sync().to_vec(),
            Server::Blk(s) => vec![s.indices()],
            Server::Net(s) => s.indices().to_vec(),
        }
    }

    fn stats(&self) -> DeviceStats {
        match self {
            Server::Rng(s) => {
                let (_, _, requests, bytes, _, interrupts) = s.sync();
                DeviceStats {
                    interrupts,
                    requests,
                    bytes,
                    ..DeviceStats::default()
                }
            }
            Server::Balloon(s) => {
                let stats = s.stats();
                DeviceStats {
                    interrupts: stats.interrupts,
                    balloon: stats.counters,
                    last_report: stats.last_report,
                    ..DeviceStats::default()
                }
            }
            // The server outlives activations but counts its interrupts per
            // activation (zeroed at each attach), as the others do.
            Server::Vsock(s) => DeviceStats {
                interrupts: s.interrupts(),
                ..DeviceStats::default()
            },
            Server::Blk(s) => {
                let (blk, interrupts) = s.stats();
                DeviceStats {
                    interrupts,
                    blk,
                    ..DeviceStats::default()
                }
            }
            Server::Net(s) => {
                let (net, interrupts) = s.stats();
                DeviceStats {
                    interrupts,
                    net,
                    ..DeviceStats::default()
                }
            }
        }
    }

    /// Serve queue `index` now (a notify with no ioeventfd); true if its budget was
    /// spent and more may be waiting.
    fn serve(&self, index: usize) -> bool {
        match self {
            Server::Rng(s) => match s.serve() {
                Served::Done => false,
                Served::Budget => true,
                Served::Fault(e) => {
                    // The native sink needs no Python: it hands nothing back.
                    let _ = s.events().report(Some(e), ());
                    false
                }
            },
            Server::Balloon(s) => s.serve_now(index),
            Server::Vsock(s) => {
                // The native sink hands nothing back; a spent budget re-arms itself
                // through the server's own eventfd.
                let _ = s.notify(index);
                false
            }
            Server::Blk(s) => s.serve_now(),
            Server::Net(s) => s.serve_now(index as u32),
        }
    }
}

/// A vsock device's host side, for the device's life: its server (the listener, the
/// connections, the private epoll registered on the loop) and the path this transport
/// bound itself, unlinked when it is dropped.
struct VsockHost {
    server: Arc<VsockServer>,
    bound_here: Option<String>,
}

impl VsockHost {
    /// The server of a device restored from `kind` (a vsock's), its epoll on `readers`
    /// and the transport-reset event armed for the activation to come.
    fn open(kind: &DeviceKind, readers: &Arc<dyn Readers>) -> Result<Option<Self>, String> {
        let DeviceKind::Vsock {
            guest_cid,
            connect_timeout,
            reset_ack_wait,
            listener,
        } = kind
        else {
            return Ok(None);
        };
        let path = &listener.path;
        let (fd, bound_here) = match listener.bound {
            Some(fd) => {
                // SAFETY: the plan's listener is open for the duration of the restore.
                let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
                let owned = borrowed
                    .try_clone_to_owned()
                    .map_err(|e| format!("vsock: dup listener {fd}: {e}"))?;
                (owned, None)
            }
            None => {
                let owned = vsock_serve::bind_listener(path)
                    .map_err(|e| format!("vsock: listen on {path}: {e}"))?;
                (owned, Some(path.clone()))
            }
        };
        let host = VsockHost {
            bound_here,
            server: Arc::new(
                VsockServer::new(fd, path, *guest_cid, *connect_timeout, *reset_ack_wait)
                    .map_err(|e| format!("vsock: set-up: {e}"))?,
            ),
        };
        // Connections are live host resources, not state: the guest is told to drop
        // the parent's when the device runs again (vsock.py's restore).
        host.server.arm_reset_event(*guest_cid);
        readers.add_reader(host.server.epoll_fd(), host.server.clone())?;
        Ok(Some(host))
    }
}

impl Drop for VsockHost {
    /// Close every socket (the transport took the epoll off the loop first) and remove
    /// the path this transport bound.
    fn drop(&mut self) {
        self.server.close();
        if let Some(path) = &self.bound_here {
            let _ = std::fs::remove_file(path);
        }
    }
}

struct Active {
    epoch: u64,
    server: Server,
    events: Arc<NativeEvents>,
}

struct TransportState {
    acked_features: u64,
    /// The device's config bytes the host serves (the balloon's), else empty.
    config: Vec<u8>,
    active: Option<Active>,
    /// Each queue's (next_avail, next_used) while no server runs: the plan's after a
    /// restore (a DRIVER_OK still to come starts from them, as the Python transport's
    /// restored queues do), zeros after a reset.
    indices: Vec<(u16, u16)>,
    /// Faults recorded by activations since dropped (the current one's is live).
    earlier: EventRecord,
    /// What activations since dropped did (the current one's is live).
    earlier_stats: DeviceStats,
    /// Captures in flight (`hold`): each balloon server starts with them.
    holds: u64,
    /// The device's eventfds; None once `close` ran (no server runs again).
    fds: Option<Fds>,
    /// vsock's host side, which outlives activations; None once `close` ran.
    vsock: Option<VsockHost>,
    /// blk's disk file or net's tap (a duplicate of the plan's); None for an empty
    /// slot, a device without a tap, and once `close` ran.
    file: Option<OwnedFd>,
    /// blk's disk as it is now (its `file` None: that is `file` above): the plan's,
    /// or the media `insert_media` put into an empty slot. None for other kinds.
    disk: Option<BlkDisk>,
    features_refused: u64,
}

/// A native transport's eventfds, owned (duplicates of the machine's).
struct Fds {
    /// The interrupt's eventfd (the KVM irqfd).
    irq: OwnedFd,
    /// Each queue's ioeventfd (registered with KVM by the machine), or None.
    notify: Vec<Option<OwnedFd>>,
}

/// A transport whose device events are acted on in Rust (see the module comment).
pub struct NativeTransport {
    kind: DeviceKind,
    regs: Arc<Mutex<Registers>>,
    ram: Arc<GuestRam>,
    readers: Arc<dyn Readers>,
    state: Mutex<TransportState>,
}

impl NativeTransport {
    /// Restore a device from `plan` over guest RAM `ram`, its server registered on
    /// `readers` when it runs; `irq` is the interrupt's eventfd, `notify` each queue's
    /// ioeventfd (or None), both owned from here on. If the driver had the device
    /// running, it is re-activated with the plan's ring indices, its rings checked as
    /// at DRIVER_OK (a bad ring sets DEVICE_NEEDS_RESET, as the Python transport does).
    pub fn restore(
        plan: &DevicePlan,
        ram: Arc<GuestRam>,
        readers: Arc<dyn Readers>,
        irq: OwnedFd,
        notify: Vec<Option<OwnedFd>>,
    ) -> Result<Arc<Self>, String> {
        plan.check()?;
        if notify.len() != plan.max_sizes.len() {
            return Err(format!(
                "{} ioeventfds for {} queues",
                notify.len(),
                plan.max_sizes.len()
            ));
        }
        let plain = match plan.kind {
            DeviceKind::Rng { .. } => Some(Vec::new()),
            DeviceKind::Balloon { .. } => None,
            DeviceKind::Vsock { guest_cid, .. } => Some(guest_cid.to_le_bytes().to_vec()),
            // Plain: its media never change on this transport.
            DeviceKind::Blk(ref disk) => Some(disk.config()),
            DeviceKind::Net(ref net) => Some(net.config()),
        };
        let mut regs = Registers::new(
            plan.kind.device_type(),
            plan.features,
            &plan.max_sizes,
            plain,
        )?;
        let (epoch, live) = regs.restore(&plan.registers)?;
        let config = match plan.kind {
            DeviceKind::Rng { .. }
            | DeviceKind::Vsock { .. }
            | DeviceKind::Blk(_)
            | DeviceKind::Net(_) => Vec::new(),
            DeviceKind::Balloon { actual, .. } => balloon_config(actual),
        };
        let file = match &plan.kind {
            DeviceKind::Blk(disk) => disk.open()?,
            DeviceKind::Net(net) => net.open()?,
            _ => None,
        };
        let disk = match &plan.kind {
            DeviceKind::Blk(disk) => Some(BlkDisk {
                file: None,
                ..disk.clone()
            }),
            _ => None,
        };
        let acked_features = if plan.registers.status & STATUS_FEATURES_OK != 0 {
            plan.registers.driver_features
        } else {
            0
        };
        let vsock = VsockHost::open(&plan.kind, &readers)?;
        if plan.registers.interrupt_status != 0 {
            // An interrupt the capture may not have held: a snapshot's device state is
            // taken after its irqchip's, and KVM injects an irqfd's IOAPIC pin from a
            // work queue, so a device that raised just before (or while) its machine
            // paused can be saved with InterruptStatus set and no interrupt pending.
            // The driver would wait on that device for good (a balloon's page report
            // never answered, every descendant's page reporting stopped). Raise it
            // again: the irqchip is restored and the irqfd registered before any
            // device, and an interrupt the guest finds already handled is harmless
            // (its handler reads InterruptStatus, as for a shared pin).
            write_eventfd(irq.as_raw_fd());
        }
        let transport = Arc::new(NativeTransport {
            kind: plan.kind.clone(),
            regs: Arc::new(Mutex::new(regs)),
            ram,
            readers,
            state: Mutex::new(TransportState {
                acked_features,
                config,
                active: None,
                indices: plan.indices.clone(),
                earlier: EventRecord::default(),
                earlier_stats: DeviceStats::default(),
                holds: 0,
                fds: Some(Fds { irq, notify }),
                vsock,
                file,
                disk,
                features_refused: 0,
            }),
        });
        if live {
            transport.activate(epoch, &plan.indices)?;
        }
        Ok(transport)
    }

    /// The register file, for the bus's `Windows` (and for Python's handle on it).
    pub fn registers(&self) -> Arc<Mutex<Registers>> {
        self.regs.clone()
    }

    /// The device as a plan again: the register image, the indices the running server
    /// advanced (or the last ones it had), the record. For a snapshot (BRANCH): call
    /// with the vCPUs paused.
    pub fn plan(&self) -> DevicePlan {
        let st = lock(&self.state);
        let registers = lock(&self.regs).save();
        let indices = match &st.active {
            Some(active) => active.server.indices(),
            None => st.indices.clone(),
        };
        let kind = match self.kind {
            DeviceKind::Balloon {
                max_chains, advice, ..
            } => DeviceKind::Balloon {
                max_chains,
                advice,
                actual: balloon_actual(&st.config),
            },
            // The media now (an inserted volume's); the file is this machine's, not
            // a plan value.
            DeviceKind::Blk(ref disk) => {
                DeviceKind::Blk(st.disk.clone().unwrap_or_else(|| BlkDisk {
                    file: None,
                    ..disk.clone()
                }))
            }
            DeviceKind::Net(ref net) => DeviceKind::Net(NetTap {
                tap: None,
                ..net.clone()
            }),
            ref other => other.clone(),
        };
        let max_sizes = registers.queues.iter().map(|q| q.max_size).collect();
        DevicePlan {
            kind,
            features: lock(&self.regs).features,
            max_sizes,
            registers,
            indices,
        }
    }

    /// The features the driver acked (FEATURES_OK).
    pub fn acked_features(&self) -> u64 {
        lock(&self.state).acked_features
    }

    /// Whether a server runs (DRIVER_OK reached, rings good, not reset since).
    pub fn active(&self) -> bool {
        lock(&self.state).active.is_some()
    }

    /// What the device did over its life: interrupts, and the rng's or the balloon's
    /// counters.
    pub fn stats(&self) -> DeviceStats {
        let st = lock(&self.state);
        match &st.active {
            Some(active) => st.earlier_stats.plus(active.server.stats()),
            None => st.earlier_stats,
        }
    }

    /// A vsock device's server (its connections, counters and transport reset), for
    /// the device's life; None for another kind, and once `close` ran.
    pub fn vsock(&self) -> Option<Arc<VsockServer>> {
        lock(&self.state).vsock.as_ref().map(|v| v.server.clone())
    }

    /// A capture is in flight: the balloon keeps reported pages until `release`
    /// (`balloon.py`'s `hold_discards` says why); this and every later activation.
    pub fn hold(&self) {
        let mut st = lock(&self.state);
        st.holds += 1;
        if let Some(s) = running_balloon(&st) {
            s.hold();
        }
    }

    /// The end of a capture `hold` began; one without a hold does nothing.
    pub fn release(&self) {
        let mut st = lock(&self.state);
        if st.holds == 0 {
            return;
        }
        st.holds -= 1;
        if let Some(s) = running_balloon(&st) {
            s.release();
        }
    }

    /// Serve no more: the running server leaves the loop, the eventfds close (the
    /// server's copies with it) and a later DRIVER_OK starts none. The machine's
    /// close, before its loop stops.
    pub fn close(&self) {
        let mut st = lock(&self.state);
        self.deactivate(&mut st);
        st.fds = None;
        st.file = None;
        let vsock = st.vsock.take();
        drop(st);
        // Off the loop before its sockets and epoll close (the drop), as at Drop.
        if let Some(vsock) = vsock {
            self.readers.remove_reader(vsock.server.epoll_fd());
        }
    }

    /// The device's events over its life: faults and reports, the last fault.
    pub fn record(&self) -> EventRecord {
        let st = lock(&self.state);
        let mut record = st.earlier.clone();
        if let Some(active) = &st.active {
            let now = active.events.record();
            record.faults += now.faults;
            record.reports += now.reports;
            record.details += now.details;
            if now.last_fault.is_some() {
                record.last_fault = now.last_fault;
            }
        }
        record
    }

    /// Give an empty volume slot its disk `media` (its file borrowed: duplicated here
    /// and checked to be `media.capacity` bytes; its guest path the slot's) and, for a
    /// slot that had none, the queue's ioeventfd `notify` (registered with KVM by the
    /// caller; owned from here on). `blk.py`'s `insert_media`: refused for a root disk
    /// and a slot that holds a disk (no eject: a mounted file system would see its
    /// disk vanish), nothing changed then. A running activation's server, built for
    /// the empty slot (no file, capacity 0: every request IOERR), is retired (a wake in
    /// progress waited out) and one for the new media built at the same epoch and ring
    /// indices, woken by `notify`; a reset meanwhile makes that epoch stale and
    /// builds nothing, as at any DRIVER_OK. The driver learns of the disk from
    /// `config_changed`.
    pub fn insert_media(&self, media: BlkDisk, notify: Option<OwnedFd>) -> Result<(), String> {
        let DeviceKind::Blk(BlkDisk {
            volume: Some(_), ..
        }) = self.kind
        else {
            return Err("this virtio-blk is not a volume slot; its disk is fixed".into());
        };
        if media.volume.is_none() || media.capacity == 0 {
            return Err("a volume slot's media are a volume's disk, not empty".into());
        }
        media.check()?;
        let mut st = lock(&self.state);
        if let Some(disk) = st.disk.as_ref().filter(|d| d.capacity != 0) {
            return Err(format!("volume slot already holds {}", disk.key));
        }
        if st.fds.is_none() {
            return Err("the device is closed".into());
        }
        let file = media.open()?;
        let running = st.active.as_ref().map(|a| a.epoch);
        self.deactivate(&mut st);
        if let (Some(fds), Some(notify)) = (st.fds.as_mut(), notify) {
            fds.notify[0] = Some(notify);
        }
        st.file = file;
        st.disk = Some(BlkDisk {
            file: None,
            ..media
        });
        let indices = st.indices.clone();
        drop(st);
        match running {
            Some(epoch) => self.activate(epoch, &indices),
            None => Ok(()),
        }
    }

    /// The device's config space changed (a volume slot got its disk): the register
    /// file's plain config bytes become the disk's, a new `ConfigGeneration` and, if
    /// the driver runs, the configuration-change interrupt (InterruptStatus bit 1 and
    /// the irqfd), on which Linux's virtio_blk re-reads the capacity. `mmio.py`'s
    /// `notify_config_change`. True if the interrupt was raised.
    pub fn config_changed(&self) -> bool {
        let st = lock(&self.state);
        let Some(disk) = &st.disk else {
            return false;
        };
        let Some(fds) = &st.fds else {
            return false;
        };
        if !lock(&self.regs).config_changed(Some(disk.config())) {
            return false;
        }
        write_eventfd(fds.irq.as_raw_fd());
        true
    }

    /// Build and register the server for `epoch` with ring indices `indices`; a stale
    /// epoch does nothing. A ring that does not lie in guest RAM sets
    /// DEVICE_NEEDS_RESET (not an error of ours: the guest's).
    fn activate(&self, epoch: u64, indices: &[(u16, u16)]) -> Result<(), String> {
        let mut st = lock(&self.state);
        self.deactivate(&mut st);
        let Some(fds) = &st.fds else {
            return Ok(());
        };
        let Some(queues) = lock(&self.regs).activation(epoch) else {
            return Ok(());
        };
        let event_idx = matches!(self.kind, DeviceKind::Net(_))
            && st.acked_features & VIRTIO_RING_F_EVENT_IDX != 0;
        let rings: Vec<Rings> = queues.iter().map(|q| rings_of(q, event_idx)).collect();
        if let Err(reason) = self.validate(&queues, &rings) {
            self.device_error(fds.irq.as_raw_fd(), reason, epoch);
            return Ok(());
        }
        // As rng.py and balloon.py: a device whose queues the driver did not make ready
        // activates without a server (vsock's needs all three, as the balloon's).
        let ready = match self.kind {
            DeviceKind::Rng { .. } | DeviceKind::Blk(_) => queues[0].ready,
            DeviceKind::Balloon { .. } | DeviceKind::Vsock { .. } | DeviceKind::Net(_) => {
                queues.iter().all(|q| q.ready)
            }
        };
        if !ready {
            return Ok(());
        }
        let events = Arc::new(NativeEvents::for_transport(
            self.regs.clone(),
            epoch,
            fds.irq.try_clone().map_err(|e| format!("dup irqfd: {e}"))?,
        ));
        let server = self.server(epoch, &rings, indices, &events, fds, &st)?;
        if let Server::Balloon(s) = &server {
            for _ in 0..st.holds {
                s.hold();
            }
        }
        let watched: Vec<RawFd> = fds
            .notify
            .iter()
            .flatten()
            .map(AsRawFd::as_raw_fd)
            .chain(server.tap_fd())
            .collect();
        for fd in &watched {
            if let Err(e) = self.readers.add_reader(*fd, server.reader()) {
                for added in &watched {
                    self.readers.remove_reader(*added);
                }
                server.retire();
                return Err(e);
            }
        }
        // An ioeventfd kick right at DRIVER_OK, or buffers a snapshot left unserved:
        // one look per queue catches both, on the loop where there is an ioeventfd
        // (kicked here, while the fds are surely open), else on this thread below.
        let mut inline = Vec::new();
        for (index, notify) in fds.notify.iter().enumerate() {
            match notify {
                Some(fd) => write_eventfd(fd.as_raw_fd()),
                None => inline.push(index),
            }
        }
        st.active = Some(Active {
            epoch,
            server: server.clone(),
            events,
        });
        drop(st);
        for index in inline {
            self.serve_inline(&server, index, epoch);
        }
        Ok(())
    }

    fn validate(&self, queues: &[QueueRegs], rings: &[Rings]) -> Result<(), String> {
        let ram = self.ram.lock().map_err(|e| format!("guest memory: {e}"))?;
        for (index, (q, r)) in queues.iter().zip(rings).enumerate() {
            if q.ready {
                virtq::validate(&ram, r, q.max_size)
                    .map_err(|e| format!("queue {index}: {}", fault_text(e)))?;
            }
        }
        Ok(())
    }

    fn server(
        &self,
        epoch: u64,
        rings: &[Rings],
        indices: &[(u16, u16)],
        events: &Arc<NativeEvents>,
        fds: &Fds,
        st: &TransportState,
    ) -> Result<Server, String> {
        let dup = |fd: &OwnedFd| fd.try_clone().map_err(|e| format!("dup eventfd: {e}"));
        let irq = dup(&fds.irq)?;
        Ok(match self.kind {
            DeviceKind::Rng {
                max_requests,
                max_bytes,
            } => {
                let notify = fds.notify[0].as_ref().map(dup).transpose()?;
                Server::Rng(Arc::new(RngServer::new(
                    self.ram.clone(),
                    self.regs.clone(),
                    epoch,
                    rings[0],
                    indices[0],
                    irq,
                    notify,
                    max_requests,
                    max_bytes,
                    events.clone() as Arc<dyn DeviceEvents<()>>,
                )?))
            }
            DeviceKind::Balloon {
                max_chains, advice, ..
            } => {
                let raw = [0, 1, 2].map(|i| fds.notify[i].as_ref().map(AsRawFd::as_raw_fd));
                let rearm = [
                    fds.notify[0].as_ref().map(dup).transpose()?,
                    fds.notify[1].as_ref().map(dup).transpose()?,
                    fds.notify[2].as_ref().map(dup).transpose()?,
                ];
                Server::Balloon(Arc::new(BalloonServer::new(
                    self.ram.clone(),
                    self.regs.clone(),
                    epoch,
                    [rings[0], rings[1], rings[2]],
                    [indices[0], indices[1], indices[2]],
                    irq,
                    raw,
                    rearm,
                    max_chains,
                    advice,
                    events.clone() as Arc<dyn DeviceEvents<Vec<DiscardError>>>,
                )?))
            }
            DeviceKind::Vsock {
                guest_cid,
                connect_timeout,
                reset_ack_wait,
                ..
            } => {
                let vsock = st
                    .vsock
                    .as_ref()
                    .ok_or("a vsock transport without its server")?;
                let fault = vsock.server.attach(Activation {
                    ram: self.ram.clone(),
                    registers: self.regs.clone(),
                    epoch,
                    guest_cid,
                    rings: [rings[0], rings[1], rings[2]],
                    indices: [indices[0], indices[1], indices[2]],
                    irq,
                    notify: [0, 1, 2].map(|i| fds.notify[i].as_ref().map(AsRawFd::as_raw_fd)),
                    connect_timeout,
                    reset_ack_wait,
                    events: events.clone() as Arc<dyn DeviceEvents<()>>,
                });
                // Posting the reset event found a guest fault (an event buffer too small
                // for it): DEVICE_NEEDS_RESET, as the Python transport's activation does.
                if let Some(fault) = fault {
                    let _ = (events.clone() as Arc<dyn DeviceEvents<()>>).report(Some(fault), ());
                }
                Server::Vsock(vsock.server.clone())
            }
            DeviceKind::Blk(_) => {
                let disk = st.disk.as_ref().ok_or("a blk transport without its disk")?;
                let notify = fds.notify[0].as_ref();
                let id = disk.id();
                Server::Blk(Arc::new(BlkServer::new(
                    self.ram.clone(),
                    self.regs.clone(),
                    epoch,
                    rings[0],
                    indices[0],
                    irq,
                    notify.map(AsRawFd::as_raw_fd),
                    notify.map(dup).transpose()?,
                    MediaSpec {
                        fd: st.file.as_ref().map(AsRawFd::as_raw_fd),
                        capacity: disk.capacity,
                        read_only: disk.read_only,
                        id: &id,
                    },
                    BLK_MAX_REQUESTS,
                    BLK_MAX_BYTES,
                    events.clone() as Arc<dyn DeviceEvents<Vec<WarningFields>>>,
                )?))
            }
            DeviceKind::Net(_) => {
                let tap = st.file.as_ref().map(dup).transpose()?;
                if let Some(tap) = &tap {
                    let offloads = tap_offloads(st.acked_features);
                    // SAFETY: TUNSETOFFLOAD takes its flags by value, on a descriptor
                    // owned here. A refusal leaves the tap's offloads off: it then
                    // gives only plain frames, which every driver takes (slower, not
                    // wrong, and nothing is to be done here).
                    let _ = unsafe {
                        libc::ioctl(
                            tap.as_raw_fd(),
                            TUNSETOFFLOAD as _,
                            offloads as libc::c_ulong,
                        )
                    };
                }
                let raw = |i: usize| fds.notify[i].as_ref().map(AsRawFd::as_raw_fd);
                Server::Net(Arc::new(NetServer::new(
                    self.ram.clone(),
                    self.regs.clone(),
                    epoch,
                    (rings[0], indices[0]),
                    (rings[1], indices[1]),
                    NetFds {
                        tap,
                        rx_notify: raw(0),
                        tx_notify: raw(1),
                        tx_rearm: fds.notify[1].as_ref().map(dup).transpose()?,
                        irq,
                    },
                    NET_MAX_FRAMES,
                    NET_MAX_TX_BYTES,
                    events.clone() as Arc<dyn DeviceEvents<NetDetails>>,
                )?))
            }
        })
    }

    /// Drop the running server: its readers off the loop, then its lock taken once
    /// (`indices`, kept), so a serve the loop had started is over when this returns.
    fn deactivate(&self, st: &mut TransportState) {
        let Some(active) = st.active.take() else {
            return;
        };
        for fd in st.fds.iter().flat_map(|f| f.notify.iter().flatten()) {
            self.readers.remove_reader(fd.as_raw_fd());
        }
        if let Some(tap) = active.server.tap_fd() {
            self.readers.remove_reader(tap);
        }
        active.server.retire();
        st.indices = active.server.indices();
        st.earlier_stats = st.earlier_stats.plus(active.server.stats());
        let record = active.events.record();
        st.earlier.faults += record.faults;
        st.earlier.reports += record.reports;
        st.earlier.details += record.details;
        if record.last_fault.is_some() {
            st.earlier.last_fault = record.last_fault;
        }
    }

    /// A notify with no ioeventfd, on the writing vCPU's thread. A ring holds at most
    /// `size` chains at a time, so `size / budget + 1` rounds serve every chain posted
    /// before the kick; what the guest posts meanwhile waits for its next kick.
    fn serve_inline(&self, server: &Server, index: usize, epoch: u64) {
        if lock(&self.regs).failed_in(epoch) {
            return;
        }
        let rounds = match self.kind {
            DeviceKind::Rng { max_requests, .. } => 256 / max_requests.max(1) + 1,
            DeviceKind::Balloon { max_chains, .. } => 256 / max_chains.max(1) + 1,
            DeviceKind::Vsock { .. } => 1,
            DeviceKind::Blk(_) => MAX_CHAINS_IN_RING,
            DeviceKind::Net(_) => MAX_CHAINS_IN_RING / NET_MAX_FRAMES + 1,
        };
        for _ in 0..rounds {
            if !server.serve(index) {
                break;
            }
        }
    }

    /// DEVICE_NEEDS_RESET for `epoch` and, if newly set, the interrupt on `irq`.
    fn device_error(&self, irq: RawFd, reason: String, epoch: u64) {
        if lock(&self.regs).device_error(reason, epoch) {
            write_eventfd(irq);
        }
    }

    fn notify(&self, index: usize, epoch: u64) {
        let server = {
            let st = lock(&self.state);
            match &st.active {
                Some(active) if active.epoch == epoch => active.server.clone(),
                _ => return,
            }
        };
        if index < self.kind.queue_count() {
            self.serve_inline(&server, index, epoch);
        }
    }
}

impl Drop for NativeTransport {
    /// The server's readers leave the loop with the transport: the loop holds the
    /// server, and its ioeventfds (duplicates owned here) are about to close, which
    /// epoll does not notice while the machine keeps the originals open.
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(vsock) = &st.vsock {
            self.readers.remove_reader(vsock.server.epoll_fd());
        }
        let Some(active) = st.active.take() else {
            return;
        };
        for fd in st.fds.iter().flat_map(|f| f.notify.iter().flatten()) {
            self.readers.remove_reader(fd.as_raw_fd());
        }
        if let Some(tap) = active.server.tap_fd() {
            self.readers.remove_reader(tap);
        }
        active.server.retire();
        let _ = active.server.indices();
    }
}

impl TransportHost for NativeTransport {
    fn read_config(&self, offset: u64, data: &mut [u8]) -> Result<(), TransportFailure> {
        data.fill(0);
        let st = lock(&self.state);
        let start = offset as usize;
        if start < st.config.len() {
            let n = (st.config.len() - start).min(data.len());
            data[..n].copy_from_slice(&st.config[start..start + n]);
        }
        Ok(())
    }

    fn apply(&self, events: Vec<Event>) -> Result<(), TransportFailure> {
        let failure = |detail: String| TransportFailure {
            detail,
            raised: None,
        };
        for event in events {
            match event {
                Event::Reset => {
                    let mut st = lock(&self.state);
                    // vsock's server first lets go of the rings and drops every
                    // connection and a restore's pending reset event, active or not
                    // (vsock.py's reset): a new driver has no stale sockets.
                    if let Some(vsock) = &st.vsock {
                        vsock.server.detach();
                    }
                    self.deactivate(&mut st);
                    st.acked_features = 0;
                    // Fresh queues, as the Python transport's reset makes.
                    st.indices = vec![(0, 0); self.kind.queue_count()];
                }
                Event::FeaturesOk(features) => lock(&self.state).acked_features = features,
                Event::FeaturesRefused(_) => lock(&self.state).features_refused += 1,
                Event::Activate(epoch) => {
                    let indices = lock(&self.state).indices.clone();
                    self.activate(epoch, &indices).map_err(failure)?;
                }
                // The register file set DEVICE_NEEDS_RESET and the config-change bit.
                Event::NeedsReset(_) => {
                    if let Some(fds) = &lock(&self.state).fds {
                        write_eventfd(fds.irq.as_raw_fd());
                    }
                }
                Event::Notify(index, epoch) => self.notify(index as usize, epoch),
                Event::ConfigWrite(offset, data) => {
                    // Only the balloon's `actual` is the driver's to write (balloon.py).
                    let mut st = lock(&self.state);
                    if matches!(self.kind, DeviceKind::Balloon { .. })
                        && u64::from(offset) == BALLOON_ACTUAL
                        && data.len() == 4
                    {
                        st.config[BALLOON_ACTUAL as usize..][..4].copy_from_slice(&data);
                    }
                }
            }
        }
        Ok(())
    }
}

/// The balloon server of the running activation, if the device is a running balloon.
fn running_balloon(st: &TransportState) -> Option<&Arc<BalloonServer>> {
    match &st.active {
        Some(Active {
            server: Server::Balloon(s),
            ..
        }) => Some(s),
        _ => None,
    }
}

/// A queue's rings; `event_idx`: the driver acked VIRTIO_RING_F_EVENT_IDX (only net
/// offers it).
fn rings_of(q: &QueueRegs, event_idx: bool) -> Rings {
    Rings {
        // The register file keeps sizes in 1..=256 (`mmio::MAX_QUEUE_SIZE`).
        size: q.size as u16,
        desc: q.desc,
        avail: q.avail,
        used: q.used,
        event_idx,
    }
}

fn fault_text(e: QueueError) -> String {
    match e {
        QueueError::Virtqueue(m) => m,
        QueueError::Memory(e) => e.to_string(),
    }
}

fn balloon_config(actual: u32) -> Vec<u8> {
    let mut config = vec![0u8; BALLOON_CONFIG_SIZE];
    config[BALLOON_ACTUAL as usize..][..4].copy_from_slice(&actual.to_le_bytes());
    config
}

fn balloon_actual(config: &[u8]) -> u32 {
    let at = BALLOON_ACTUAL as usize;
    u32::from_le_bytes([config[at], config[at + 1], config[at + 2], config[at + 3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offloads_follow_the_features_the_guest_accepted() {
        assert_eq!(tap_offloads(0), 0);
        // TSO without checksum offload is invalid: the tap is told nothing.
        assert_eq!(tap_offloads(NET_F_GUEST_TSO4), 0);
        assert_eq!(tap_offloads(NET_F_GUEST_CSUM), TUN_F_CSUM);
        assert_eq!(
            tap_offloads(NET_F_GUEST_CSUM | NET_F_GUEST_TSO6 | NET_F_GUEST_ECN),
            TUN_F_CSUM | TUN_F_TSO6 | TUN_F_TSO_ECN
        );
        let everything = NET_F_GUEST_CSUM | NET_F_GUEST_TSO4 | NET_F_GUEST_TSO6 | NET_F_GUEST_ECN;
        assert_eq!(
            tap_offloads(everything),
            TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN
        );
    }
}
