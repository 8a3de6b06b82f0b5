//! The places where idem's engine and stores let a crash test kill a call: the crash points.
//!
//! A [`CrashTest`](super::CrashTest) runs a call under a plan (a task-local): each point
//! the call reaches is counted, and the one the plan names "crashes" the process there. A
//! crash parks the call forever ([`reach`]), and the harness drops it, as a process that
//! dies stops between two statements: open transactions roll back, a lease is left to end.
//! Inside a store's step that finishes on its own task once dropped ([`detached`](crate::detached)),
//! parking would leave that transaction open for ever, so there the point fails the step
//! instead ([`fault`]) and its transaction is dropped uncommitted; the harness drops the call
//! at once too.
//!
//! With no crash test running in the process, a point costs one relaxed atomic load.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::Error;
use crate::ledger::BoxFuture;

/// Ends the lease of a call that crashed holding it: the harness runs it, as the lease's
/// end would (lease mode builds it around its store, which this file does not name, so that
/// the stores' own crash points build on it).
pub(crate) type EndLease = Arc<dyn Fn() -> BoxFuture<'static, Result<(), Error>> + Send + Sync>;

/// A point of a call where idem lets a crash test kill it. Atomic mode has three; lease mode
/// has three around each recorded step ([`step`](crate::lease::step)) and each final step
/// (`final_step`/`finish`), and three of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CrashPoint {
    /// Atomic mode: the key is claimed in the open transaction; the body has not run.
    AfterClaim,
    /// Atomic mode: the body returned; its answer is not recorded yet.
    BeforeRecord,
    /// Atomic mode: the answer is written in the transaction, which has not committed.
    BeforeCommit,
    /// Lease mode: the lease's claim committed; the body has not run.
    AfterLeaseClaim,
    /// Lease mode: a recorded step is about to run its effect.
    BeforeStep,
    /// Lease mode: a step's effect ran; its value is not recorded yet. Only the step's
    /// derived key, deduplicated downstream, keeps the next holder from doing it twice.
    StepNotRecorded,
    /// Lease mode: a step's value is recorded; the body has not gone on.
    AfterStep,
    /// Lease mode: a final step is about to begin its transaction.
    BeforeFinalStep,
    /// Lease mode: a final step's writes and its record are in its transaction, which has
    /// not committed (nor been kept open for the answer).
    FinalStepBeforeCommit,
    /// Lease mode: a final step committed (or was kept open for the answer, which a crash
    /// rolls back); the body has not gone on.
    AfterFinalStep,
    /// Lease mode: the body returned; its answer is not recorded yet.
    BeforeLeaseRecord,
    /// Lease mode: the answer is written in the final phase's transaction kept open
    /// (`finish`), which has not committed.
    BeforeLeaseCommit,
}

impl CrashPoint {
    /// Whether the point is lease mode's.
    pub const fn is_lease(self) -> bool {
        !matches!(
            self,
            Self::AfterClaim | Self::BeforeRecord | Self::BeforeCommit
        )
    }

    /// What the call had done when it crashed there.
    pub const fn describe(self) -> &'static str {
        match self {
            Self::AfterClaim => "after the claim, before the body",
            Self::BeforeRecord => "after the body, before the record",
            Self::BeforeCommit => "after the record, before the commit",
            Self::AfterLeaseClaim => "after the lease's claim, before the body",
            Self::BeforeStep => "before the step ran",
            Self::StepNotRecorded => "after the step ran, before it was recorded",
            Self::AfterStep => "after the step was recorded",
            Self::BeforeFinalStep => "before the final step's transaction",
            Self::FinalStepBeforeCommit => "after the final step's writes, before its commit",
            Self::AfterFinalStep => "after the final step's commit",
            Self::BeforeLeaseRecord => "after the body, before the record",
            Self::BeforeLeaseCommit => "after the record in the final phase, before its commit",
        }
    }
}

/// A crash point as one call reached it: which point, and in which step.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Reached {
    /// The point.
    pub point: CrashPoint,
    /// The step (or final step) it is in, by name.
    pub step: Option<String>,
}

impl fmt::Display for Reached {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = if self.point.is_lease() {
            "lease"
        } else {
            "atomic"
        };
        match (&self.step, self.point) {
            (
                Some(step),
                CrashPoint::BeforeFinalStep
                | CrashPoint::FinalStepBeforeCommit
                | CrashPoint::AfterFinalStep,
            ) => write!(f, "{mode}: final step `{step}`, {}", self.point.describe()),
            (Some(step), _) => write!(f, "{mode}: step `{step}`, {}", self.point.describe()),
            (None, _) => write!(f, "{mode}: {}", self.point.describe()),
        }
    }
}

/// How many crash tests are running in the process: points do nothing else while none is.
static RUNNING: AtomicUsize = AtomicUsize::new(0);

tokio::task_local! {
    static PLAN: Arc<Plan>;
}

/// What a crash test asks of one run of a call: count the points it reaches, and crash at
/// the `crash_at`-th (from 0), if any.
#[derive(Default)]
pub(crate) struct Plan {
    crash_at: Option<usize>,
    reached: Mutex<Vec<Reached>>,
    crashed: AtomicBool,
    /// The lease the call claimed last: a crash leaves it held, and the harness ends it.
    lease: Mutex<Option<EndLease>>,
}

impl fmt::Debug for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plan")
            .field("crash_at", &self.crash_at)
            .field("crashed", &self.crashed())
            .finish_non_exhaustive()
    }
}

impl Plan {
    /// A plan that crashes at the `crash_at`-th point reached, or never.
    pub(crate) fn new(crash_at: Option<usize>) -> Arc<Self> {
        Arc::new(Self {
            crash_at,
            ..Self::default()
        })
    }

    /// Runs `future` (the call) under this plan, counted among the running tests.
    pub(crate) async fn scope<F: Future>(self: &Arc<Self>, future: F) -> F::Output {
        struct Running;
        impl Drop for Running {
            fn drop(&mut self) {
                RUNNING.fetch_sub(1, Ordering::SeqCst);
            }
        }
        RUNNING.fetch_add(1, Ordering::SeqCst);
        let _running = Running;
        PLAN.scope(Arc::clone(self), future).await
    }

    /// Whether the call crashed.
    pub(crate) fn crashed(&self) -> bool {
        self.crashed.load(Ordering::SeqCst)
    }

    /// The points reached, in order.
    pub(crate) fn reached(&self) -> Vec<Reached> {
        self.reached
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The lease the call held when it crashed, if it ran in lease mode.
    pub(crate) fn lease(&self) -> Option<EndLease> {
        self.lease
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Counts `point`; `true` if the call crashes there.
    fn arrive(&self, point: CrashPoint, step: Option<&str>) -> bool {
        let mut reached = self.reached.lock().unwrap_or_else(PoisonError::into_inner);
        let index = reached.len();
        reached.push(Reached {
            point,
            step: step.map(str::to_owned),
        });
        let crash = self.crash_at == Some(index) && !self.crashed();
        if crash {
            self.crashed.store(true, Ordering::SeqCst);
        }
        crash
    }
}

/// Whether the call running in this task is run by a crash test.
pub(crate) fn under_crash_test() -> bool {
    RUNNING.load(Ordering::Relaxed) != 0 && PLAN.try_with(|_| ()).is_ok()
}

/// Whether the call running in this task crashes at `point`.
fn crashes_at(point: CrashPoint, step: Option<&str>) -> bool {
    if RUNNING.load(Ordering::Relaxed) == 0 {
        return false;
    }
    PLAN.try_with(|plan| plan.arrive(point, step))
        .unwrap_or(false)
}

/// A crash point where the call may park: if the crash test running this call crashes
/// here, the call never goes on (the harness drops it, as the process's death would). Lease
/// mode's points go through `lease::reach_crash_point`, which also rolls back a final phase
/// kept open.
#[doc(hidden)]
pub async fn reach(point: CrashPoint, step: Option<&str>) {
    if crashes_here(point, step) {
        std::future::pending::<()>().await;
    }
}

/// Whether the crash test running this call (if any) crashes it at `point`: counts the point.
#[doc(hidden)]
pub fn crashes_here(point: CrashPoint, step: Option<&str>) -> bool {
    crashes_at(point, step)
}

/// A crash point inside a store's step that would finish on its own task if dropped: if the
/// crash test running this call crashes here, the step fails (its transaction is dropped
/// uncommitted) and the harness drops the call.
#[doc(hidden)]
pub fn fault(point: CrashPoint) -> Result<(), Error> {
    if !crashes_at(point, None) {
        return Ok(());
    }
    Err(Error::Store {
        message: format!(
            "idem::testing: a crash test killed the call here ({})",
            point.describe()
        ),
        source: None,
    })
}

/// Notes the lease a call claimed, for the crash test running it (if any): a crash leaves
/// the lease held, and the harness ends it, as the lease's end would.
pub(crate) fn note_lease(end: impl FnOnce() -> EndLease) {
    if RUNNING.load(Ordering::Relaxed) == 0 {
        return;
    }
    let _ = PLAN.try_with(|plan| {
        *plan.lease.lock().unwrap_or_else(PoisonError::into_inner) = Some(end());
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn points_are_counted_only_under_a_plan_and_crash_only_where_it_says() {
        // No crash test: inert.
        reach(CrashPoint::AfterClaim, None).await;
        assert!(fault(CrashPoint::BeforeCommit).is_ok());

        let plan = Plan::new(Some(1));
        let (first, second, third) = plan
            .scope(async {
                // Another task is not counted: the plan is this call's.
                let other = tokio::spawn(async { fault(CrashPoint::AfterClaim).is_ok() });
                assert!(other.await.expect("the other task"));
                (
                    fault(CrashPoint::AfterClaim).is_ok(),
                    fault(CrashPoint::BeforeCommit).is_err(),
                    fault(CrashPoint::BeforeCommit).is_ok(),
                )
            })
            .await;
        assert!(first && second && third, "crashes at the second point only");
        assert!(plan.crashed());
        let points: Vec<CrashPoint> = plan.reached().iter().map(|r| r.point).collect();
        assert_eq!(
            points,
            [
                CrashPoint::AfterClaim,
                CrashPoint::BeforeCommit,
                CrashPoint::BeforeCommit
            ]
        );
        assert_eq!(RUNNING.load(Ordering::SeqCst), 0, "the test has ended");
    }
}
