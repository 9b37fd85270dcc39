//! A budget for a log whose lines the guest decides (COM1's console log): the rules
//! of `vmfork.vmm.bounded.LogBudget`, word for word, so a guest that prints without
//! end can neither fill the host's disk (or the tmpfs of a run directory: RAM) nor
//! drown the lines around its flood.
//!
//! A token bucket of `burst` lines refilled at `per_second` decides whether one more
//! line may be written; lines over it are dropped and, when writing resumes, a marker
//! line says how many. Once `total_bytes` (markers included) would be passed, one
//! final notice is written and every later line is dropped.

use std::time::Instant;

pub struct LogBudget {
    what: &'static str,
    burst: f64,
    per_second: f64,
    total_bytes: u64,
    tokens: f64,
    stamp: Instant,
    written: u64,
    /// Lines dropped so far, for the rate or the cap.
    pub dropped: u64,
    unreported: u64,
    exhausted: bool,
}

impl LogBudget {
    pub fn new(what: &'static str, burst: u32, per_second: f64, total_bytes: u64) -> Self {
        LogBudget {
            what,
            burst: f64::from(burst),
            per_second,
            total_bytes,
            tokens: f64::from(burst),
            stamp: Instant::now(),
            written: 0,
            dropped: 0,
            unreported: 0,
            exhausted: false,
        }
    }

    /// Whether a line of `size` bytes may be written now, and a line to write
    /// before it (a drop marker, or the final truncation notice) if there is one.
    pub fn take(&mut self, size: usize) -> (bool, Option<String>) {
        self.take_at(size, Instant::now())
    }

    fn take_at(&mut self, size: usize, now: Instant) -> (bool, Option<String>) {
        if self.exhausted {
            self.dropped += 1;
            return (false, None);
        }
        let elapsed = now.saturating_duration_since(self.stamp).as_secs_f64();
        self.tokens = self.burst.min(self.tokens + elapsed * self.per_second);
        self.stamp = now;
        let mut size = size as u64;
        if self.written + size > self.total_bytes {
            self.exhausted = true;
            self.dropped += 1;
            return (
                false,
                Some(format!(
                    "[vmfork: {} truncated here: it reached its {} byte limit; \
                     later lines are dropped]",
                    self.what, self.total_bytes
                )),
            );
        }
        if self.tokens < 1.0 {
            self.dropped += 1;
            self.unreported += 1;
            return (false, None);
        }
        let mut marker = None;
        if self.unreported > 0 {
            let text = format!(
                "[vmfork: {} {} lines dropped: more than {} lines/s]",
                self.unreported, self.what, self.per_second
            );
            let with_marker = size + text.len() as u64 + 1;
            // Past the cap with it: the truncation notice says it, next time.
            if self.written + with_marker <= self.total_bytes {
                self.unreported = 0;
                size = with_marker; // markers count against the cap too
                marker = Some(text);
            }
        }
        self.tokens -= 1.0;
        self.written += size;
        (true, marker)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_then_drops_then_a_marker_once_refilled() {
        let mut b = LogBudget::new("console", 3, 10.0, 1 << 20);
        let t0 = b.stamp;
        for _ in 0..3 {
            assert_eq!(b.take_at(10, t0), (true, None));
        }
        assert_eq!(b.take_at(10, t0), (false, None));
        assert_eq!(b.take_at(10, t0), (false, None));
        assert_eq!(b.dropped, 2);
        // 0.1 s at 10 lines/s: one token.
        let (allowed, marker) = b.take_at(10, t0 + Duration::from_millis(100));
        assert!(allowed);
        assert_eq!(
            marker.as_deref(),
            Some("[vmfork: 2 console lines dropped: more than 10 lines/s]")
        );
        assert_eq!(
            b.take_at(10, t0 + Duration::from_millis(100)),
            (false, None)
        );
    }

    #[test]
    fn the_cap_ends_the_log_with_one_notice() {
        let mut b = LogBudget::new("console", 100, 1000.0, 25);
        let t0 = b.stamp;
        assert_eq!(b.take_at(10, t0), (true, None));
        assert_eq!(b.take_at(10, t0), (true, None));
        let (allowed, marker) = b.take_at(10, t0);
        assert!(!allowed);
        assert_eq!(
            marker.as_deref(),
            Some("[vmfork: console truncated here: it reached its 25 byte limit; later lines are dropped]")
        );
        // Refilled or not, nothing more, and no second notice.
        assert_eq!(b.take_at(1, t0 + Duration::from_secs(60)), (false, None));
        assert_eq!(b.dropped, 2);
    }

    #[test]
    fn a_marker_that_would_pass_the_cap_waits_for_the_notice() {
        let mut b = LogBudget::new("console", 1, 1.0, 60);
        let t0 = b.stamp;
        assert_eq!(b.take_at(10, t0), (true, None));
        assert_eq!(b.take_at(10, t0), (false, None));
        // The marker (~50 bytes) plus 10 would pass 60: the line goes, the marker waits.
        assert_eq!(b.take_at(10, t0 + Duration::from_secs(1)), (true, None));
        let (allowed, marker) = b.take_at(50, t0 + Duration::from_secs(2));
        assert!(!allowed);
        assert!(marker.unwrap().contains("truncated here"));
    }

    #[test]
    fn the_rate_in_the_marker_reads_as_python_prints_it() {
        let mut b = LogBudget::new("console", 1, 0.5, 1 << 20);
        let t0 = b.stamp;
        assert!(b.take_at(1, t0).0);
        assert!(!b.take_at(1, t0).0);
        let (_, marker) = b.take_at(1, t0 + Duration::from_secs(2));
        assert_eq!(
            marker.as_deref(),
            Some("[vmfork: 1 console lines dropped: more than 0.5 lines/s]")
        );
    }
}
