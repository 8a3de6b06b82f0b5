//! Transient conflicts, retried inside the call.
//!
//! A database that aborts a transaction instead of making it wait (a deadlock victim, a
//! PostgreSQL serialization failure, a Galera certification failure at `COMMIT` or a
//! brute-force abort by a write replicated from another node) says nothing about the call
//! itself: run again, it succeeds, or it finds the record its concurrent duplicate committed
//! and replays it. So the engine runs a try that met a conflict ([`Error::Conflict`]) again,
//! after a jittered backoff, up to [`MAX_CONFLICT_ATTEMPTS`] tries; only then does the caller
//! get the conflict (HTTP 503 with `Retry-After`, problem type `conflict`).
//!
//! What a try is depends on the mode. In atomic mode it is the whole call: claim, body and
//! record, all in one transaction that the conflict rolled back, so nothing of it remains. In
//! lease mode it is one of the engine's own short transactions (the claim, a step's record,
//! the completion, the release), never the body or a step's external effect.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::error::Error;
use crate::retry::{Backoff, Jitter};

/// How many times a call (atomic mode) or one of its lease transactions is tried by default
/// when each try meets a transient conflict ([`set_max_attempts`]).
pub const MAX_CONFLICT_ATTEMPTS: u32 = 8;

static MAX_ATTEMPTS: AtomicU32 = AtomicU32::new(MAX_CONFLICT_ATTEMPTS);

/// Sets how many times a try that meets a transient conflict is run in all (process-wide; at
/// least 1, which turns retrying off). Default [`MAX_CONFLICT_ATTEMPTS`]; with jittered backoff
/// of at most 4, 8, 16 … 200 ms between tries, the default waits at most 0.45 s in all.
pub fn set_max_attempts(attempts: u32) {
    MAX_ATTEMPTS.store(attempts.max(1), Ordering::Relaxed);
}

/// The `Retry-After` of a conflict that reached the caller.
pub use crate::retry::CONFLICT_RETRY_AFTER as RETRY_AFTER;

/// The bound of the wait before a conflict's retry: 4 ms, doubling with every try, at most
/// 200 ms; the wait is uniform below it (full jitter).
const BACKOFF: Backoff = Backoff {
    initial: Duration::from_millis(4),
    max: Duration::from_millis(200),
};

/// The tries of one call (or of one lease transaction): counts them and sleeps between them.
#[derive(Debug)]
pub(crate) struct Tries {
    attempts: u32,
}

impl Tries {
    pub(crate) const fn new() -> Self {
        Self { attempts: 1 }
    }

    /// How many tries were made.
    pub(crate) const fn tried(&self) -> u32 {
        self.attempts
    }

    /// After a try that failed with `error`: `Ok` once the backoff has passed if the error is
    /// a conflict with tries left, or the error to give up with (a conflict carries the scope
    /// and the number of tries).
    pub(crate) async fn again(&mut self, scope: &str, error: Error) -> Result<(), Error> {
        let Error::Conflict { message, .. } = &error else {
            return Err(error);
        };
        if self.attempts >= MAX_ATTEMPTS.load(Ordering::Relaxed) {
            return Err(named(scope, error, self.attempts));
        }
        tracing::debug!(
            scope,
            attempt = self.attempts,
            conflict = %message,
            "transient conflict; trying again"
        );
        crate::metrics::conflict_retry(scope);
        crate::call::outcome::note_conflict_retry();
        tokio::time::sleep(backoff(self.attempts)).await;
        self.attempts += 1;
        Ok(())
    }
}

/// A conflict as the caller gets it: with the call's scope and the tries it took, at least
/// `attempts` (a store reports one try, before it knows the scope; a conflict named already
/// keeps its larger count). Other errors are handed back as they are.
pub(crate) fn named(scope: &str, error: Error, attempts: u32) -> Error {
    match error {
        Error::Conflict {
            message,
            retry_after,
            attempts: counted,
            ..
        } => Error::Conflict {
            scope: scope.to_owned(),
            message,
            attempts: attempts.max(counted),
            retry_after,
        },
        other => other,
    }
}

/// "Full jitter": a uniform wait below a bound that doubles with every try, so the tries of
/// concurrent duplicates spread out instead of meeting again.
fn backoff(attempt: u32) -> Duration {
    BACKOFF.jittered(attempt, Jitter::Full)
}

/// Runs `tx` (one of lease mode's short transactions) until it succeeds, fails otherwise
/// than by a conflict, or has met [`MAX_CONFLICT_ATTEMPTS`] conflicts.
pub(crate) async fn retried<T, F, Fut>(scope: &str, mut tx: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let mut tries = Tries::new();
    loop {
        match tx().await {
            Ok(value) => return Ok(value),
            Err(e) => tries.again(scope, e).await?,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_stays_under_its_doubling_bound_and_the_cap() {
        for attempt in 1..20 {
            // 4 ms doubling per try, at most 200 ms.
            let bound = Duration::from_millis(4)
                .saturating_mul(1 << (attempt.min(16) - 1))
                .min(Duration::from_millis(200));
            for _ in 0..50 {
                assert!(backoff(attempt) <= bound, "attempt {attempt}");
            }
        }
        let spread: std::collections::HashSet<Duration> = (0..50).map(|_| backoff(5)).collect();
        assert!(spread.len() > 10, "jittered: {spread:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn conflicts_are_tried_again_up_to_the_bound_and_then_named() {
        let mut calls = 0;
        let result: Result<(), Error> = retried("s", || {
            calls += 1;
            async { Err(Error::conflict("committing")) }
        })
        .await;
        assert_eq!(calls, MAX_CONFLICT_ATTEMPTS);
        match result {
            Err(Error::Conflict {
                scope, attempts, ..
            }) => assert_eq!((scope.as_str(), attempts), ("s", MAX_CONFLICT_ATTEMPTS)),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn other_errors_and_successes_end_at_once() {
        let mut calls = 0;
        let result: Result<u8, Error> = retried("s", || {
            calls += 1;
            let call = calls;
            async move {
                if call < 3 {
                    Err(Error::conflict("claiming"))
                } else {
                    Ok(7)
                }
            }
        })
        .await;
        assert_eq!((result.ok(), calls), (Some(7), 3));
        let mut calls = 0;
        let result: Result<u8, Error> = retried("s", || {
            calls += 1;
            async { Err(Error::MissingKey) }
        })
        .await;
        assert!(matches!(result, Err(Error::MissingKey)));
        assert_eq!(calls, 1);
    }
}
