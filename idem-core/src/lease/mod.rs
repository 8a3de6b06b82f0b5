//! Lease mode: for handlers whose effects leave the database (a payment gateway, an email).
//!
//! The claim commits first, as in progress, with a lease end on the database clock and a
//! fencing token that grows with every takeover. The body runs outside any claim transaction;
//! its [`step`]s (recovery points) are recorded durably, each fenced by the token, and a
//! takeover replays them instead of running them again. The result is recorded only if the
//! token still holds. A holder that ran past its lease finds out at its next step or at
//! completion ([`Error::LeaseLost`]); its work is rejected and rolled back.

mod observe;

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::call::handler::{Finality, HandlerError, HandlerOutput, Replayable, Verdict};
use crate::call::outcome;
use crate::call::{Call, Request};
use crate::error::Error;
use crate::ledger::{BoxFuture, LeaseClaim, RecordStatus, Ticket};
use crate::metrics::{self, Label};
use crate::retry::conflict::{self, Tries, retried};
use crate::retry::{Backoff, Jitter};
use crate::store::LeaseStore;
use crate::testing::crash_points::{self, CrashPoint};

pub use crate::call::DEFAULT_DEADLINE_LEASES;

/// How long a final phase's transaction is kept open for the call's result: a handler
/// returns right after its final phase, and one that does more work first (which may need
/// the connection or the locks the phase holds) gets the phase committed alone after this.
const OPEN_PHASE_FUSE: Duration = Duration::from_millis(50);

/// The same fuse for a call run by a crash test ([`crate::testing::CrashTest`]), whose path
/// must not depend on the machine's speed.
const CRASH_TEST_FUSE: Duration = Duration::from_secs(10);

/// A final phase whose transaction the store keeps open, so the call's result is recorded in
/// it: one write transaction per call fewer. Dropping it rolls the phase back.
pub trait OpenPhase: Send {
    /// Records the call's outcome in the phase's transaction (fenced by `ticket`, as
    /// [`LeaseStore::complete`]: kept for `ttl`, the `steps` forgotten) and commits.
    fn complete(
        self: Box<Self>,
        ticket: Ticket,
        status: RecordStatus,
        payload: Vec<u8>,
        ttl: Duration,
        steps: Vec<String>,
    ) -> BoxFuture<'static, Result<(), Error>>;

    /// Commits the phase alone: the call records nothing now, or did not return in time.
    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<(), Error>>;
}

/// The lease of the call running in this task.
struct Context {
    request: Request,
    ticket: Ticket,
    store: Arc<dyn LeaseStore>,
    holding: Holding,
    steps: Mutex<HashMap<String, Vec<u8>>>,
    /// The steps that may be recorded under the call's key: handed over by an earlier holder,
    /// or recorded (or about to be) by this one. The completion forgets them, by name where
    /// the store deletes by key (the lease fences out every other writer of them).
    written_steps: Mutex<BTreeSet<String>>,
    lost: AtomicBool,
    /// A final phase waiting for the call's result; locked while it commits.
    open_phase: tokio::sync::Mutex<Option<KeptOpen>>,
    /// A final phase that was committed alone and failed: its writes and step are gone, so
    /// the call must not record a result.
    phase_failed: AtomicBool,
    /// A step could not reach the store within the connection bound: ending the lease would
    /// most likely wait the bound out again, so it is done behind the caller's answer.
    store_unreachable: AtomicBool,
}

/// A final phase kept open for the call's result, and the step it records: noted as recorded
/// already, though it commits only with the phase.
struct KeptOpen {
    step: String,
    phase: Box<dyn OpenPhase>,
}

impl Context {
    /// Commits a final phase kept open, before anything else runs (a later step must not wait
    /// on its locks). Fails if that commit fails: the phase's writes are gone (and if the
    /// store was unreachable, the lease ends behind the answer).
    async fn commit_open_phase(&self) -> Result<(), Error> {
        let mut slot = self.open_phase.lock().await;
        if let Some(open) = slot.take()
            && let Err(e) = open.phase.commit().await
        {
            self.phase_failed.store(true, Ordering::SeqCst);
            if e.kind() == crate::ErrorKind::Unavailable {
                self.store_unreachable.store(true, Ordering::SeqCst);
            }
            return Err(e);
        }
        if self.phase_failed.load(Ordering::SeqCst) {
            return Err(self.phase_lost());
        }
        Ok(())
    }

    fn phase_lost(&self) -> Error {
        Error::Store {
            message: format!(
                "the final phase of a call in scope `{}` could not commit; the call is retried from there",
                self.request.scope()
            ),
            source: None,
        }
    }
}

impl Context {
    /// Notes step `name` as about to be written, before its write (which may commit even when
    /// it fails to say so).
    fn writing_step(&self, name: &str) {
        self.written_steps
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name.to_owned());
    }

    /// Forgets step `name`, noted as recorded by a final phase kept open that then rolled
    /// back: the next try runs it again.
    fn forget_step(&self, name: &str) {
        self.steps
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(name);
    }

    /// The steps the completion forgets ([`LeaseStore::complete`]).
    fn written_steps(&self) -> Vec<String> {
        let names = self
            .written_steps
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        names.iter().cloned().collect()
    }

    fn lost(&self) -> Error {
        Error::LeaseLost {
            scope: self.request.scope().to_owned(),
        }
    }
}

tokio::task_local! {
    static LEASE: Arc<Context>;
}

fn current(what: &str) -> Result<Arc<Context>, Error> {
    LEASE.try_with(Arc::clone).map_err(|_| Error::Store {
        message: format!(
            "`{what}` was called outside a lease-mode `#[idempotent(..., lease = \"…\")]` handler"
        ),
        source: None,
    })
}

/// Runs `run` once as the recovery point `name` of the current lease-mode call, and records
/// its value durably before returning it. On a takeover, a recorded step is not run again:
/// its recorded value is returned.
///
/// `run` gets the step's derived key ([`derived_key`](crate::derived_key)): send it downstream as the
/// `Idempotency-Key`, so a step that ran but was not recorded (a crash in between) is
/// deduplicated by the receiver when the next holder runs it again.
///
/// Fails with [`Error::LeaseLost`] when the lease was taken over (nothing is recorded; stop).
///
/// ```text
/// let charge: Charge = idem::step("charge", |key| gateway.charge(key, amount)).await?;
/// ```
pub async fn step<T, E, F, Fut>(name: &str, run: F) -> Result<T, E>
where
    T: Serialize + DeserializeOwned,
    E: From<Error>,
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let context = current("idem::step")?;
    if let Some(value) = recorded_step::<T>(&context, name)? {
        return Ok(value);
    }
    context.commit_open_phase().await?;
    if context.lost.load(Ordering::SeqCst) {
        return Err(context.lost().into());
    }
    let key = context.request.derived_key(name);
    reach_crash_point(CrashPoint::BeforeStep, Some(name)).await;
    let value = run(key).await?;
    reach_crash_point(CrashPoint::StepNotRecorded, Some(name)).await;
    let payload = encode_step(&context, &value)?;
    context.writing_step(name);
    // A conflict runs the record again, never the step: its effect has happened.
    let recorded = retried(context.request.scope(), || {
        context.store.record_step(&context.ticket, name, &payload)
    })
    .await;
    if let Err(e) = recorded {
        if e.kind() == crate::ErrorKind::LeaseLost {
            context.lost.store(true, Ordering::SeqCst);
            return Err(context.lost().into());
        }
        if e.kind() == crate::ErrorKind::Unavailable {
            context.store_unreachable.store(true, Ordering::SeqCst);
        }
        return Err(e.into());
    }
    note_step(&context, name, payload);
    reach_crash_point(CrashPoint::AfterStep, Some(name)).await;
    Ok(value)
}

fn recorded_step<T: DeserializeOwned>(context: &Context, name: &str) -> Result<Option<T>, Error> {
    let steps = context.steps.lock().unwrap_or_else(PoisonError::into_inner);
    steps
        .get(name)
        .map(|payload| {
            serde_json::from_slice(payload).map_err(|e| Error::Decode {
                scope: context.request.scope().to_owned(),
                key: context.request.key().to_owned(),
                source: format!("recorded step `{name}`: {e}").into(),
            })
        })
        .transpose()
}

fn encode_step<T: Serialize>(context: &Context, value: &T) -> Result<Vec<u8>, Error> {
    serde_json::to_vec(value).map_err(|e| Error::Encode {
        scope: context.request.scope().to_owned(),
        source: Box::new(e),
    })
}

fn note_step(context: &Context, name: &str, payload: Vec<u8>) {
    context
        .steps
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(name.to_owned(), payload);
}

/// A crash point of lease mode (see `testing::crash_points::reach`): a call the crash test
/// kills here parks for ever, and the final phase it keeps open is rolled back with it.
#[doc(hidden)]
pub async fn reach_crash_point(point: CrashPoint, step: Option<&str>) {
    if crash_points::crashes_here(point, step) {
        abandon_open_phase();
        std::future::pending::<()>().await;
    }
}

/// Rolls back the final phase the lease-mode call in this task keeps open, if any: a crash
/// test kills the call, and its open transaction dies with it (else the phase's fuse would
/// commit it after the "crash").
fn abandon_open_phase() {
    let _ = LEASE.try_with(|context| {
        if let Ok(mut slot) = context.open_phase.try_lock() {
            drop(slot.take());
        }
    });
}

/// The current lease-mode call, for stores that record a step together with writes of their
/// own (the SeaORM store's final phase).
#[derive(Clone)]
pub struct LeaseHandle(Arc<Context>);

impl std::fmt::Debug for LeaseHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseHandle")
            .field("scope", &self.0.request.scope())
            .field("token", &self.0.ticket.token)
            .finish_non_exhaustive()
    }
}

impl LeaseHandle {
    /// The lease of the call running in this task; `what` names the caller for the error.
    pub fn current(what: &str) -> Result<Self, Error> {
        current(what).map(Self)
    }

    /// The call's ticket.
    pub fn ticket(&self) -> Ticket {
        self.0.ticket
    }

    /// Whether the call is resumable (its arguments are stored for a completer).
    pub fn is_resumable(&self) -> bool {
        self.0.request.stored_args().is_some()
    }

    /// A step's recorded value, if it was recorded.
    pub fn recorded<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, Error> {
        recorded_step(&self.0, name)
    }

    /// Serialises a step's value.
    pub fn encode<T: Serialize>(&self, value: &T) -> Result<Vec<u8>, Error> {
        encode_step(&self.0, value)
    }

    /// Notes that the store is about to record step `name` itself, so that the completion
    /// forgets it (call it before the step's write, whether or not that commits).
    pub fn recording_step(&self, name: &str) {
        self.0.writing_step(name);
    }

    /// Notes a step the store recorded itself (after its transaction committed).
    pub fn note_recorded(&self, name: &str, payload: Vec<u8>) {
        note_step(&self.0, name, payload);
    }

    /// [`Error::LeaseLost`] for this call, remembered for its later steps.
    pub fn lose(&self) -> Error {
        self.0.lost.store(true, Ordering::SeqCst);
        self.0.lost()
    }

    /// Notes a store error the holder's own work met (a final phase's `BEGIN` or commit) and
    /// hands it back: a store that is unreachable makes the call end its lease behind its
    /// answer, as after a step, instead of waiting the connection bound out a second time.
    pub fn store_failed(&self, e: Error) -> Error {
        if e.kind() == crate::ErrorKind::Unavailable {
            self.0.store_unreachable.store(true, Ordering::SeqCst);
        }
        e
    }

    /// Whether the call's final phase is fenced by its lease: `false` for a body observe mode
    /// runs under a lease in memory ([`Mode::Observe`](crate::Mode::Observe)), whose final
    /// phase runs its writes in a transaction of their own.
    pub fn fences_writes(&self) -> bool {
        self.0.holding != Holding::InMemory
    }

    /// Whether the lease is known to be lost.
    pub fn is_lost(&self) -> bool {
        self.0.lost.load(Ordering::SeqCst)
    }

    /// Commits a final phase an earlier [`keep_open`](Self::keep_open) left open, before a
    /// new phase runs.
    pub async fn commit_open_phase(&self) -> Result<(), Error> {
        self.0.commit_open_phase().await
    }

    /// Keeps a final phase's transaction open for the call's result, which the engine then
    /// records in it ([`OpenPhase::complete`]) instead of in a transaction of its own. If the
    /// handler has not returned soon after, the phase is committed alone. `step` names the
    /// step the phase records: if the completion is aborted for a conflict (which rolls the
    /// phase back), the engine runs the body again, and the phase with it.
    pub fn keep_open(&self, step: &str, phase: Box<dyn OpenPhase>) {
        let context = Arc::clone(&self.0);
        let Ok(mut slot) = context.open_phase.try_lock() else {
            // Being committed by its fuse: commit this one alone too (never reached in
            // practice: phases run one after another and each first commits the last).
            tokio::spawn(phase.commit());
            return;
        };
        let step = step.to_owned();
        *slot = Some(KeptOpen { step, phase });
        drop(slot);
        // Under a crash test the fuse waits for the handler as long as the test would: a
        // machine slow enough to miss 50 ms would otherwise change the call's crash points
        // from one run to the next (the phase's commit point comes and goes).
        let fuse = if crate::testing::crash_points::under_crash_test() {
            CRASH_TEST_FUSE
        } else {
            OPEN_PHASE_FUSE
        };
        tokio::spawn(async move {
            tokio::time::sleep(fuse).await;
            if let Err(e) = context.commit_open_phase().await {
                tracing::warn!(parent: context.request.span(), error = %e, "the final phase failed to commit");
            }
        });
    }
}

/// Ends the lease at once when the body panics (the guard is dropped while its thread
/// unwinds): nothing will complete the call, so the next retry, or a completer, takes it over
/// from the recorded steps instead of waiting the lease out. A body dropped without a panic
/// keeps its lease until it ends, as a crash would.
struct ReleaseOnPanic {
    store: Arc<dyn LeaseStore>,
    scope: &'static str,
    ticket: Ticket,
}

impl Drop for ReleaseOnPanic {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (store, scope, ticket) = (Arc::clone(&self.store), self.scope, self.ticket);
            runtime.spawn(async move { release_now(&*store, scope, &ticket).await });
        }
    }
}

/// Stops the renewal task when the call ends or is dropped.
struct Renewal(tokio::task::JoinHandle<()>);

impl Drop for Renewal {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn renew_in_background(context: Arc<Context>, lease: Duration) -> Renewal {
    Renewal(tokio::spawn(async move {
        // Renew at a third of the lease, so two renewals can fail before it ends.
        let every = (lease / 3).max(Duration::from_millis(10));
        loop {
            tokio::time::sleep(every).await;
            match context.store.renew(&context.ticket, lease).await {
                Ok(()) => {}
                Err(e) if e.kind() == crate::ErrorKind::LeaseLost => {
                    context.lost.store(true, Ordering::SeqCst);
                    return;
                }
                Err(e) => {
                    tracing::warn!(parent: context.request.span(), error = %e, "lease renewal failed");
                }
            }
        }
    }))
}

/// What `#[idempotent(..., lease = "…")]` expands to: claims a lease on `store` (committed),
/// runs the body outside any claim transaction with its steps fenced by the lease, renews the
/// lease while the body runs, then records the result if the lease still holds. A transient
/// error ends the lease at once, keeping the recorded steps, so a retry resumes after them.
/// A call in observe mode ([`Call::mode`]) is decided the same way and answered by its body.
///
/// `bodies` makes the body for each try: a final phase kept open for the result
/// ([`LeaseHandle::keep_open`]) whose commit the database aborts for a conflict rolls back
/// with it, and the body runs again under the lease the call still holds (its recorded steps
/// replay). A factory that cannot make a second body ([`once`]) answers that conflict instead.
pub fn run_lease<R, F, B>(
    store: Arc<dyn LeaseStore>,
    call: Call,
    lease: Duration,
    finality: Option<Finality<R::Error>>,
    bodies: F,
) -> impl Future<Output = R>
where
    R: HandlerOutput,
    R::Ok: Replayable,
    R::Error: HandlerError,
    F: FnMut() -> Result<B, Error>,
    B: AsyncFnOnce() -> R,
{
    // Counted once, when the answer is known (feature `metrics`; without it, `observe` hands
    // the call back as it is).
    let scope = call.site().scope();
    metrics::observe(scope, async move {
        if call.observing() {
            return observe::observed(store, call, lease, finality, bodies).await;
        }
        let deadline = call.deadline_for(lease);
        let request = match call.prepare::<R>(false) {
            Ok(request) => request,
            Err(answer) => return answer,
        };
        if let Some(recorded) = request.recent_answer() {
            return request.replay(&recorded, finality);
        }
        let (ticket, steps) = match claim(&*store, &request, lease).await {
            Ok(LeaseClaim::Execute { ticket, steps }) => (ticket, steps),
            Ok(LeaseClaim::Recorded(recorded)) => return request.replay(&recorded, finality),
            Ok(LeaseClaim::InFlight { retry_after }) => {
                return request.fail(request.in_flight(retry_after));
            }
            Err(e) => return request.fail(e),
        };
        let held = Held {
            store,
            request,
            ticket,
            steps,
            lease,
            deadline,
        };
        execute(held, Holding::Enforced, finality, bodies).await.0
    })
}

/// The factory of a body that runs once (an HTTP request's, which its first try consumes),
/// for [`run_lease`]: a second try is refused with a conflict, answered to the caller.
pub fn once<B>(body: B) -> impl FnMut() -> Result<B, Error> {
    let mut body = Some(body);
    move || {
        body.take().ok_or_else(|| Error::Conflict {
            scope: String::new(),
            message: "the call's final phase was aborted for a conflict, and its body cannot run again in this process".to_owned(),
            attempts: 1,
            retry_after: crate::error::CONFLICT_RETRY_AFTER,
        })
    }
}

/// How a duplicate under `wait("…")` polls a key in flight: 10 ms doubling to 250 ms, each
/// pause at most the holder's `Retry-After`, the last one at the bound.
const POLL_IN_FLIGHT: Backoff = Backoff {
    initial: Duration::from_millis(10),
    max: Duration::from_millis(250),
};

/// Claims `request`'s key on `store` for `lease`: under `wait("…")` a key in flight is polled
/// until the bound, under `reject` it answers at once; a claim the database aborted for a
/// conflict (nothing of it committed) is tried again.
async fn claim(
    store: &dyn LeaseStore,
    request: &Request,
    lease: Duration,
) -> Result<LeaseClaim, Error> {
    let wait_until = match request.concurrency() {
        crate::Concurrency::Wait { bound } => Some(tokio::time::Instant::now() + bound),
        _ => None,
    };
    let mut polls = 0;
    let mut conflicts = Tries::new();
    loop {
        let claimed = store.claim_lease(request, lease).await;
        match (claimed, wait_until) {
            (Ok(LeaseClaim::InFlight { retry_after }), Some(wait_until))
                if tokio::time::Instant::now() < wait_until =>
            {
                polls += 1;
                let pause = POLL_IN_FLIGHT.jittered(polls, Jitter::None);
                let wake = (tokio::time::Instant::now() + pause.min(retry_after)).min(wait_until);
                tokio::time::sleep_until(wake).await;
            }
            (Err(e), _) if e.is_conflict() => conflicts.again(request.scope(), e).await?,
            (claimed, _) => return claimed,
        }
    }
}

/// A lease a call holds, and what running its body under it needs.
struct Held {
    store: Arc<dyn LeaseStore>,
    request: Request,
    ticket: Ticket,
    /// The steps an earlier holder recorded.
    steps: Vec<(String, Vec<u8>)>,
    lease: Duration,
    /// How long the body may run.
    deadline: Duration,
}

/// How a call holds its lease, and so how its final phase and its answer go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holding {
    /// Enforcing: the lease fences the call's steps and final phase; an error of idem's is
    /// the call's answer.
    Enforced,
    /// Observe mode, a call enforcing would execute: held as enforcing holds it, but when
    /// idem cannot record an answer whose writes already committed, the body's answer stands.
    Observed,
    /// Observe mode, a call enforcing would answer without its body: the lease is of a fresh
    /// in-memory store, so steps work and nothing is kept, and a final phase's writes run in
    /// a transaction of their own, unfenced.
    InMemory,
}

/// Runs the body under `held`'s lease (renewed while it runs, ended at once if it panics or
/// runs past its deadline) and settles its output: the call's answer, and how a call enforcing
/// would be counted. A try whose final phase kept open was aborted for a conflict is run
/// again with a new body from `bodies`, as a conflict of atomic mode's is.
async fn execute<R, F, B>(
    held: Held,
    holding: Holding,
    finality: Option<Finality<R::Error>>,
    mut bodies: F,
) -> (R, Label)
where
    R: HandlerOutput,
    R::Ok: Replayable,
    R::Error: HandlerError,
    F: FnMut() -> Result<B, Error>,
    B: AsyncFnOnce() -> R,
{
    let Held {
        store,
        request,
        ticket,
        steps,
        lease,
        deadline,
    } = held;
    let scope = request.scope();
    let span = request.span().clone();
    let context = Arc::new(Context {
        request,
        ticket,
        store: Arc::clone(&store),
        holding,
        written_steps: Mutex::new(steps.iter().map(|(name, _)| name.clone()).collect()),
        steps: Mutex::new(steps.into_iter().collect()),
        lost: AtomicBool::new(false),
        open_phase: tokio::sync::Mutex::new(None),
        phase_failed: AtomicBool::new(false),
        store_unreachable: AtomicBool::new(false),
    });
    crash_points::note_lease(|| {
        let store = Arc::clone(&store);
        Arc::new(move || {
            let store = Arc::clone(&store);
            Box::pin(async move { store.release_lease(&ticket).await })
        })
    });
    // The deadline bounds the call, not each try.
    let deadline_at = tokio::time::Instant::now() + deadline;
    let mut conflicts = Tries::new();
    loop {
        let body = match bodies() {
            Ok(body) => body,
            Err(e) => {
                release_now(&*store, scope, &ticket).await;
                return failed(
                    &context.request,
                    conflict::named(scope, e, conflicts.tried()),
                );
            }
        };
        // Declared first, so that while unwinding the renewal stops before the release.
        let on_panic = ReleaseOnPanic {
            store: Arc::clone(&store),
            scope,
            ticket,
        };
        let renewal = renew_in_background(Arc::clone(&context), lease);
        let nested = outcome::Nested::enter();
        // Hooks the body asks for (the outbox's wake after staging in a final phase) run once
        // the call has ended, when its final phase has certainly committed.
        let ran = tokio::time::timeout_at(
            deadline_at,
            LEASE.scope(
                Arc::clone(&context),
                crate::call::collecting_hooks(tracing::Instrument::instrument(
                    async {
                        reach_crash_point(CrashPoint::AfterLeaseClaim, None).await;
                        body().await
                    },
                    span.clone(),
                )),
            ),
        )
        .await;
        drop(nested);
        drop(renewal);
        drop(on_panic);
        let Ok((output, hooks)) = ran else {
            return past_deadline(&*store, &context, deadline).await;
        };
        match settle::<R>(&*store, &context, ticket, output, finality).await {
            Settled::Answered(answer, label) => {
                hooks.iter().for_each(|hook| hook());
                return (answer, label);
            }
            // The phase's writes (and any outbox rows a hook would wake for) rolled back.
            Settled::PhaseAborted(e) => {
                if let Err(e) = conflicts.again(scope, e).await {
                    release_now(&*store, scope, &ticket).await;
                    return failed(&context.request, e);
                }
            }
        }
    }
}

/// How a try of a lease-mode call ended.
enum Settled<R> {
    /// With the call's answer, and how enforcing counts it.
    Answered(R, Label),
    /// The database aborted the commit of the final phase kept open for the result, for a
    /// conflict: the phase's writes rolled back with the result, and the lease is still held.
    PhaseAborted(Error),
}

/// Ends a try of a lease-mode call whose body returned `output`: records it (in a final phase
/// kept open, or on its own) if the lease still holds, or releases the lease. The answer, and
/// how enforcing counts it; or a final phase kept open that a conflict aborted, to run again.
async fn settle<R>(
    store: &dyn LeaseStore,
    context: &Context,
    ticket: Ticket,
    output: R,
    finality: Option<Finality<R::Error>>,
) -> Settled<R>
where
    R: HandlerOutput,
    R::Ok: Replayable,
    R::Error: HandlerError,
{
    let request = &context.request;
    let scope = request.scope();
    // A final phase kept open: the result is recorded in its transaction (waits for its
    // fuse if that is committing it alone right now).
    let open_phase = context.open_phase.lock().await.take();
    // After the phase is taken: a crash here drops it, uncommitted, with the call.
    reach_crash_point(CrashPoint::BeforeLeaseRecord, None).await;
    let record = match request.verdict(output, finality) {
        Verdict::Record(record) if !context.phase_failed.load(Ordering::SeqCst) => record,
        Verdict::Record(_) => {
            release_unrecorded(store, context, &ticket).await;
            return failed(request, context.phase_lost()).into();
        }
        Verdict::Release(error) => {
            end_unrecorded(store, context, &ticket, open_phase).await;
            metrics::settle(request.span(), Label::Released);
            return Settled::Answered(R::from_result(Err(error)), Label::Released);
        }
        Verdict::Unencodable(e) => {
            end_unrecorded(store, context, &ticket, open_phase).await;
            return failed(request, e).into();
        }
    };
    // Taken before the store starts the record's TTL, so a remembered copy expires first.
    let since = Instant::now();
    // An answer recorded only in memory is not this layer's to replay.
    let remembered = (request.remembers_answers() && context.holding != Holding::InMemory)
        .then(|| record.payload.clone());
    let phase_was_open = open_phase.is_some();
    let completed = match open_phase {
        Some(KeptOpen { step, phase }) => {
            let steps = context.written_steps();
            let completed = phase
                .complete(ticket, record.status, record.payload, request.ttl(), steps)
                .await;
            match completed {
                // The phase's writes rolled back with the result: only running the body again
                // runs them again.
                Err(e) if e.is_conflict() => {
                    context.forget_step(&step);
                    return Settled::PhaseAborted(e);
                }
                completed => completed,
            }
        }
        None => {
            let steps = context.written_steps();
            retried(scope, || {
                store.complete(&ticket, request, record.status, &record.payload, &steps)
            })
            .await
        }
    };
    let e = match completed {
        Ok(()) => {
            if let Some(payload) = remembered {
                request.remember(record.status, payload, since);
            }
            return Settled::Answered(request.executed(record.answer), Label::Executed);
        }
        Err(e) if e.kind() == crate::ErrorKind::LeaseLost => context.lost(),
        Err(e) if e.kind() == crate::ErrorKind::Unavailable => {
            // The store is unreachable: the release would most likely wait out the same
            // connection bound again before failing, so the caller is answered now and the
            // release is tried behind it.
            let store = Arc::clone(&context.store);
            tokio::spawn(async move { release_now(&*store, scope, &ticket).await });
            e
        }
        Err(e) => {
            // Not recorded: end the lease at once, so the next retry (or a completer) takes
            // over from the recorded steps instead of waiting the lease out.
            release_now(store, scope, &ticket).await;
            conflict::named(scope, e, 1)
        }
    };
    if context.holding == Holding::Observed && !phase_was_open {
        // Observe mode never makes idem's error the caller's: the body's writes committed in
        // their own phases, so its answer stands. (A phase kept open for the result rolled
        // back with it: that call must fail, as enforcing's does.)
        tracing::warn!(parent: request.span(), error = %e, "observe mode: idem could not record the answer; the body's own answer is returned");
        return Settled::Answered(R::from_result(record.answer), Label::of_error(&e));
    }
    failed(request, e).into()
}

impl<R> From<(R, Label)> for Settled<R> {
    fn from((answer, label): (R, Label)) -> Self {
        Self::Answered(answer, label)
    }
}

/// Ends a call that records nothing: its final phase's writes kept, its lease released.
async fn end_unrecorded(
    store: &dyn LeaseStore,
    context: &Context,
    ticket: &Ticket,
    open_phase: Option<KeptOpen>,
) {
    if let Some(open) = open_phase {
        let _ = open.phase.commit().await;
    }
    release_unrecorded(store, context, ticket).await;
}

/// Fails the call with idem's error `e`, and how it is counted.
fn failed<R>(request: &Request, e: Error) -> (R, Label)
where
    R: HandlerOutput,
    R::Error: HandlerError,
{
    let label = Label::of_error(&e);
    (request.fail(e), label)
}

/// Ends a call whose body ran past its deadline (the body was dropped): a final phase kept
/// open commits (its writes and step stand), and the lease ends now, so the next retry or a
/// completer takes over from the recorded steps.
async fn past_deadline<R>(
    store: &dyn LeaseStore,
    context: &Context,
    deadline: Duration,
) -> (R, Label)
where
    R: HandlerOutput,
    R::Error: HandlerError,
{
    let request = &context.request;
    if let Err(e) = context.commit_open_phase().await {
        tracing::warn!(parent: request.span(), error = %e, "the final phase failed to commit");
    }
    release_now(store, request.scope(), &context.ticket).await;
    let e = Error::DeadlineExceeded {
        scope: request.scope().to_owned(),
        deadline,
        retry_after: crate::call::RETRY_AFTER,
    };
    failed(request, e)
}

/// Ends the lease of a call that recorded nothing: now, or behind the caller's answer when a
/// step found the store unreachable (a dead node's pool would make the release wait out the
/// connection bound a second time; measured on Galera: a dead node's 503 after 10 s, not 5).
async fn release_unrecorded(store: &dyn LeaseStore, context: &Context, ticket: &Ticket) {
    let scope = context.request.scope();
    if context.store_unreachable.load(Ordering::SeqCst)
        && let Ok(runtime) = tokio::runtime::Handle::try_current()
    {
        let (store, ticket) = (Arc::clone(&context.store), *ticket);
        runtime.spawn(async move { release_now(&*store, scope, &ticket).await });
    } else {
        release_now(store, scope, ticket).await;
    }
}

/// Ends the lease now, keeping its recorded steps: the next attempt takes over at once. A
/// failed release changes nothing for the caller: the lease then ends on its own.
async fn release_now(store: &dyn LeaseStore, scope: &str, ticket: &Ticket) {
    let _ = retried(scope, || store.release_lease(ticket)).await;
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;
    use std::time::Instant;

    use super::*;
    use crate::call::{Call, Site};
    use crate::{Concurrency, ErrorKind, MemoryStore};

    /// What a dead node's pool answers.
    fn unreachable() -> Error {
        Error::Unavailable {
            message: "no connection within the bound".to_owned(),
            retry_after: Duration::from_secs(1),
        }
    }

    /// A dead node's pool: steps find the store unreachable, and a release takes 2 s to fail.
    struct DeadNode {
        inner: MemoryStore,
        released: Arc<AtomicBool>,
    }

    impl LeaseStore for DeadNode {
        fn claim_lease<'a>(
            &'a self,
            req: &'a Request,
            lease: Duration,
        ) -> BoxFuture<'a, Result<LeaseClaim, Error>> {
            self.inner.claim_lease(req, lease)
        }

        fn renew<'a>(
            &'a self,
            ticket: &'a Ticket,
            lease: Duration,
        ) -> BoxFuture<'a, Result<(), Error>> {
            self.inner.renew(ticket, lease)
        }

        fn record_step<'a>(
            &'a self,
            _ticket: &'a Ticket,
            _name: &'a str,
            _payload: &'a [u8],
        ) -> BoxFuture<'a, Result<(), Error>> {
            Box::pin(async { Err(unreachable()) })
        }

        fn complete<'a>(
            &'a self,
            ticket: &'a Ticket,
            req: &'a Request,
            status: RecordStatus,
            payload: &'a [u8],
            steps: &'a [String],
        ) -> BoxFuture<'a, Result<(), Error>> {
            self.inner.complete(ticket, req, status, payload, steps)
        }

        fn release_lease<'a>(&'a self, _ticket: &'a Ticket) -> BoxFuture<'a, Result<(), Error>> {
            let released = Arc::clone(&self.released);
            Box::pin(async move {
                tokio::time::sleep(Duration::from_secs(2)).await;
                released.store(true, Ordering::SeqCst);
                Ok(())
            })
        }
    }

    /// Runs `body` as a lease-mode call of `site` on a [`DeadNode`] whose release takes 2 s:
    /// its answer, when the call started, and whether the release has run.
    async fn on_a_dead_node(
        site: &'static Site,
        body: impl AsyncFnOnce() -> Result<u8, Error>,
    ) -> (Result<u8, Error>, Instant, Arc<AtomicBool>) {
        let released = Arc::new(AtomicBool::new(false));
        let store = DeadNode {
            inner: MemoryStore::new(),
            released: Arc::clone(&released),
        };
        let started = Instant::now();
        let call = Call::new(site, "k-1");
        let answer = run_lease(
            Arc::new(store),
            call,
            Duration::from_secs(30),
            None,
            once(body),
        )
        .await;
        (answer, started, released)
    }

    /// Checks that a call on a [`DeadNode`] was answered `Unavailable` at once, and its lease
    /// released behind the answer (the release takes 2 s).
    async fn answered_before_the_release(
        answer: Result<u8, Error>,
        started: Instant,
        released: &AtomicBool,
    ) {
        assert_eq!(
            answer.expect_err("unreachable").kind(),
            ErrorKind::Unavailable
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "answered after {:?}: the release was awaited",
            started.elapsed()
        );
        assert!(!released.load(Ordering::SeqCst));
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert!(
            released.load(Ordering::SeqCst),
            "the release ran behind the answer"
        );
    }

    /// A step that found the store unreachable answers at once; the lease's release, which
    /// would wait the connection bound out again, runs behind the answer.
    #[tokio::test]
    async fn a_step_that_found_the_store_unreachable_is_answered_before_the_release() {
        static SITE: Site = Site::new(
            "lease.dead-node",
            Duration::from_secs(60),
            Concurrency::Reject,
        );
        let (answer, started, released) = on_a_dead_node(&SITE, async || {
            step("charge", |_key| async { Ok::<u8, Error>(1) }).await
        })
        .await;
        answered_before_the_release(answer, started, &released).await;
    }

    /// The same for a final phase that could not begin on a dead node (a store's
    /// `final_step`/`finish` reports it through `LeaseHandle::store_failed`).
    #[tokio::test]
    async fn a_final_phase_that_found_the_store_unreachable_is_answered_before_the_release() {
        static SITE: Site = Site::new(
            "lease.dead-node-phase",
            Duration::from_secs(60),
            Concurrency::Reject,
        );
        let (answer, started, released) = on_a_dead_node(&SITE, async || {
            let lease = LeaseHandle::current("a final phase")?;
            Err(lease.store_failed(unreachable()))
        })
        .await;
        answered_before_the_release(answer, started, &released).await;
    }

    /// A final phase kept open whose completion and commit fail with `error` the next
    /// `failures` times, then succeed.
    struct FailingPhase {
        failures: Arc<AtomicU32>,
        error: fn() -> Error,
    }

    impl OpenPhase for FailingPhase {
        fn complete(
            self: Box<Self>,
            _ticket: Ticket,
            _status: RecordStatus,
            _payload: Vec<u8>,
            _ttl: Duration,
            _steps: Vec<String>,
        ) -> BoxFuture<'static, Result<(), Error>> {
            self.commit()
        }

        fn commit(self: Box<Self>) -> BoxFuture<'static, Result<(), Error>> {
            let failed = self
                .failures
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            let error = self.error;
            Box::pin(async move { if failed { Err(error()) } else { Ok(()) } })
        }
    }

    /// The same for a final phase kept open that could not commit when the next step began.
    #[tokio::test]
    async fn an_open_phase_that_could_not_commit_is_answered_before_the_release() {
        static SITE: Site = Site::new(
            "lease.dead-node-open-phase",
            Duration::from_secs(60),
            Concurrency::Reject,
        );
        let (answer, started, released) = on_a_dead_node(&SITE, async || {
            LeaseHandle::current("a final phase")?.keep_open(
                "phase",
                Box::new(FailingPhase {
                    failures: Arc::new(AtomicU32::new(u32::MAX)),
                    error: unreachable,
                }),
            );
            step("after", |_key| async { Ok::<u8, Error>(1) }).await
        })
        .await;
        answered_before_the_release(answer, started, &released).await;
    }

    /// What the database answers a commit that conflicted (a Galera certification failure):
    /// the phase's writes rolled back with the result.
    fn certification_failed() -> Error {
        Error::Conflict {
            scope: String::new(),
            message: "certification failed".to_owned(),
            attempts: 1,
            retry_after: Duration::from_millis(10),
        }
    }

    /// The body of a call whose final phase (`pay`) is kept open for the result: a step
    /// (`charge`) recorded on its own first. Counts the step's runs and the phase's runs.
    async fn charge_then_pay(
        conflicts: &Arc<AtomicU32>,
        charges: &AtomicU32,
        payments: &AtomicU32,
    ) -> Result<u8, Error> {
        step("charge", |_key| async {
            charges.fetch_add(1, Ordering::SeqCst);
            Ok::<u8, Error>(7)
        })
        .await?;
        let lease = LeaseHandle::current("a final phase")?;
        if let Some(paid) = lease.recorded::<u8>("pay")? {
            return Ok(paid);
        }
        payments.fetch_add(1, Ordering::SeqCst);
        lease.recording_step("pay");
        let failures = Arc::clone(conflicts);
        let error = certification_failed;
        lease.keep_open("pay", Box::new(FailingPhase { failures, error }));
        lease.note_recorded("pay", lease.encode(&9_u8)?);
        Ok(9)
    }

    /// A conflict at the commit of a final phase kept open for the result rolled back the
    /// phase's writes with the result: the engine runs the body again under the lease it
    /// still holds (the step it recorded replays, the phase runs again), instead of answering
    /// the conflict after one try.
    #[tokio::test]
    async fn a_conflict_at_the_commit_of_a_phase_kept_open_runs_the_body_again() {
        static SITE: Site = Site::new(
            "lease.open-phase-conflict",
            Duration::from_secs(60),
            Concurrency::Reject,
        );
        let conflicts = Arc::new(AtomicU32::new(2));
        let (charges, payments, bodies) = (AtomicU32::new(0), AtomicU32::new(0), AtomicU32::new(0));
        let call = Call::new(&SITE, "k-1");
        let answer = run_lease(
            Arc::new(MemoryStore::new()),
            call,
            Duration::from_secs(30),
            None,
            || {
                bodies.fetch_add(1, Ordering::SeqCst);
                Ok(async || charge_then_pay(&conflicts, &charges, &payments).await)
            },
        )
        .await;
        assert_eq!(answer.expect("recorded on the third try"), 9);
        assert_eq!(bodies.load(Ordering::SeqCst), 3, "one body per try");
        assert_eq!(
            payments.load(Ordering::SeqCst),
            3,
            "the phase ran on each try"
        );
        assert_eq!(
            charges.load(Ordering::SeqCst),
            1,
            "the recorded step replayed on the later tries"
        );
    }

    /// A body that cannot run again (its factory refuses a second try) is answered the
    /// conflict, and its lease is released for the client's retry.
    #[tokio::test]
    async fn a_conflict_of_a_phase_kept_open_is_answered_when_the_body_cannot_run_again() {
        static SITE: Site = Site::new(
            "lease.open-phase-conflict-once",
            Duration::from_secs(60),
            Concurrency::Reject,
        );
        let conflicts = Arc::new(AtomicU32::new(1));
        let (charges, payments) = (AtomicU32::new(0), AtomicU32::new(0));
        let store = Arc::new(MemoryStore::new());
        let body = async || charge_then_pay(&conflicts, &charges, &payments).await;
        let call = Call::new(&SITE, "k-1");
        let answer = run_lease(
            store.clone(),
            call,
            Duration::from_secs(30),
            None,
            once(body),
        )
        .await;
        let e = answer.expect_err("the body could not run again");
        assert_eq!(e.kind(), ErrorKind::Conflict, "{e}");
        assert_eq!(payments.load(Ordering::SeqCst), 1);
        // Released: the client's retry takes over at once, the recorded step replayed.
        let call = Call::new(&SITE, "k-1");
        let retried = run_lease(
            store,
            call,
            Duration::from_secs(30),
            None,
            once(async || charge_then_pay(&conflicts, &charges, &payments).await),
        )
        .await;
        assert_eq!(retried.expect("the retry records"), 9);
        assert_eq!(charges.load(Ordering::SeqCst), 1);
        assert_eq!(payments.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_step_outside_a_lease_mode_handler_is_an_error_not_a_panic() {
        let result: Result<u8, Error> = step("x", |_key| async { Ok(1) }).await;
        assert!(
            result
                .unwrap_err()
                .to_string()
                .contains("outside a lease-mode")
        );
    }
}
