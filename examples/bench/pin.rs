//! Pinning the bench to one CPU, for figures that measure work rather than this VM's wake-ups.
//!
//! On this VM a thread woken on the other, idle vCPU costs tens of µs in some stretches and
//! not in others (docs/BENCHMARKS.md, round 4), so a figure that crosses threads for every
//! statement swings with it. On one CPU the same work measures the same.

use std::process::{Command, Stdio};

/// Every thread of this process on the first CPU while it lives (`taskset`, util-linux); the
/// mask it found is restored on drop, and threads started meanwhile keep the pin.
pub(crate) struct Pinned {
    pid: String,
    mask: String,
}

impl Pinned {
    pub(crate) fn to_one_cpu() -> Option<Self> {
        let pid = std::process::id().to_string();
        let out = Command::new("taskset").args(["-p", &pid]).output().ok()?;
        // "pid 123's current affinity mask: 3"
        let mask = String::from_utf8(out.stdout).ok()?;
        let mask = mask.rsplit(':').next()?.trim().to_owned();
        let pinned = Command::new("taskset")
            .args(["-a", "-p", "1", &pid])
            .stdout(Stdio::null())
            .status()
            .ok()?
            .success();
        pinned.then_some(Self { pid, mask })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = Command::new("taskset")
            .args(["-a", "-p", &self.mask, &self.pid])
            .stdout(Stdio::null())
            .status();
    }
}
