//! One call of an idempotent handler: its [`Site`] (the attribute's static description), the
//! [`Call`] the generated code builds from the arguments, and the [`Request`] it becomes once
//! its key, principal and fingerprint have passed their checks. The request is the call's one
//! shape from then on: claims, records, leases and steps read it by reference.

pub(crate) mod answers;
#[doc(hidden)]
pub mod handler;
pub(crate) mod key;
pub(crate) mod outcome;

use std::cell::RefCell;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::call::answers::RecentAnswers;
use crate::call::handler::{
    Finality, Fingerprintable, HandlerError, HandlerOutput, Record, Replayable, StoredArgument,
    Verdict, verdict,
};
use crate::call::key::{Key, KeySource, derived_key, record_id};
use crate::call::outcome::Outcome;
use crate::error::Error;
use crate::fingerprint::{Fingerprint, FingerprintError, Fingerprinter, Fingerprints};
use crate::ledger::ids::KeyHash;
use crate::ledger::{Concurrency, RecordStatus, Recorded};
use crate::metrics::{self, Label};
use crate::observe::Mode;
use crate::versioned::{AnswerError, AnswerVersion, NEWER_RETRY_AFTER};

/// A lease-mode call's deadline when its attribute gives none, in leases: 5 minutes for a
/// 30 s lease. Past its deadline a call's body is dropped and its lease ended
/// ([`Error::DeadlineExceeded`]): a body that hangs (a step awaiting a call without a timeout)
/// would otherwise renew its lease, and hold its key, for as long as its process lives.
pub const DEFAULT_DEADLINE_LEASES: u32 = 10;

/// How long a caller should wait before retrying a key that is in flight in atomic mode.
pub(crate) const RETRY_AFTER: Duration = Duration::from_secs(1);

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

    /// The site of a call configured at run time (a tower layer's route or gRPC method):
    /// one per distinct scope, TTL and policy in the process, made once and kept for the
    /// process's life, so the engine's `&'static Site` holds without a leak per layer or
    /// request. Call it when configuring, not per request (it takes a lock).
    pub fn interned(scope: &str, ttl: Duration, concurrency: Concurrency) -> &'static Site {
        static SITES: Mutex<Vec<&'static Site>> = Mutex::new(Vec::new());
        let mut sites = SITES.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(site) = sites
            .iter()
            .find(|s| s.scope == scope && s.ttl == ttl && s.concurrency == concurrency)
        {
            return site;
        }
        let scope: &'static str = match sites.iter().find(|s| s.scope == scope) {
            Some(known) => known.scope,
            None => Box::leak(scope.to_owned().into_boxed_str()),
        };
        let site: &'static Site = Box::leak(Box::new(Site::new(scope, ttl, concurrency)));
        sites.push(site);
        site
    }
}

/// One call of an idempotent handler, before its checks: built from its site and key, then
/// given its principal and arguments. [`run`](crate::atomic::run) and
/// [`run_lease`](crate::lease::run_lease) take it with the store they use.
#[derive(Debug)]
pub struct Call {
    site: &'static Site,
    key: Result<Key, Error>,
    principal: Result<Option<Key>, Error>,
    fingerprint: Fingerprinter,
    fingerprint_error: Option<FingerprintError>,
    /// A resumable call's arguments, as a JSON array being written (`None` for others).
    stored: Option<Result<Vec<u8>, String>>,
    answers: Option<Arc<RecentAnswers>>,
    versions: Versions,
    /// Lease mode: how long the body may run in all (`None`: the default, a multiple of the
    /// lease).
    deadline: Option<Duration>,
    /// How long the record is kept: the site's, unless set at run time ([`Call::ttl`]).
    ttl: Duration,
    /// Whether idem acts on its decision or only reports it ([`Call::mode`]).
    mode: Mode,
}

/// The versions a call's answers are recorded and read as: its value's and its final
/// error's ([`Versioned`](crate::Versioned); version 1 for types without one).
#[derive(Debug, Clone, Copy)]
struct Versions {
    value: AnswerVersion,
    error: AnswerVersion,
}

impl Versions {
    /// The version of what a record of `status` holds.
    fn of(self, status: RecordStatus) -> AnswerVersion {
        match status {
            RecordStatus::Failed => self.error,
            _ => self.value,
        }
    }
}

impl Call {
    /// Starts a call of the handler at `site` with the key taken from `key` (the attribute's
    /// key expression): an invalid or missing key fails the call when it runs.
    pub fn new<K: KeySource + ?Sized>(site: &'static Site, key: &K) -> Self {
        Self::with_key_result(site, key.to_key())
    }

    /// Starts a call of the handler at `site` whose key was read already, or failed to be (a
    /// transport layer's header): an `Err` fails the call when it runs, counted as such.
    pub fn with_key_result(site: &'static Site, key: Result<Key, Error>) -> Self {
        Self {
            site,
            key,
            principal: Ok(None),
            fingerprint: Fingerprinter::new(site.scope),
            fingerprint_error: None,
            stored: None,
            answers: None,
            versions: Versions {
                value: AnswerVersion::UNVERSIONED,
                error: AnswerVersion::UNVERSIONED,
            },
            deadline: None,
            ttl: site.ttl,
            mode: Mode::Enforce,
        }
    }

    /// Sets whether idem acts on what it decides for this call ([`Mode::Enforce`], the
    /// default) or only reports it while the body runs every time ([`Mode::Observe`]:
    /// `#[idempotent(..., mode = observe)]`), in atomic and lease mode.
    pub fn mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    /// Whether this call is run in observe mode.
    pub(crate) fn observing(&self) -> bool {
        self.mode == Mode::Observe
    }

    /// Sets how long this call's record is kept, in place of its site's TTL: a TTL read
    /// from configuration (`#[idempotent(..., ttl = settings.ttl)]`, any expression of type
    /// [`Duration`]). The store measures it on its own clock from the claim; a resumable
    /// call stores it with its arguments, so its completer keeps it too. A zero TTL is
    /// accepted and deduplicates nothing: every retry finds the record expired and runs
    /// again.
    pub fn ttl(&mut self, ttl: Duration) {
        self.ttl = ttl;
    }

    /// Sets how long a lease-mode call's body may run in all, from its claim: past it the
    /// body is dropped and its lease ended, and the caller gets
    /// [`Error::DeadlineExceeded`] (`#[idempotent(..., deadline = "5m")]`). Without it,
    /// [`DEFAULT_DEADLINE_LEASES`](DEFAULT_DEADLINE_LEASES) leases.
    pub fn deadline(&mut self, deadline: Duration) {
        self.deadline = Some(deadline);
    }

    /// The deadline of a lease-mode call whose lease is `lease`.
    pub(crate) fn deadline_for(&self, lease: Duration) -> Duration {
        self.deadline
            .unwrap_or_else(|| lease.saturating_mul(DEFAULT_DEADLINE_LEASES))
    }

    /// Sets the versions the call's answers are recorded and read as: its value's and its
    /// final error's (the generated code passes each type's
    /// [`Versioned`](crate::Versioned) version, or version 1). Without it, both are version 1.
    pub fn answer_versions(&mut self, value: AnswerVersion, error: AnswerVersion) {
        self.versions = Versions { value, error };
    }

    /// Replays from `answers` when it holds this call's record, and keeps the answer there
    /// when this call records one (lease mode), so a retry this process receives needs no
    /// round trip to the store.
    pub fn remember_answers(&mut self, answers: &Arc<RecentAnswers>) {
        self.answers = Some(Arc::clone(answers));
    }

    /// Adds an argument to those stored with a resumable call's claim (a JSON array, in the
    /// order they are added), from which a completer rebuilds the call.
    pub fn store_arg<T: StoredArgument>(&mut self, value: &T) {
        let stored = self.stored.get_or_insert_with(|| Ok(vec![b'[']));
        let Ok(bytes) = stored else { return };
        if bytes.len() > 1 {
            bytes.push(b',');
        }
        if let Err(e) = serde_json::to_writer(&mut *bytes, value) {
            *stored = Err(e.to_string());
        }
    }

    /// Sets the principal the key belongs to, taken from `principal` as a key is: one that is
    /// not a valid key fails the call when it runs.
    pub fn principal<K: KeySource + ?Sized>(&mut self, principal: &K) {
        self.principal = principal.to_key().map(Some);
    }

    /// Adds an unnamed argument to the fingerprint ([`Fingerprinter::arg`]).
    pub fn arg<T: Fingerprintable + ?Sized>(&mut self, value: &T) {
        self.fingerprinted(|f| f.arg(value));
    }

    /// Adds the argument `name` to the fingerprint ([`Fingerprinter::named`]): what
    /// `#[idempotent]` does for each parameter, so one added as `None` keeps the fingerprint.
    pub fn named_arg<T: Fingerprintable + ?Sized>(&mut self, name: &'static str, value: &T) {
        self.fingerprinted(|f| f.named(name, value));
    }

    /// Adds the argument `name` as `current`, where version 1 of the fingerprint had `v1`
    /// ([`Fingerprinter::changed`]).
    pub fn changed_arg<C, V>(&mut self, name: &'static str, current: &C, v1: &V)
    where
        C: Fingerprintable + ?Sized,
        V: Fingerprintable + ?Sized,
    {
        self.fingerprinted(|f| f.changed(name, current, v1));
    }

    /// Adds to the fingerprint unless an argument already failed (the first error is the
    /// call's answer).
    fn fingerprinted(
        &mut self,
        add: impl FnOnce(&mut Fingerprinter) -> Result<(), FingerprintError>,
    ) {
        if self.fingerprint_error.is_none()
            && let Err(e) = add(&mut self.fingerprint)
        {
            self.fingerprint_error = Some(e);
        }
    }

    /// The handler's description.
    pub fn site(&self) -> &'static Site {
        self.site
    }

    /// Checks the key, the principal and the fingerprint: everything a claim needs, before
    /// any store work. An invalid call is counted (feature `metrics`) and answered here.
    pub(crate) fn prepare<R>(self, savepoint: bool) -> Result<Request, R>
    where
        R: HandlerOutput,
        R::Error: HandlerError,
    {
        self.check(savepoint).map_err(|e| {
            metrics::note(Label::of_error(&e));
            R::from_result(Err(e.into()))
        })
    }

    /// The checks of [`Call::prepare`], answering idem's error itself (observe mode reports
    /// it and runs the body).
    pub(crate) fn check(self, savepoint: bool) -> Result<Request, Error> {
        let site = self.site;
        let key = self.key?;
        let principal = self.principal?;
        if let Some(e) = self.fingerprint_error {
            return Err(e.into_error(site.scope));
        }
        let stored_args = self
            .stored
            .map(|stored| stored_args(site.scope, stored))
            .transpose()?;
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
        Ok(Request {
            site,
            key,
            principal,
            fingerprint: self.fingerprint.finish_versions(),
            id,
            savepoint,
            span,
            stored_args,
            answers: self.answers,
            versions: self.versions,
            ttl: self.ttl,
        })
    }
}

/// What a give-up records in the ledger: `{"attempts": n, "reason": "..."}`.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct GiveUpRecord {
    pub(crate) attempts: u32,
    pub(crate) reason: String,
}

/// The answer a recorded give-up replays as.
pub(crate) fn gave_up_error(scope: &str, payload: &[u8]) -> Error {
    let record: GiveUpRecord = serde_json::from_slice(payload).unwrap_or(GiveUpRecord {
        attempts: 0,
        reason: "no reason was recorded".to_owned(),
    });
    Error::GaveUp {
        scope: scope.to_owned(),
        attempts: record.attempts,
        reason: record.reason,
    }
}

/// The most bytes a resumable call's stored arguments may take (a JSON array).
pub const MAX_STORED_ARGS: usize = 64 * 1024;

/// Closes a resumable call's argument array and checks its size.
fn stored_args(scope: &str, stored: Result<Vec<u8>, String>) -> Result<Vec<u8>, Error> {
    let mut bytes = stored.map_err(|message| Error::Fingerprint {
        scope: scope.to_owned(),
        message: format!("the arguments cannot be stored for resuming: {message}"),
    })?;
    bytes.push(b']');
    let limit = MAX_STORED_ARGS;
    if bytes.len() > limit {
        return Err(Error::ArgumentsTooLarge {
            scope: scope.to_owned(),
            size: bytes.len(),
            limit,
        });
    }
    Ok(bytes)
}

/// A call whose key, principal and fingerprint passed their checks: what a store claims,
/// records and leases. It lives from the checks to the call's last statement and is only
/// ever lent out.
#[derive(Debug)]
pub struct Request {
    site: &'static Site,
    key: Key,
    principal: Option<Key>,
    fingerprint: Fingerprints,
    id: [u8; 32],
    savepoint: bool,
    span: tracing::Span,
    stored_args: Option<Vec<u8>>,
    answers: Option<Arc<RecentAnswers>>,
    versions: Versions,
    ttl: Duration,
}

impl Request {
    /// The operation's scope, e.g. `orders.pay`.
    pub fn scope(&self) -> &'static str {
        self.site.scope
    }

    /// Tenant, user or client the key belongs to; empty when the scope has none.
    pub fn principal(&self) -> &str {
        self.principal.as_ref().map_or("", Key::as_str)
    }

    /// The idempotency key.
    pub fn key(&self) -> &str {
        self.key.as_str()
    }

    /// Record id: SHA-256 over scope, principal and key (length-prefixed, [`record_id`]).
    pub fn id(&self) -> &[u8; 32] {
        &self.id
    }

    /// Fingerprint of the call's arguments, under the current version: what a record of
    /// this call is written with.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint.current()
    }

    /// The call's fingerprints under every version a record may carry: compare a record's
    /// fingerprint with [`Fingerprints::matches`], so records an earlier release wrote keep
    /// matching their retries.
    pub fn fingerprints(&self) -> &Fingerprints {
        &self.fingerprint
    }

    /// How long a recorded result is kept (measured on the store's clock).
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The concurrency policy.
    pub fn concurrency(&self) -> Concurrency {
        self.site.concurrency
    }

    /// Whether the store must take a savepoint after the claim, so a final error can roll
    /// back the handler's writes and still record itself.
    pub fn savepoint(&self) -> bool {
        self.savepoint
    }

    /// A resumable call's arguments (a JSON array), which the store keeps with the claim so
    /// that a completer can rebuild the call; `None` for a call that is not resumable.
    pub fn stored_args(&self) -> Option<&[u8]> {
        self.stored_args.as_deref()
    }

    /// The key step `step` of this call sends downstream ([`derived_key`]).
    pub fn derived_key(&self, step: &str) -> String {
        derived_key(self.scope(), self.principal(), self.key(), step)
    }

    /// The call's tracing span (`idem`, with scope, key hash, principal and outcome).
    pub fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// The record id's hash as log lines name the call (keys can carry user data).
    pub(crate) fn key_hash(&self) -> String {
        KeyHash(&self.id).to_string()
    }

    /// This call's answer, if this process recorded it recently ([`Call::remember_answers`]).
    pub(crate) fn recent_answer(&self) -> Option<Arc<Recorded>> {
        self.answers.as_ref()?.get(&self.id)
    }

    /// Whether answers recorded for this call are remembered in memory.
    pub(crate) fn remembers_answers(&self) -> bool {
        self.answers.is_some()
    }

    /// Remembers the answer just recorded for this call, for its TTL from `since` (taken
    /// before the store started the record's TTL).
    pub(crate) fn remember(&self, status: RecordStatus, payload: Vec<u8>, since: Instant) {
        if let Some(answers) = &self.answers {
            let recorded = Recorded {
                fingerprint: self.fingerprint.current(),
                status,
                payload,
            };
            answers.keep(self.id, recorded, since, self.ttl());
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

    /// Ends the call as executed: its answer was recorded.
    pub(crate) fn executed<R: HandlerOutput>(&self, answer: Result<R::Ok, R::Error>) -> R {
        metrics::settle(&self.span, Label::Executed);
        outcome::report(Outcome::Executed);
        R::from_result(answer)
    }

    /// Sorts the body's output: `Ok` with what to record; `Err` with the answer of an output that records nothing (a
    /// transient error releases the key; a value that cannot be encoded fails the call), for
    /// the caller to give after it freed the key.
    pub(crate) fn record_of<R>(
        &self,
        output: R,
        finality: Option<Finality<R::Error>>,
    ) -> Result<Record<R::Ok, R::Error>, R>
    where
        R: HandlerOutput,
        R::Ok: Replayable,
        R::Error: HandlerError,
    {
        match self.verdict(output, finality) {
            Verdict::Record(record) => Ok(record),
            Verdict::Release(error) => {
                metrics::settle(&self.span, Label::Released);
                Err(R::from_result(Err(error)))
            }
            Verdict::Unencodable(e) => Err(self.fail(e)),
        }
    }

    /// Sorts the body's output as [`Request::record_of`] does, with no answer given: what to
    /// record (behind its version's envelope), or why nothing is.
    pub(crate) fn verdict<R>(
        &self,
        output: R,
        finality: Option<Finality<R::Error>>,
    ) -> Verdict<R::Ok, R::Error>
    where
        R: HandlerOutput,
        R::Ok: Replayable,
    {
        match verdict(self.scope(), output, finality) {
            Verdict::Record(mut record) => {
                let version = self.versions.of(record.status);
                record.payload = version.envelope(record.payload);
                Verdict::Record(record)
            }
            other => other,
        }
    }

    /// [`Error::InFlight`] for this call, retried after `retry_after`.
    pub(crate) fn in_flight(&self, retry_after: Duration) -> Error {
        Error::InFlight {
            scope: self.scope().to_owned(),
            retry_after,
        }
    }

    /// Answers from a recorded outcome: the value or final error it holds (upcast from the
    /// version it was recorded as), `KeyReused` for other arguments, `AnswerTooNew` when a
    /// newer version of the type recorded it, `AnswerUnreadable` when it no longer reads as
    /// the handler's types.
    pub(crate) fn replay<R>(&self, recorded: &Recorded, finality: Option<Finality<R::Error>>) -> R
    where
        R: HandlerOutput,
        R::Ok: Replayable,
        R::Error: HandlerError,
    {
        match self.replayed::<R>(recorded, finality) {
            Ok(answer) => {
                metrics::settle(&self.span, Label::Replayed);
                outcome::report(Outcome::Replayed);
                R::from_result(answer)
            }
            Err(e) => self.fail(e),
        }
    }

    /// What replaying `recorded` would answer, and nothing else: the label observe mode
    /// reports for it.
    pub(crate) fn replay_decision<R>(
        &self,
        recorded: &Recorded,
        finality: Option<Finality<R::Error>>,
    ) -> Label
    where
        R: HandlerOutput,
        R::Ok: Replayable,
        R::Error: HandlerError,
    {
        match self.replayed::<R>(recorded, finality) {
            Ok(_) => Label::Replayed,
            Err(e) => Label::of_error(&e),
        }
    }

    /// The answer `recorded` replays as, or the error of idem's a replay answers instead;
    /// nothing is counted or reported.
    fn replayed<R>(
        &self,
        recorded: &Recorded,
        finality: Option<Finality<R::Error>>,
    ) -> Result<Result<R::Ok, R::Error>, Error>
    where
        R: HandlerOutput,
        R::Ok: Replayable,
        R::Error: HandlerError,
    {
        let scope = self.scope();
        if !self.fingerprint.matches(&recorded.fingerprint) {
            return Err(Error::KeyReused {
                scope: scope.to_owned(),
            });
        }
        let payload = &recorded.payload;
        match recorded.status {
            RecordStatus::Completed => self
                .versions
                .value
                .decode_with(payload, |json| serde_json::from_slice(json))
                .map(Ok)
                .map_err(|e| self.unreadable(e)),
            RecordStatus::Failed if let Some(f) = finality => self
                .versions
                .error
                .decode_with(payload, f.decode)
                .map(Err)
                .map_err(|e| self.unreadable(e)),
            RecordStatus::Failed => Err(self.unreadable(AnswerError::Unreadable {
                recorded: crate::versioned::recorded_version(payload).unwrap_or(0),
                expected: self.versions.error.version(),
                message: "a final error was recorded, but the handler's error type no longer implements `idem::FinalError`".to_owned(),
            })),
            // A give-up is answered as an error of idem's, the same on every retry.
            RecordStatus::GaveUp => Ok(Err(gave_up_error(
                scope,
                &recorded.payload,
            )
            .into())),
            _ => Err(self.in_flight(RETRY_AFTER)),
        }
    }

    /// The error of a recorded answer this call cannot read. It names the key by its hash,
    /// as the call's log lines do: keys can carry user data.
    fn unreadable(&self, e: AnswerError) -> Error {
        let (scope, key_hash) = (self.scope().to_owned(), KeyHash(&self.id).to_string());
        match e {
            AnswerError::Newer { recorded, known } => Error::AnswerTooNew {
                scope,
                key_hash,
                recorded,
                known,
                retry_after: NEWER_RETRY_AFTER,
            },
            AnswerError::Unreadable {
                recorded,
                expected,
                message,
            } => Error::AnswerUnreadable {
                scope,
                key_hash,
                recorded,
                expected,
                source: message.into(),
            },
        }
    }
}

tokio::task_local! {
    static AFTER_COMMIT: RefCell<Vec<fn()>>;
}

/// Asks the engine to call `hook` once the idempotent call running in this task has ended:
/// committed, in atomic mode; recorded (its final phase committed), in lease mode. The outbox
/// wakes its relays this way after a body staged messages. Returns `false` when no such call
/// is running in this task: then nobody will call it.
pub fn after_commit(hook: fn()) -> bool {
    AFTER_COMMIT
        .try_with(|hooks| {
            let mut hooks = hooks.borrow_mut();
            if !hooks.iter().any(|h| std::ptr::fn_addr_eq(*h, hook)) {
                hooks.push(hook);
            }
        })
        .is_ok()
}

/// Runs a handler body, collecting the hooks it asks for with [`after_commit`].
pub(crate) async fn collecting_hooks<F: Future>(body: F) -> (F::Output, Vec<fn()>) {
    AFTER_COMMIT
        .scope(RefCell::new(Vec::new()), async move {
            let output = body.await;
            (output, AFTER_COMMIT.with(RefCell::take))
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn hooks_asked_for_in_a_body_are_collected_once_and_none_outside() {
        fn hook() {}
        let (inside, hooks) =
            collecting_hooks(async { after_commit(hook) && after_commit(hook) }).await;
        assert!(inside);
        assert_eq!(hooks.len(), 1, "the same hook is collected once");
        let ((), hooks) = collecting_hooks(async {}).await;
        assert!(hooks.is_empty());
        assert!(!after_commit(hook), "outside a body nobody collects");
    }
}
