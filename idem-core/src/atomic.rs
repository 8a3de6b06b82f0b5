//! Atomic mode, what `#[idempotent]` expands to by default: claim the key in a transaction,
//! run the body in that transaction, then record the result and commit, or release (roll
//! back). A replay or an idem error answers without running the body.

use std::marker::PhantomData;

use crate::call::{Call, RETRY_AFTER, Request, collecting_hooks};
use crate::flight;
use crate::handler::{Finality, HandlerError, HandlerOutput, Replayable};
use crate::metrics::{self, Label};
use crate::outcome;
use crate::store::{Claim, Concurrency, Recorded, Store};

/// Claims the key of `call` on `store`. `Ok` hands out the guard whose transaction the body
/// runs in; `Err` carries the call's final answer (a replay, or an error) and the body must
/// not run.
pub async fn claim<S, R>(
    store: S,
    call: Call,
    finality: Option<Finality<R::Error>>,
) -> Result<Guard<S, R>, R>
where
    S: Store,
    R: HandlerOutput,
    R::Ok: Replayable,
    R::Error: HandlerError,
{
    let request = call.prepare::<R>(finality.is_some())?;
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
                return Err(request.fail(request.in_flight(RETRY_AFTER)));
            }
            flight::Role::Follower(flight) => {
                match tokio::time::timeout_at(deadline, flight::landing(flight)).await {
                    Ok(Some(recorded)) => return Err(request.replay(&recorded, finality)),
                    Ok(None) => {} // the first call recorded nothing: claim in the store
                    Err(_elapsed) => return Err(request.fail(request.in_flight(RETRY_AFTER))),
                }
            }
        }
    }
    let claimed = match tokio::time::timeout_at(deadline, store.claim(&request)).await {
        Ok(claimed) => claimed,
        Err(_elapsed) => Ok(Claim::InFlight),
    };
    match claimed {
        Ok(Claim::Execute(claimed)) => Ok(Guard {
            store,
            claimed,
            request,
            finality,
            nested: outcome::Nested::enter(),
            leader,
            _output: PhantomData,
        }),
        Ok(Claim::Recorded(recorded)) => {
            let answer = request.replay(&recorded, finality);
            if let Some(leader) = leader {
                leader.land(Some(recorded));
            }
            Err(answer)
        }
        Ok(Claim::InFlight) => Err(request.fail(request.in_flight(RETRY_AFTER))),
        Err(e) => Err(request.fail(e)),
    }
}

/// A claimed key: the body runs in [`Guard::tx`], then [`Guard::finish`] records or releases.
/// Dropping a guard without finishing rolls everything back (the store's transaction is
/// dropped), so a cancelled call leaves nothing behind.
#[derive(Debug)]
pub struct Guard<S: Store, R: HandlerOutput> {
    store: S,
    claimed: S::Claimed,
    request: Request,
    finality: Option<Finality<R::Error>>,
    /// Keeps nested calls from reporting while the body runs; dropped by `finish`, or with
    /// the guard when the call is cancelled.
    nested: outcome::Nested,
    /// This call's single flight, if it leads one: landed with the recorded answer, or empty
    /// when dropped.
    leader: Option<flight::Leader>,
    _output: PhantomData<fn() -> R>,
}

impl<S: Store, R: HandlerOutput> Guard<S, R>
where
    R::Ok: Replayable,
    R::Error: HandlerError,
{
    /// The transaction the body runs in.
    pub fn tx(&self) -> &S::Tx {
        S::tx(&self.claimed)
    }

    /// Runs the body inside the call's tracing span, so the handler's own logs carry the
    /// scope and key hash.
    pub fn in_span<F: Future>(&self, body: F) -> tracing::instrument::Instrumented<F> {
        tracing::Instrument::instrument(body, self.request.span().clone())
    }

    /// Records the body's result and commits, or releases the key, and returns what the
    /// caller gets.
    pub async fn finish(self, output: R) -> R {
        let Self {
            store,
            claimed,
            request,
            finality,
            nested,
            leader,
            ..
        } = self;
        drop(nested);
        let record = match request.record_of(output, finality) {
            Ok(record) => record,
            Err(answer) => {
                // Nothing to record: roll back so a retry executes again. A failed rollback
                // changes nothing for the caller: the dropped transaction rolls back anyway.
                let _ = store.release(claimed).await;
                return answer;
            }
        };
        match store
            .record(claimed, &request, record.status, &record.payload)
            .await
        {
            Ok(()) => {
                if let Some(leader) = leader {
                    // Committed: duplicates waiting in this process replay it from memory.
                    let recorded = leader.has_followers().then(|| Recorded {
                        fingerprint: request.fingerprint(),
                        status: record.status,
                        payload: record.payload,
                    });
                    leader.land(recorded);
                }
                request.executed(record.answer)
            }
            Err(e) => {
                tracing::warn!(parent: request.span(), error = %e, "recording failed; rolled back");
                metrics::settle(request.span(), Label::Error);
                R::from_result(Err(e.into()))
            }
        }
    }
}

/// What `#[idempotent]` expands to: claims the key on `store`, runs the body in the claim's
/// transaction (inside the call's tracing span), then records or releases. A replay or an idem
/// error returns without running the body. Every bound on the handler's return type is here,
/// on one call, so an unsuitable type is one compile error.
pub fn run<S, R, F>(
    store: S,
    call: Call,
    finality: Option<Finality<R::Error>>,
    body: F,
) -> impl Future<Output = R>
where
    S: Store,
    R: HandlerOutput,
    R::Ok: Replayable,
    R::Error: HandlerError,
    F: AsyncFnOnce(&S::Tx) -> R,
{
    // Counted once, when the answer is known (feature `metrics`; without it, `observe` hands
    // the call back as it is: no extra future around it).
    let scope = call.site().scope();
    metrics::observe(scope, async move {
        let guard = match claim::<S, R>(store, call, finality).await {
            Ok(guard) => guard,
            Err(answer) => return answer,
        };
        let (output, hooks) = collecting_hooks(guard.in_span(body(guard.tx()))).await;
        let answer = guard.finish(output).await;
        // The call's transaction has ended (committed, or rolled back and the hooks find
        // nothing to do).
        hooks.iter().for_each(|hook| hook());
        answer
    })
}
