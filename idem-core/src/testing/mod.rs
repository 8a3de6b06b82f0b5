//! Tests of a service that uses idem: switching idem off ([`run_disabled`], [`disable`]),
//! and crash-testing its handlers ([`CrashTest`]: one run per crash point idem has, each
//! finished by a retry or a completer, its effects counted).
//!
//! # Switching idem off
//!
//! A test of a handler's business logic sometimes wants idem out of the way: every call runs
//! its body, nothing is claimed, recorded or replayed. Three ways, narrowest first:
//!
//! - [`run_disabled`]: for the calls inside one future (one test; parallel tests unaffected);
//! - [`disable`] / [`enable`]: for the whole process, from now on;
//! - the environment variable `IDEM_DISABLED=1` (or `true`), read once, when the first call
//!   asks: for a whole test run.
//!
//! Switched off, an atomic-mode body still runs in a transaction of its store (`db` keeps
//! its type; `Ok` commits, `Err` rolls back), and a lease-mode body runs under a lease of a
//! fresh in-memory store, so `idem::step` and the final phase work and nothing is
//! remembered. No ledger table is needed. A retry runs the body again: this is for tests
//! only, and the first call that runs switched off logs a WARN saying so, once per process,
//! so a switch left on in production cannot go unseen.

#[doc(hidden)]
pub mod crash_points;
mod harness;

pub use crash_points::{CrashPoint, Reached};
pub use harness::{
    CrashReport, CrashRun, CrashTest, DEFAULT_CALL_TIMEOUT, Finisher, NoCompleter, Scenario,
    WithCompleter,
};

use std::future::Future;
use std::sync::Once;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

/// The environment variable that switches idem off for the process (`1` or `true`).
pub const DISABLED_ENV: &str = "IDEM_DISABLED";

/// What [`disable`] / [`enable`] last said: 0 nothing (the environment decides), 1 off, 2 on.
static SWITCH: AtomicU8 = AtomicU8::new(0);

tokio::task_local! {
    static SCOPED: ();
}

/// Switches idem off for the whole process: from now on every `#[idempotent]` call runs its
/// body without claiming, recording or replaying. For tests; see the [module](self) docs.
pub fn disable() {
    SWITCH.store(1, Ordering::SeqCst);
}

/// Switches idem back on for the whole process, whatever `IDEM_DISABLED` says.
pub fn enable() {
    SWITCH.store(2, Ordering::SeqCst);
}

/// Runs `future` with idem switched off for the calls inside it (in this task), and only
/// them: tests running in parallel keep idem on.
pub async fn run_disabled<F: Future>(future: F) -> F::Output {
    SCOPED.scope((), future).await
}

/// Whether a call starting now in this task runs with idem switched off. The first time it
/// answers `true` it logs a WARN, once per process.
pub fn is_disabled() -> bool {
    let disabled = SCOPED.try_with(|()| ()).is_ok()
        || match SWITCH.load(Ordering::SeqCst) {
            1 => true,
            2 => false,
            _ => from_env(),
        };
    if disabled {
        static WARNED: Once = Once::new();
        WARNED.call_once(|| {
            tracing::warn!(
                "idem is switched off (IDEM_DISABLED, idem::testing::disable or run_disabled): \
                 handlers run without claims and retries run their bodies again; \
                 for tests only, never in production"
            );
        });
    }
    disabled
}

/// `IDEM_DISABLED`, read once.
fn from_env() -> bool {
    static FROM_ENV: OnceLock<bool> = OnceLock::new();
    *FROM_ENV.get_or_init(|| {
        std::env::var(DISABLED_ENV)
            .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn off_only_inside_run_disabled_unless_switched() {
        // The unit tests of this crate never set IDEM_DISABLED nor call disable().
        assert!(
            !is_disabled(),
            "idem is on unless something switched it off"
        );
        assert!(run_disabled(async { is_disabled() }).await);
        assert!(!is_disabled(), "the scope ends with its future");
    }
}
