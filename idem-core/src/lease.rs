//! Lease mode: for handlers whose effects leave the database (a payment gateway, an email).
//!
//! The claim commits first, as in progress, with a lease end on the database clock and a
//! fencing token that grows with every takeover. The body runs outside any claim transaction;
//! its [`step`]s (recovery points) are recorded durably, each fenced by the token, and a
//! takeover replays them instead of running them again. The result is recorded only if the
//! token still holds. A holder that ran past its lease finds out at its next step or at
//! completion ([`Error::LeaseLost`]); its work is rejected and rolled back.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::call::{Call, Request};
use crate::error::Error;
use crate::handler::{Finality, HandlerError, HandlerOutput, Replayable};
use crate::metrics;
use crate::outcome;
use crate::store::{LeaseClaim, LeaseStore, Ticket};

/// The lease of the call running in this task.
struct Context {
    request: Request,
    ticket: Ticket,
    store: Arc<dyn LeaseStore>,
    steps: Mutex<HashMap<String, Vec<u8>>>,
    lost: AtomicBool,
}

impl Context {
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
/// `run` gets the step's derived key ([`derived_key`](crate::ids::derived_key)): send it downstream as the
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
    if context.lost.load(Ordering::SeqCst) {
        return Err(context.lost().into());
    }
    let key = context.request.derived_key(name);
    let value = run(key).await?;
    let payload = encode_step(&context, &value)?;
    if let Err(e) = context
        .store
        .record_step(&context.ticket, name, &payload)
        .await
    {
        if e.kind() == crate::ErrorKind::LeaseLost {
            context.lost.store(true, Ordering::SeqCst);
            return Err(context.lost().into());
        }
        return Err(e.into());
    }
    note_step(&context, name, payload);
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

    /// A step's recorded value, if it was recorded.
    pub fn recorded<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, Error> {
        recorded_step(&self.0, name)
    }

    /// Serialises a step's value.
    pub fn encode<T: Serialize>(&self, value: &T) -> Result<Vec<u8>, Error> {
        encode_step(&self.0, value)
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

    /// Whether the lease is known to be lost.
    pub fn is_lost(&self) -> bool {
        self.0.lost.load(Ordering::SeqCst)
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
pub fn run_lease<R, F>(
    store: Arc<dyn LeaseStore>,
    call: Call,
    lease: Duration,
    finality: Option<Finality<R::Error>>,
    body: F,
) -> impl Future<Output = R>
where
    R: HandlerOutput,
    R::Ok: Replayable,
    R::Error: HandlerError,
    F: AsyncFnOnce() -> R,
{
    // Counted once, when the answer is known (feature `metrics`; without it, `observe` hands
    // the call back as it is).
    let scope = call.site().scope();
    metrics::observe(scope, async move {
        let request = match call.prepare::<R>(false) {
            Ok(request) => request,
            Err(answer) => return answer,
        };
        // `wait("…")` polls for the holder's result until its bound; `reject` answers at once.
        let deadline = match request.concurrency() {
            crate::Concurrency::Wait { bound } => Some(tokio::time::Instant::now() + bound),
            _ => None,
        };
        let mut pause = Duration::from_millis(10);
        let claimed = loop {
            let claimed = store.claim_lease(&request, lease).await;
            match (&claimed, deadline) {
                (Ok(LeaseClaim::InFlight { retry_after }), Some(deadline))
                    if tokio::time::Instant::now() < deadline =>
                {
                    let wake =
                        (tokio::time::Instant::now() + pause.min(*retry_after)).min(deadline);
                    tokio::time::sleep_until(wake).await;
                    pause = (pause * 2).min(Duration::from_millis(250));
                }
                _ => break claimed,
            }
        };
        let (ticket, steps) = match claimed {
            Ok(LeaseClaim::Execute { ticket, steps }) => (ticket, steps),
            Ok(LeaseClaim::Recorded(recorded)) => return request.replay(&recorded, finality),
            Ok(LeaseClaim::InFlight { retry_after }) => {
                return request.fail(request.in_flight(retry_after));
            }
            Err(e) => return request.fail(e),
        };
        let span = request.span().clone();
        let context = Arc::new(Context {
            request,
            ticket,
            store: Arc::clone(&store),
            steps: Mutex::new(steps.into_iter().collect()),
            lost: AtomicBool::new(false),
        });
        let renewal = renew_in_background(Arc::clone(&context), lease);
        let nested = outcome::Nested::enter();
        let output = LEASE
            .scope(
                Arc::clone(&context),
                tracing::Instrument::instrument(body(), span),
            )
            .await;
        drop(nested);
        drop(renewal);
        let request = &context.request;
        let record = match request.record_of(output, finality) {
            Ok(record) => record,
            Err(answer) => {
                // Nothing to record: hand the key to the next attempt now, with the steps
                // done so far.
                let _ = store.release_lease(&ticket).await;
                return answer;
            }
        };
        match store
            .complete(&ticket, request, record.status, &record.payload)
            .await
        {
            Ok(()) => request.executed(record.answer),
            Err(e) if e.kind() == crate::ErrorKind::LeaseLost => request.fail(context.lost()),
            Err(e) => request.fail(e),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
