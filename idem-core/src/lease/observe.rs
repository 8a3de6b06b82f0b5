//! Lease mode observed ([`Mode::Observe`](crate::Mode::Observe)): the call is decided as
//! [`run_lease`](super::run_lease) decides it (the key checked, the answers remembered, the
//! lease claimed, waiting or not), the decision is reported ([`observe::report`]), and the
//! body runs whatever was decided. A call enforcing would execute holds the lease and records
//! its answer, as enforcing does ([`Holding::Observed`]); every other call runs its body under
//! a lease of a fresh in-memory store ([`Holding::InMemory`]), so its steps and final phase
//! work, and nothing of it is kept.

use std::sync::Arc;
use std::time::Duration;

use super::{Held, Holding, claim, execute};
use crate::MemoryStore;
use crate::call::handler::{Finality, HandlerError, HandlerOutput, Replayable};
use crate::call::outcome::{self, Outcome};
use crate::call::{Call, Request, Site};
use crate::error::Error;
use crate::ledger::LeaseClaim;
use crate::metrics::{self, Label};
use crate::observe;
use crate::store::LeaseStore;

/// A lease-mode call in observe mode: decided, reported, and answered by its body.
pub(super) async fn observed<R, F, B>(
    store: Arc<dyn LeaseStore>,
    call: Call,
    lease: Duration,
    finality: Option<Finality<R::Error>>,
    bodies: F,
) -> R
where
    R: HandlerOutput,
    R::Ok: Replayable,
    R::Error: HandlerError,
    F: FnMut() -> Result<B, Error>,
    B: AsyncFnOnce() -> R,
{
    // The call is counted once, as `observed` (the first note wins, so the labels the
    // decision's own paths note are not counted); the decision has its own counter.
    metrics::note(Label::Observed);
    let site = call.site();
    let deadline = call.deadline_for(lease);
    let request = match call.check(false) {
        Ok(request) => request,
        Err(e) => {
            // No record id without a valid key: the event names none, and the body runs
            // under a request of its own.
            observe::report(
                site.scope(),
                "",
                &tracing::Span::current(),
                Label::of_error(&e),
            );
            return match placeholder(site) {
                Ok(request) => in_memory(request, lease, deadline, finality, bodies).await,
                Err(e) => R::from_result(Err(e.into())),
            };
        }
    };
    let decision = match request.recent_answer() {
        Some(recorded) => request.replay_decision::<R>(&recorded, finality),
        None => match claim(&*store, &request, lease).await {
            Ok(LeaseClaim::Execute { ticket, steps }) => {
                let (scope, key_hash, span) =
                    (request.scope(), request.key_hash(), request.span().clone());
                let held = Held {
                    store,
                    request,
                    ticket,
                    steps,
                    lease,
                    deadline,
                };
                let (answer, decision) = execute(held, Holding::Observed, finality, bodies).await;
                observe::report(scope, &key_hash, &span, decision);
                metrics::settle(&span, Label::Observed);
                outcome::report(Outcome::Executed);
                return answer;
            }
            Ok(LeaseClaim::Recorded(recorded)) => request.replay_decision::<R>(&recorded, finality),
            Ok(LeaseClaim::InFlight { .. }) => Label::InFlight,
            Err(e) => observe::decision_on_error(request.span(), &e),
        },
    };
    observe::report(
        request.scope(),
        &request.key_hash(),
        request.span(),
        decision,
    );
    let span = request.span().clone();
    let answer = in_memory(request, lease, deadline, finality, bodies).await;
    // After the in-memory run, which notes its own outcome in the span.
    metrics::settle(&span, Label::Observed);
    answer
}

/// Runs the body as enforcing would not have run it: under a lease of a fresh in-memory
/// store (so the claim is always this call's), its answer recorded nowhere that lasts.
async fn in_memory<R, F, B>(
    request: Request,
    lease: Duration,
    deadline: Duration,
    finality: Option<Finality<R::Error>>,
    bodies: F,
) -> R
where
    R: HandlerOutput,
    R::Ok: Replayable,
    R::Error: HandlerError,
    F: FnMut() -> Result<B, Error>,
    B: AsyncFnOnce() -> R,
{
    let store: Arc<dyn LeaseStore> = Arc::new(MemoryStore::new());
    let (ticket, steps) = match store.claim_lease(&request, lease).await {
        Ok(LeaseClaim::Execute { ticket, steps }) => (ticket, steps),
        // A fresh store holds no other claim: never reached.
        Ok(_) => {
            let e = Error::Store {
                message: "observe mode: a fresh in-memory lease store refused a claim".to_owned(),
                source: None,
            };
            return R::from_result(Err(e.into()));
        }
        Err(e) => return R::from_result(Err(e.into())),
    };
    let held = Held {
        store,
        request,
        ticket,
        steps,
        lease,
        deadline,
    };
    let (answer, _) = execute(held, Holding::InMemory, finality, bodies).await;
    outcome::report(Outcome::Executed);
    answer
}

/// A request for a call whose own key was refused, so its body can run under a lease.
fn placeholder(site: &'static Site) -> Result<Request, Error> {
    Call::new(site, "observe-mode-invalid-key").check(false)
}
