//! A device wired with no Python object: guest RAM over an anonymous mapping, a register
//! file brought up as a driver brings it up, the server on a `NativeLoop` with a
//! `NativeEvents` sink, an eventfd as the irqfd and one as the queue's ioeventfd. What
//! the native machine assembly (docs/native.md, "Where the line goes next") will do for
//! every device, done here for rng and balloon; the test binary has no interpreter
//! linked, so any path into Python would not even link. The last tests go one step
//! further: the device restored from a `DevicePlan` built in Rust, its transport a
//! `NativeTransport` on a `Windows` map, the driver's register writes what builds and
//! drops its server.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, Mutex};

use crate::balloon_serve::BalloonServer;
use crate::eventloop::NativeLoop;
use crate::guest_ram::{GuestRam, Region};
use crate::mmio::{self, Event, Registers, INT_CONFIG_CHANGE, INT_USED_BUFFER};
use crate::queue_server::{DeviceEvents, NativeEvents};
use crate::rng_serve::{RngServer, Served};
use crate::transport::{
    BlkDisk, DeviceKind, DevicePlan, NativeTransport, NetTap, Readers, VsockListener, Windows,
};
use crate::virtq::{self, Rings};

const RAM_SIZE: usize = 1 << 20;
const PAGE: u64 = 4096;
const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;
/// How long a wait for the loop thread may take before the test calls it hung (a
/// guard against a hang, not a measurement: a healthy run takes microseconds).
const HANG_GUARD_MS: i32 = 20_000;

/// An anonymous private mapping standing in for the guest RAM Python maps.
struct Mapping {
    host: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(len: usize) -> Self {
        // SAFETY: a fresh anonymous mapping; nothing else refers to the range.
        let host = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(host, libc::MAP_FAILED, "mmap");
        Mapping {
            host: host.cast(),
            len,
        }
    }

    /// Guest RAM at guest address 0 over the whole mapping.
    fn ram(&self) -> Arc<GuestRam> {
        let region = Region {
            gpa: 0,
            size: self.len as u64,
            host: self.host as usize,
        };
        // SAFETY: the mapping is readable and writable and outlives the `GuestRam`: each
        // test closes it (`GuestRam::close`) before the `Mapping` is dropped.
        Arc::new(unsafe { GuestRam::new(vec![region]) })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping, of this length; the guest RAM over it is closed.
        unsafe { libc::munmap(self.host.cast(), self.len) };
    }
}

fn eventfd() -> OwnedFd {
    // SAFETY: plain eventfd(2); the fd is owned right below.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    assert!(fd >= 0, "eventfd");
    // SAFETY: a fresh fd owned by nobody else.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn signal(fd: &OwnedFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: 8 bytes from a live buffer into an eventfd we own.
    let n = unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    assert_eq!(n, 8);
}

/// Wait until `fd` (an eventfd) is signalled and read its counter.
fn wait_signalled(fd: &OwnedFd) -> u64 {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, HANG_GUARD_MS) };
    assert_eq!(n, 1, "the eventfd was never signalled");
    read_counter(fd.as_raw_fd()).expect("signalled")
}

/// The eventfd's counter, read to zero; None if it was zero.
fn read_counter(fd: RawFd) -> Option<u64> {
    let mut buf = [0u8; 8];
    // SAFETY: 8 bytes into a live buffer, from a non-blocking eventfd we own.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    (n == 8).then(|| u64::from_ne_bytes(buf))
}

fn write_reg(regs: &Mutex<Registers>, offset: u64, value: u32) -> Vec<Event> {
    let mut events = Vec::new();
    regs.lock()
        .unwrap()
        .write(offset, &value.to_le_bytes(), &mut events);
    events
}

/// The driver's bring-up (virtio 1.2, 3.1.1) of a device with these queue sizes, the
/// rings of queue `i` at `0x10000 * (i + 1)` (descriptors), `+ 0x1000` (avail) and
/// `+ 0x2000` (used): the activation's epoch and each queue's rings.
fn bring_up(regs: &Mutex<Registers>, sizes: &[u32]) -> (u64, Vec<Rings>) {
    write_reg(regs, mmio::REG_STATUS, mmio::STATUS_ACKNOWLEDGE);
    write_reg(
        regs,
        mmio::REG_STATUS,
        mmio::STATUS_ACKNOWLEDGE | mmio::STATUS_DRIVER,
    );
    write_reg(regs, mmio::REG_DRIVER_FEATURES_SEL, 1);
    write_reg(regs, mmio::REG_DRIVER_FEATURES, 1); // VIRTIO_F_VERSION_1, bit 32
    let features_ok = mmio::STATUS_ACKNOWLEDGE | mmio::STATUS_DRIVER | mmio::STATUS_FEATURES_OK;
    let events = write_reg(regs, mmio::REG_STATUS, features_ok);
    assert_eq!(events, vec![Event::FeaturesOk(mmio::VIRTIO_F_VERSION_1)]);
    for (i, &size) in sizes.iter().enumerate() {
        let base = 0x10000 * (i as u32 + 1);
        write_reg(regs, mmio::REG_QUEUE_SEL, i as u32);
        write_reg(regs, mmio::REG_QUEUE_NUM, size);
        write_reg(regs, mmio::REG_QUEUE_DESC_LOW, base);
        write_reg(regs, mmio::REG_QUEUE_DRIVER_LOW, base + 0x1000);
        write_reg(regs, mmio::REG_QUEUE_DEVICE_LOW, base + 0x2000);
        write_reg(regs, mmio::REG_QUEUE_READY, 1);
    }
    let events = write_reg(regs, mmio::REG_STATUS, features_ok | mmio::STATUS_DRIVER_OK);
    let [Event::Activate(epoch)] = events[..] else {
        panic!("DRIVER_OK did not activate: {events:?}");
    };
    let queues = regs.lock().unwrap().activation(epoch).expect("activated");
    let rings = queues
        .iter()
        .map(|q| Rings {
            size: q.size as u16,
            desc: q.desc,
            avail: q.avail,
            used: q.used,
            event_idx: false,
        })
        .collect();
    (epoch, rings)
}

/// The driver side of a split ring: place a one-descriptor chain and publish it.
struct Driver {
    rings: Rings,
    avail_idx: u16,
}

impl Driver {
    fn offer(&mut self, ram: &GuestRam, head: u16, addr: u64, len: u32, flags: u16) {
        let r = ram.lock().unwrap();
        let desc = self.rings.desc + 16 * u64::from(head);
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        r.write_from(desc, &d).unwrap();
        let slot = u64::from(self.avail_idx % self.rings.size);
        r.write_u16(self.rings.avail + 4 + 2 * slot, head).unwrap();
        // The entry before the index that publishes it, as a driver's write barrier.
        fence(Ordering::SeqCst);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        r.write_u16(self.rings.avail + 2, self.avail_idx).unwrap();
    }

    /// Place a chain of descriptors from `head` on (addr, len, flags each; NEXT is
    /// added) and publish it.
    fn offer_chain(&mut self, ram: &GuestRam, head: u16, parts: &[(u64, u32, u16)]) {
        let r = ram.lock().unwrap();
        for (i, &(addr, len, flags)) in parts.iter().enumerate() {
            let index = head + i as u16;
            let last = i + 1 == parts.len();
            let mut d = [0u8; 16];
            d[..8].copy_from_slice(&addr.to_le_bytes());
            d[8..12].copy_from_slice(&len.to_le_bytes());
            let flags = if last { flags } else { flags | DESC_F_NEXT };
            d[12..14].copy_from_slice(&flags.to_le_bytes());
            d[14..16].copy_from_slice(&(index + 1).to_le_bytes());
            r.write_from(self.rings.desc + 16 * u64::from(index), &d)
                .unwrap();
        }
        let slot = u64::from(self.avail_idx % self.rings.size);
        r.write_u16(self.rings.avail + 4 + 2 * slot, head).unwrap();
        fence(Ordering::SeqCst);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        r.write_u16(self.rings.avail + 2, self.avail_idx).unwrap();
    }

    /// The used ring's index and its entry `n` (id, len).
    fn used(&self, ram: &GuestRam, n: u16) -> (u16, (u32, u32)) {
        let r = ram.lock().unwrap();
        let idx = r.read_u16(self.rings.used + 2).unwrap();
        let at = self.rings.used + 4 + 8 * u64::from(n % self.rings.size);
        (idx, (r.read_u32(at).unwrap(), r.read_u32(at + 4).unwrap()))
    }
}

#[test]
fn rng_is_served_on_the_native_loop_with_no_python_object() {
    let mapping = Mapping::new(RAM_SIZE);
    let ram = mapping.ram();
    let regs = Arc::new(Mutex::new(
        Registers::new(4, mmio::VIRTIO_F_VERSION_1, &[256], Some(Vec::new())).unwrap(),
    ));
    let (epoch, rings) = bring_up(&regs, &[16]);
    virtq::validate(&ram.lock().unwrap(), &rings[0], 256).unwrap();
    let irq = eventfd();
    let notify = eventfd();
    let events = Arc::new(NativeEvents::for_transport(
        regs.clone(),
        epoch,
        irq.try_clone().unwrap(),
    ));
    let server = Arc::new(
        RngServer::new(
            ram.clone(),
            regs.clone(),
            epoch,
            rings[0],
            (0, 0),
            irq.try_clone().unwrap(),
            Some(notify.try_clone().unwrap()),
            8,
            4096,
            events.clone() as Arc<dyn DeviceEvents<()>>,
        )
        .unwrap(),
    );
    let event_loop = NativeLoop::new("rng-test".into()).unwrap();
    event_loop
        .add_native(notify.as_raw_fd(), server.clone())
        .unwrap();
    event_loop.start().unwrap();

    let mut driver = Driver {
        rings: rings[0],
        avail_idx: 0,
    };
    let buffer = 0x80000;
    driver.offer(&ram, 0, buffer, 64, DESC_F_WRITE);
    signal(&notify); // the guest's QueueNotify, as KVM's ioeventfd delivers it
    assert_eq!(wait_signalled(&irq), 1);
    assert_eq!(driver.used(&ram, 0), (1, (0, 64)));
    let mut random = [0u8; 64];
    ram.lock().unwrap().read_into(buffer, &mut random).unwrap();
    assert_ne!(random, [0u8; 64]); // 2^-512 to be all zeros by chance
    let mut after = [0u8; 16];
    ram.lock()
        .unwrap()
        .read_into(buffer + 64, &mut after)
        .unwrap();
    assert_eq!(after, [0u8; 16]); // nothing written past the buffer
    assert_eq!(regs.lock().unwrap().interrupt_status, INT_USED_BUFFER);
    // (next_avail, next_used, served, bytes, failed, interrupts)
    assert_eq!(server.sync(), (1, 1, 1, 64, false, 1));
    assert_eq!(events.record().faults, 0);

    // A buffer outside guest RAM: a guest fault, which the native sink turns into
    // DEVICE_NEEDS_RESET and the configuration-change interrupt, as Python's does.
    driver.offer(&ram, 1, RAM_SIZE as u64 + 0x1000, 64, DESC_F_WRITE);
    signal(&notify);
    assert_eq!(wait_signalled(&irq), 1);
    // The record is written before the interrupt is raised.
    let record = events.record();
    assert_eq!(record.faults, 1);
    assert!(
        record
            .last_fault
            .as_deref()
            .unwrap()
            .contains("outside guest RAM"),
        "{record:?}"
    );
    assert_eq!(driver.used(&ram, 1).0, 1); // nothing more used
    {
        let r = regs.lock().unwrap();
        assert_ne!(r.status & mmio::STATUS_DEVICE_NEEDS_RESET, 0);
        assert_eq!(r.interrupt_status, INT_USED_BUFFER | INT_CONFIG_CHANGE);
        assert!(r.failed_in(epoch));
    }
    let (.., failed, interrupts) = server.sync();
    assert!(failed);
    assert_eq!(interrupts, 1);

    event_loop.stop();
    assert!(!event_loop.running());
    // A failed device serves nothing more (until the driver resets it).
    driver.offer(&ram, 2, buffer, 64, DESC_F_WRITE);
    assert!(matches!(server.serve(), Served::Done));
    assert_eq!(driver.used(&ram, 2).0, 1);
    assert_eq!(read_counter(irq.as_raw_fd()), None);
    ram.close();
}

#[test]
fn balloon_reports_drop_pages_on_the_native_loop_with_no_python_object() {
    let mapping = Mapping::new(RAM_SIZE);
    let ram = mapping.ram();
    let regs = Arc::new(Mutex::new(
        Registers::new(
            5,
            mmio::VIRTIO_F_VERSION_1,
            &[256, 256, 32],
            Some(vec![0; 8]),
        )
        .unwrap(),
    ));
    let (epoch, rings) = bring_up(&regs, &[16, 16, 16]);
    let irq = eventfd();
    let notify = [eventfd(), eventfd(), eventfd()];
    let events = Arc::new(NativeEvents::new());
    let server = Arc::new(
        BalloonServer::new(
            ram.clone(),
            regs.clone(),
            epoch,
            [rings[0], rings[1], rings[2]],
            [(0, 0); 3],
            irq.try_clone().unwrap(),
            notify.each_ref().map(|n| Some(n.as_raw_fd())),
            notify.each_ref().map(|n| Some(n.try_clone().unwrap())),
            8,
            libc::MADV_DONTNEED,
            events.clone() as Arc<dyn DeviceEvents<Vec<(u64, u64, i32)>>>,
        )
        .unwrap(),
    );
    let event_loop = NativeLoop::new("balloon-test".into()).unwrap();
    for n in &notify {
        event_loop
            .add_native(n.as_raw_fd(), server.clone())
            .unwrap();
    }
    event_loop.start().unwrap();

    // Two pages the guest writes, then reports free: a report of a page and a half
    // drops only the whole page (balloon.py's rule) and leaves the rest as it was.
    let pages = 0xA0000;
    ram.lock()
        .unwrap()
        .write_from(pages, &[0xAB; 2 * PAGE as usize])
        .unwrap();
    let mut driver = Driver {
        rings: rings[2],
        avail_idx: 0,
    };
    driver.offer(&ram, 0, pages, (PAGE + PAGE / 2) as u32, DESC_F_WRITE);
    signal(&notify[2]);
    assert_eq!(wait_signalled(&irq), 1);
    assert_eq!(driver.used(&ram, 0), (1, (0, 0)));
    let mut dropped = vec![0xFFu8; PAGE as usize];
    let mut kept = vec![0u8; PAGE as usize];
    {
        let r = ram.lock().unwrap();
        r.read_into(pages, &mut dropped).unwrap();
        r.read_into(pages + PAGE, &mut kept).unwrap();
    }
    assert!(dropped.iter().all(|&b| b == 0)); // an anonymous page reads as zeros again
    assert!(kept.iter().all(|&b| b == 0xAB));
    assert_eq!(events.record(), Default::default());
    event_loop.stop();
    ram.close();
}

/// Where the device's window is on the test's MMIO bus.
const WINDOW: u64 = 0xd000_0000;

fn bus_write(windows: &Windows, offset: u64, value: u32) {
    let served = windows.serve_write(WINDOW + offset, &value.to_le_bytes());
    assert!(
        matches!(served, Some(Ok(()))),
        "write {offset:#x} not served"
    );
}

fn bus_read(windows: &Windows, offset: u64, data: &mut [u8]) {
    let served = windows.serve_read(WINDOW + offset, data);
    assert!(
        matches!(served, Some(Ok(()))),
        "read {offset:#x} not served"
    );
}

/// `bring_up`, through the bus: the transport's host acts on the events (the
/// activation builds the server). Each queue's rings as `bring_up` lays them out.
fn bring_up_on_bus(windows: &Windows, sizes: &[u32]) -> Vec<Rings> {
    let mut magic = [0u8; 4];
    bus_read(windows, mmio::REG_MAGIC, &mut magic);
    assert_eq!(u32::from_le_bytes(magic), mmio::MAGIC);
    let features_ok = mmio::STATUS_ACKNOWLEDGE | mmio::STATUS_DRIVER | mmio::STATUS_FEATURES_OK;
    bus_write(windows, mmio::REG_STATUS, mmio::STATUS_ACKNOWLEDGE);
    bus_write(
        windows,
        mmio::REG_STATUS,
        mmio::STATUS_ACKNOWLEDGE | mmio::STATUS_DRIVER,
    );
    bus_write(windows, mmio::REG_DRIVER_FEATURES_SEL, 1);
    bus_write(windows, mmio::REG_DRIVER_FEATURES, 1);
    bus_write(windows, mmio::REG_STATUS, features_ok);
    let mut rings = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        let base = 0x10000 * (i as u32 + 1);
        bus_write(windows, mmio::REG_QUEUE_SEL, i as u32);
        bus_write(windows, mmio::REG_QUEUE_NUM, size);
        bus_write(windows, mmio::REG_QUEUE_DESC_LOW, base);
        bus_write(windows, mmio::REG_QUEUE_DRIVER_LOW, base + 0x1000);
        bus_write(windows, mmio::REG_QUEUE_DEVICE_LOW, base + 0x2000);
        bus_write(windows, mmio::REG_QUEUE_READY, 1);
        rings.push(Rings {
            size: size as u16,
            desc: u64::from(base),
            avail: u64::from(base) + 0x1000,
            used: u64::from(base) + 0x2000,
            event_idx: false,
        });
    }
    bus_write(
        windows,
        mmio::REG_STATUS,
        features_ok | mmio::STATUS_DRIVER_OK,
    );
    rings
}

/// A started loop, as the trait object a transport registers its server on.
fn started_loop(name: &str) -> Arc<NativeLoop> {
    let event_loop = Arc::new(NativeLoop::new(name.into()).unwrap());
    event_loop.start().unwrap();
    event_loop
}

/// A transport restored from `plan` on `windows`, with fresh eventfds (each queue's
/// ioeventfd only if `ioeventfds`): the transport, the irqfd, the ioeventfds.
fn restore_on_bus(
    plan: &DevicePlan,
    ram: &Arc<GuestRam>,
    event_loop: &Arc<NativeLoop>,
    windows: &Windows,
    ioeventfds: bool,
) -> (Arc<NativeTransport>, OwnedFd, Vec<OwnedFd>) {
    let irq = eventfd();
    let notify: Vec<OwnedFd> = if ioeventfds {
        plan.max_sizes.iter().map(|_| eventfd()).collect()
    } else {
        Vec::new()
    };
    let handed = if ioeventfds {
        notify
            .iter()
            .map(|n| Some(n.try_clone().unwrap()))
            .collect()
    } else {
        plan.max_sizes.iter().map(|_| None).collect()
    };
    let transport = NativeTransport::restore(
        plan,
        ram.clone(),
        event_loop.clone() as Arc<dyn Readers>,
        irq.try_clone().unwrap(),
        handed,
    )
    .unwrap();
    windows
        .add(WINDOW, transport.registers(), transport.clone())
        .unwrap();
    (transport, irq, notify)
}

#[test]
fn rng_restored_from_a_plan_serves_where_the_snapshot_left_off() {
    let mapping = Mapping::new(RAM_SIZE);
    let ram = mapping.ram();
    let rng = DeviceKind::Rng {
        max_requests: 64,
        max_bytes: 64 * 1024,
    };
    let boot = DevicePlan::fresh(rng, mmio::VIRTIO_F_VERSION_1, vec![256]).unwrap();

    // A booted device: the driver's DRIVER_OK builds the server, one request served.
    let first_loop = started_loop("rng-boot");
    let windows = Windows::new();
    let (booted, irq, notify) = restore_on_bus(&boot, &ram, &first_loop, &windows, true);
    assert!(!booted.active());
    let rings = bring_up_on_bus(&windows, &[16]);
    assert!(booted.active());
    assert_eq!(first_loop.counts().0, 1); // the queue's ioeventfd
    let mut driver = Driver {
        rings: rings[0],
        avail_idx: 0,
    };
    driver.offer(&ram, 0, 0x80000, 64, DESC_F_WRITE);
    signal(&notify[0]);
    assert_eq!(wait_signalled(&irq), 1);
    assert_eq!(driver.used(&ram, 0), (1, (0, 64)));

    // The snapshot: the plan the running device gives back.
    let snapshot = booted.plan();
    assert_eq!(snapshot.indices, vec![(1, 1)]);
    assert_ne!(snapshot.registers.status & mmio::STATUS_DRIVER_OK, 0);
    assert_eq!(snapshot.registers.queues[0].desc, rings[0].desc);
    assert_eq!(booted.acked_features(), mmio::VIRTIO_F_VERSION_1);
    // The driver's reset drops the server: its ioeventfd is off the loop.
    bus_write(&windows, mmio::REG_STATUS, 0);
    assert!(!booted.active());
    assert_eq!(first_loop.counts().0, 0);
    assert_eq!(booted.plan().indices, vec![(0, 0)]); // fresh queues
    first_loop.stop();

    // A child restored from the plan: another loop, bus and eventfds, the same RAM.
    let child_loop = started_loop("rng-child");
    let child_bus = Windows::new();
    let (child, irq, notify) = restore_on_bus(&snapshot, &ram, &child_loop, &child_bus, true);
    assert!(child.active());
    assert_eq!(child.acked_features(), mmio::VIRTIO_F_VERSION_1);
    // The driver had not acked the used buffer: InterruptStatus was saved set, and the
    // restore raises the interrupt again (the capture may not have held it), once.
    assert_eq!(snapshot.registers.interrupt_status, INT_USED_BUFFER);
    assert_eq!(read_counter(irq.as_raw_fd()), Some(1));
    assert_eq!(read_counter(irq.as_raw_fd()), None);
    let mut status = [0u8; 4];
    bus_read(&child_bus, mmio::REG_STATUS, &mut status);
    assert_eq!(u32::from_le_bytes(status), snapshot.registers.status);
    // The guest's next request: the ring indices go on from the snapshot's.
    driver.offer(&ram, 1, 0x81000, 32, DESC_F_WRITE);
    signal(&notify[0]);
    assert_eq!(wait_signalled(&irq), 1);
    assert_eq!(driver.used(&ram, 1), (2, (1, 32)));
    assert_eq!(child.plan().indices, vec![(2, 2)]);
    assert_eq!(child.record().faults, 0);
    child_loop.stop();

    // A snapshot taken between FEATURES_OK and DRIVER_OK: not live when restored, and
    // the driver's DRIVER_OK starts the server from the plan's indices.
    let mut early = child.plan();
    early.registers.status &= !mmio::STATUS_DRIVER_OK;
    let early_loop = started_loop("rng-early");
    let early_bus = Windows::new();
    let (restored, irq, notify) = restore_on_bus(&early, &ram, &early_loop, &early_bus, true);
    assert!(!restored.active());
    assert_eq!(read_counter(irq.as_raw_fd()), Some(1)); // InterruptStatus still set
    assert_eq!(restored.plan().indices, vec![(2, 2)]);
    bus_write(
        &early_bus,
        mmio::REG_STATUS,
        early.registers.status | mmio::STATUS_DRIVER_OK,
    );
    assert!(restored.active());
    assert_eq!(restored.plan().indices, vec![(2, 2)]);
    drop(early_bus);
    drop(restored);
    drop((irq, notify));
    early_loop.stop();

    // The same plan with no ioeventfd: a QueueNotify write is served on the writer's
    // thread, the used entry and the interrupt there when the write returns.
    let plan = child.plan();
    let bare_loop = started_loop("rng-bare");
    let bare_bus = Windows::new();
    let (bare, irq, _) = restore_on_bus(&plan, &ram, &bare_loop, &bare_bus, false);
    assert!(bare.active());
    assert_eq!(bare_loop.counts().0, 0);
    // The restore's interrupt (InterruptStatus still set).
    assert_eq!(read_counter(irq.as_raw_fd()), Some(1));

    // The driver acks: a snapshot taken now restores with no interrupt raised.
    bus_write(&bare_bus, mmio::REG_INTERRUPT_ACK, INT_USED_BUFFER);
    let acked = bare.plan();
    assert_eq!(acked.registers.interrupt_status, 0);
    let acked_bus = Windows::new();
    let (quiet, quiet_irq, _) = restore_on_bus(&acked, &ram, &bare_loop, &acked_bus, false);
    assert!(quiet.active());
    assert_eq!(read_counter(quiet_irq.as_raw_fd()), None);
    drop(acked_bus);
    drop(quiet);
    driver.offer(&ram, 2, 0x82000, 16, DESC_F_WRITE);
    bus_write(&bare_bus, mmio::REG_QUEUE_NOTIFY, 0);
    assert_eq!(read_counter(irq.as_raw_fd()), Some(1));
    assert_eq!(driver.used(&ram, 2), (3, (2, 16)));
    let mut isr = [0u8; 4];
    bus_read(&bare_bus, mmio::REG_INTERRUPT_STATUS, &mut isr);
    assert_eq!(u32::from_le_bytes(isr), INT_USED_BUFFER);
    bare_loop.stop();
    ram.close();
}

/// `plan` restores as a device the guest broke: not active, DEVICE_NEEDS_RESET with
/// the config-change interrupt raised once, the error naming the queue (`queue`).
fn assert_restores_as_needs_reset(
    plan: &DevicePlan,
    ram: &Arc<GuestRam>,
    event_loop: &Arc<NativeLoop>,
    queue: &str,
) {
    let bad_bus = Windows::new();
    let (bad, irq, _) = restore_on_bus(plan, ram, event_loop, &bad_bus, true);
    assert!(!bad.active());
    assert_eq!(read_counter(irq.as_raw_fd()), Some(1));
    let regs = bad.registers();
    let r = regs.lock().unwrap();
    assert_ne!(r.status & mmio::STATUS_DEVICE_NEEDS_RESET, 0);
    assert_eq!(r.interrupt_status, INT_CONFIG_CHANGE);
    assert!(
        r.last_device_error.as_deref().unwrap().starts_with(queue),
        "{:?}",
        r.last_device_error
    );
}

#[test]
fn a_plan_whose_rings_are_outside_ram_restores_as_needs_reset() {
    let mapping = Mapping::new(RAM_SIZE);
    let ram = mapping.ram();
    let rng = DeviceKind::Rng {
        max_requests: 64,
        max_bytes: 64 * 1024,
    };
    let boot = DevicePlan::fresh(rng, mmio::VIRTIO_F_VERSION_1, vec![256]).unwrap();
    let event_loop = started_loop("rng-bad");
    let windows = Windows::new();
    let (booted, _irq, _notify) = restore_on_bus(&boot, &ram, &event_loop, &windows, true);
    bring_up_on_bus(&windows, &[16]);
    let mut plan = booted.plan();
    plan.registers.queues[0].used = RAM_SIZE as u64; // the used ring past the end of RAM
    assert_restores_as_needs_reset(&plan, &ram, &event_loop, "queue 0: ");
    event_loop.stop();
    ram.close();
}

#[test]
fn balloon_restored_from_a_plan_keeps_its_config_and_drops_reported_pages() {
    let mapping = Mapping::new(RAM_SIZE);
    let ram = mapping.ram();
    let balloon = DeviceKind::Balloon {
        max_chains: 16,
        advice: libc::MADV_DONTNEED,
        actual: 0,
    };
    let features = mmio::VIRTIO_F_VERSION_1 | 1 << 5; // VIRTIO_BALLOON_F_REPORTING
    let boot = DevicePlan::fresh(balloon, features, vec![64, 64, 64]).unwrap();
    let first_loop = started_loop("balloon-boot");
    let windows = Windows::new();
    let (booted, _irq, _notify) = restore_on_bus(&boot, &ram, &first_loop, &windows, true);
    let rings = bring_up_on_bus(&windows, &[32, 32, 32]);
    assert!(booted.active());
    assert_eq!(first_loop.counts().0, 3);
    // The driver writes `actual` (config offset 4), and reads it back from the host.
    bus_write(&windows, mmio::CONFIG_SPACE + 4, 7);
    let mut actual = [0u8; 4];
    bus_read(&windows, mmio::CONFIG_SPACE + 4, &mut actual);
    assert_eq!(u32::from_le_bytes(actual), 7);
    let snapshot = booted.plan();
    assert!(matches!(
        snapshot.kind,
        DeviceKind::Balloon { actual: 7, .. }
    ));
    bus_write(&windows, mmio::REG_STATUS, 0);
    assert_eq!(first_loop.counts().0, 0);
    first_loop.stop();

    let child_loop = started_loop("balloon-child");
    let child_bus = Windows::new();
    let (child, irq, notify) = restore_on_bus(&snapshot, &ram, &child_loop, &child_bus, true);
    assert!(child.active());
    let mut actual = [0u8; 8];
    bus_read(&child_bus, mmio::CONFIG_SPACE, &mut actual);
    assert_eq!(actual, [0, 0, 0, 0, 7, 0, 0, 0]);
    let pages = 0xA0000;
    ram.lock()
        .unwrap()
        .write_from(pages, &[0xAB; PAGE as usize])
        .unwrap();
    let mut driver = Driver {
        rings: rings[2],
        avail_idx: 0,
    };
    driver.offer(&ram, 0, pages, PAGE as u32, DESC_F_WRITE);
    signal(&notify[2]);
    assert_eq!(wait_signalled(&irq), 1);
    assert_eq!(driver.used(&ram, 0), (1, (0, 0)));
    let mut dropped = vec![0xFFu8; PAGE as usize];
    ram.lock().unwrap().read_into(pages, &mut dropped).unwrap();
    assert!(dropped.iter().all(|&b| b == 0));
    assert_eq!(child.plan().indices, vec![(0, 0), (0, 0), (1, 1)]);
    // The device dropped (its bus with it): its readers leave the loop.
    drop(child_bus);
    drop(child);
    assert_eq!(child_loop.counts().0, 0);
    child_loop.stop();
    ram.close();
}

/// A vsock packet header (`struct virtio_vsock_hdr`, 44 bytes little-endian) as a
/// driver lays it out: (src_cid, dst_cid, src_port, dst_port, len, op, buf_alloc).
fn vsock_header(fields: (u64, u64, u32, u32, u32, u16, u32)) -> Vec<u8> {
    let (src_cid, dst_cid, src_port, dst_port, len, op, buf_alloc) = fields;
    let mut h = Vec::with_capacity(44);
    h.extend_from_slice(&src_cid.to_le_bytes());
    h.extend_from_slice(&dst_cid.to_le_bytes());
    h.extend_from_slice(&src_port.to_le_bytes());
    h.extend_from_slice(&dst_port.to_le_bytes());
    h.extend_from_slice(&len.to_le_bytes());
    h.extend_from_slice(&1u16.to_le_bytes()); // VIRTIO_VSOCK_TYPE_STREAM
    h.extend_from_slice(&op.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes()); // flags
    h.extend_from_slice(&buf_alloc.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes()); // fwd_cnt
    h
}

/// (src_port, dst_port, len, op) of the header at `addr`, and its payload.
fn read_vsock_packet(ram: &GuestRam, addr: u64, used_len: u32) -> ((u32, u32, u32, u16), Vec<u8>) {
    let r = ram.lock().unwrap();
    let src_cid = r.read_u32(addr).unwrap();
    assert_eq!(src_cid, 2, "the host's CID");
    let fields = (
        r.read_u32(addr + 16).unwrap(),
        r.read_u32(addr + 20).unwrap(),
        r.read_u32(addr + 24).unwrap(),
        r.read_u16(addr + 30).unwrap(),
    );
    let mut payload = vec![0u8; used_len as usize - 44];
    r.read_into(addr + 44, &mut payload).unwrap();
    (fields, payload)
}

/// Wait until the used ring's index reaches `n`: its last entry.
fn wait_used(driver: &Driver, ram: &GuestRam, n: u16) -> (u32, u32) {
    let deadline =
        std::time::Instant::now() + std::time::Duration::from_millis(HANG_GUARD_MS as u64);
    loop {
        let (idx, entry) = driver.used(ram, n - 1);
        if idx >= n {
            assert_eq!(idx, n, "more used entries than expected");
            return entry;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "used index stuck at {idx}, waiting for {n}"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

const GUEST_CID: u64 = 42;
const OP_REQUEST: u16 = 1;
const OP_RESPONSE: u16 = 2;
const OP_RW: u16 = 5;

fn vsock_kind(path: &str, bound: Option<RawFd>) -> DeviceKind {
    DeviceKind::Vsock {
        guest_cid: GUEST_CID,
        connect_timeout: std::time::Duration::from_secs(20),
        reset_ack_wait: std::time::Duration::from_secs(10),
        listener: VsockListener {
            path: path.into(),
            bound,
        },
    }
}

/// A fresh directory for a test's sockets, removed when dropped.
struct SocketDir(std::path::PathBuf);

impl SocketDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("vmfork-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        SocketDir(dir)
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).to_str().unwrap().into()
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A vsock booted from a fresh plan that binds its own socket at `path`, on `event_loop`
/// and a bus of its own, brought up by the driver (its reset first): the device, its
/// bus, each queue's rings.
fn booted_vsock(
    ram: &Arc<GuestRam>,
    event_loop: &Arc<NativeLoop>,
    path: &str,
) -> (Arc<NativeTransport>, Windows, Vec<Rings>) {
    let boot = DevicePlan::fresh(
        vsock_kind(path, None),
        mmio::VIRTIO_F_VERSION_1,
        vec![256; 3],
    )
    .unwrap();
    let windows = Windows::new();
    let (booted, _irq, _notify) = restore_on_bus(&boot, ram, event_loop, &windows, true);
    assert!(std::path::Path::new(path).exists());
    bus_write(&windows, mmio::REG_STATUS, 0);
    let rings = bring_up_on_bus(&windows, &[16, 16, 16]);
    assert!(booted.active());
    (booted, windows, rings)
}

#[test]
fn vsock_restored_from_a_plan_resets_the_guests_connections_and_carries_a_host_connection() {
    use std::io::{Read, Write};
    let mapping = Mapping::new(RAM_SIZE);
    let ram = mapping.ram();
    let dir = SocketDir::new("vsock-plan");

    // The parent: a vsock booted from a fresh plan that binds its own socket path, the
    // driver's bring-up through the bus; its plan is the snapshot.
    let parent_path = dir.path("parent.sock");
    let first_loop = started_loop("vsock-boot");
    let (booted, windows, rings) = booted_vsock(&ram, &first_loop, &parent_path);
    assert_eq!(first_loop.counts().0, 4); // the private epoll and three ioeventfds
    let mut cid = [0u8; 8];
    bus_read(&windows, mmio::CONFIG_SPACE, &mut cid);
    assert_eq!(u64::from_le_bytes(cid), GUEST_CID);
    let snapshot = booted.plan();
    assert_eq!(snapshot.kind, vsock_kind(&parent_path, None));
    assert_eq!(snapshot.indices, vec![(0, 0); 3]);
    // The device dropped: off the loop, and the path it bound removed.
    drop(windows);
    drop(booted);
    assert_eq!(first_loop.counts().0, 0);
    assert!(!std::path::Path::new(&parent_path).exists());
    first_loop.stop();

    // The guest had an event buffer posted when the snapshot was taken.
    let mut event_queue = Driver {
        rings: rings[2],
        avail_idx: 0,
    };
    event_queue.offer(&ram, 0, 0x90000, 8, DESC_F_WRITE);

    // The child: its listener bound before the restore (the zygote's prefork), carried
    // in the plan as an fd.
    let child_path = dir.path("child.sock");
    let listener = std::os::unix::net::UnixListener::bind(&child_path).unwrap();
    let mut plan = snapshot.clone();
    plan.kind = vsock_kind(&child_path, Some(listener.as_raw_fd()));
    let child_loop = started_loop("vsock-child");
    let child_bus = Windows::new();
    let (child, irq, notify) = restore_on_bus(&plan, &ram, &child_loop, &child_bus, true);
    drop(listener); // the device holds its own duplicate
    assert!(child.active());
    // The restore posted VIRTIO_VSOCK_EVENT_TRANSPORT_RESET (id 0) at once.
    assert_eq!(wait_used(&event_queue, &ram, 1), (0, 4));
    assert!(wait_signalled(&irq) >= 1);
    let mut event = [0xFFu8; 4];
    ram.lock().unwrap().read_into(0x90000, &mut event).unwrap();
    assert_eq!(event, [0, 0, 0, 0]);

    // A host process connects; the request is held until the guest handled the reset
    // (gave an event buffer back), then reaches the guest's rx queue as OP_REQUEST.
    let mut host = std::os::unix::net::UnixStream::connect(&child_path).unwrap();
    host.set_read_timeout(Some(std::time::Duration::from_millis(HANG_GUARD_MS as u64)))
        .unwrap();
    host.write_all(b"CONNECT 1234\n").unwrap();
    let mut rx = Driver {
        rings: rings[0],
        avail_idx: 0,
    };
    for head in 0..4u16 {
        rx.offer(
            &ram,
            head,
            0xA0000 + 0x1000 * u64::from(head),
            4096,
            DESC_F_WRITE,
        );
    }
    signal(&notify[0]);
    event_queue.offer(&ram, 1, 0x90000, 8, DESC_F_WRITE);
    signal(&notify[2]);
    let (head, len) = wait_used(&rx, &ram, 1);
    assert_eq!((head, len), (0, 44));
    let ((host_port, port, _, op), _) = read_vsock_packet(&ram, 0xA0000, len);
    assert_eq!((port, op), (1234, OP_REQUEST));
    assert!(host_port >= 1 << 30);

    // The guest accepts: OP_RESPONSE on the tx queue; the host reads OK <its port>.
    let mut tx = Driver {
        rings: rings[1],
        avail_idx: 0,
    };
    let response = vsock_header((GUEST_CID, 2, 1234, host_port, 0, OP_RESPONSE, 65536));
    ram.lock().unwrap().write_from(0xC0000, &response).unwrap();
    tx.offer(&ram, 0, 0xC0000, 44, 0);
    signal(&notify[1]);
    let ok = format!("OK {host_port}\n");
    let mut line = vec![0u8; ok.len()];
    host.read_exact(&mut line).unwrap();
    assert_eq!(line, ok.as_bytes());
    assert_eq!(wait_used(&tx, &ram, 1).0, 0);

    // Host -> guest: the bytes arrive in an rx buffer as OP_RW.
    host.write_all(b"ping").unwrap();
    let (head, len) = wait_used(&rx, &ram, 2);
    assert_eq!((head, len), (1, 48));
    let ((src, dst, n, op), payload) = read_vsock_packet(&ram, 0xA1000, len);
    assert_eq!((src, dst, n, op), (host_port, 1234, 4, OP_RW));
    assert_eq!(payload, b"ping");

    // Guest -> host.
    let mut packet = vsock_header((GUEST_CID, 2, 1234, host_port, 4, OP_RW, 65536));
    packet.extend_from_slice(b"pong");
    ram.lock().unwrap().write_from(0xC1000, &packet).unwrap();
    tx.offer(&ram, 1, 0xC1000, 48, 0);
    signal(&notify[1]);
    let mut pong = [0u8; 4];
    host.read_exact(&mut pong).unwrap();
    assert_eq!(&pong, b"pong");
    assert_eq!(wait_used(&tx, &ram, 2).0, 1);
    assert_eq!(child.record().faults, 0);
    let [rx_indices, tx_indices, ev_indices] = child.plan().indices[..] else {
        panic!("three queues");
    };
    assert_eq!(
        (rx_indices, tx_indices, ev_indices),
        ((2, 2), (2, 2), (1, 1))
    );

    // The driver's reset drops the connection: the host process sees EOF.
    bus_write(&child_bus, mmio::REG_STATUS, 0);
    assert!(!child.active());
    let mut rest = Vec::new();
    host.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "{rest:?}");
    assert_eq!(child_loop.counts().0, 1); // the private epoll stays with the device
    drop(child_bus);
    drop(child);
    drop((irq, notify));
    assert_eq!(child_loop.counts().0, 0);
    assert!(std::path::Path::new(&child_path).exists()); // not ours to remove
    child_loop.stop();
    ram.close();
}

#[test]
fn a_vsock_plan_whose_rings_are_outside_ram_restores_as_needs_reset() {
    let mapping = Mapping::new(RAM_SIZE);
    let ram = mapping.ram();
    let dir = SocketDir::new("vsock-bad");
    let path = dir.path("vsock.sock");
    let event_loop = started_loop("vsock-bad");
    let (booted, windows, _) = booted_vsock(&ram, &event_loop, &path);
    let mut plan = booted.plan();
    drop(windows);
    drop(booted);
    plan.registers.queues[2].used = RAM_SIZE as u64; // the event queue's used ring
    assert_restores_as_needs_reset(&plan, &ram, &event_loop, "queue 2: ");
    // A CID the device cannot have is refused, not served.
    let mut wrong = plan.clone();
    wrong.kind = DeviceKind::Vsock {
        guest_cid: 2,
        connect_timeout: std::time::Duration::from_secs(1),
        reset_ack_wait: std::time::Duration::from_secs(1),
        listener: VsockListener { path, bound: None },
    };
    let refused = NativeTransport::restore(
        &wrong,
        ram.clone(),
        event_loop.clone() as Arc<dyn Readers>,
        eventfd(),
        vec![None, None, None],
    );
    assert_eq!(
        refused.err().as_deref(),
        Some("guest CID 2 must be in 3..2**32-2")
    );
    event_loop.stop();
    ram.close();
}

#[test]
fn a_vsock_restored_before_driver_ok_drops_its_reset_event_at_the_drivers_reset() {
    let mapping = Mapping::new(RAM_SIZE);
    let ram = mapping.ram();
    let dir = SocketDir::new("vsock-early");
    let path = dir.path("vsock.sock");
    let event_loop = started_loop("vsock-early");
    let (booted, windows, rings) = booted_vsock(&ram, &event_loop, &path);
    let mut plan = booted.plan();
    drop(windows);
    drop(booted);
    // A snapshot between FEATURES_OK and DRIVER_OK: restored not live, its reset event
    // armed for an activation to come, and an event buffer already posted.
    plan.registers.status &= !mmio::STATUS_DRIVER_OK;
    let mut event_queue = Driver {
        rings: rings[2],
        avail_idx: 0,
    };
    event_queue.offer(&ram, 0, 0x90000, 8, DESC_F_WRITE);
    let bus = Windows::new();
    let (restored, _irq, _notify) = restore_on_bus(&plan, &ram, &event_loop, &bus, true);
    assert!(!restored.active());
    // A new driver resets the device first: it has no stale connections to drop, so
    // its bring-up gets no reset event (vsock.py's reset drops the pending one).
    bus_write(&bus, mmio::REG_STATUS, 0);
    bring_up_on_bus(&bus, &[16, 16, 16]);
    assert!(restored.active());
    std::thread::sleep(std::time::Duration::from_millis(50)); // the loop's look at each queue
    assert_eq!(event_queue.used(&ram, 0).0, 0);
    assert_eq!(restored.plan().indices, vec![(0, 0); 3]);
    drop(bus);
    drop(restored);
    event_loop.stop();
    ram.close();
}

/// A disk's content key (the id GET_ID answers is its first 20 bytes).
const DISK_KEY: &str = "0123456789abcdef0123456789abcdef";
/// `blk.py`'s features: a read-only disk's and a volume slot's.
const BLK_RO_FEATURES: u64 = mmio::VIRTIO_F_VERSION_1 | (1 << 1) | (1 << 2) | (1 << 5);
const BLK_SLOT_FEATURES: u64 = mmio::VIRTIO_F_VERSION_1 | (1 << 1) | (1 << 2) | (1 << 9);
const SECTOR: usize = 512;

/// A disk file of `sectors` sectors, sector i filled with byte i + 1, in `dir`.
fn disk_file(dir: &SocketDir, name: &str, sectors: usize) -> std::fs::File {
    let path = dir.path(name);
    let bytes: Vec<u8> = (0..sectors * SECTOR)
        .map(|i| (i / SECTOR) as u8 + 1)
        .collect();
    std::fs::write(&path, bytes).unwrap();
    std::fs::File::open(&path).unwrap()
}

fn root_disk(file: Option<RawFd>, capacity: u64) -> DeviceKind {
    DeviceKind::Blk(BlkDisk {
        key: DISK_KEY.into(),
        capacity,
        read_only: true,
        volume: None,
        file,
    })
}

/// Post one blk request at `head` (header at 0x80000 + 0x1000 * n, data after it,
/// the status byte last): `data` bytes for the device to write, or to read (`out`).
fn blk_request(
    driver: &mut Driver,
    ram: &GuestRam,
    head: u16,
    kind: u32,
    sector: u64,
    data: u32,
    out: bool,
) -> u64 {
    let at = 0x80000 + 0x1000 * u64::from(head);
    let mut header = kind.to_le_bytes().to_vec();
    header.extend_from_slice(&0u32.to_le_bytes());
    header.extend_from_slice(&sector.to_le_bytes());
    ram.lock().unwrap().write_from(at, &header).unwrap();
    ram.lock().unwrap().write_from(at + 0x800, &[0xEE]).unwrap();
    let data_flags = if out { 0 } else { DESC_F_WRITE };
    driver.offer_chain(
        ram,
        head,
        &[
            (at, 16, 0),
            (at + 0x20, data, data_flags),
            (at + 0x800, 1, DESC_F_WRITE),
        ],
    );
    at
}

/// A booted disk of `kind` offering `features` on a bus and a started loop of its own
/// (`name`), with ioeventfds unless it is an empty slot: the loop, the bus, the
/// transport, its irqfd and ioeventfds.
fn fresh_disk(
    kind: DeviceKind,
    features: u64,
    ram: &Arc<GuestRam>,
    name: &str,
) -> (
    Arc<NativeLoop>,
    Windows,
    Arc<NativeTransport>,
    OwnedFd,
    Vec<OwnedFd>,
) {
    let plan = DevicePlan::fresh(kind, features, vec![256]).unwrap();
    let event_loop = started_loop(name);
    let windows = Windows::new();
    let ioeventfds = plan.wants_ioeventfds();
    let (transport, irq, notify) = restore_on_bus(&plan, ram, &event_loop, &windows, ioeventfds);
    (event_loop, windows, transport, irq, notify)
}

/// A one-queue disk on `windows` brought up as its driver brings it up: the driver
/// of its request queue.
fn blk_driver(windows: &Windows) -> Driver {
    let rings = bring_up_on_bus(windows, &[16]);
    Driver {
        rings: rings[0],
        avail_idx: 0,
    }
}

fn status_of(ram: &GuestRam, at: u64) -> u8 {
    let mut status = [0u8];
    ram.lock()
        .unwrap()
        .read_into(at + 0x800, &mut status)
        .unwrap();
    status[0]
}

/// The bus and the transport dropped, then its eventfds: nothing of the device is left
/// on the loop, which stops.
fn tear_down(
    windows: Windows,
    transport: Arc<NativeTransport>,
    fds: (OwnedFd, Vec<OwnedFd>),
    event_loop: &NativeLoop,
) {
    drop(windows);
    drop(transport);
    drop(fds);
    assert_eq!(event_loop.counts().0, 0);
    event_loop.stop();
}

#[test]
fn blk_restored_from_a_plan_reads_its_disk_file_on_the_native_loop() {
    let mapping = Mapping::new(RAM_SIZE);
    let ram = mapping.ram();
    let dir = SocketDir::new("blk-plan");
    let disk = disk_file(&dir, "disk.img", 8);
    let boot = DevicePlan::fresh(
        root_disk(Some(disk.as_raw_fd()), 8 * SECTOR as u64),
        BLK_RO_FEATURES,
        vec![256],
    )
    .unwrap();
    assert!(boot.wants_ioeventfds());

    // A booted disk: its config space as blk.py packs it, the driver's DRIVER_OK
    // builds the server on the loop.
    let first_loop = started_loop("blk-boot");
    let windows = Windows::new();
    let (booted, irq, notify) = restore_on_bus(&boot, &ram, &first_loop, &windows, true);
    let mut config = [0u8; 16];
    for (i, chunk) in config.chunks_mut(4).enumerate() {
        bus_read(&windows, mmio::CONFIG_SPACE + 4 * i as u64, chunk);
    }
    let mut want = 8u64.to_le_bytes().to_vec();
    want.extend_from_slice(&(64u32 * 1024).to_le_bytes());
    want.extend_from_slice(&128u32.to_le_bytes());
    assert_eq!(config.to_vec(), want);
    let mut driver = blk_driver(&windows);
    assert!(booted.active());
    assert_eq!(first_loop.counts().0, 1);
    // Sector 2 read from the file into the guest's buffer.
    let at = blk_request(&mut driver, &ram, 0, 0, 2, SECTOR as u32, false);
    signal(&notify[0]);
    assert_eq!(wait_signalled(&irq), 1);
    assert_eq!(driver.used(&ram, 0), (1, (0, SECTOR as u32 + 1)));
    assert_eq!(status_of(&ram, at), 0);
    let mut data = vec![0u8; SECTOR];
    ram.lock().unwrap().read_into(at + 0x20, &mut data).unwrap();
    assert!(data.iter().all(|&b| b == 3), "sector 2 is the file's third");
    // GET_ID: the key's first 20 bytes; a write to a read-only disk: IOERR.
    let at = blk_request(&mut driver, &ram, 3, 8, 0, 20, false);
    let write = blk_request(&mut driver, &ram, 6, 1, 0, SECTOR as u32, true);
    signal(&notify[0]);
    assert_eq!(wait_used(&driver, &ram, 3), (6, 1));
    let mut id = [0u8; 20];
    ram.lock().unwrap().read_into(at + 0x20, &mut id).unwrap();
    assert_eq!(&id, &DISK_KEY.as_bytes()[..20]);
    assert_eq!(status_of(&ram, write), 1);
    let stats = booted.stats().blk;
    assert_eq!((stats.requests, stats.reads, stats.get_ids), (3, 1, 1));
    assert_eq!((stats.bytes_read, stats.writes_refused), (SECTOR as u64, 1));

    // The snapshot: the plan gives the disk back without its file.
    let snapshot = booted.plan();
    assert_eq!(snapshot.kind, root_disk(None, 8 * SECTOR as u64));
    assert_eq!(snapshot.indices, vec![(3, 3)]);
    drop(windows);
    drop(booted);
    assert_eq!(first_loop.counts().0, 0);
    first_loop.stop();

    // A plan with no file, or another file, is not this disk.
    let child_loop = started_loop("blk-child");
    let restore = |plan: &DevicePlan| {
        NativeTransport::restore(
            plan,
            ram.clone(),
            child_loop.clone() as Arc<dyn Readers>,
            eventfd(),
            vec![None],
        )
        .map(|_| ())
    };
    assert_eq!(
        restore(&snapshot).err().as_deref(),
        Some(&*format!("disk {DISK_KEY}: no file given"))
    );
    let other = disk_file(&dir, "other.img", 4);
    let mut plan = snapshot.clone();
    plan.kind = root_disk(Some(other.as_raw_fd()), 8 * SECTOR as u64);
    let refused = restore(&plan).err().unwrap();
    assert!(refused.contains("its file has 2048"), "{refused}");

    // The child: the same disk's file, the ring indices where the snapshot left them.
    plan.kind = root_disk(Some(disk.as_raw_fd()), 8 * SECTOR as u64);
    let child_bus = Windows::new();
    let (child, irq, notify) = restore_on_bus(&plan, &ram, &child_loop, &child_bus, true);
    drop(disk); // the transport holds its own duplicate
    assert!(child.active());
    // InterruptStatus was saved set (nothing acked): the restore's interrupt.
    assert_eq!(read_counter(irq.as_raw_fd()), Some(1));
    let at = blk_request(&mut driver, &ram, 9, 0, 7, 2 * SECTOR as u32, false);
    signal(&notify[0]);
    assert_eq!(wait_signalled(&irq), 1);
    // Sector 7 is the last: a read of two reaches past the capacity, refused with
    // only the status byte written.
    assert_eq!(driver.used(&ram, 3), (4, (9, 1)));
    assert_eq!(status_of(&ram, at), 1);
    let at = blk_request(&mut driver, &ram, 12, 0, 7, SECTOR as u32, false);
    signal(&notify[0]);
    assert_eq!(wait_used(&driver, &ram, 5), (12, SECTOR as u32 + 1));
    assert_eq!(status_of(&ram, at), 0);
    ram.lock().unwrap().read_into(at + 0x20, &mut data).unwrap();
    assert!(data.iter().all(|&b| b == 8));
    assert_eq!(child.plan().indices, vec![(5, 5)]);
    let stats = child.stats().blk;
    assert_eq!((stats.requests, stats.reads, stats.read_errors), (2, 1, 1));
    assert_eq!(child.record().faults, 0);
    tear_down(child_bus, child, (irq, notify), &child_loop);
    ram.close();
}

/// An empty volume slot's media: no key, no bytes, no file.
fn empty_slot_disk() -> BlkDisk {
    BlkDisk {
        key: String::new(),
        capacity: 0,
        read_only: true,
        volume: Some(String::new()),
        file: None,
    }
}

#[test]
fn an_empty_volume_slot_has_no_ioeventfd_and_answers_on_the_writing_thread() {
    let mapping = Mapping::new(RAM_SIZE);
    let ram = mapping.ram();
    let empty_disk = empty_slot_disk();
    let slot = DeviceKind::Blk(empty_disk.clone());
    let plan = DevicePlan::fresh(slot.clone(), BLK_SLOT_FEATURES, vec![256]).unwrap();
    assert!(!plan.wants_ioeventfds());
    let event_loop = started_loop("blk-slot");
    let windows = Windows::new();
    let (empty, irq, _) = restore_on_bus(&plan, &ram, &event_loop, &windows, false);
    let mut capacity = [0xFFu8; 8];
    bus_read(&windows, mmio::CONFIG_SPACE, &mut capacity);
    assert_eq!(capacity, [0; 8]);
    let rings = bring_up_on_bus(&windows, &[16]);
    assert!(empty.active());
    assert_eq!(event_loop.counts().0, 0); // nothing on the loop
    let mut driver = Driver {
        rings: rings[0],
        avail_idx: 0,
    };
    // A read of an empty slot: IOERR, answered before the notify's write returns.
    let at = blk_request(&mut driver, &ram, 0, 0, 0, SECTOR as u32, false);
    bus_write(&windows, mmio::REG_QUEUE_NOTIFY, 0);
    assert_eq!(read_counter(irq.as_raw_fd()), Some(1));
    assert_eq!(driver.used(&ram, 0), (1, (0, 1)));
    assert_eq!(status_of(&ram, at), 1);
    let saved = empty.plan();
    assert_eq!(saved.kind, slot);
    assert_eq!(saved.indices, vec![(1, 1)]);
    // An empty slot has no file, and a root disk is never empty.
    let mut refused = plan.clone();
    refused.kind = DeviceKind::Blk(BlkDisk {
        volume: None,
        ..empty_disk
    });
    let err = NativeTransport::restore(
        &refused,
        ram.clone(),
        event_loop.clone() as Arc<dyn Readers>,
        eventfd(),
        vec![None],
    );
    assert_eq!(err.err().as_deref(), Some("a root disk cannot be empty"));
    drop(windows);
    drop(empty);
    event_loop.stop();
    ram.close();
}

#[test]
fn a_volume_slot_takes_its_media_while_running_and_serves_them_after_the_config_change() {
    let mapping = Mapping::new(RAM_SIZE);
    let ram = mapping.ram();
    let dir = SocketDir::new("blk-insert");
    drop(disk_file(&dir, "volume.img", 8));
    let disk = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.path("volume.img"))
        .unwrap();
    let empty_disk = empty_slot_disk();
    let (event_loop, windows, slot, irq, _) = fresh_disk(
        DeviceKind::Blk(empty_disk.clone()),
        BLK_SLOT_FEATURES,
        &ram,
        "blk-insert",
    );
    let mut driver = blk_driver(&windows);
    assert!(slot.active());
    assert_eq!(event_loop.counts().0, 0);
    // A read of the empty slot, left in the ring unnotified: the guest raced the insert.
    let early = blk_request(&mut driver, &ram, 0, 0, 1, SECTOR as u32, false);

    let media = |key: &str, capacity: u64, file: Option<RawFd>| BlkDisk {
        key: key.into(),
        capacity,
        read_only: false,
        volume: Some("/data".into()),
        file,
    };
    // Refused, nothing changed: a file of another size, an empty medium.
    let short = media(DISK_KEY, 16 * SECTOR as u64, Some(disk.as_raw_fd()));
    let refused = slot.insert_media(short, Some(eventfd())).unwrap_err();
    assert!(refused.contains("its file has 4096"), "{refused}");
    let refused = slot.insert_media(empty_disk.clone(), None).unwrap_err();
    assert!(refused.contains("not empty"), "{refused}");
    assert_eq!(slot.plan().kind, DeviceKind::Blk(empty_disk.clone()));
    assert_eq!(event_loop.counts().0, 0);

    let notify = eventfd();
    let inserted = media(DISK_KEY, 8 * SECTOR as u64, Some(disk.as_raw_fd()));
    let handed = notify.try_clone().unwrap();
    slot.insert_media(inserted.clone(), Some(handed)).unwrap();
    drop(disk); // the transport holds its own duplicate
                // The new server is on the loop, woken by the new ioeventfd; its first look found
                // the early request and served it from the new disk.
    assert_eq!(event_loop.counts().0, 1);
    assert_eq!(wait_signalled(&irq), 1);
    assert_eq!(driver.used(&ram, 0), (1, (0, SECTOR as u32 + 1)));
    assert_eq!(status_of(&ram, early), 0);
    let mut data = vec![0u8; SECTOR];
    ram.lock()
        .unwrap()
        .read_into(early + 0x20, &mut data)
        .unwrap();
    assert!(
        data.iter().all(|&b| b == 2),
        "sector 1 is the file's second"
    );

    // The register file's config still says 0 sectors until the change is announced:
    // then a new generation, InterruptStatus bit 1 and the irqfd.
    let mut capacity = [0xFFu8; 8];
    bus_read(&windows, mmio::CONFIG_SPACE, &mut capacity);
    assert_eq!(capacity, [0; 8]);
    let mut generation = [0u8; 4];
    bus_read(&windows, mmio::REG_CONFIG_GENERATION, &mut generation);
    let before = u32::from_le_bytes(generation);
    bus_write(&windows, mmio::REG_INTERRUPT_ACK, mmio::INT_USED_BUFFER);
    assert!(slot.config_changed());
    assert_eq!(read_counter(irq.as_raw_fd()), Some(1));
    let mut status = [0u8; 4];
    bus_read(&windows, mmio::REG_INTERRUPT_STATUS, &mut status);
    assert_eq!(u32::from_le_bytes(status), INT_CONFIG_CHANGE);
    bus_read(&windows, mmio::REG_CONFIG_GENERATION, &mut generation);
    assert_eq!(u32::from_le_bytes(generation), before.wrapping_add(1));
    bus_read(&windows, mmio::CONFIG_SPACE, &mut capacity);
    assert_eq!(u64::from_le_bytes(capacity), 8);

    // A write after the insert lands in the file through the new ioeventfd.
    let write = blk_request(&mut driver, &ram, 3, 1, 5, SECTOR as u32, true);
    ram.lock()
        .unwrap()
        .write_from(write + 0x20, &[0xAB; SECTOR])
        .unwrap();
    signal(&notify);
    assert_eq!(wait_signalled(&irq), 1);
    assert_eq!(driver.used(&ram, 1), (2, (3, 1)));
    assert_eq!(status_of(&ram, write), 0);
    let on_disk = std::fs::read(dir.path("volume.img")).unwrap();
    assert!(on_disk[5 * SECTOR..6 * SECTOR].iter().all(|&b| b == 0xAB));
    let stats = slot.stats().blk;
    assert_eq!((stats.reads, stats.writes), (1, 1));

    // A slot holds one disk till the end (no eject); the snapshot names the volume.
    let again = media(DISK_KEY, 8 * SECTOR as u64, Some(notify.as_raw_fd()));
    let refused = slot.insert_media(again, None).unwrap_err();
    assert_eq!(refused, format!("volume slot already holds {DISK_KEY}"));
    assert_eq!(
        slot.plan().kind,
        DeviceKind::Blk(BlkDisk {
            file: None,
            ..inserted
        })
    );
    tear_down(windows, slot, (irq, vec![notify]), &event_loop);

    // A root disk takes no media.
    let root_file = disk_file(&dir, "root.img", 8);
    let (root_loop, root_bus, root, root_irq, root_notify) = fresh_disk(
        root_disk(Some(root_file.as_raw_fd()), 8 * SECTOR as u64),
        BLK_RO_FEATURES,
        &ram,
        "blk-root",
    );
    let volume = media(DISK_KEY, 8 * SECTOR as u64, Some(root_file.as_raw_fd()));
    assert_eq!(
        root.insert_media(volume, None).unwrap_err(),
        "this virtio-blk is not a volume slot; its disk is fixed"
    );
    tear_down(root_bus, root, (root_irq, root_notify), &root_loop);
    ram.close();
}

const MAC: [u8; 6] = [0x02, 0x00, 0x5e, 0x10, 0x00, 0x07];
const NET_HDR: usize = 12;

/// A datagram socketpair standing in for a tap (the test host may have no
/// `/dev/net/tun`): like a tap with IFF_VNET_HDR, one write is one frame and one read
/// gives one frame. The device's end, the host's end; both non-blocking as a tap is.
fn tap_pair() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: socketpair writes two fds into a live two-int array.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    assert_eq!(rc, 0, "socketpair");
    // SAFETY: two fresh fds owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// The next frame the device wrote to the tap (the host's end), waiting for it.
fn host_reads(host: &OwnedFd) -> Vec<u8> {
    let mut pfd = libc::pollfd {
        fd: host.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    assert_eq!(
        unsafe { libc::poll(&mut pfd, 1, HANG_GUARD_MS) },
        1,
        "no frame"
    );
    let mut buf = vec![0u8; 4096];
    // SAFETY: reads into a live buffer of its length.
    let n = unsafe { libc::read(host.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(n > 0, "read the tap's other end");
    buf.truncate(n as usize);
    buf
}

fn host_writes(host: &OwnedFd, frame: &[u8]) {
    // SAFETY: writes from a live buffer of its length.
    let n = unsafe { libc::write(host.as_raw_fd(), frame.as_ptr().cast(), frame.len()) };
    assert_eq!(n, frame.len() as isize);
}

/// A frame as the guest's driver lays one out: the virtio-net header (zeros: no
/// offload), then `len` bytes of `fill`.
fn net_frame(fill: u8, len: usize) -> Vec<u8> {
    let mut frame = vec![0u8; NET_HDR];
    frame.extend(std::iter::repeat_n(fill, len));
    frame
}

/// Post `frame` on the tx queue as one readable descriptor at `at`.
fn post_tx(driver: &mut Driver, ram: &GuestRam, head: u16, at: u64, frame: &[u8]) {
    ram.lock().unwrap().write_from(at, frame).unwrap();
    driver.offer(ram, head, at, frame.len() as u32, 0);
}

fn net_kind(tap: Option<RawFd>) -> DeviceKind {
    DeviceKind::Net(NetTap { mac: MAC, tap })
}

#[test]
fn net_restored_from_a_plan_moves_frames_both_ways_through_its_tap() {
    let mapping = Mapping::new(RAM_SIZE);
    let ram = mapping.ram();
    let (tap, host) = tap_pair();
    let boot = DevicePlan::fresh(
        net_kind(Some(tap.as_raw_fd())),
        mmio::VIRTIO_F_VERSION_1 | (1 << 5),
        vec![256, 256],
    )
    .unwrap();

    // A booted device: its config space is net.py's (the MAC, the link up), the
    // driver's DRIVER_OK builds the server with the tap on the loop.
    let first_loop = started_loop("net-boot");
    let windows = Windows::new();
    let (booted, irq, notify) = restore_on_bus(&boot, &ram, &first_loop, &windows, true);
    drop(tap); // the transport holds its own duplicate
    let mut config = [0u8; 8];
    for (i, chunk) in config.chunks_mut(4).enumerate() {
        bus_read(&windows, mmio::CONFIG_SPACE + 4 * i as u64, chunk);
    }
    assert_eq!(config, [0x02, 0x00, 0x5e, 0x10, 0x00, 0x07, 1, 0]);
    let rings = bring_up_on_bus(&windows, &[16, 16]);
    assert!(booted.active());
    assert_eq!(first_loop.counts().0, 3, "both ioeventfds and the tap");
    let mut rx = Driver {
        rings: rings[0],
        avail_idx: 0,
    };
    let mut tx = Driver {
        rings: rings[1],
        avail_idx: 0,
    };
    // Guest to host: the frame, header and all, is one write on the tap.
    let sent = net_frame(0xAB, 60);
    post_tx(&mut tx, &ram, 0, 0x80000, &sent);
    signal(&notify[1]);
    assert_eq!(host_reads(&host), sent);
    assert_eq!(wait_signalled(&irq), 1);
    assert_eq!(tx.used(&ram, 0), (1, (0, 0)));
    // Host to guest: a buffer posted, the host's frame read into it, num_buffers 1.
    rx.offer(&ram, 0, 0x90000, 2048, DESC_F_WRITE);
    signal(&notify[0]);
    let arriving = net_frame(0xCD, 90);
    host_writes(&host, &arriving);
    assert_eq!(wait_used(&rx, &ram, 1), (0, arriving.len() as u32));
    let mut got = vec![0u8; arriving.len()];
    ram.lock().unwrap().read_into(0x90000, &mut got).unwrap();
    let mut want = arriving.clone();
    want[10] = 1; // num_buffers
    assert_eq!(got, want);
    let stats = booted.stats().net;
    assert_eq!((stats.tx_frames, stats.rx_frames), (1, 1));
    assert_eq!(stats.rx_bytes, 90);

    // The snapshot: the plan gives the MAC back without the tap.
    let snapshot = booted.plan();
    assert_eq!(snapshot.kind, net_kind(None));
    assert_eq!(snapshot.indices, vec![(1, 1), (1, 1)]);
    drop(windows);
    drop(booted);
    assert_eq!(
        first_loop.counts().0,
        0,
        "the tap left the loop with the device"
    );
    first_loop.stop();

    // The child: its own tap, the rings where the snapshot left them.
    let (tap, host) = tap_pair();
    let mut plan = snapshot.clone();
    plan.kind = net_kind(Some(tap.as_raw_fd()));
    let child_loop = started_loop("net-child");
    let child_bus = Windows::new();
    let (child, irq, notify) = restore_on_bus(&plan, &ram, &child_loop, &child_bus, true);
    drop(tap);
    assert!(child.active());
    assert_eq!(child_loop.counts().0, 3);
    let sent = net_frame(0x11, 100);
    post_tx(&mut tx, &ram, 1, 0x81000, &sent);
    signal(&notify[1]);
    assert_eq!(host_reads(&host), sent);
    assert_eq!(wait_used(&tx, &ram, 2), (1, 0));
    // The driver resets the device: the server and the tap leave the loop, the
    // counters stay; a new activation serves the same tap and adds to them.
    bus_write(&child_bus, mmio::REG_STATUS, 0);
    assert!(!child.active());
    assert_eq!(child_loop.counts().0, 0);
    let _ = read_counter(irq.as_raw_fd());
    // A driver starts its rings afresh after a reset (the same addresses here).
    for ring in [rx.rings, tx.rings] {
        let r = ram.lock().unwrap();
        r.write_u16(ring.avail + 2, 0).unwrap();
        r.write_u16(ring.used + 2, 0).unwrap();
    }
    let rings = bring_up_on_bus(&child_bus, &[16, 16]);
    let mut tx = Driver {
        rings: rings[1],
        avail_idx: 0,
    };
    let sent = net_frame(0x22, 70);
    post_tx(&mut tx, &ram, 0, 0x82000, &sent);
    signal(&notify[1]);
    assert_eq!(host_reads(&host), sent);
    assert_eq!(wait_used(&tx, &ram, 1), (0, 0));
    let stats = child.stats().net;
    assert_eq!((stats.tx_frames, stats.tx_bytes), (2, 170));
    assert_eq!(child.record().faults, 0);
    tear_down(child_bus, child, (irq, notify), &child_loop);
    ram.close();
}

#[test]
fn a_net_plan_refuses_a_multicast_mac() {
    let mut kind = NetTap {
        mac: MAC,
        tap: None,
    };
    kind.mac[0] |= 1;
    let plan = DevicePlan::fresh(
        DeviceKind::Net(kind),
        mmio::VIRTIO_F_VERSION_1,
        vec![256, 256],
    )
    .unwrap();
    let mapping = Mapping::new(RAM_SIZE);
    let ram = mapping.ram();
    let event_loop = started_loop("net-mac");
    let refused = NativeTransport::restore(
        &plan,
        ram.clone(),
        event_loop.clone() as Arc<dyn Readers>,
        eventfd(),
        vec![None, None],
    )
    .err()
    .unwrap();
    assert!(refused.contains("not a unicast address"), "{refused}");
    event_loop.stop();
    ram.close();
}
