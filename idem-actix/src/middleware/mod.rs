//! [`IdempotencyMiddleware`]: makes plain actix-web handlers idempotent by recording their
//! whole responses, the twin of `idem::axum::IdempotencyLayer` (same ledger records, same
//! answers).

mod service;

use std::fmt;
use std::sync::Arc;

use actix_web::HttpRequest;
use http::HeaderName;
use http::header::{CONTENT_LANGUAGE, CONTENT_TYPE, ETAG, LAST_MODIFIED, LOCATION};
use idem_core::LeaseStore;
use idem_core::call::Site;
use idem_http::recording::Recording;

pub use service::IdempotencyMiddlewareService;

/// Records the whole response of actix-web handlers on the idem ledger, so a retry with the
/// same `Idempotency-Key` gets the recorded response instead of running the handler again:
/// `idem::axum::IdempotencyLayer`'s contract and record format on actix-web 4, for handlers
/// that are not `#[idempotent]` domain functions.
///
/// ```text
/// use idem::actix::IdempotencyMiddleware;
/// use idem::sea_orm::SeaOrmLeaseStore;
///
/// // Once, outside the factory: the workers share its memory of recent answers.
/// let refunds = IdempotencyMiddleware::new(SeaOrmLeaseStore::new(db.clone()), "shop.refunds");
/// HttpServer::new(move || {
///     App::new().service(web::resource("/refunds").wrap(refunds.clone()).route(web::post().to(refund)))
/// })
/// ```
///
/// Build it once and clone it into `HttpServer::new`'s factory: each clone shares the
/// settings and the [memory of recent answers](Self::remember_answers); one built inside the
/// factory has a memory per worker (still correct: a miss reads the ledger).
///
/// A request with a key is fingerprinted over its method, path and query, and body (the key
/// belongs to the request's [`principal`](Self::principal), if one is configured), and
/// claimed in **lease mode**: the claim commits first, the handler runs outside any ledger
/// transaction, and its response is recorded if the lease still holds.
///
/// | request | answer |
/// |---|---|
/// | no `Idempotency-Key`, or a malformed or repeated one | 400 problem+json, the handler does not run |
/// | request body over [`max_request_body`](Self::max_request_body) | 413 problem+json, nothing claimed |
/// | same key, another method, path, query or body | 422 problem+json |
/// | same key while the first request runs | 409 problem+json + `Retry-After` (or wait: [`on_concurrent`](Self::on_concurrent)) |
/// | same key after a recorded response | the recorded status, [recorded headers](Self::record_header) and body + `Idempotent-Replayed: true` |
/// | the handler answers 5xx or fails | the answer passes through; nothing is recorded and the key is free at once |
/// | the handler panics | 500 problem+json; the lease is left to expire, then a retry runs the handler again |
/// | the response body is over [`max_response_body`](Self::max_response_body) | the first client gets the whole response; a retry gets 500 `response-not-recorded` (never a second execution) |
/// | store unavailable | 503 problem+json, the handler does not run |
///
/// The handler runs on a task of its own on the worker (actix-web's handlers are not `Send`):
/// a client that disconnects does not cancel it, so its response is recorded and its retry
/// replays it. The response body is read whole before it is sent.
#[derive(Clone)]
pub struct IdempotencyMiddleware {
    config: Arc<Config>,
}

#[derive(Clone)]
struct Config {
    scope: &'static str,
    /// The engine's description of the route, kept in step with scope, TTL and policy.
    site: &'static Site,
    recording: Recording,
    headers: Vec<HeaderName>,
    principal: Option<Principal>,
}

type Principal = Arc<dyn Fn(&HttpRequest) -> Option<String> + Send + Sync>;

impl fmt::Debug for IdempotencyMiddleware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        let mut f = f.debug_struct("IdempotencyMiddleware");
        f.field("scope", &c.scope);
        c.recording.debug_fields(&mut f);
        f.field("headers", &c.headers)
            .field("principal", &c.principal.is_some())
            .finish_non_exhaustive()
    }
}

impl IdempotencyMiddleware {
    /// The default limit of a recorded response body and of a fingerprinted request body: 1 MiB.
    pub const DEFAULT_MAX_BODY: usize = Recording::DEFAULT_MAX_BODY;

    /// The default memory for responses replayed without reading the ledger: 8 MiB.
    pub const DEFAULT_REMEMBERED: usize = Recording::DEFAULT_REMEMBERED;

    /// A middleware recording responses under `scope` (a name for the route's operation,
    /// stable across refactors, e.g. `"shop.refunds"`) in `store`, the ledger's lease store
    /// (with SeaORM: `idem::sea_orm::SeaOrmLeaseStore::new(db)`). The defaults are
    /// `idem::axum::IdempotencyLayer`'s: responses kept 24 h, leases of 30 s, a duplicate in
    /// flight answered 409 at once, bodies up to 1 MiB, headers `content-type`,
    /// `content-language`, `location`, `etag` and `last-modified` recorded, 8 MiB of recent
    /// responses replayed from memory.
    pub fn new(store: impl LeaseStore, scope: &'static str) -> Self {
        let recording = Recording::new(store);
        Self {
            config: Arc::new(Config {
                scope,
                site: recording.site(scope),
                recording,
                headers: vec![
                    CONTENT_TYPE,
                    CONTENT_LANGUAGE,
                    LOCATION,
                    ETAG,
                    LAST_MODIFIED,
                ],
                principal: None,
            }),
        }
    }

    fn with(mut self, change: impl FnOnce(&mut Config)) -> Self {
        let config = Arc::make_mut(&mut self.config);
        change(config);
        config.site = config.recording.site(config.scope);
        self
    }

    fn with_recording(self, change: impl FnOnce(&mut Recording)) -> Self {
        self.with(|c| change(&mut c.recording))
    }

    idem_http::recording_settings!();

    /// Records response header `name` too (besides the defaults of [`new`](Self::new)).
    pub fn record_header(self, name: HeaderName) -> Self {
        self.with(|c| {
            if !c.headers.contains(&name) {
                c.headers.push(name);
            }
        })
    }

    /// Who the key belongs to (tenant, user, API client), read from the request: keys of two
    /// principals never meet. A principal that is not a valid key is a 400.
    pub fn principal<F>(self, principal: F) -> Self
    where
        F: Fn(&HttpRequest) -> Option<String> + Send + Sync + 'static,
    {
        self.with(|c| c.principal = Some(Arc::new(principal)))
    }
}
