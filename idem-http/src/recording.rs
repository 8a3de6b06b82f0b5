//! What every whole-answer layer shares (axum's `IdempotencyLayer`, actix-web's
//! `IdempotencyMiddleware`, tonic's `IdempotencyLayer`): the ledger and its settings, the
//! site of a route, the start of a call, and an HTTP request's fingerprint.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;
use idem_core::call::{Call, Site};
use idem_core::{Error, Key, LeaseStore, RecentAnswers};

/// How a duplicate of a running request is answered (re-exported for the settings methods).
pub use idem_core::Concurrency;
/// Whether the layer acts on its decisions or only reports them (re-exported for the settings
/// methods).
pub use idem_core::Mode;

use crate::canonical;

/// The settings of a layer that records whole answers in lease mode, and the calls it starts.
#[derive(Clone)]
pub struct Recording {
    /// The ledger's lease store.
    pub store: Arc<dyn LeaseStore>,
    /// How long a recorded answer is replayed.
    pub ttl: Duration,
    /// How a duplicate of a running request is answered.
    pub concurrency: Concurrency,
    /// How long a request holds its key before a retry may take it over.
    pub lease: Duration,
    /// The largest request body read to fingerprint it.
    pub max_request_body: usize,
    /// The largest response body recorded.
    pub max_response_body: usize,
    /// Answers this layer recorded, replayed from memory while they live.
    pub answers: Option<Arc<RecentAnswers>>,
    /// Whether the layer acts on its decisions ([`Mode::Enforce`]) or runs every request and
    /// only reports them ([`Mode::Observe`]).
    pub mode: Mode,
}

impl Recording {
    /// The default limit of a recorded answer and of a fingerprinted request: 1 MiB.
    pub const DEFAULT_MAX_BODY: usize = 1 << 20;

    /// The default memory for answers replayed without reading the ledger: 8 MiB.
    pub const DEFAULT_REMEMBERED: usize = 8 << 20;

    /// The defaults on `store`: answers kept 24 h, leases of 30 s, a duplicate in flight
    /// refused at once, bodies up to [`DEFAULT_MAX_BODY`](Self::DEFAULT_MAX_BODY),
    /// [`DEFAULT_REMEMBERED`](Self::DEFAULT_REMEMBERED) of recent answers in memory.
    pub fn new(store: impl LeaseStore) -> Self {
        Self {
            store: Arc::new(store),
            ttl: Duration::from_secs(24 * 60 * 60),
            concurrency: Concurrency::Reject,
            lease: Duration::from_secs(30),
            max_request_body: Self::DEFAULT_MAX_BODY,
            max_response_body: Self::DEFAULT_MAX_BODY,
            answers: Some(Arc::new(RecentAnswers::new(Self::DEFAULT_REMEMBERED))),
            mode: Mode::Enforce,
        }
    }

    /// Whether the layer only reports its decisions ([`Mode::Observe`]): every request reaches
    /// the handler, its body whole, whatever its key.
    pub fn observing(&self) -> bool {
        self.mode == Mode::Observe
    }

    /// Keeps up to `bytes` of recorded answers in memory; `0` turns it off.
    pub fn remember_answers(&mut self, bytes: usize) {
        self.answers = (bytes > 0).then(|| Arc::new(RecentAnswers::new(bytes)));
    }

    /// The site of the route or method `scope` under these settings (interned: call it when
    /// configuring, not per request).
    pub fn site(&self, scope: &str) -> &'static Site {
        Site::interned(scope, self.ttl, self.concurrency)
    }

    /// A call of `site` with `key` (an invalid or missing key fails the call, counted as
    /// such), owned by `principal` if there is one (a principal that is not a valid key fails
    /// the call with 400 / `INVALID_ARGUMENT`), answered from memory when this layer recorded
    /// it.
    pub fn call(
        &self,
        site: &'static Site,
        key: Result<Key, Error>,
        principal: Option<String>,
    ) -> Call {
        let mut call = Call::with_key_result(site, key);
        call.mode(self.mode);
        if let Some(principal) = principal {
            call.principal(&principal);
        }
        if let Some(answers) = &self.answers {
            call.remember_answers(answers);
        }
        call
    }

    /// The settings as fields of a layer's `Debug`.
    pub fn debug_fields(&self, f: &mut fmt::DebugStruct<'_, '_>) {
        f.field("ttl", &self.ttl)
            .field("concurrency", &self.concurrency)
            .field("lease", &self.lease)
            .field("max_request_body", &self.max_request_body)
            .field("max_response_body", &self.max_response_body)
            .field(
                "remember_answers",
                &self.answers.as_ref().map_or(0, |a| a.budget()),
            )
            .field("mode", &self.mode);
    }
}

impl fmt::Debug for Recording {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut f = f.debug_struct("Recording");
        self.debug_fields(&mut f);
        f.finish_non_exhaustive()
    }
}

/// Adds an HTTP request to `call`'s fingerprint: its method, its target and its body, in their
/// canonical forms (query parameters in order, JSON bodies by value) since fingerprint
/// version 2; a record written before was fingerprinted over the raw forms, which version 1
/// keeps comparing. `headers` tell the body's type.
pub fn fingerprint_request(
    call: &mut Call,
    method: &str,
    path_and_query: &str,
    headers: &HeaderMap,
    body: &[u8],
) {
    call.named_arg("method", method);
    call.changed_arg("target", &canonical::target(path_and_query), path_and_query);
    call.changed_arg(
        "body",
        &canonical::Body::of(headers, body),
        &canonical::Raw(body),
    );
}

/// The settings methods every whole-answer layer offers (`ttl`, `lease`, `on_concurrent`,
/// `max_request_body`, `max_response_body`, `remember_answers`), written once: expanded inside
/// the `impl` of a layer that has `fn with_recording(self, change: impl FnOnce(&mut
/// Recording)) -> Self`.
#[doc(hidden)]
#[macro_export]
macro_rules! recording_settings {
    () => {
        /// How long a recorded answer is replayed (measured on the database's clock).
        pub fn ttl(self, ttl: ::std::time::Duration) -> Self {
            self.with_recording(|r| r.ttl = ttl)
        }

        /// How long a request holds its key before a retry may take it over (renewed while
        /// the handler runs). After a crash, a retry waits at most this long.
        pub fn lease(self, lease: ::std::time::Duration) -> Self {
            self.with_recording(|r| r.lease = lease)
        }

        /// How a duplicate of a running request is answered: `Concurrency::Reject` (the
        /// default: 409 + `Retry-After` over HTTP, `ABORTED` + retry delay over gRPC) or
        /// `Concurrency::Wait` (poll until the first answer is recorded, then replay it; the
        /// same refusal after the bound).
        pub fn on_concurrent(self, concurrency: $crate::recording::Concurrency) -> Self {
            self.with_recording(|r| r.concurrency = concurrency)
        }

        /// The largest request body read to fingerprint it; a larger one is refused (413 over
        /// HTTP, `RESOURCE_EXHAUSTED` over gRPC) before anything is claimed.
        pub fn max_request_body(self, bytes: usize) -> Self {
            self.with_recording(|r| r.max_request_body = bytes)
        }

        /// The largest response body recorded. A larger answer still reaches its client
        /// whole, but only the fact that the key was used is recorded: a retry gets
        /// `response-not-recorded` (500 over HTTP, `INTERNAL` over gRPC), and the handler does
        /// not run again.
        pub fn max_response_body(self, bytes: usize) -> Self {
            self.with_recording(|r| r.max_response_body = bytes)
        }

        /// How much memory (in bytes: bodies and headers, plus about 128 per answer) keeps the
        /// answers this layer recorded, so that a retry reaching this process is replayed
        /// without reading the ledger; `0` turns it off. A recorded answer never changes until
        /// it expires, and each copy is dropped before its record expires, so the answer is
        /// the one the ledger would give. The oldest copies go first; an answer over an eighth
        /// of the budget is not kept. Retries reaching another process read the ledger.
        pub fn remember_answers(self, bytes: usize) -> Self {
            self.with_recording(|r| r.remember_answers(bytes))
        }

        /// Observe mode ("shadow mode") with `Mode::Observe`: every request reaches the
        /// handler and gets the handler's own answer, whatever idem decides. idem decides each
        /// request as when enforcing (the default, `Mode::Enforce`), records the answers
        /// enforcing would record, and reports each decision: an INFO event with `scope`,
        /// `key_hash` and `decision` (`executed`, `replayed`, `key_reused`, `in_flight`,
        /// `released`, `invalid_key`, `error`) and the counter `idem_observed_total`.
        /// Switching to enforcing needs no migration: a retry then replays what an observed
        /// request recorded. A request body over `max_request_body` is still refused, as
        /// enforcing refuses it: raise the limit to your largest request before observing.
        pub fn mode(self, mode: $crate::recording::Mode) -> Self {
            self.with_recording(|r| r.mode = mode)
        }
    };
}
