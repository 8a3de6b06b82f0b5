//! Atomic mode observed ([`Mode::Observe`](crate::Mode::Observe)): the call is decided as
//! [`run`](super::run) decides it (single flight, the claim, conflict retries), the decision is
//! reported ([`observe::report`]), and the body runs whatever was decided. A call enforcing
//! would execute runs its body in the claim's transaction and records its answer, as
//! enforcing does; every other call runs its body unclaimed, as with idem switched off
//! ([`unclaimed`]), and records nothing.

use super::{Try, flight, in_claim, unclaimed};
use crate::call::handler::{Finality, HandlerError, HandlerOutput, Replayable, Verdict};
use crate::call::outcome::{self, Outcome};
use crate::call::{Call, Request};
use crate::error::Error;
use crate::ledger::{Claim, Concurrency, Recorded};
use crate::metrics::{self, Label};
use crate::observe;
use crate::retry::conflict::Tries;
use crate::store::Store;

/// What observe mode made of a call.
enum Decided<R> {
    /// Enforcing would have run the body, and it ran, in the claim's transaction: its answer,
    /// and what enforcing counts it as (`executed`, or `released` for a transient error).
    Ran(R, Label),
    /// Enforcing would have answered without the body (a replay, a 409 or 422, an error of
    /// idem's), or idem's own recording failed after it: the body is still to run, unclaimed.
    Unclaimed(Label),
}

/// A call in observe mode: decided, reported, and answered by its body.
pub(super) async fn observed<S, R, F, B>(
    store: &S,
    call: Call,
    finality: Option<Finality<R::Error>>,
    mut bodies: F,
) -> R
where
    S: Store,
    R: HandlerOutput,
    R::Ok: Replayable,
    R::Error: HandlerError,
    F: FnMut() -> Result<B, Error>,
    B: for<'t> AsyncFnOnce(S::Tx<'t>) -> R,
{
    // The call is counted once, as `observed` (the first note wins, so the labels the
    // decision's own paths note are not counted); the decision has its own counter.
    metrics::note(Label::Observed);
    let scope = call.site().scope();
    let request = match call.check(finality.is_some()) {
        Ok(request) => request,
        Err(e) => {
            // No record id without a valid key: the event names none.
            observe::report(scope, "", &tracing::Span::current(), Label::of_error(&e));
            return answered_by_body(store, bodies).await;
        }
    };
    let decided = decide(store, &request, finality, &mut bodies).await;
    let (answer, decision) = match decided {
        Decided::Ran(answer, decision) => (Some(answer), decision),
        Decided::Unclaimed(decision) => (None, decision),
    };
    observe::report(scope, &request.key_hash(), request.span(), decision);
    metrics::settle(request.span(), Label::Observed);
    match answer {
        Some(answer) => {
            outcome::report(Outcome::Executed);
            answer
        }
        None => {
            let span = request.span().clone();
            tracing::Instrument::instrument(answered_by_body(store, bodies), span).await
        }
    }
}

/// The body run unclaimed, reported as executed (it ran; nothing was replayed).
async fn answered_by_body<S, R, F, B>(store: &S, bodies: F) -> R
where
    S: Store,
    R: HandlerOutput,
    R::Error: HandlerError,
    F: FnMut() -> Result<B, Error>,
    B: for<'t> AsyncFnOnce(S::Tx<'t>) -> R,
{
    let nested = outcome::Nested::enter();
    let answer = unclaimed(store, bodies).await;
    drop(nested);
    outcome::report(Outcome::Executed);
    answer
}

/// Decides the call as [`run`](super::run) does, running the body only where enforcing would.
async fn decide<S, R, F, B>(
    store: &S,
    request: &Request,
    finality: Option<Finality<R::Error>>,
    bodies: &mut F,
) -> Decided<R>
where
    S: Store,
    R: HandlerOutput,
    R::Ok: Replayable,
    R::Error: HandlerError,
    F: FnMut() -> Result<B, Error>,
    B: for<'t> AsyncFnOnce(S::Tx<'t>) -> R,
{
    let bound = match request.concurrency() {
        Concurrency::Wait { bound } => bound,
        _ => Concurrency::DEFAULT_BOUND,
    };
    let deadline = tokio::time::Instant::now() + bound;
    let mut leader = None;
    if let Some(ledger) = store.ledger_identity() {
        match flight::join(ledger, *request.id()) {
            flight::Role::Leader(l) => leader = Some(l),
            flight::Role::Follower(_) if request.concurrency() == Concurrency::Reject => {
                return Decided::Unclaimed(Label::InFlight);
            }
            flight::Role::Follower(flight) => {
                match tokio::time::timeout_at(deadline, flight::landing(flight)).await {
                    Ok(Some(recorded)) => {
                        let decision = request.replay_decision::<R>(&recorded, finality);
                        return Decided::Unclaimed(decision);
                    }
                    Ok(None) => {} // the first call recorded nothing: claim in the store
                    Err(_elapsed) => return Decided::Unclaimed(Label::InFlight),
                }
            }
        }
    }
    let mut tries = Tries::new();
    loop {
        let conflict = match attempt(store, request, finality, &mut leader, bodies, deadline).await
        {
            Try::Answered(decided) => return decided,
            Try::Conflict(conflict) => conflict,
        };
        if let Err(e) = tries.again(request.scope(), conflict).await {
            return unclaimed_after(request, &e);
        }
    }
}

/// One try, as [`attempt`](super::attempt) runs it, but an answer enforcing would give without
/// the body is only a decision, and idem's own failure after the body is logged, not answered.
async fn attempt<S, R, F, B>(
    store: &S,
    request: &Request,
    finality: Option<Finality<R::Error>>,
    leader: &mut Option<flight::Leader>,
    bodies: &mut F,
    deadline: tokio::time::Instant,
) -> Try<Decided<R>>
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
            let decision = request.replay_decision::<R>(&recorded, finality);
            if let Some(leader) = leader.take() {
                leader.land(Some(recorded));
            }
            return Try::Answered(Decided::Unclaimed(decision));
        }
        Ok(Claim::InFlight) => return Try::Answered(Decided::Unclaimed(Label::InFlight)),
        Err(e) if e.is_conflict() => return Try::Conflict(e),
        Err(e) => return Try::Answered(unclaimed_after(request, &e)),
    };
    let body = match bodies() {
        Ok(body) => body,
        Err(e) => {
            // The body cannot run again (an argument that is not `Clone` went into a try the
            // database aborted): enforcing answers this error, and so does the unclaimed run.
            let _ = store.release(claimed).await;
            return Try::Answered(unclaimed_after(request, &e));
        }
    };
    let Some((output, hooks)) = in_claim(store, request, finality, &mut claimed, body).await else {
        let _ = store.release(claimed).await;
        return Try::Conflict(super::aborted_body());
    };
    let record = match request.verdict(R::from_result(output), finality) {
        Verdict::Record(record) => record,
        Verdict::Release(error) => {
            // A transient error: nothing recorded, the key free, as when enforcing; the
            // caller gets the body's error.
            let _ = store.release(claimed).await;
            hooks.iter().for_each(|hook| hook());
            return Try::Answered(Decided::Ran(R::from_result(Err(error)), Label::Released));
        }
        Verdict::Unencodable(e) => {
            // Enforcing would fail the call; the body's writes are rolled back with the claim,
            // so the body runs again, unclaimed, and answers.
            let _ = store.release(claimed).await;
            return Try::Answered(unclaimed_after(request, &e));
        }
    };
    match store
        .record(claimed, request, record.status, &record.payload)
        .await
    {
        Ok(()) => {
            if let Some(leader) = leader.take() {
                let recorded = leader.has_followers().then(|| Recorded {
                    fingerprint: request.fingerprint(),
                    status: record.status,
                    payload: record.payload,
                });
                leader.land(recorded);
            }
            hooks.iter().for_each(|hook| hook());
            Try::Answered(Decided::Ran(R::from_result(record.answer), Label::Executed))
        }
        Err(e) if e.is_conflict() => Try::Conflict(e),
        // The body's writes went with the claim's transaction: it runs again, unclaimed.
        Err(e) => Try::Answered(unclaimed_after(request, &e)),
    }
}

/// The decision of a call for which enforcing would answer idem's error `e`: logged as
/// enforcing logs it, and the body is to run unclaimed.
fn unclaimed_after<R>(request: &Request, e: &Error) -> Decided<R> {
    Decided::Unclaimed(observe::decision_on_error(request.span(), e))
}
