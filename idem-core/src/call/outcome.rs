//! Telling a first execution from a replay, without changing the handler's return type.

use std::cell::Cell;
use std::future::Future;

/// How an idempotent call was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use]
pub enum Outcome {
    /// The handler ran and its result (or final error) was recorded now.
    Executed,
    /// A recorded result (or final error) was returned; the handler did not run.
    Replayed,
}

impl Outcome {
    /// `true` for [`Outcome::Replayed`].
    pub const fn is_replayed(self) -> bool {
        matches!(self, Self::Replayed)
    }
}

#[derive(Debug, Default)]
struct Tracker {
    depth: Cell<u32>,
    outcome: Cell<Option<Outcome>>,
    conflict_retries: Cell<u32>,
}

/// What [`with_report`] found out about the idempotent calls inside its future.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CallReport {
    /// How the first (outermost) call was answered, as [`with_outcome`] reports it.
    pub outcome: Option<Outcome>,
    /// How many tries were run again after a transient database conflict
    /// ([`conflict`](crate::retry::conflict)), over every call inside the future.
    pub conflict_retries: u32,
}

tokio::task_local! {
    static TRACKER: Tracker;
}

/// Runs `future` and reports how the first (outermost) idempotent call inside it was
/// answered. `None` when no idempotent call answered (for example, it failed before its
/// claim).
///
/// ```
/// # async fn demo() {
/// let (value, outcome) = idem_core::with_outcome(async { 42 }).await;
/// assert_eq!((value, outcome), (42, None));
/// # }
/// ```
pub async fn with_outcome<F: Future>(future: F) -> (F::Output, Option<Outcome>) {
    let (value, report) = with_report(future).await;
    (value, report.outcome)
}

/// Runs `future` and reports, beside its outcome, how many tries its idempotent calls ran
/// again after transient database conflicts: what contention cost them.
pub async fn with_report<F: Future>(future: F) -> (F::Output, CallReport) {
    TRACKER
        .scope(Tracker::default(), async move {
            let value = future.await;
            let report = TRACKER.with(|t| CallReport {
                outcome: t.outcome.get(),
                conflict_retries: t.conflict_retries.get(),
            });
            (value, report)
        })
        .await
}

/// Counts a try run again after a conflict.
pub(crate) fn note_conflict_retry() {
    let _ = TRACKER.try_with(|t| t.conflict_retries.set(t.conflict_retries.get() + 1));
}

/// Records `outcome` if no outer call is running in this task.
pub(crate) fn report(outcome: Outcome) {
    let _ = TRACKER.try_with(|t| {
        if t.depth.get() == 0 && t.outcome.get().is_none() {
            t.outcome.set(Some(outcome));
        }
    });
}

/// A handler body in progress: calls nested in it do not report until it is dropped, when
/// the body finishes or the call is cancelled (a cancelled call must not leave the depth
/// raised, or no later call in the same `with_outcome` would report).
#[derive(Debug)]
pub(crate) struct Nested(());

impl Nested {
    /// Enters a handler body.
    pub(crate) fn enter() -> Self {
        nest(true);
        Self(())
    }
}

impl Drop for Nested {
    fn drop(&mut self) {
        nest(false);
    }
}

/// Marks the start (`+1`) or end (`-1`) of a handler body, so nested calls do not report.
fn nest(enter: bool) {
    let _ = TRACKER.try_with(|t| {
        let depth = t.depth.get();
        t.depth.set(if enter {
            depth + 1
        } else {
            depth.saturating_sub(1)
        });
    });
}
