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
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use crate::engine::{Call, Finality, HandlerError, HandlerOutput, Replayable, Verdict, verdict};
use crate::error::Error;
use crate::metrics::{self, Label};
use crate::outcome::{self, Outcome};
use crate::store::{ClaimRequest, RecordStatus, Recorded};

/// A boxed, sendable future (lease stores are used behind `dyn`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a lease claim hands out: the record, the fencing token and the lease end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Ticket {
    /// The record id (SHA-256 of scope, principal, key).
    pub id: [u8; 32],
    /// The fencing token: 1 for the first holder, one more for every takeover. Every write of
    /// the holder is checked against it.
    pub token: i64,
    /// When the lease ends, in epoch milliseconds on the store's clock.
    pub lease_end_ms: i64,
}

impl Ticket {
    /// A ticket (stores build them).
    pub fn new(id: [u8; 32], token: i64, lease_end_ms: i64) -> Self {
        Self {
            id,
            token,
            lease_end_ms,
        }
    }
}

/// What a lease claim found.
#[derive(Debug)]
#[non_exhaustive]
pub enum LeaseClaim {
    /// The key is ours (new, or taken over after its lease ended): run the body. `steps` are
    /// the recovery points an earlier holder recorded, by name.
    Execute {
        /// The lease.
        ticket: Ticket,
        /// Recorded steps: name and serialised value.
        steps: Vec<(String, Vec<u8>)>,
    },
    /// The key has a completed record.
    Recorded(Recorded),
    /// Another holder's lease is live.
    InFlight {
        /// Until its lease ends.
        retry_after: Duration,
    },
}

/// A ledger store that supports lease mode. Owned and shareable (`'static`), because the
/// lease outlives the claim: the renewal task and the steps reach it while the body runs.
pub trait LeaseStore: Send + Sync + 'static {
    /// Claims `req.id` with a lease of `lease` and commits: a new record (token 1), a takeover
    /// of an in-progress record whose lease ended (token + 1, its steps), the completed record,
    /// or the live lease's remaining time.
    fn claim_lease<'a>(
        &'a self,
        req: &'a ClaimRequest<'a>,
        lease: Duration,
    ) -> BoxFuture<'a, Result<LeaseClaim, Error>>;

    /// Extends the lease to `lease` from now, if `ticket` still holds it.
    fn renew<'a>(&'a self, ticket: &'a Ticket, lease: Duration)
    -> BoxFuture<'a, Result<(), Error>>;

    /// Records step `name` with `payload`, if `ticket` still holds the lease.
    fn record_step<'a>(
        &'a self,
        ticket: &'a Ticket,
        name: &'a str,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<(), Error>>;

    /// Records the call's outcome (kept for `ttl` from now), if `ticket` still holds the
    /// lease, and forgets its steps.
    fn complete<'a>(
        &'a self,
        ticket: &'a Ticket,
        status: RecordStatus,
        payload: &'a [u8],
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), Error>>;

    /// Ends the lease now, keeping the steps: a retry takes over at once and resumes.
    fn release_lease<'a>(&'a self, ticket: &'a Ticket) -> BoxFuture<'a, Result<(), Error>>;
}

/// The lease of the call running in this task.
struct Context {
    scope: &'static str,
    principal: String,
    key: String,
    ticket: Ticket,
    store: Arc<dyn LeaseStore>,
    steps: Mutex<HashMap<String, Vec<u8>>>,
    lost: AtomicBool,
}

impl Context {
    fn lost(&self) -> Error {
        Error::LeaseLost {
            scope: self.scope.to_owned(),
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

/// The key a step sends downstream (`Idempotency-Key`): SHA-256 over scope, principal, key and
/// step name (length-prefixed), as `idem-` and 64 hex digits. Stable across attempts and
/// takeovers, distinct per step, 69 bytes.
pub fn derived_key(scope: &str, principal: &str, key: &str, step: &str) -> String {
    let mut hasher = Sha256::new();
    for part in [scope, principal, key, step] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    let digest: [u8; 32] = hasher.finalize().into();
    let mut out = String::with_capacity(69);
    out.push_str("idem-");
    for b in digest {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// Runs `run` once as the recovery point `name` of the current lease-mode call, and records
/// its value durably before returning it. On a takeover, a recorded step is not run again:
/// its recorded value is returned.
///
/// `run` gets the step's derived key ([`derived_key`]): send it downstream as the
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
    let key = derived_key(context.scope, &context.principal, &context.key, name);
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
                scope: context.scope.to_owned(),
                key: context.key.clone(),
                source: format!("recorded step `{name}`: {e}").into(),
            })
        })
        .transpose()
}

fn encode_step<T: Serialize>(context: &Context, value: &T) -> Result<Vec<u8>, Error> {
    serde_json::to_vec(value).map_err(|e| Error::Encode {
        scope: context.scope.to_owned(),
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
            .field("scope", &self.0.scope)
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
                Err(e) => tracing::warn!(scope = context.scope, error = %e, "lease renewal failed"),
            }
        }
    }))
}

/// What `#[idempotent(..., lease = "…")]` expands to: claims a lease (committed), runs the body
/// outside any claim transaction with its steps fenced by the lease, renews the lease while the
/// body runs, then records the result if the lease still holds. A transient error ends the
/// lease at once, keeping the recorded steps, so a retry resumes after them.
///
/// `call`'s store is not used: `store` holds the leases.
pub fn run_lease<S, R, F>(
    call: Call<S>,
    store: Arc<dyn LeaseStore>,
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
    metrics::observe(scope, lease_call(call, store, lease, finality, body))
}

/// [`run_lease`] without its metrics.
async fn lease_call<S, R, F>(
    call: Call<S>,
    store: Arc<dyn LeaseStore>,
    lease: Duration,
    finality: Option<Finality<R::Error>>,
    body: F,
) -> R
where
    R: HandlerOutput,
    R::Ok: Replayable,
    R::Error: HandlerError,
    F: AsyncFnOnce() -> R,
{
    let (_, prepared) = match call.prepare() {
        Ok(parts) => parts,
        Err(e) => {
            metrics::note(Label::of_error(&e));
            return R::from_result(Err(e.into()));
        }
    };
    let site = prepared.site;
    let request = prepared.request(0, false);
    // `wait("…")` polls for the holder's result until its bound; `reject` answers at once.
    let deadline = match site.concurrency() {
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
                let wake = (tokio::time::Instant::now() + pause.min(*retry_after)).min(deadline);
                tokio::time::sleep_until(wake).await;
                pause = (pause * 2).min(Duration::from_millis(250));
            }
            _ => break claimed,
        }
    };
    let (ticket, steps) = match claimed {
        Ok(LeaseClaim::Execute { ticket, steps }) => (ticket, steps),
        Ok(LeaseClaim::Recorded(recorded)) => return prepared.replay(&recorded, finality),
        Ok(LeaseClaim::InFlight { retry_after }) => {
            return prepared.fail(Error::InFlight {
                scope: site.scope().to_owned(),
                retry_after,
            });
        }
        Err(e) => return prepared.fail(e),
    };
    let context = Arc::new(Context {
        scope: site.scope(),
        principal: prepared
            .principal
            .as_ref()
            .map_or_else(String::new, |p| p.as_str().to_owned()),
        key: prepared.key.as_str().to_owned(),
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
            tracing::Instrument::instrument(body(), prepared.span.clone()),
        )
        .await;
    drop(nested);
    drop(renewal);
    let (status, payload, answer) = match verdict(output, finality) {
        Verdict::Record {
            status,
            payload,
            answer,
        } => (status, payload, answer),
        Verdict::Release(error) => {
            // Transient: hand the key to the next attempt now, with the steps done so far.
            let _ = store.release_lease(&ticket).await;
            metrics::settle(&prepared.span, Label::Released);
            return R::from_result(Err(error));
        }
    };
    let payload = match payload {
        Ok(payload) => payload,
        Err(e) => {
            let _ = store.release_lease(&ticket).await;
            return prepared.fail(Error::Encode {
                scope: site.scope().to_owned(),
                source: Box::new(e),
            });
        }
    };
    match store.complete(&ticket, status, &payload, site.ttl()).await {
        Ok(()) => {
            metrics::settle(&prepared.span, Label::Executed);
            outcome::report(Outcome::Executed);
            R::from_result(answer)
        }
        Err(e) if e.kind() == crate::ErrorKind::LeaseLost => prepared.fail(context.lost()),
        Err(e) => prepared.fail(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_keys_are_stable_distinct_per_step_and_short() {
        let a = derived_key("shop.pay", "", "k-1", "charge");
        assert_eq!(a, derived_key("shop.pay", "", "k-1", "charge"));
        assert_ne!(a, derived_key("shop.pay", "", "k-1", "refund"));
        assert_ne!(a, derived_key("shop.pay", "p", "k-1", "charge"));
        // Shifted boundaries give other keys (length-prefixed parts).
        assert_ne!(
            derived_key("ab", "", "c", "d"),
            derived_key("a", "", "bc", "d")
        );
        let long = derived_key(&"s".repeat(255), &"p".repeat(255), &"k".repeat(255), "x");
        assert_eq!(long.len(), 69);
        assert!(
            crate::Key::new(long).is_ok(),
            "usable as an idempotency key"
        );
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
