//! Guest RAM as the native device code sees it: the host addresses of the regions
//! that Python mapped (and still owns and unmaps), with every access checked to lie
//! wholly inside one region, exactly as `GuestMemory._find` checks it.
//!
//! Why not `vm-memory`'s `GuestMemoryMmap`: Python owns the mappings (anonymous,
//! memfd, a snapshot file `MAP_PRIVATE` with a chain's layer files `MAP_FIXED` over
//! it) and unmaps them; wrapping them would take `MmapRegion::build_raw` (as
//! unsafe as this) and bring a bitmap and a `GuestAddress` space for what is, here,
//! three checks and a copy. The one thing `vm-memory` would add, volatile slices, is
//! the rule below, stated once.
//!
//! The guest writes its RAM while we read it (vCPUs run concurrently). Every read
//! copies bytes out with `copy_nonoverlapping` into memory of ours before anything
//! interprets them (each field is read once, so there is no check-then-use window),
//! and every byte pattern is a valid `u8`, so a racing guest can make us read
//! garbage, never make us misbehave. Writes copy in the same way.
//!
//! Lifetime: `close()` (which Python's `GuestMemory.close` calls before it unmaps)
//! takes the write side of the lock and forgets the regions; every access holds the
//! read side for its whole length, so no access can outlive a mapping.

use std::sync::{RwLock, RwLockReadGuard};

#[derive(Clone, Copy, Debug)]
pub struct Region {
    pub gpa: u64,
    pub size: u64,
    pub host: usize,
}

#[derive(Debug, PartialEq, Eq)]
pub enum RamError {
    /// The message `GuestMemory` gives for the same range, so both paths read alike.
    OutOfRange(String),
    Closed,
}

impl std::fmt::Display for RamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RamError::OutOfRange(m) => f.write_str(m),
            RamError::Closed => f.write_str("guest memory is closed"),
        }
    }
}

pub struct GuestRam {
    regions: RwLock<Vec<Region>>,
}

/// A locked view: the regions cannot go away while it lives.
pub struct Ram<'a> {
    regions: RwLockReadGuard<'a, Vec<Region>>,
}

impl GuestRam {
    /// # Safety
    /// Each region's `host..host + size` must be a readable and writable mapping that
    /// stays mapped until `close()` returns (Python calls it before it unmaps).
    pub unsafe fn new(mut regions: Vec<Region>) -> Self {
        regions.sort_by_key(|r| r.gpa);
        GuestRam {
            regions: RwLock::new(regions),
        }
    }

    pub fn close(&self) {
        self.regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    pub fn lock(&self) -> Result<Ram<'_>, RamError> {
        let regions = self.regions.read().unwrap_or_else(|p| p.into_inner());
        if regions.is_empty() {
            return Err(RamError::Closed);
        }
        Ok(Ram { regions })
    }
}

impl Ram<'_> {
    /// The host address of `gpa..gpa + len`, which must lie inside one region.
    /// A zero-length range still needs `gpa` inside a region (as in Python).
    pub fn host(&self, gpa: u64, len: u64) -> Result<*mut u8, RamError> {
        for r in self.regions.iter() {
            let end = r.gpa + r.size;
            if r.gpa <= gpa && gpa < end {
                if len > end - gpa {
                    return Err(RamError::OutOfRange(format!(
                        "guest range {gpa:#x}+{len:#x} crosses the end of RAM region \
                         {:#x}..{end:#x}",
                        r.gpa
                    )));
                }
                return Ok((r.host + (gpa - r.gpa) as usize) as *mut u8);
            }
        }
        Err(RamError::OutOfRange(format!(
            "guest address {gpa:#x} is not in guest RAM"
        )))
    }

    /// The region `gpa` lies in, if any.
    pub fn region_containing(&self, gpa: u64) -> Option<Region> {
        self.regions
            .iter()
            .find(|r| r.gpa <= gpa && gpa - r.gpa < r.size)
            .copied()
    }

    pub fn check(&self, gpa: u64, len: u64) -> Result<(), RamError> {
        self.host(gpa, len).map(|_| ())
    }

    pub fn read_into(&self, gpa: u64, out: &mut [u8]) -> Result<(), RamError> {
        let src = self.host(gpa, out.len() as u64)?;
        // SAFETY: `host` checked that `src..src + out.len()` lies in one region, which
        // stays mapped while `self` holds the read lock; `out` is ours and cannot
        // overlap guest RAM. The guest may write the bytes meanwhile (see the module
        // comment): we copy them once and interpret only our copy.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    pub fn write_from(&self, gpa: u64, data: &[u8]) -> Result<(), RamError> {
        let dst = self.host(gpa, data.len() as u64)?;
        // SAFETY: as in `read_into`, with the roles swapped; `data` is ours.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    pub fn read_u16(&self, gpa: u64) -> Result<u16, RamError> {
        let mut b = [0u8; 2];
        self.read_into(gpa, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    #[cfg(test)]
    pub fn read_u32(&self, gpa: u64) -> Result<u32, RamError> {
        let mut b = [0u8; 4];
        self.read_into(gpa, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    pub fn write_u16(&self, gpa: u64, v: u16) -> Result<(), RamError> {
        self.write_from(gpa, &v.to_le_bytes())
    }

    #[cfg(test)]
    pub fn write_u32(&self, gpa: u64, v: u32) -> Result<(), RamError> {
        self.write_from(gpa, &v.to_le_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked_against_one_region() {
        let mut low = vec![0u8; 0x1000];
        let mut high = vec![0u8; 0x1000];
        // SAFETY: both vectors outlive `ram` in this test.
        let ram = unsafe {
            GuestRam::new(vec![
                Region {
                    gpa: 0x2000,
                    size: 0x1000,
                    host: high.as_mut_ptr() as usize,
                },
                Region {
                    gpa: 0,
                    size: 0x1000,
                    host: low.as_mut_ptr() as usize,
                },
            ])
        };
        let r = ram.lock().unwrap();
        assert!(r.check(0, 0x1000).is_ok());
        assert!(r.check(0xFFF, 2).is_err());
        assert!(r.check(0x1000, 0).is_err()); // the hole
        assert!(r.check(0x2FFF, 1).is_ok());
        assert!(r.check(u64::MAX, 1).is_err());
        assert!(r.check(0x2000, u64::MAX).is_err());
        r.write_u32(0x2004, 0xdead_beef).unwrap();
        assert_eq!(r.read_u32(0x2004).unwrap(), 0xdead_beef);
        drop(r);
        ram.close();
        assert_eq!(ram.lock().err(), Some(RamError::Closed));
    }
}
