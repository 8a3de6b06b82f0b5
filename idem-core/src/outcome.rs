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
    TRACKER
        .scope(Tracker::default(), async move {
            let value = future.await;
            let outcome = TRACKER.with(|t| t.outcome.get());
            (value, outcome)
        })
        .await
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
