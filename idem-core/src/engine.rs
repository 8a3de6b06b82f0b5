//! The store-independent engine behind `#[idempotent]`: build the call, claim, run the body
//! in the claim's transaction, record or release, replay.

use std::hash::{BuildHasher, Hasher};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use crate::error::{BoxError, Error};
use crate::fingerprint::{FingerprintError, Fingerprinter};
use crate::flight;
use crate::key::Key;
use crate::metrics::{self, Label};
use crate::outcome::{self, Outcome};
use crate::store::{Claim, ClaimRequest, Concurrency, RecordStatus, Recorded, Store};

/// How long a caller should wait before retrying an in-flight key.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The static description of one `#[idempotent]` function.
#[derive(Debug)]
pub struct Site {
    scope: &'static str,
    ttl: Duration,
    concurrency: Concurrency,
}

impl Site {
    /// Describes a handler: its scope, how long results are kept, and its concurrency policy.
    pub const fn new(scope: &'static str, ttl: Duration, concurrency: Concurrency) -> Self {
        Self {
            scope,
            ttl,
            concurrency,
        }
    }

    /// The scope literal.
    pub const fn scope(&self) -> &'static str {
        self.scope
    }

    /// How long recorded results are kept.
    pub const fn ttl(&self) -> Duration {
        self.ttl
    }

    /// How a concurrent duplicate is treated.
    pub const fn concurrency(&self) -> Concurrency {
        self.concurrency
    }
}

/// The return type of a handler: `Result<T, E>`.
pub trait HandlerOutput: Sized {
    /// The success type, recorded and replayed.
    type Ok;
    /// The handler's error type.
    type Error;
    /// Splits into a `Result`.
    fn into_result(self) -> Result<Self::Ok, Self::Error>;
    /// Builds from a `Result`.
    fn from_result(result: Result<Self::Ok, Self::Error>) -> Self;
}

impl<T, E> HandlerOutput for Result<T, E> {
    type Ok = T;
    type Error = E;
    fn into_result(self) -> Self {
        self
    }
    fn from_result(result: Self) -> Self {
        result
    }
}

/// A value `#[idempotent]` can record and replay: anything serde can write and read back.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be recorded and replayed by `#[idempotent]`",
    label = "the `Ok` type of this return type must be recordable",
    note = "derive `serde::Serialize` and `serde::Deserialize` for `{Self}`"
)]
pub trait Replayable: Serialize + DeserializeOwned {}
#[diagnostic::do_not_recommend] // report `T: Replayable` (with its note), not each serde trait
impl<T: Serialize + DeserializeOwned> Replayable for T {}

/// The error type of an `#[idempotent]` handler: it must absorb idem's own errors.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot carry idem's errors",
    label = "the error type of this return type needs `From<idem::Error>`",
    note = "add `impl From<idem::Error> for {Self}` (for example a `#[error(transparent)] Idem(#[from] idem::Error)` variant)"
)]
pub trait HandlerError: From<Error> {}
#[diagnostic::do_not_recommend] // report `E: HandlerError` (with its note), not `From`
impl<E: From<Error>> HandlerError for E {}

/// An argument `#[idempotent]` can fingerprint: anything serde can write.
#[diagnostic::on_unimplemented(
    message = "argument of type `{Self}` cannot be fingerprinted by `#[idempotent]`",
    label = "this argument goes into the fingerprint",
    note = "derive `serde::Serialize` for `{Self}`, or leave the argument out of the fingerprint with `skip(<name>)`"
)]
pub trait Fingerprintable: Serialize {}
#[diagnostic::do_not_recommend] // report `T: Fingerprintable` (with its note), not `Serialize`
impl<T: Serialize + ?Sized> Fingerprintable for T {}

/// An error type whose deterministic failures (card declined, invalid transition) are
/// recorded and replayed like results, instead of releasing the key.
///
/// Without this impl every `Err` releases the key, so a retry executes again. With it,
/// errors for which [`is_final`](FinalError::is_final) is `true` roll back the handler's
/// writes but commit the recorded error; a retry gets the same error back.
pub trait FinalError: Serialize + DeserializeOwned {
    /// Whether this error is deterministic: retrying the same request would fail the same way.
    fn is_final(&self) -> bool;
}

/// How the engine treats a handler's errors; built by [`FinalProbe`].
#[derive(Debug)]
pub struct Finality<E> {
    is_final: fn(&E) -> bool,
    encode: fn(&E) -> serde_json::Result<Vec<u8>>,
    decode: fn(&[u8]) -> serde_json::Result<E>,
}

impl<E> Clone for Finality<E> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<E> Copy for Finality<E> {}

impl<E: FinalError> Finality<E> {
    fn of() -> Self {
        Self {
            is_final: E::is_final,
            encode: |e| serde_json::to_vec(e),
            decode: |bytes| serde_json::from_slice(bytes),
        }
    }
}

/// Chooses [`Finality`] by whether `E: FinalError` (autoref specialisation: the generated
/// code calls `(&&FinalProbe::<E>::new()).finality()`).
#[derive(Debug)]
pub struct FinalProbe<E>(PhantomData<fn() -> E>);

impl<E> FinalProbe<E> {
    /// A probe for `E`.
    #[allow(clippy::new_without_default)] // only the generated code builds probes
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}

/// Chosen when `E: FinalError`.
pub trait ViaFinal<E> {
    /// `Some` for error types that can be final.
    fn finality(&self) -> Option<Finality<E>>;
}
impl<E: FinalError> ViaFinal<E> for &FinalProbe<E> {
    fn finality(&self) -> Option<Finality<E>> {
        Some(Finality::of())
    }
}

/// Chosen for every other error type.
pub trait ViaPlain<E> {
    /// `None`: every error releases the key.
    fn finality(&self) -> Option<Finality<E>>;
}
impl<E> ViaPlain<E> for FinalProbe<E> {
    fn finality(&self) -> Option<Finality<E>> {
        None
    }
}

/// One call of an idempotent handler, before its claim.
#[derive(Debug)]
pub struct Call<S> {
    site: &'static Site,
    store: S,
    key: Result<Key, Error>,
    principal: Result<Option<Key>, Error>,
    fingerprint: Fingerprinter,
    fingerprint_error: Option<FingerprintError>,
}

impl<S> Call<S> {
    /// Starts a call of the handler at `site` with `key`.
    pub fn new(site: &'static Site, store: S, key: Result<Key, Error>) -> Self {
        Self {
            site,
            store,
            key,
            principal: Ok(None),
            fingerprint: Fingerprinter::new(site.scope),
            fingerprint_error: None,
        }
    }

    /// Sets the principal the key belongs to.
    pub fn principal(&mut self, principal: Result<Key, Error>) {
        self.principal = principal.map(Some);
    }

    /// Adds an argument to the fingerprint.
    pub fn arg<T: Fingerprintable + ?Sized>(&mut self, value: &T) {
        if self.fingerprint_error.is_none()
            && let Err(e) = self.fingerprint.arg(value)
        {
            self.fingerprint_error = Some(e);
        }
    }

    /// The handler's description.
    pub(crate) fn site(&self) -> &'static Site {
        self.site
    }

    /// Checks the key, the principal and the fingerprint: everything a claim needs, before
    /// any store work.
    pub(crate) fn prepare(self) -> Result<(S, Prepared), Error> {
        let site = self.site;
        let key = self.key?;
        let principal = self.principal?;
        if let Some(e) = self.fingerprint_error {
            return Err(e.into_error(site.scope));
        }
        let fingerprint = self.fingerprint.finish();
        let id = record_id(
            site.scope,
            principal.as_ref().map_or("", Key::as_str),
            key.as_str(),
        );
        let span = tracing::info_span!(
            "idem",
            scope = site.scope,
            key_hash = %KeyHash(&id),
            principal = principal.as_ref().map_or("", Key::as_str),
            outcome = tracing::field::Empty,
        );
        // The raw key only at debug level: keys can carry user data.
        tracing::debug!(parent: &span, key = key.as_str(), "claiming");
        Ok((
            self.store,
            Prepared {
                site,
                key,
                principal,
                fingerprint,
                id,
                span,
            },
        ))
    }
}

impl<S: Store> Call<S> {
    /// Claims the key. `Ok` hands out the transaction to run the body in; `Err` carries the
    /// call's final answer (a replay, or an error) and the body must not run.
    pub async fn claim<R>(self, finality: Option<Finality<R::Error>>) -> Result<Guard<S, R>, R>
    where
        R: HandlerOutput,
        R::Ok: Replayable,
        R::Error: HandlerError,
    {
        let (store, prepared) = match self.prepare() {
            Ok(parts) => parts,
            Err(e) => {
                metrics::note(Label::of_error(&e));
                return Err(R::from_result(Err(e.into())));
            }
        };
        let site = prepared.site;
        let request = prepared.request(random_token(), finality.is_some());
        let bound = match site.concurrency {
            Concurrency::Wait { bound } => bound,
            _ => Concurrency::DEFAULT_BOUND,
        };
        let deadline = tokio::time::Instant::now() + bound;
        // Single flight: a duplicate of a call running in this process waits for it in memory
        // and replays its answer; only the first call (or, if it recorded nothing, each
        // duplicate in turn) goes to the store, where the database decides across processes.
        let mut leader = None;
        if let Some(ledger) = store.ledger_identity() {
            match flight::join(ledger, prepared.id) {
                flight::Role::Leader(l) => leader = Some(l),
                flight::Role::Follower(_) if matches!(site.concurrency, Concurrency::Reject) => {
                    return Err(prepared.fail(Error::InFlight {
                        scope: site.scope.to_owned(),
                        retry_after: RETRY_AFTER,
                    }));
                }
                flight::Role::Follower(flight) => {
                    match tokio::time::timeout_at(deadline, flight::landing(flight)).await {
                        Ok(Some(recorded)) => return Err(prepared.replay(&recorded, finality)),
                        Ok(None) => {} // the first call recorded nothing: claim in the store
                        Err(_elapsed) => {
                            return Err(prepared.fail(Error::InFlight {
                                scope: site.scope.to_owned(),
                                retry_after: RETRY_AFTER,
                            }));
                        }
                    }
                }
            }
        }
        let claimed = match tokio::time::timeout_at(deadline, store.claim(&request)).await {
            Ok(claimed) => claimed,
            Err(_elapsed) => Ok(Claim::InFlight),
        };
        match claimed {
            Ok(Claim::Execute(tx)) => {
                let request = OwnedRequest::from(&request);
                Ok(Guard {
                    store,
                    tx,
                    site,
                    request,
                    key: prepared.key,
                    finality,
                    span: prepared.span,
                    nested: outcome::Nested::enter(),
                    leader,
                    _output: PhantomData,
                })
            }
            Ok(Claim::Recorded(recorded)) => {
                let answer = prepared.replay(&recorded, finality);
                if let Some(leader) = leader {
                    leader.land(Some(recorded));
                }
                Err(answer)
            }
            Ok(Claim::InFlight) => Err(prepared.fail(Error::InFlight {
                scope: site.scope.to_owned(),
                retry_after: RETRY_AFTER,
            })),
            Err(e) => Err(prepared.fail(e)),
        }
    }
}

/// A call whose key, principal and fingerprint passed their checks.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub(crate) site: &'static Site,
    pub(crate) key: Key,
    pub(crate) principal: Option<Key>,
    pub(crate) fingerprint: crate::Fingerprint,
    pub(crate) id: [u8; 32],
    pub(crate) span: tracing::Span,
}

impl Prepared {
    /// The store's view of this call.
    pub(crate) fn request(&self, owner: i64, savepoint: bool) -> ClaimRequest<'_> {
        ClaimRequest {
            scope: self.site.scope,
            principal: self.principal.as_ref().map_or("", Key::as_str),
            key: self.key.as_str(),
            id: self.id,
            fingerprint: self.fingerprint,
            owner,
            ttl: self.site.ttl,
            concurrency: self.site.concurrency,
            savepoint,
        }
    }

    /// Ends the call with an idem error, logged in its span.
    pub(crate) fn fail<R: HandlerOutput>(&self, e: Error) -> R
    where
        R::Error: HandlerError,
    {
        let label = Label::of_error(&e);
        metrics::settle(&self.span, label);
        if label == Label::Error {
            tracing::warn!(parent: &self.span, error = %e, "call failed");
        }
        R::from_result(Err(e.into()))
    }

    /// Answers from a recorded outcome: the value or final error it holds, `KeyReused` for
    /// other arguments, `Decode` when it no longer reads as the handler's types.
    pub(crate) fn replay<R>(&self, recorded: &Recorded, finality: Option<Finality<R::Error>>) -> R
    where
        R: HandlerOutput,
        R::Ok: Replayable,
        R::Error: HandlerError,
    {
        let scope = self.site.scope;
        if recorded.fingerprint != self.fingerprint {
            return self.fail(Error::KeyReused {
                scope: scope.to_owned(),
            });
        }
        let decode_error = |source: BoxError| Error::Decode {
            scope: scope.to_owned(),
            key: self.key.as_str().to_owned(),
            source,
        };
        let replay: Result<Result<R::Ok, R::Error>, Error> = match recorded.status {
            RecordStatus::Completed => serde_json::from_slice(&recorded.payload)
                .map(Ok)
                .map_err(|e| decode_error(e.into())),
            RecordStatus::Failed if let Some(f) = finality => (f.decode)(&recorded.payload)
                .map(Err)
                .map_err(|e| decode_error(e.into())),
            RecordStatus::Failed => Err(decode_error(
                "a final error was recorded, but the handler's error type no longer implements `idem::FinalError`".into(),
            )),
            _ => Err(Error::InFlight {
                scope: scope.to_owned(),
                retry_after: RETRY_AFTER,
            }),
        };
        match replay {
            Ok(answer) => {
                metrics::settle(&self.span, Label::Replayed);
                outcome::report(Outcome::Replayed);
                R::from_result(answer)
            }
            Err(e) => self.fail(e),
        }
    }
}

/// The parts of a [`ClaimRequest`] a guard keeps for the record step.
#[derive(Debug)]
struct OwnedRequest {
    principal: String,
    id: [u8; 32],
    fingerprint: crate::Fingerprint,
    owner: i64,
    savepoint: bool,
}

impl From<&ClaimRequest<'_>> for OwnedRequest {
    fn from(r: &ClaimRequest<'_>) -> Self {
        Self {
            principal: r.principal.to_owned(),
            id: r.id,
            fingerprint: r.fingerprint,
            owner: r.owner,
            savepoint: r.savepoint,
        }
    }
}

/// A claimed key: the body runs in [`Guard::tx`], then [`Guard::finish`] records or releases.
/// Dropping a guard without finishing rolls everything back (the store's transaction is
/// dropped), so a cancelled call leaves nothing behind.
#[derive(Debug)]
pub struct Guard<S: Store, R: HandlerOutput> {
    store: S,
    tx: S::Tx,
    site: &'static Site,
    request: OwnedRequest,
    key: Key,
    finality: Option<Finality<R::Error>>,
    span: tracing::Span,
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
        &self.tx
    }

    /// Runs the body inside the call's tracing span, so the handler's own logs carry the
    /// scope and key hash.
    pub fn in_span<F: std::future::Future>(&self, body: F) -> tracing::instrument::Instrumented<F> {
        tracing::Instrument::instrument(body, self.span.clone())
    }

    /// Records the body's result and commits, or releases the key, and returns what the
    /// caller gets.
    pub async fn finish(self, output: R) -> R {
        let Self {
            store,
            tx,
            site,
            request,
            key,
            finality,
            span,
            nested,
            leader,
            ..
        } = self;
        drop(nested);
        let request = ClaimRequest {
            scope: site.scope,
            principal: &request.principal,
            key: key.as_str(),
            id: request.id,
            fingerprint: request.fingerprint,
            owner: request.owner,
            ttl: site.ttl,
            concurrency: site.concurrency,
            savepoint: request.savepoint,
        };
        let encode_error = |source: serde_json::Error| Error::Encode {
            scope: site.scope.to_owned(),
            source: Box::new(source),
        };
        let (status, payload, answer) = match verdict(output, finality) {
            Verdict::Record {
                status,
                payload,
                answer,
            } => (status, payload, answer),
            Verdict::Release(error) => {
                // A transient error: roll back so a retry executes again. A failed rollback
                // changes nothing for the caller: the dropped transaction rolls back anyway.
                let _ = store.release(tx).await;
                metrics::settle(&span, Label::Released);
                return R::from_result(Err(error));
            }
        };
        let recorded = match payload {
            Ok(payload) => store
                .record(tx, &request, status, &payload)
                .await
                .map(|()| payload),
            Err(e) => {
                let _ = store.release(tx).await;
                Err(encode_error(e))
            }
        };
        R::from_result(match recorded {
            Ok(payload) => {
                if let Some(leader) = leader {
                    // Committed: duplicates waiting in this process replay it from memory.
                    let recorded = leader.has_followers().then_some(Recorded {
                        fingerprint: request.fingerprint,
                        status,
                        payload,
                    });
                    leader.land(recorded);
                }
                metrics::settle(&span, Label::Executed);
                outcome::report(Outcome::Executed);
                answer
            }
            Err(e) => {
                metrics::settle(&span, Label::Error);
                tracing::warn!(parent: &span, error = %e, "recording failed; rolled back");
                Err(e.into())
            }
        })
    }
}

/// What a handler's output means for its record.
pub(crate) enum Verdict<T, E> {
    /// Record `payload` (the value, or a final error) with `status`; the caller gets `answer`.
    Record {
        status: RecordStatus,
        payload: serde_json::Result<Vec<u8>>,
        answer: Result<T, E>,
    },
    /// A transient error: record nothing, free the key.
    Release(E),
}

/// Sorts a handler's output: values and final errors are recorded, other errors release.
pub(crate) fn verdict<R: HandlerOutput>(
    output: R,
    finality: Option<Finality<R::Error>>,
) -> Verdict<R::Ok, R::Error>
where
    R::Ok: Replayable,
{
    match output.into_result() {
        Ok(value) => Verdict::Record {
            status: RecordStatus::Completed,
            payload: serde_json::to_vec(&value),
            answer: Ok(value),
        },
        Err(error) if let Some(f) = finality.filter(|f| (f.is_final)(&error)) => Verdict::Record {
            status: RecordStatus::Failed,
            payload: (f.encode)(&error),
            answer: Err(error),
        },
        Err(error) => Verdict::Release(error),
    }
}

/// What `#[idempotent]` expands to: claims the key, runs the body in the claim's transaction
/// (inside the call's tracing span), then records or releases. A replay or an idem error
/// returns without running the body. Every bound on the handler's return type is here, on one
/// call, so an unsuitable type is one compile error.
pub fn run<S, R, F>(
    call: Call<S>,
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
    metrics::observe(scope, atomic_call(call, finality, body))
}

/// [`run`] without its metrics.
async fn atomic_call<S, R, F>(call: Call<S>, finality: Option<Finality<R::Error>>, body: F) -> R
where
    S: Store,
    R: HandlerOutput,
    R::Ok: Replayable,
    R::Error: HandlerError,
    F: AsyncFnOnce(&S::Tx) -> R,
{
    let guard = match call.claim::<R>(finality).await {
        Ok(guard) => guard,
        Err(answer) => return answer,
    };
    let (output, staged) = crate::outbox::tracking_staged(guard.in_span(body(guard.tx()))).await;
    let answer = guard.finish(output).await;
    if staged {
        // The call's messages are committed (or rolled back, and a relay finds nothing).
        crate::outbox::wake();
    }
    answer
}

/// The first 8 bytes of a record id in hex: identifies a key in logs without revealing it.
struct KeyHash<'a>(&'a [u8; 32]);

impl std::fmt::Display for KeyHash<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0[..8].iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// The ledger id of `(scope, principal, key)`: SHA-256 over the length-prefixed parts, so no
/// two different triples share an id.
pub fn record_id(scope: &str, principal: &str, key: &str) -> [u8; 32] {
    let mut hasher = Sha256::new();
    for part in [scope, principal, key] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    hasher.finalize().into()
}

/// A random positive 63-bit token: record owners, relay rounds, lease owners (no extra
/// dependency: std's randomly keyed SipHash over a process-wide counter).
pub fn random_token() -> i64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::hash::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    (hasher.finish() >> 1) as i64
}
