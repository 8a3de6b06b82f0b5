//! Finishing lease-mode calls without their clients: the [`Completer`].
//!
//! A resumable handler (`#[idempotent(..., lease = "30s", resumable)]`) stores its arguments
//! with its claim, in the same write. When its lease ends without the call finishing (the
//! process crashed, hung, or the call failed transiently) and no client comes back, a
//! completer takes the call over exactly as a client retry would: it rebuilds the arguments,
//! runs the handler registered for the scope, the lease's fencing token grows by one, recorded
//! steps replay, the rest runs, and the answer is recorded, so the client's late retry gets a
//! replay. Completers in any number of processes share the work: each attempt is claimed in the
//! store first (one completer wins it), and the lease's fence keeps effects single even if a
//! completer and a client race.
//!
//! After [`max_attempts`](Completer::max_attempts) attempts that did not finish the call (or
//! when its stored arguments no longer rebuild it), the completer **gives up**: the ledger
//! records [`RecordStatus::GaveUp`](crate::RecordStatus::GaveUp), fenced like a takeover
//! (token + 1, so a holder still running cannot record anything after it), every retry of the
//! key answers [`Error::GaveUp`], and the [`on_give_up`](Completer::on_give_up) hook runs with
//! the call's recorded steps, to compensate. The hook runs at least once: a completer that
//! crashes before the hook reported success leaves it owed, and another completer runs it
//! again after [`HOOK_RETRY`]; use [`GaveUp::idempotency_key`] for the compensation.

use std::collections::HashMap;
use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;

use crate::call::GiveUpRecord;
use crate::call::key::derived_key;
use crate::call::outcome::with_outcome;
use crate::error::Error;
use crate::ledger::BoxFuture;
use crate::retry::{Backoff, Jitter};

pub use crate::call::MAX_STORED_ARGS;

/// How many attempts a completer makes at a call before giving it up, by default.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 10;

/// How long a completer that took a give-up hook has before another completer runs it again.
pub const HOOK_RETRY: Duration = Duration::from_secs(30);

/// A resumable call that a completer may work on, as its store hands it out.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredCall {
    /// The record id.
    pub id: Vec<u8>,
    /// The handler's scope.
    pub scope: String,
    /// The principal the key belongs to (empty when none).
    pub principal: String,
    /// The idempotency key.
    pub key: String,
    /// The stored arguments (a JSON array).
    pub args: Vec<u8>,
    /// Attempts completers have started so far.
    pub attempts: u32,
    /// The last attempt's error.
    pub last_error: Option<String>,
    /// Whether the call was given up and its give-up hook is still owed.
    pub gave_up: bool,
    /// Whether the call's final phase committed: its database effects are done, so it is
    /// completed (attempted again), never given up.
    pub final_phase_done: bool,
}

impl StoredCall {
    /// A stored call, as a store reads it.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: Vec<u8>,
        scope: String,
        principal: String,
        key: String,
        args: Vec<u8>,
        attempts: u32,
        last_error: Option<String>,
        gave_up: bool,
    ) -> Self {
        Self {
            id,
            scope,
            principal,
            key,
            args,
            attempts,
            last_error,
            gave_up,
            final_phase_done: false,
        }
    }

    /// Notes that the call's final phase committed.
    #[must_use]
    pub fn with_final_phase_done(mut self, done: bool) -> Self {
        self.final_phase_done = done;
        self
    }
}

/// A call's recorded steps: name and serialised value.
pub type Steps = Vec<(String, Vec<u8>)>;

/// What a completer's store finds due.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct Due {
    /// Calls to work on now: leases that ended, and give-ups whose hook is owed.
    pub calls: Vec<StoredCall>,
    /// When the next call of the scopes asked for becomes due, if one is known (a live lease
    /// ends, a backoff passes).
    pub next_in: Option<Duration>,
}

impl Due {
    /// What a store found.
    pub fn new(calls: Vec<StoredCall>, next_in: Option<Duration>) -> Self {
        Self { calls, next_in }
    }
}

/// The store side of a [`Completer`]: where resumable calls are found, claimed for an attempt
/// and given up. The SeaORM lease store implements it.
pub trait ResumeStore: Send + Sync + 'static {
    /// Up to `limit` calls of `scopes` that are due: in progress with their lease ended and
    /// their backoff passed, or given up with the hook owed and its retry time passed.
    fn due_calls<'a>(
        &'a self,
        scopes: &'a [&'a str],
        limit: u32,
    ) -> BoxFuture<'a, Result<Due, Error>>;

    /// Claims the next attempt at `call` for this completer: counts it and puts the call's
    /// next attempt `backoff` from now. `false` when another completer claimed it first (the
    /// count moved on since `call` was read).
    fn begin_attempt<'a>(
        &'a self,
        call: &'a StoredCall,
        backoff: Duration,
    ) -> BoxFuture<'a, Result<bool, Error>>;

    /// Keeps the error of the attempt that just failed, for the next give-up.
    fn note_failure<'a>(
        &'a self,
        call: &'a StoredCall,
        error: &'a str,
    ) -> BoxFuture<'a, Result<(), Error>>;

    /// Records the give-up (`payload`, see [`GaveUp`]) if the call is still in progress with
    /// its lease ended, fencing out its last holder, and owes the hook (retried after
    /// `hook_retry`). `false` when the call finished or was taken over meanwhile.
    fn give_up<'a>(
        &'a self,
        call: &'a StoredCall,
        payload: &'a [u8],
        hook_retry: Duration,
    ) -> BoxFuture<'a, Result<bool, Error>>;

    /// The steps the call recorded, by name.
    fn steps<'a>(&'a self, call: &'a StoredCall) -> BoxFuture<'a, Result<Steps, Error>>;

    /// Forgets a given-up call whose hook ran: its stored arguments and steps.
    fn forget<'a>(&'a self, call: &'a StoredCall) -> BoxFuture<'a, Result<(), Error>>;

    /// Scopes other than `scopes` that have resumable calls whose lease ended, with how many:
    /// nobody registered a resumer for them, so only a client can finish them.
    fn unregistered<'a>(
        &'a self,
        scopes: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<(String, u64)>, Error>>;
}

/// A call as a completer hands it to the resumer registered for its scope.
#[derive(Debug)]
#[non_exhaustive]
pub struct Resumed<A> {
    /// The stored arguments: the handler's parameters that are neither the connection nor
    /// skipped, in order, as a tuple (`(A,)` for one).
    pub args: A,
    /// The idempotency key.
    pub key: String,
    /// The principal (empty when none).
    pub principal: String,
    /// Which completer attempt this is, from 1.
    pub attempt: u32,
}

/// A call a completer gave up, as the [`on_give_up`](Completer::on_give_up) hook sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct GaveUp {
    /// The handler's scope.
    pub scope: String,
    /// The principal (empty when none).
    pub principal: String,
    /// The idempotency key.
    pub key: String,
    /// Attempts made.
    pub attempts: u32,
    /// The last attempt's error.
    pub reason: String,
    /// The steps the call recorded before it was given up: what may need compensating.
    pub steps: Steps,
    /// The stored arguments (a JSON array).
    pub args: Vec<u8>,
}

impl GaveUp {
    /// The value step `name` recorded, if it ran.
    pub fn step<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, Error> {
        let Some((_, payload)) = self.steps.iter().find(|(n, _)| n == name) else {
            return Ok(None);
        };
        serde_json::from_slice(payload)
            .map(Some)
            .map_err(|e| self.decode_error(format!("recorded step `{name}`: {e}")))
    }

    /// The stored arguments, as the resumer's tuple.
    pub fn args<A: DeserializeOwned>(&self) -> Result<A, Error> {
        serde_json::from_slice(&self.args)
            .map_err(|e| self.decode_error(format!("stored arguments: {e}")))
    }

    /// An idempotency key for the compensation (a refund), the same every time the hook runs
    /// for this call: send it downstream so that a hook run twice compensates once.
    pub fn idempotency_key(&self) -> String {
        derived_key(&self.scope, &self.principal, &self.key, "give-up")
    }

    fn decode_error(&self, source: String) -> Error {
        Error::Decode {
            scope: self.scope.clone(),
            key: self.key.clone(),
            source: source.into(),
        }
    }
}

type Resumer = Arc<dyn Fn(StoredCall) -> BoxFuture<'static, Result<(), String>> + Send + Sync>;
type Hook = Arc<dyn Fn(GaveUp) -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// What one [`Completer::run_once`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Round {
    /// Calls taken over and run.
    pub resumed: u32,
    /// Of those, calls that finished (their answer is recorded, by this attempt or another).
    pub finished: u32,
    /// Of those, attempts that did not finish the call (retried after a backoff).
    pub failed: u32,
    /// Calls given up.
    pub gave_up: u32,
    /// Give-up hooks that ran and succeeded.
    pub hooks_run: u32,
    /// When the next call becomes due, if known.
    pub next_in: Option<Duration>,
}

/// Finds lease-mode calls whose lease ended without them finishing, and finishes them by
/// running the resumer registered for their scope; gives a call up after
/// [`max_attempts`](Self::max_attempts). See the [module docs](self).
///
/// ```text
/// let completer = Completer::new(SeaOrmLeaseStore::new(db.clone()))
///     .resume("shop.orders.pay", move |call: Resumed<(IdempotencyKey, String, PayRequest)>| {
///         let (db, gateway) = (db.clone(), gateway.clone());
///         async move {
///             let (key, order_id, request) = call.args;
///             pay(&db, &gateway, key, order_id, request).await
///         }
///     })
///     .on_give_up(|gave_up: GaveUp| async move { refund(&gave_up).await });
/// tokio::spawn(completer.run(shutdown));
/// ```
pub struct Completer<S> {
    store: Arc<S>,
    resumers: HashMap<String, Resumer>,
    on_give_up: Option<Hook>,
    max_attempts: u32,
    poll_interval: Duration,
    backoff: (Duration, Duration),
    batch: u32,
    concurrency: usize,
}

impl<S> std::fmt::Debug for Completer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completer")
            .field("scopes", &self.resumers.keys().collect::<Vec<_>>())
            .field("max_attempts", &self.max_attempts)
            .field("poll_interval", &self.poll_interval)
            .field("backoff", &self.backoff)
            .finish_non_exhaustive()
    }
}

impl<S: ResumeStore> Completer<S> {
    /// A completer on `store`, with no resumers yet: up to [`DEFAULT_MAX_ATTEMPTS`] attempts
    /// per call, polling every second (and sooner when the store tells when the next lease
    /// ends), backing off from 1 s, doubling, to 5 min between attempts at one call: with
    /// the defaults a call is given up about 8.5 min after its first completer attempt, so an
    /// outage of a few minutes downstream does not give calls up.
    pub fn new(store: S) -> Self {
        Self {
            store: Arc::new(store),
            resumers: HashMap::new(),
            on_give_up: None,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            poll_interval: Duration::from_secs(1),
            backoff: (Duration::from_secs(1), Duration::from_secs(300)),
            batch: 32,
            concurrency: 16,
        }
    }

    /// Registers how calls of `scope` are resumed: `resumer` gets the stored arguments as
    /// `A` (the handler's stored parameters as a tuple, in order) and calls the handler with
    /// them and with what was not stored (the connection, skipped parameters). Its answer is
    /// not used: the handler records it, and a client's retry replays it.
    #[must_use]
    pub fn resume<A, F, Fut, T, E>(mut self, scope: &str, resumer: F) -> Self
    where
        A: DeserializeOwned + Send + 'static,
        F: Fn(Resumed<A>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        E: Display,
    {
        let resumer = Arc::new(resumer);
        let erased: Resumer = Arc::new(move |call: StoredCall| {
            let args = match serde_json::from_slice::<A>(&call.args) {
                Ok(args) => args,
                Err(e) => {
                    let message = format!(
                        "the stored arguments do not decode as `{}`: {e}",
                        std::any::type_name::<A>()
                    );
                    return Box::pin(std::future::ready(Err(message)));
                }
            };
            let run = resumer(Resumed {
                args,
                key: call.key,
                principal: call.principal,
                attempt: call.attempts + 1,
            });
            Box::pin(async move { run.await.map(drop).map_err(|e| e.to_string()) })
        });
        self.resumers.insert(scope.to_owned(), erased);
        self
    }

    /// Registers the give-up hook: runs once a call is given up, with its recorded steps, to
    /// compensate (refund a charge, alert). An `Err` runs it again after [`HOOK_RETRY`]; so
    /// does a completer crash before it returned: make it idempotent
    /// ([`GaveUp::idempotency_key`]).
    #[must_use]
    pub fn on_give_up<F, Fut, E>(mut self, hook: F) -> Self
    where
        F: Fn(GaveUp) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Display,
    {
        self.on_give_up = Some(Arc::new(move |gave_up| {
            let run = hook(gave_up);
            Box::pin(async move { run.await.map_err(|e| e.to_string()) })
        }));
        self
    }

    /// How many attempts [`run`](Self::run) keeps going at once (at least 1; default 16).
    #[must_use]
    pub fn concurrency(mut self, attempts: usize) -> Self {
        self.concurrency = attempts.max(1);
        self
    }

    /// Attempts at one call before it is given up (at least 1).
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The longest sleep between two looks at the store.
    #[must_use]
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll_interval = every.max(Duration::from_millis(1));
        self
    }

    /// The wait before a call's second attempt (`first`), doubling per attempt up to `max`.
    #[must_use]
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff = (first, max.max(first));
        self
    }

    /// The wait after attempt `attempt` (from 1) at one call.
    fn backoff_after(&self, attempt: u32) -> Duration {
        let (initial, max) = self.backoff;
        Backoff { initial, max }.jittered(attempt, Jitter::None)
    }

    /// Runs until `shutdown` resolves: looks for due calls and starts attempts at them
    /// (at most [`concurrency`](Self::concurrency) at once; a slow attempt does not hold up
    /// the others), sleeps until the next is due (at most the poll interval) or an attempt
    /// ends. Errors are logged and retried, never returned; on shutdown the attempts under
    /// way finish first (a cancelled attempt would only leave its lease to end).
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut attempts = tokio::task::JoinSet::new();
        let mut failures = 0_u32;
        let mut rounds = 0_u64;
        loop {
            // Once a minute (at the default interval), say which scopes nobody resumes.
            if rounds.is_multiple_of(60) {
                self.report_unregistered().await;
            }
            rounds += 1;
            while attempts.try_join_next().is_some() {}
            let pause = match self.start_round(&mut attempts).await {
                Ok(round) => {
                    failures = 0;
                    if round.gave_up + round.hooks_run > 0
                        || (round.resumed > 0 && attempts.len() < self.concurrency)
                    {
                        // Work was found and there is room: look again at once for more.
                        Duration::ZERO
                    } else {
                        round.next_in.map_or(self.poll_interval, |next| {
                            next.clamp(Duration::from_millis(5), self.poll_interval)
                        })
                    }
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    tracing::warn!(error = %e, "completer: the store failed; retrying");
                    self.backoff_after(failures).min(self.poll_interval * 10)
                }
            };
            tokio::select! {
                () = &mut shutdown => break,
                () = tokio::time::sleep(pause) => {}
                // An attempt that ends frees room (and may have left work behind).
                Some(_) = attempts.join_next(), if !attempts.is_empty() => {}
            }
        }
        while attempts.join_next().await.is_some() {}
    }

    /// One look at the store: works on every due call found (attempts run concurrently) and
    /// returns when they are done.
    pub async fn run_once(&self) -> Result<Round, Error> {
        let mut attempts = tokio::task::JoinSet::new();
        let mut round = self.start_round(&mut attempts).await?;
        while let Some(finished) = attempts.join_next().await {
            match finished {
                Ok(true) => round.finished += 1,
                _ => round.failed += 1,
            }
        }
        Ok(round)
    }

    /// Finds due calls: runs owed hooks and give-ups, and starts attempts into `attempts`
    /// while it has room. Counts what it started; `finished` and `failed` are the caller's.
    async fn start_round(&self, attempts: &mut tokio::task::JoinSet<bool>) -> Result<Round, Error> {
        let scopes: Vec<&str> = self.resumers.keys().map(String::as_str).collect();
        let mut round = Round::default();
        let room = self.concurrency.saturating_sub(attempts.len());
        if scopes.is_empty() || room == 0 {
            return Ok(round);
        }
        let limit = u32::try_from(room).unwrap_or(u32::MAX).min(self.batch);
        let due = self.store.due_calls(&scopes, limit).await?;
        round.next_in = due.next_in;
        for call in due.calls {
            if call.gave_up {
                round.hooks_run += u32::from(self.owed_hook(call).await?);
            } else if call.attempts >= self.max_attempts && !call.final_phase_done {
                let reason = call
                    .last_error
                    .clone()
                    .unwrap_or_else(|| "no attempt finished".to_owned());
                if self.give_up(call, reason).await? {
                    round.gave_up += 1;
                    round.hooks_run += 1;
                }
            } else if let Some(resumer) = self.resumers.get(&call.scope) {
                let backoff = self.backoff_after(call.attempts + 1);
                if !self.store.begin_attempt(&call, backoff).await? {
                    continue; // another completer took this attempt
                }
                round.resumed += 1;
                crate::metrics::completer(&call.scope, "resumed");
                let (store, resumer) = (Arc::clone(&self.store), Arc::clone(resumer));
                attempts.spawn(async move { attempt(&*store, &resumer, call).await });
            }
        }
        Ok(round)
    }

    /// Gives `call` up and runs its hook; `false` when it finished or was taken over first.
    async fn give_up(&self, call: StoredCall, reason: String) -> Result<bool, Error> {
        let record = GiveUpRecord {
            attempts: call.attempts,
            reason,
        };
        let payload = serde_json::to_vec(&record).map_err(|e| Error::Encode {
            scope: call.scope.clone(),
            source: Box::new(e),
        })?;
        if !self.store.give_up(&call, &payload, HOOK_RETRY).await? {
            return Ok(false);
        }
        crate::metrics::completer(&call.scope, "gave_up");
        tracing::error!(
            scope = %call.scope,
            attempts = call.attempts,
            reason = %record.reason,
            "completer: gave the call up; retries of its key answer `gave-up`"
        );
        let call = StoredCall {
            last_error: Some(record.reason),
            gave_up: true,
            ..call
        };
        self.run_hook(call).await.map(|_| true)
    }

    /// Runs the hook a give-up still owes (its last runner failed or crashed), if this
    /// completer claims it first.
    async fn owed_hook(&self, call: StoredCall) -> Result<bool, Error> {
        if !self.store.begin_attempt(&call, HOOK_RETRY).await? {
            return Ok(false);
        }
        self.run_hook(call).await
    }

    async fn run_hook(&self, call: StoredCall) -> Result<bool, Error> {
        if let Some(hook) = &self.on_give_up {
            let gave_up = GaveUp {
                steps: self.store.steps(&call).await?,
                scope: call.scope.clone(),
                principal: call.principal.clone(),
                key: call.key.clone(),
                attempts: call.attempts,
                reason: call.last_error.clone().unwrap_or_default(),
                args: call.args.clone(),
            };
            if let Err(e) = hook(gave_up).await {
                tracing::warn!(scope = %call.scope, error = %e, "completer: the give-up hook failed; it runs again later");
                self.store.note_failure(&call, &e).await?;
                return Ok(false);
            }
        }
        self.store.forget(&call).await?;
        Ok(true)
    }

    async fn report_unregistered(&self) {
        let scopes: Vec<&str> = self.resumers.keys().map(String::as_str).collect();
        match self.store.unregistered(&scopes).await {
            Ok(unregistered) => {
                for (scope, calls) in unregistered {
                    crate::metrics::completer(&scope, "unregistered");
                    tracing::warn!(%scope, calls, "completer: resumable calls whose lease ended have no resumer registered for their scope; only a client retry can finish them");
                }
            }
            Err(e) => tracing::warn!(error = %e, "completer: listing unregistered scopes failed"),
        }
    }
}

/// One attempt at `call`: runs its resumer and tells whether the call finished. The handler
/// inside says how it was answered ([`with_outcome`]): executed now, or replayed because
/// someone else finished it; anything else (a transient error, the lease held by a client,
/// arguments that no longer decode) is a failed attempt, kept for the give-up.
async fn attempt<S: ResumeStore + ?Sized>(store: &S, resumer: &Resumer, call: StoredCall) -> bool {
    let scope = call.scope.clone();
    let (result, outcome) = with_outcome(resumer(call.clone())).await;
    if outcome.is_some() {
        crate::metrics::completer(&scope, "finished");
        tracing::info!(%scope, attempt = call.attempts + 1, "completer: finished an abandoned call");
        return true;
    }
    let error = match result {
        Err(e) => e,
        Ok(()) => "the resumer returned without calling the handler of its scope".to_owned(),
    };
    crate::metrics::completer(&scope, "failed");
    tracing::warn!(%scope, attempt = call.attempts + 1, %error, "completer: an attempt did not finish the call");
    if let Err(e) = store.note_failure(&call, &error).await {
        tracing::warn!(%scope, error = %e, "completer: could not keep the attempt's error");
    }
    false
}
