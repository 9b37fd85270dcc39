//! A device wired with no Python object: guest RAM over an anonymous mapping, a register
//! file brought up as a driver brings it up, the server on a `NativeLoop` with a
//! `NativeEvents` sink, an eventfd as the irqfd and one as the queue's ioeventfd. What
//! the native machine assembly (docs/native.md, "Where the line goes next") will do for
//! every device, done here for rng and balloon; the test binary has no interpreter
//! linked, so any path into Python would not even link.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, Mutex};

use crate::balloon_serve::BalloonServer;
use crate::eventloop::NativeLoop;
use crate::guest_ram::{GuestRam, Region};
use crate::mmio::{self, Event, Registers, INT_CONFIG_CHANGE, INT_USED_BUFFER};
use crate::queue_server::{DeviceEvents, NativeEvents};
use crate::rng_serve::{RngServer, Served};
use crate::virtq::{self, Rings};

const RAM_SIZE: usize = 1 << 20;
const PAGE: u64 = 4096;
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
