//! Atomic mode, what `#[idempotent]` expands to by default: claim the key in a transaction,
//! run the body in that transaction, then record the result and commit, or release (roll
//! back). A replay or an idem error answers without running the body. A try that the database
//! aborts for a conflict is run again whole ([`conflict`](crate::retry::conflict)).

mod flight;
mod observe;

use crate::call::{Call, RETRY_AFTER, Request, collecting_hooks};
use crate::error::Error;
use crate::retry::conflict::Tries;

use crate::call::handler::{Finality, HandlerError, HandlerOutput, Replayable};
use crate::call::outcome;
use crate::ledger::{Claim, Concurrency, Recorded};
use crate::metrics::{self, Label};
use crate::store::Store;
use crate::testing::crash_points::{self, CrashPoint};

/// What `#[idempotent]` expands to: claims the key on `store`, runs the body in the claim's
/// transaction (inside the call's tracing span), then records or releases. A replay or an idem
/// error returns without running the body. Every bound on the handler's return type is here,
/// on one call, so an unsuitable type is one compile error.
///
/// A try the database aborts for a transient conflict (at the claim, in the body, at the
/// record or its `COMMIT`) left nothing behind, so it is run again, claim, body and record,
/// after a jittered backoff. So `bodies` makes the body afresh for each try that executes
/// (the macro hands each one its own copy of the arguments), or says why the body cannot run
/// again (an argument that is not `Clone` went into the first try: [`Rerun`](crate::call::handler::Rerun)),
/// which the caller is answered. Usually the second try finds the record a concurrent
/// duplicate committed and replays it.
pub fn run<S, R, F, B>(
    store: S,
    call: Call,
    finality: Option<Finality<R::Error>>,
    mut bodies: F,
) -> impl Future<Output = R>
where
    S: Store,
    R: HandlerOutput,
    R::Ok: Replayable,
    R::Error: HandlerError,
    F: FnMut() -> Result<B, Error>,
    B: for<'t> AsyncFnOnce(S::Tx<'t>) -> R,
{
    // Counted once, when the answer is known (feature `metrics`; without it, `observe` hands
    // the call back as it is: no extra future around it).
    let scope = call.site().scope();
    metrics::observe(scope, async move {
        if crate::testing::is_disabled() {
            return unclaimed(&store, bodies).await;
        }
        if call.observing() {
            return observe::observed(&store, call, finality, bodies).await;
        }
        let request = match call.prepare::<R>(finality.is_some()) {
            Ok(request) => request,
            Err(answer) => return answer,
        };
        let bound = match request.concurrency() {
            Concurrency::Wait { bound } => bound,
            _ => Concurrency::DEFAULT_BOUND,
        };
        let deadline = tokio::time::Instant::now() + bound;
        // Single flight: a duplicate of a call running in this process waits for it in memory
        // and replays its answer; only the first call (or, if it recorded nothing, each
        // duplicate in turn) goes to the store, where the database decides across processes.
        let mut leader = None;
        if let Some(ledger) = store.ledger_identity() {
            match flight::join(ledger, *request.id()) {
                flight::Role::Leader(l) => leader = Some(l),
                flight::Role::Follower(_) if request.concurrency() == Concurrency::Reject => {
                    return request.fail(request.in_flight(RETRY_AFTER));
                }
                flight::Role::Follower(flight) => {
                    match tokio::time::timeout_at(deadline, flight::landing(flight)).await {
                        Ok(Some(recorded)) => return request.replay(&recorded, finality),
                        Ok(None) => {} // the first call recorded nothing: claim in the store
                        Err(_elapsed) => return request.fail(request.in_flight(RETRY_AFTER)),
                    }
                }
            }
        }
        let mut tries = Tries::new();
        loop {
            let conflict = match attempt(
                &store,
                &request,
                finality,
                &mut leader,
                &mut bodies,
                deadline,
            )
            .await
            {
                Try::Answered(answer) => return answer,
                Try::Conflict(conflict) => conflict,
            };
            if let Err(e) = tries.again(request.scope(), conflict).await {
                // Dropping the leader tells this process's duplicates to claim for themselves.
                return request.fail(e);
            }
        }
    })
}

/// A call run with idem switched off ([`testing`](crate::testing)): the body in a
/// transaction of the store that claims nothing; `Ok` commits, `Err` rolls back.
async fn unclaimed<S, R, F, B>(store: &S, mut bodies: F) -> R
where
    S: Store,
    R: HandlerOutput,
    R::Error: HandlerError,
    F: FnMut() -> Result<B, Error>,
    B: for<'t> AsyncFnOnce(S::Tx<'t>) -> R,
{
    let body = match bodies() {
        Ok(body) => body,
        Err(e) => return R::from_result(Err(e.into())),
    };
    let mut tx = match store.begin().await {
        Ok(tx) => tx,
        Err(e) => return R::from_result(Err(e.into())),
    };
    let open = OpenClaim {
        ledger: store.ledger_identity(),
    };
    let (output, hooks) = OPEN_CLAIM
        .scope(open, collecting_hooks(body(S::tx(&mut tx))))
        .await;
    let output = output.into_result();
    let ended = if output.is_ok() {
        store.commit(tx).await
    } else {
        store.release(tx).await
    };
    match ended {
        Ok(()) => {
            hooks.iter().for_each(|hook| hook());
            R::from_result(output)
        }
        Err(e) => R::from_result(Err(e.into())),
    }
}

/// An atomic-mode call whose body is running in this task, its claim's transaction open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct OpenClaim {
    /// The ledger the claim is on ([`Store::ledger_identity`]), as far as known.
    pub ledger: Option<usize>,
}

tokio::task_local! {
    static OPEN_CLAIM: OpenClaim;
}

/// The atomic-mode call whose body is running in this task, if any. A store that takes a
/// connection of its own (a pool) asks, so that a call made inside another call's body
/// through the pool, not the body's transaction, fails at once with a clear error instead
/// of committing on its own or waiting for the body's own locks.
pub fn open_claim() -> Option<OpenClaim> {
    OPEN_CLAIM.try_with(|c| *c).ok()
}

/// Whether an atomic-mode body runs in this task with its claim open on the ledger `ledger`
/// ([`Store::ledger_identity`] of a pool), or on a ledger it cannot tell apart: a claim
/// through that pool now would commit on its own instead of with the body, or wait for the
/// body's own lock. The pooled stores refuse such a claim.
pub fn inside_open_claim(ledger: Option<usize>) -> bool {
    open_claim().is_some_and(|open| open.ledger.is_none() || open.ledger == ledger)
}

/// Refuses the lease claim of the lease-mode `scope` on an embedded (SQLite) ledger `ledger`
/// while an atomic-mode body in this task holds that database's one write lock: the claim
/// would wait for it. (On a server a lease commits on its own, as it must.)
pub fn lease_outside_open_sqlite_claim(ledger: Option<usize>, scope: &str) -> Result<(), Error> {
    if !inside_open_claim(ledger) {
        return Ok(());
    }
    Err(Error::Store {
        message: format!(
            "the lease-mode `{scope}` was called inside the body of an atomic-mode `#[idempotent]` call on the same SQLite database, whose write lock that body holds: the lease's claim would wait for it; call it before or after the atomic call (a lease commits on its own and cannot take the body's transaction)"
        ),
        source: None,
    })
}

/// How one try of a call ended.
enum Try<R> {
    /// With the caller's answer.
    Answered(R),
    /// Aborted by the database for a conflict; nothing of it was committed.
    Conflict(Error),
}

/// One try: claim, body, record. Lands this process's single flight when it answers from a
/// record it read or wrote.
async fn attempt<S, R, F, B>(
    store: &S,
    request: &Request,
    finality: Option<Finality<R::Error>>,
    leader: &mut Option<flight::Leader>,
    bodies: &mut F,
    deadline: tokio::time::Instant,
) -> Try<R>
where
    S: Store,
    R: HandlerOutput,
    R::Ok: Replayable,
    R::Error: HandlerError,
    F: FnMut() -> Result<B, Error>,
    B: for<'t> AsyncFnOnce(S::Tx<'t>) -> R,
{
    let claimed = match tokio::time::timeout_at(deadline, store.claim(request)).await {
        Ok(claimed) => claimed,
        Err(_elapsed) => Ok(Claim::InFlight),
    };
    let mut claimed = match claimed {
        Ok(Claim::Execute(claimed)) => claimed,
        Ok(Claim::Recorded(recorded)) => {
            let answer = request.replay(&recorded, finality);
            if let Some(leader) = leader.take() {
                leader.land(Some(recorded));
            }
            return Try::Answered(answer);
        }
        Ok(Claim::InFlight) => return Try::Answered(request.fail(request.in_flight(RETRY_AFTER))),
        Err(e) if e.is_conflict() => return Try::Conflict(e),
        Err(e) => return Try::Answered(request.fail(e)),
    };
    let body = match bodies() {
        Ok(body) => body,
        Err(e) => {
            let _ = store.release(claimed).await;
            return Try::Answered(request.fail(e));
        }
    };
    crash_points::reach(CrashPoint::AfterClaim, None).await;
    let Some((output, hooks)) = in_claim(store, request, finality, &mut claimed, body).await else {
        let _ = store.release(claimed).await;
        return Try::Conflict(aborted_body());
    };
    let record = match request.record_of(R::from_result(output), finality) {
        Ok(record) => record,
        Err(answer) => {
            // Nothing to record: roll back so a retry executes again. A failed rollback
            // changes nothing for the caller: the dropped transaction rolls back anyway.
            let _ = store.release(claimed).await;
            hooks.iter().for_each(|hook| hook());
            return Try::Answered(answer);
        }
    };
    crash_points::reach(CrashPoint::BeforeRecord, None).await;
    match store
        .record(claimed, request, record.status, &record.payload)
        .await
    {
        Ok(()) => {
            if let Some(leader) = leader.take() {
                // Committed: duplicates waiting in this process replay it from memory.
                let recorded = leader.has_followers().then(|| Recorded {
                    fingerprint: request.fingerprint(),
                    status: record.status,
                    payload: record.payload,
                });
                leader.land(recorded);
            }
            // The call's transaction has committed: the hooks find what the body staged.
            hooks.iter().for_each(|hook| hook());
            Try::Answered(request.executed(record.answer))
        }
        Err(e) if e.is_conflict() => Try::Conflict(e),
        Err(e) => {
            tracing::warn!(parent: request.span(), error = %e, "recording failed; rolled back");
            metrics::settle(request.span(), Label::Error);
            Try::Answered(R::from_result(Err(e.into())))
        }
    }
}

/// Runs a try's body in the claim's transaction (in the call's span, marked as an open claim
/// for the calls nested in it): its output and the hooks it asked for. `None` when the body
/// failed because the database had aborted the transaction under it: the try was a conflict
/// ([`aborted_body`]), and the caller releases the claim.
async fn in_claim<S, R, B>(
    store: &S,
    request: &Request,
    finality: Option<Finality<R::Error>>,
    claimed: &mut S::Claimed,
    body: B,
) -> Option<(Result<R::Ok, R::Error>, Vec<fn()>)>
where
    S: Store,
    R: HandlerOutput,
    R::Error: HandlerError,
    B: for<'t> AsyncFnOnce(S::Tx<'t>) -> R,
{
    let nested = outcome::Nested::enter();
    let running = tracing::Instrument::instrument(body(S::tx(claimed)), request.span().clone());
    let open = OpenClaim {
        ledger: store
            .ledger_identity()
            .or(open_claim().and_then(|c| c.ledger)),
    };
    let (output, hooks) = OPEN_CLAIM.scope(open, collecting_hooks(running)).await;
    drop(nested);
    let output = output.into_result();
    if let Err(error) = &output
        && !finality.is_some_and(|f| (f.is_final)(error))
        && store.aborted(claimed, request).await
    {
        return None;
    }
    Some((output, hooks))
}

/// The conflict of a try whose body's error only reports that the database aborted its
/// transaction.
fn aborted_body() -> Error {
    Error::conflict("running the handler's body, whose transaction was aborted")
}
