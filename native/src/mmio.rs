//! The virtio-mmio v2 register file (virtio 1.x, 4.2), device side, without Python.
//!
//! The one implementation: the rules are those `vmfork.vmm.devices.virtio.mmio`'s
//! module comment lists (its Python twin, `PyRegisters`, is deleted), and the contract
//! properties in tests/unit/test_virtio_mmio_native.py hold this file to them on
//! hostile register sequences. It knows nothing of the device model: what needs
//! the device (activation, reset, the acked features, a device error, a notification
//! without an ioeventfd, a config access to a device whose config is not a plain byte
//! string) comes back as an `Event` for the caller to hand to Python once the lock is
//! released. Everything here is bounded by the guest's inputs: no allocation grows
//! with them except the reason strings, which are short and formatted from numbers.

pub const WINDOW_SIZE: u64 = 0x1000;
pub const MAGIC: u32 = 0x7472_6976; // "virt"
pub const VERSION: u32 = 2;
pub const VENDOR_ID: u32 = 0x554D_4551; // "QEMU"

pub const REG_MAGIC: u64 = 0x000;
pub const REG_VERSION: u64 = 0x004;
pub const REG_DEVICE_ID: u64 = 0x008;
pub const REG_VENDOR_ID: u64 = 0x00C;
pub const REG_DEVICE_FEATURES: u64 = 0x010;
pub const REG_DEVICE_FEATURES_SEL: u64 = 0x014;
pub const REG_DRIVER_FEATURES: u64 = 0x020;
pub const REG_DRIVER_FEATURES_SEL: u64 = 0x024;
pub const REG_QUEUE_SEL: u64 = 0x030;
pub const REG_QUEUE_NUM_MAX: u64 = 0x034;
pub const REG_QUEUE_NUM: u64 = 0x038;
pub const REG_QUEUE_READY: u64 = 0x044;
pub const REG_QUEUE_NOTIFY: u64 = 0x050;
pub const REG_INTERRUPT_STATUS: u64 = 0x060;
pub const REG_INTERRUPT_ACK: u64 = 0x064;
pub const REG_STATUS: u64 = 0x070;
pub const REG_QUEUE_DESC_LOW: u64 = 0x080;
pub const REG_QUEUE_DESC_HIGH: u64 = 0x084;
pub const REG_QUEUE_DRIVER_LOW: u64 = 0x090;
pub const REG_QUEUE_DRIVER_HIGH: u64 = 0x094;
pub const REG_QUEUE_DEVICE_LOW: u64 = 0x0A0;
pub const REG_QUEUE_DEVICE_HIGH: u64 = 0x0A4;
pub const REG_CONFIG_GENERATION: u64 = 0x0FC;
pub const CONFIG_SPACE: u64 = 0x100;

pub const INT_USED_BUFFER: u32 = 0x1;
pub const INT_CONFIG_CHANGE: u32 = 0x2;

pub const STATUS_ACKNOWLEDGE: u32 = 0x01;
pub const STATUS_DRIVER: u32 = 0x02;
pub const STATUS_DRIVER_OK: u32 = 0x04;
pub const STATUS_FEATURES_OK: u32 = 0x08;
pub const STATUS_DEVICE_NEEDS_RESET: u32 = 0x40;
pub const STATUS_FAILED: u32 = 0x80;
const DRIVER_STATUS_BITS: u32 =
    STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK;
const STATUS_ORDER: [u32; 4] = [
    STATUS_ACKNOWLEDGE,
    STATUS_DRIVER,
    STATUS_FEATURES_OK,
    STATUS_DRIVER_OK,
];
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
/// The largest queue a device may offer (queue.py's `MAX_QUEUE_SIZE`).
pub const MAX_QUEUE_SIZE: u32 = 256;
/// The most queues a device may have (ours have at most 3; a bound for the state import).
pub const MAX_QUEUES: usize = 64;

/// What a register access needs from the device model, in the order it happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Status was written 0: the registers are fresh, the device must reset.
    Reset,
    /// FEATURES_OK accepted: the device's acked features are these.
    FeaturesOk(u64),
    /// FEATURES_OK refused, and why (for the log).
    FeaturesRefused(String),
    /// DRIVER_OK reached: activate the device for this epoch.
    Activate(u64),
    /// The guest broke the protocol: DEVICE_NEEDS_RESET and the config interrupt
    /// bit are set; raise the interrupt and log why.
    NeedsReset(String),
    /// QueueNotify for queue `.0` in epoch `.1`.
    Notify(u32, u64),
    /// A config-space write for a device whose config is not plain bytes.
    ConfigWrite(u32, Vec<u8>),
}

/// One queue's registers (its ring indices are the device's, kept in Python).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueRegs {
    pub max_size: u32,
    pub size: u32,
    pub ready: bool,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
}

impl QueueRegs {
    fn new(max_size: u32) -> Self {
        QueueRegs {
            max_size,
            size: max_size,
            ready: false,
            desc: 0,
            avail: 0,
            used: 0,
        }
    }
}

fn size_is_valid(size: u32, max_size: u32) -> bool {
    size > 0 && size <= max_size && size.is_power_of_two()
}

/// The saved registers (`MmioTransportState` without the ring indices).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Saved {
    pub status: u32,
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    pub driver_features: u64,
    pub driver_features_bad: bool,
    pub queue_sel: u32,
    pub interrupt_status: u32,
    pub config_generation: u32,
    pub queues: Vec<QueueRegs>,
}

/// A register file; the caller serialises access (a mutex in the bindings).
pub struct Registers {
    pub device_type: u32,
    pub features: u64,
    pub epoch: u64,
    pub status: u32,
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    pub driver_features: u64,
    pub driver_features_bad: bool,
    pub queue_sel: u32,
    pub interrupt_status: u32,
    pub config_generation: u32,
    pub queues: Vec<QueueRegs>,
    max_sizes: Vec<u32>,
    /// The device's config bytes when they are plain (served here), else None.
    pub config: Option<Vec<u8>>,
    pub ignored_writes: u64,
    pub bad_accesses: u64,
    pub device_errors: u64,
    pub last_device_error: Option<String>,
}

/// What a read asks of the caller.
pub enum Read {
    /// Served: the bytes are in the buffer.
    Done,
    /// A config read the device must answer (its config is not plain bytes).
    Device,
}

impl Registers {
    /// `max_sizes` must each be a power of 2 in 1..=256, at most `MAX_QUEUES` of them.
    pub fn new(
        device_type: u32,
        features: u64,
        max_sizes: &[u32],
        config: Option<Vec<u8>>,
    ) -> Result<Self, String> {
        if max_sizes.len() > MAX_QUEUES {
            return Err(format!("{} queues, at most {MAX_QUEUES}", max_sizes.len()));
        }
        for &m in max_sizes {
            if !size_is_valid(m, MAX_QUEUE_SIZE) {
                return Err(format!(
                    "queue max size {m} is not a power of 2 in 1..{MAX_QUEUE_SIZE}"
                ));
            }
        }
        let mut r = Registers {
            device_type,
            features,
            epoch: 0,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            driver_features_bad: false,
            queue_sel: 0,
            interrupt_status: 0,
            config_generation: 0,
            queues: Vec::new(),
            max_sizes: max_sizes.to_vec(),
            config,
            ignored_writes: 0,
            bad_accesses: 0,
            device_errors: 0,
            last_device_error: None,
        };
        r.reset_registers();
        Ok(r)
    }

    fn reset_registers(&mut self) {
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.driver_features_bad = false;
        self.queue_sel = 0;
        self.interrupt_status = 0;
        self.config_generation = 0;
        self.queues = self.max_sizes.iter().map(|&m| QueueRegs::new(m)).collect();
    }

    fn selected(&self) -> Option<usize> {
        let i = self.queue_sel as usize;
        (i < self.queues.len()).then_some(i)
    }

    /// A guest read of `out.len()` bytes at `offset`.
    pub fn read(&mut self, offset: u64, out: &mut [u8]) -> Read {
        let size = out.len() as u64;
        if offset >= CONFIG_SPACE {
            out.fill(0);
            if !matches!(size, 1 | 2 | 4 | 8) || offset + size > WINDOW_SIZE {
                self.bad_accesses += 1;
                return Read::Done;
            }
            let Some(cfg) = self.config.as_ref() else {
                return Read::Device;
            };
            let start = (offset - CONFIG_SPACE) as usize;
            if start < cfg.len() {
                let n = (cfg.len() - start).min(out.len());
                out[..n].copy_from_slice(&cfg[start..start + n]);
            }
            return Read::Done;
        }
        if size != 4 || !offset.is_multiple_of(4) {
            out.fill(0);
            self.bad_accesses += 1;
            return Read::Done;
        }
        out.copy_from_slice(&self.read_register(offset).to_le_bytes());
        Read::Done
    }

    fn read_register(&self, offset: u64) -> u32 {
        let q = self.selected().map(|i| self.queues[i]);
        match offset {
            REG_MAGIC => MAGIC,
            REG_VERSION => VERSION,
            REG_DEVICE_ID => self.device_type,
            REG_VENDOR_ID => VENDOR_ID,
            REG_DEVICE_FEATURES => {
                if self.device_features_sel > 1 {
                    0
                } else {
                    (self.features >> (32 * self.device_features_sel)) as u32
                }
            }
            REG_QUEUE_NUM_MAX => q.map_or(0, |q| q.max_size),
            REG_QUEUE_READY => q.map_or(0, |q| u32::from(q.ready)),
            REG_INTERRUPT_STATUS => self.interrupt_status,
            REG_STATUS => self.status,
            REG_CONFIG_GENERATION => self.config_generation,
            _ => 0,
        }
    }

    /// A guest write of `data` at `offset`; the events it caused are appended.
    pub fn write(&mut self, offset: u64, data: &[u8], events: &mut Vec<Event>) {
        let size = data.len() as u64;
        if offset >= CONFIG_SPACE {
            if !matches!(size, 1 | 2 | 4 | 8) || offset + size > WINDOW_SIZE {
                self.bad_accesses += 1;
                return;
            }
            // Plain config is read-only for every device we have: the write is dropped.
            if self.config.is_none() {
                events.push(Event::ConfigWrite(
                    (offset - CONFIG_SPACE) as u32,
                    data.to_vec(),
                ));
            }
            return;
        }
        if size != 4 || !offset.is_multiple_of(4) {
            self.bad_accesses += 1;
            return;
        }
        let value = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        if offset == REG_STATUS && value == 0 {
            self.epoch += 1;
            self.reset_registers();
            events.push(Event::Reset);
            return;
        }
        match offset {
            REG_DEVICE_FEATURES_SEL => self.device_features_sel = value,
            REG_DRIVER_FEATURES_SEL => self.driver_features_sel = value,
            REG_DRIVER_FEATURES => self.write_driver_features(value),
            REG_QUEUE_SEL => self.queue_sel = value,
            REG_QUEUE_NOTIFY => self.write_queue_notify(value, events),
            REG_INTERRUPT_ACK => self.interrupt_status &= !value,
            REG_STATUS => self.write_status(value, events),
            REG_QUEUE_NUM
            | REG_QUEUE_READY
            | REG_QUEUE_DESC_LOW
            | REG_QUEUE_DESC_HIGH
            | REG_QUEUE_DRIVER_LOW
            | REG_QUEUE_DRIVER_HIGH
            | REG_QUEUE_DEVICE_LOW
            | REG_QUEUE_DEVICE_HIGH => self.write_queue_register(offset, value, events),
            _ => self.ignored_writes += 1,
        }
    }

    fn write_driver_features(&mut self, value: u32) {
        if self.status & STATUS_DRIVER == 0 || self.status & STATUS_FEATURES_OK != 0 {
            self.ignored_writes += 1;
            return;
        }
        if self.driver_features_sel > 1 {
            if value != 0 {
                self.driver_features_bad = true;
            }
            return;
        }
        let shift = 32 * self.driver_features_sel;
        self.driver_features =
            (self.driver_features & !(0xFFFF_FFFFu64 << shift)) | (u64::from(value) << shift);
    }

    fn write_status(&mut self, value: u32, events: &mut Vec<Event>) {
        let current = self.status & DRIVER_STATUS_BITS;
        let mut wanted = value & DRIVER_STATUS_BITS;
        if value & STATUS_FAILED != 0 {
            self.status |= STATUS_FAILED;
        }
        if wanted == current {
            return;
        }
        if current & !wanted != 0 {
            self.ignored_writes += 1;
            return;
        }
        for (i, &bit) in STATUS_ORDER.iter().enumerate() {
            if wanted & bit != 0
                && current & bit == 0
                && STATUS_ORDER[..i].iter().any(|&b| wanted & b == 0)
            {
                self.ignored_writes += 1;
                return;
            }
        }
        if wanted & STATUS_FEATURES_OK != 0 && current & STATUS_FEATURES_OK == 0 {
            match self.features_refusal() {
                Some(reason) => {
                    events.push(Event::FeaturesRefused(reason));
                    wanted &= !(STATUS_FEATURES_OK | STATUS_DRIVER_OK);
                }
                None => events.push(Event::FeaturesOk(self.driver_features)),
            }
        }
        self.status = (self.status & !DRIVER_STATUS_BITS) | wanted;
        if wanted & STATUS_DRIVER_OK != 0
            && current & STATUS_DRIVER_OK == 0
            && self.status & STATUS_DEVICE_NEEDS_RESET == 0
        {
            events.push(Event::Activate(self.epoch));
        }
    }

    fn features_refusal(&self) -> Option<String> {
        let unoffered = self.driver_features & !self.features;
        if unoffered != 0 || self.driver_features_bad {
            return Some(format!(
                "driver accepted feature bits never offered ({unoffered:#x})"
            ));
        }
        if self.driver_features & VIRTIO_F_VERSION_1 == 0 {
            return Some(
                "driver did not accept VIRTIO_F_VERSION_1 (legacy is not supported)".into(),
            );
        }
        None
    }

    fn write_queue_register(&mut self, offset: u64, value: u32, events: &mut Vec<Event>) {
        let Some(i) = self.selected() else {
            self.ignored_writes += 1;
            return;
        };
        if self.status & STATUS_DRIVER_OK != 0 || self.status & STATUS_DRIVER == 0 {
            self.ignored_writes += 1;
            return;
        }
        if offset == REG_QUEUE_READY {
            match value {
                0 | 1 => self.queues[i].ready = value == 1,
                _ => self.ignored_writes += 1,
            }
            return;
        }
        if self.queues[i].ready {
            self.ignored_writes += 1;
            return;
        }
        let q = &mut self.queues[i];
        let low = 0xFFFF_FFFFu64;
        let high = low << 32;
        let v = u64::from(value);
        match offset {
            REG_QUEUE_NUM => {
                if !size_is_valid(value, q.max_size) {
                    let reason = format!(
                        "queue {} size {value} is not a power of 2 in 1..{}",
                        self.queue_sel, q.max_size
                    );
                    self.set_needs_reset(reason, events);
                    return;
                }
                q.size = value;
            }
            REG_QUEUE_DESC_LOW => q.desc = (q.desc & high) | v,
            REG_QUEUE_DESC_HIGH => q.desc = (q.desc & low) | (v << 32),
            REG_QUEUE_DRIVER_LOW => q.avail = (q.avail & high) | v,
            REG_QUEUE_DRIVER_HIGH => q.avail = (q.avail & low) | (v << 32),
            REG_QUEUE_DEVICE_LOW => q.used = (q.used & high) | v,
            REG_QUEUE_DEVICE_HIGH => q.used = (q.used & low) | (v << 32),
            _ => {}
        }
    }

    fn write_queue_notify(&mut self, index: u32, events: &mut Vec<Event>) {
        if index as usize >= self.queues.len() || !self.running() {
            self.ignored_writes += 1;
            return;
        }
        events.push(Event::Notify(index, self.epoch));
    }

    fn running(&self) -> bool {
        self.status & STATUS_DRIVER_OK != 0 && self.status & STATUS_DEVICE_NEEDS_RESET == 0
    }

    fn set_needs_reset(&mut self, reason: String, events: &mut Vec<Event>) {
        self.device_errors += 1;
        self.last_device_error = Some(reason.clone());
        self.status |= STATUS_DEVICE_NEEDS_RESET;
        self.interrupt_status |= INT_CONFIG_CHANGE;
        events.push(Event::NeedsReset(reason));
    }

    // -- the device side (Python threads) -----------------------------------------------

    /// The epoch if the device is running (DRIVER_OK, not NEEDS_RESET).
    pub fn running_epoch(&self) -> Option<u64> {
        self.running().then_some(self.epoch)
    }

    /// Set interrupt bits for a device of `epoch`; true if the interrupt is to be raised.
    pub fn raise(&mut self, bits: u32, epoch: u64) -> bool {
        if epoch != self.epoch {
            return false;
        }
        self.interrupt_status |= bits;
        true
    }

    pub fn failed_in(&self, epoch: u64) -> bool {
        epoch != self.epoch || self.status & STATUS_DEVICE_NEEDS_RESET != 0
    }

    /// A device error in `epoch`; true if it newly set NEEDS_RESET (raise the interrupt).
    pub fn device_error(&mut self, reason: String, epoch: u64) -> bool {
        if epoch != self.epoch || self.status & STATUS_DEVICE_NEEDS_RESET != 0 {
            return false;
        }
        let mut events = Vec::new();
        self.set_needs_reset(reason, &mut events);
        true
    }

    /// The device's config changed (now `config`): a new generation; true if the
    /// driver runs and so gets the configuration-change interrupt.
    pub fn config_changed(&mut self, config: Option<Vec<u8>>) -> bool {
        self.config = config;
        self.config_generation = self.config_generation.wrapping_add(1);
        if !self.running() {
            return false;
        }
        self.interrupt_status |= INT_CONFIG_CHANGE;
        true
    }

    /// The queues to activate for `epoch`, or None if it is stale or the device broken.
    pub fn activation(&self, epoch: u64) -> Option<Vec<QueueRegs>> {
        if epoch != self.epoch || self.status & STATUS_DEVICE_NEEDS_RESET != 0 {
            return None;
        }
        Some(self.queues.clone())
    }

    pub fn save(&self) -> Saved {
        Saved {
            status: self.status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            driver_features: self.driver_features,
            driver_features_bad: self.driver_features_bad,
            queue_sel: self.queue_sel,
            interrupt_status: self.interrupt_status,
            config_generation: self.config_generation,
            queues: self.queues.clone(),
        }
    }

    /// Load saved registers (a new epoch); returns the epoch and whether the device
    /// was live (to be re-activated). The queue count and max sizes must match.
    pub fn restore(&mut self, s: &Saved) -> Result<(u64, bool), String> {
        if s.queues.len() != self.max_sizes.len() {
            return Err(format!(
                "state has {} queues, device has {}",
                s.queues.len(),
                self.max_sizes.len()
            ));
        }
        for (q, &m) in s.queues.iter().zip(&self.max_sizes) {
            if q.max_size != m {
                return Err(format!(
                    "queue state has max size {}, this queue {m}",
                    q.max_size
                ));
            }
        }
        self.epoch += 1;
        self.reset_registers();
        self.status = s.status;
        self.device_features_sel = s.device_features_sel;
        self.driver_features_sel = s.driver_features_sel;
        self.driver_features = s.driver_features;
        self.driver_features_bad = s.driver_features_bad;
        self.queue_sel = s.queue_sel;
        self.interrupt_status = s.interrupt_status;
        self.config_generation = s.config_generation;
        self.queues = s.queues.clone();
        Ok((self.epoch, self.running()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(r: &mut Registers, offset: u64, value: u32) -> Vec<Event> {
        let mut ev = Vec::new();
        r.write(offset, &value.to_le_bytes(), &mut ev);
        ev
    }

    fn rd(r: &mut Registers, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        r.read(offset, &mut b);
        u32::from_le_bytes(b)
    }

    #[test]
    fn bring_up_activates_once_and_reset_clears() {
        let mut r = Registers::new(4, VIRTIO_F_VERSION_1, &[256], Some(vec![])).unwrap();
        assert_eq!(rd(&mut r, REG_MAGIC), MAGIC);
        w(&mut r, REG_STATUS, 1);
        w(&mut r, REG_STATUS, 3);
        w(&mut r, REG_DRIVER_FEATURES_SEL, 1);
        w(&mut r, REG_DRIVER_FEATURES, 1);
        assert_eq!(
            w(&mut r, REG_STATUS, 11),
            vec![Event::FeaturesOk(VIRTIO_F_VERSION_1)]
        );
        w(&mut r, REG_QUEUE_NUM, 16);
        w(&mut r, REG_QUEUE_READY, 1);
        assert_eq!(w(&mut r, REG_STATUS, 15), vec![Event::Activate(0)]);
        assert_eq!(w(&mut r, REG_QUEUE_NOTIFY, 0), vec![Event::Notify(0, 0)]);
        assert!(w(&mut r, REG_QUEUE_NOTIFY, 1).is_empty());
        assert_eq!(w(&mut r, REG_STATUS, 0), vec![Event::Reset]);
        assert_eq!((r.status, r.epoch, r.queues[0].ready), (0, 1, false));
    }

    #[test]
    fn bad_queue_size_needs_reset() {
        let mut r = Registers::new(4, VIRTIO_F_VERSION_1, &[256], None).unwrap();
        w(&mut r, REG_STATUS, 1);
        w(&mut r, REG_STATUS, 3);
        let ev = w(&mut r, REG_QUEUE_NUM, 3);
        assert_eq!(
            ev,
            vec![Event::NeedsReset(
                "queue 0 size 3 is not a power of 2 in 1..256".into()
            )]
        );
        assert_eq!(rd(&mut r, REG_INTERRUPT_STATUS), INT_CONFIG_CHANGE);
    }
}
