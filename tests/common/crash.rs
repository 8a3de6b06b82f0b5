//! Child processes that die on purpose: how a child kills itself with SIGKILL, and how its
//! parent reads the way it ended (lease crash tests, R14, the outbox's fault tests).

/// The exit code of a child whose call returned an error before any kill point.
pub const CHILD_CALL_FAILED: i32 = 3;

/// Kills this process with SIGKILL (abort if the signal does not land).
pub fn kill_self() -> ! {
    let _ = std::process::Command::new("kill")
        .args(["-9", &std::process::id().to_string()])
        .status();
    std::process::abort()
}

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ChildEnd {
    /// Killed: at its kill point, or by the parent.
    Killed,
    /// Its call returned an error before any kill point.
    CallFailed,
    /// Its call returned an answer (a random kill that came too late).
    Finished,
    /// Any other exit: the child itself broke (a panic exits with 101).
    Broke(i32),
    /// Still running past its parent's bound: killed as hung.
    Hung,
}

impl ChildEnd {
    /// The end an exit status says.
    pub fn of(status: std::process::ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        match (status.signal(), status.code()) {
            // SIGKILL, or SIGABRT after a `kill -9` that did not land.
            (Some(_), _) => Self::Killed,
            (_, Some(0)) => Self::Finished,
            (_, Some(CHILD_CALL_FAILED)) => Self::CallFailed,
            (_, code) => Self::Broke(code.unwrap_or(-1)),
        }
    }
}
