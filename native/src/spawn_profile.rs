//! `runtime/spawnprofile.py`'s phase record, kept by a child that runs no Python
//! (`native_fork.rs`, `child_life.rs`): the same `spawn-profile.json` (each phase's
//! end as the monotonic clock, the main thread's and the process's CPU time), under
//! the same phase names where the two children do the same step, so that
//! `bench/spawn.py --phases` and `bench/spawn_profile.py` read both children alike.
//!
//! Off unless the zygote runs with `VMFORK_SPAWN_PROFILE` (the plan then carries a
//! `SpawnProfile`); a mark costs two `clock_gettime`s and a push into a vector of
//! at most `MAX_MARKS`, allocated at the first mark, in the child.

use std::ffi::CString;
use std::sync::Mutex;

use crate::child_report::replace_file;

/// More marks than a life makes (it makes 27 with a jail's): the rest are dropped.
const MAX_MARKS: usize = 32;

struct Mark {
    phase: &'static str,
    mono_ns: i64,
    thread_cpu_ns: i64,
    process_cpu_ns: i64,
}

pub(crate) fn clock_ns(clock: libc::clockid_t) -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a live timespec; the clocks asked for always exist.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

/// One child's marks and where they go (`<run_dir>/spawn-profile.json`).
pub struct SpawnProfile {
    tmp: CString,
    path: CString,
    marks: Mutex<Vec<Mark>>,
}

impl SpawnProfile {
    /// The record of the child whose run directory is `run_dir`.
    pub fn at(run_dir: &str) -> Result<Self, String> {
        let dir = run_dir.trim_end_matches('/');
        let c = |path: String| CString::new(path).map_err(|_| format!("a NUL byte in {dir:?}"));
        Ok(SpawnProfile {
            tmp: c(format!("{dir}/.spawn-profile.json.tmp"))?,
            path: c(format!("{dir}/spawn-profile.json"))?,
            marks: Mutex::new(Vec::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Mark>> {
        self.marks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `spawnprofile.start`: the zygote's clock just before the fork (`forked_ns`,
    /// CPU times 0: the child's clocks start at the fork), then the child's first mark.
    pub fn start(&self, forked_ns: i64) {
        let mut marks = self.lock();
        marks.clear();
        marks.reserve(MAX_MARKS);
        marks.push(Mark {
            phase: "fork",
            mono_ns: forked_ns,
            thread_cpu_ns: 0,
            process_cpu_ns: 0,
        });
        drop(marks);
        self.mark("forked");
    }

    /// The end of `phase`: the clocks now.
    pub fn mark(&self, phase: &'static str) {
        let mark = Mark {
            phase,
            mono_ns: clock_ns(libc::CLOCK_MONOTONIC),
            thread_cpu_ns: clock_ns(libc::CLOCK_THREAD_CPUTIME_ID),
            process_cpu_ns: clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID),
        };
        let mut marks = self.lock();
        if marks.len() < MAX_MARKS {
            marks.push(mark);
        }
    }

    /// `spawnprofile.finish`: a last mark, then the record written whole (renamed into
    /// place); a failure is a line on stderr: a probe never fails what it measures.
    pub fn finish(&self) {
        self.mark("finished");
        let marks: Vec<String> = self
            .lock()
            .iter()
            .map(|m| {
                format!(
                    "{{\"phase\": \"{}\", \"mono_ns\": {}, \"thread_cpu_ns\": {}, \
                     \"process_cpu_ns\": {}}}",
                    m.phase, m.mono_ns, m.thread_cpu_ns, m.process_cpu_ns
                )
            })
            .collect();
        let json = format!("{{\"marks\": [{}]}}", marks.join(", "));
        if let Err(err) = replace_file(&self.tmp, &self.path, json.as_bytes()) {
            let line = format!("vmfork spawnprofile: not written: {err}\n");
            // SAFETY: fd 2 borrowed for one write of a live buffer.
            unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_is_spawnprofiles_marks_in_order() {
        let dir = std::env::temp_dir().join(format!("vmfork-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let profile = SpawnProfile::at(dir.to_str().expect("UTF-8")).expect("paths");
        profile.start(1);
        profile.mark("set_up");
        for _ in 0..2 * MAX_MARKS {
            profile.mark("again");
        }
        profile.finish();
        let text = std::fs::read_to_string(dir.join("spawn-profile.json")).expect("written");
        let record: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        let marks = record["marks"].as_array().expect("marks");
        assert_eq!(marks.len(), MAX_MARKS, "bounded");
        assert_eq!(marks[0]["phase"], "fork");
        assert_eq!(marks[0]["mono_ns"], 1);
        assert_eq!(marks[1]["phase"], "forked");
        assert_eq!(marks[2]["phase"], "set_up");
        assert!(marks[2]["mono_ns"].as_i64() >= marks[1]["mono_ns"].as_i64());
        assert!(marks[2]["thread_cpu_ns"].as_i64() > Some(0));
        std::fs::remove_dir_all(&dir).expect("removed");
    }
}
