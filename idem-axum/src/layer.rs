//! [`IdempotencyLayer`]: a tower layer that makes a plain axum route idempotent by recording
//! its whole response, for routes that are not written as `#[idempotent]` domain functions.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum_core::body::Body;
use axum_core::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::StreamExt;
use http::header::{CONTENT_LANGUAGE, CONTENT_TYPE, ETAG, LAST_MODIFIED, LOCATION};
use http::request::Parts;
use http::{HeaderName, Request};

use idem_core::call::Site;
use idem_core::lease::{once, run_lease};
use idem_core::{Error, LeaseStore};

use crate::http::{IdempotencyKey, Problem};
use idem_http::recording::{Recording, fingerprint_request};
use idem_http::{RecordedBody, RecordedResponse, spawn_and_wait};

/// Records the whole response of an axum route on the idem ledger, so a retry with the same
/// `Idempotency-Key` gets the recorded response instead of running the route again: the
/// HTTP-middleware style of Stripe's API and the IETF Idempotency-Key draft, for handlers
/// that are not `#[idempotent]` domain functions.
///
/// ```text
/// use idem::axum::IdempotencyLayer;
/// use idem::sea_orm::SeaOrmLeaseStore;
///
/// let refunds = IdempotencyLayer::new(SeaOrmLeaseStore::new(db.clone()), "shop.refunds");
/// let app = Router::new().route("/refunds", post(refund).route_layer(refunds));
/// ```
///
/// A request with a key is fingerprinted over its method, path and query, and body (the key
/// belongs to the request's [`principal`](Self::principal), if one is configured), and
/// claimed in **lease mode**: the claim commits first, the route runs outside any ledger
/// transaction, and its response is recorded if the lease still holds. A crash between the two leaves a lease that expires
/// ([`lease`](Self::lease), default 30 s); the next retry then runs the route again.
///
/// | request | answer |
/// |---|---|
/// | no `Idempotency-Key`, or a malformed or repeated one | 400 problem+json, the route does not run |
/// | request body over [`max_request_body`](Self::max_request_body) | 413 problem+json, nothing claimed |
/// | same key, another method, path, query or body | 422 problem+json |
/// | same key, another principal | its own key: the two never meet |
/// | same key while the first request runs | 409 problem+json + `Retry-After` (or wait: [`on_concurrent`](Self::on_concurrent)) |
/// | same key after a recorded response | the recorded status, [recorded headers](Self::record_header) and body + `Idempotent-Replayed: true` (from memory when this process recorded it: [`remember_answers`](Self::remember_answers)) |
/// | the route answers 5xx | the answer passes through; nothing is recorded and the key is free at once, so a retry runs the route again |
/// | the route's body fails mid-stream | 502 problem+json; the key is free at once, as for a 5xx |
/// | the route panics | 500 problem+json; the lease is left to expire, then a retry runs the route again |
/// | the route's body is over [`max_response_body`](Self::max_response_body) | the first client gets the whole response; the ledger records that the key was used, without the body, and a retry gets 500 `response-not-recorded` (never a second execution) |
/// | store unavailable | 503 problem+json, the route does not run |
///
/// The route runs on a task of its own: a client that disconnects does not cancel it, so its
/// response is recorded and its retry replays it. Requests through the layer are counted by
/// the `metrics` feature like any lease-mode call.
#[derive(Clone)]
pub struct IdempotencyLayer {
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

type Principal = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        let mut f = f.debug_struct("IdempotencyLayer");
        f.field("scope", &c.scope);
        c.recording.debug_fields(&mut f);
        f.field("headers", &c.headers)
            .field("principal", &c.principal.is_some())
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// The default limit of a recorded response body and of a fingerprinted request body: 1 MiB.
    pub const DEFAULT_MAX_BODY: usize = Recording::DEFAULT_MAX_BODY;

    /// The default memory for responses replayed without reading the ledger: 8 MiB.
    pub const DEFAULT_REMEMBERED: usize = Recording::DEFAULT_REMEMBERED;

    /// A layer recording responses under `scope` (a name for the route's operation, stable
    /// across refactors, e.g. `"shop.refunds"`) in `store`, the ledger's lease store (with
    /// SeaORM: `idem::sea_orm::SeaOrmLeaseStore::new(db)`).
    ///
    /// Defaults: responses kept 24 h, leases of 30 s, a duplicate in flight answered 409 at
    /// once, bodies up to [`DEFAULT_MAX_BODY`](Self::DEFAULT_MAX_BODY), headers
    /// `content-type`, `content-language`, `location`, `etag` and `last-modified` recorded,
    /// [`DEFAULT_REMEMBERED`](Self::DEFAULT_REMEMBERED) of recent responses replayed from
    /// memory.
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

    /// Records response header `name` too (besides the defaults of [`new`](Self::new)). Other
    /// headers reach the first client but are not replayed.
    pub fn record_header(self, name: HeaderName) -> Self {
        self.with(|c| {
            if !c.headers.contains(&name) {
                c.headers.push(name);
            }
        })
    }

    /// Who the key belongs to (tenant, user, API client), read from the request: keys of two
    /// principals never meet. `None` is a request without a principal; a principal that is
    /// not a valid key (empty, over 255 bytes, control characters) is a 400.
    pub fn principal<F>(self, principal: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.with(|c| c.principal = Some(Arc::new(principal)))
    }
}

impl<S> tower_layer::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            config: Arc::clone(&self.config),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps a route in.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("scope", &self.config.scope)
            .finish_non_exhaustive()
    }
}

impl<S> tower_service::Service<Request<Body>> for IdempotencyService<S>
where
    S: tower_service::Service<Request<Body>, Response = Response, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // The route is called later, on its own task, after the claim: readiness is awaited there.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let config = Arc::clone(&self.config);
        let inner = self.inner.clone();
        Box::pin(async move { Ok(answer(config, inner, request).await) })
    }
}

/// Reads `body` whole if it has at most `limit` bytes; else the chunks read so far and the
/// rest of the body, unread.
async fn read_up_to(body: Body, limit: usize) -> Result<Read, axum_core::Error> {
    let mut stream = body.into_data_stream();
    let mut chunks = Vec::new();
    let mut len = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        len += chunk.len();
        chunks.push(chunk);
        if len > limit {
            return Ok(Read::Over {
                chunks,
                rest: stream,
            });
        }
    }
    let mut whole = Vec::with_capacity(len);
    chunks.iter().for_each(|c| whole.extend_from_slice(c));
    Ok(Read::Whole(whole))
}

enum Read {
    Whole(Vec<u8>),
    Over {
        chunks: Vec<Bytes>,
        rest: axum_core::body::BodyDataStream,
    },
}

/// A response as the ledger keeps it, with the route's own response for its first client.
type Recorded = RecordedResponse<Response>;

/// The first client's response, or the replay of the recorded one.
fn into_response(recorded: Recorded) -> Response {
    match recorded.live {
        Some(live) => live,
        None => recorded.replay().map(Body::from),
    }
}

/// Why a request through the layer recorded nothing.
enum Unrecorded {
    /// idem's own answer: a bad key, reuse, in flight, a store failure.
    Idem(Error),
    /// The route answered 5xx: passed through, the key released.
    Released(Response),
}

impl From<Error> for Unrecorded {
    fn from(e: Error) -> Self {
        Self::Idem(e)
    }
}

/// Answers one request: checks and fingerprints it, then claims, runs and records on a task
/// of its own, which finishes whether or not the client waits.
async fn answer<S>(config: Arc<Config>, inner: S, request: Request<Body>) -> Response
where
    S: tower_service::Service<Request<Body>, Response = Response, Error = Infallible>
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let (parts, body) = request.into_parts();
    let key = match IdempotencyKey::of_headers(&parts.headers) {
        Ok(Some(key)) => Ok(key.0),
        Ok(None) => Err(Error::MissingKey),
        Err(e) => Err(e),
    };
    let key_is_valid = key.is_ok();
    let mut bytes = Vec::new();
    let principal = if key_is_valid {
        config
            .principal
            .as_ref()
            .and_then(|principal| principal(&parts))
    } else {
        None
    };
    let mut call = config.recording.call(config.site, key, principal);
    if key_is_valid || config.recording.observing() {
        // Read the body only for a request the layer will claim, or that observe mode runs
        // whatever its key.
        bytes = match read_up_to(body, config.recording.max_request_body).await {
            Ok(Read::Whole(bytes)) => bytes,
            Ok(Read::Over { .. }) => {
                return Problem::new(
                    413,
                    "request-too-large",
                    "Request body too large",
                    format!(
                        "this route reads request bodies of at most {} bytes",
                        config.recording.max_request_body
                    ),
                )
                .into_response();
            }
            Err(e) => {
                return Problem::new(
                    400,
                    "invalid-body",
                    "Request body unreadable",
                    format!("the request body could not be read: {e}"),
                )
                .into_response();
            }
        };
        let path_and_query = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        fingerprint_request(
            &mut call,
            parts.method.as_str(),
            path_and_query,
            &parts.headers,
            &bytes,
        );
    }
    let task = spawn_and_wait(Box::pin(run_lease(
        Arc::clone(&config.recording.store),
        call,
        config.recording.lease,
        None,
        // The request's first try consumes it: a conflict of a final phase kept open is
        // answered (503, `Retry-After`), and the client's retry runs it again.
        once(async move || run_route(&config, inner, parts, bytes).await),
    )));
    match task.await {
        Ok(Ok(recorded)) => into_response(recorded),
        Ok(Err(Unrecorded::Released(response))) => response,
        Ok(Err(Unrecorded::Idem(e))) => Problem::from(e).into_response(),
        Err(e) => {
            // The route panicked: its lease is left to expire, and a retry runs it again.
            tracing::error!(error = %e, "a route under IdempotencyLayer panicked");
            Problem::new(
                500,
                "internal",
                "Internal error",
                "the request could not be processed",
            )
            .into_response()
        }
    }
}

/// Runs the route and sorts its response: 5xx released, the rest recorded (the body up to
/// the limit).
async fn run_route<S>(
    config: &Config,
    mut inner: S,
    parts: Parts,
    bytes: Vec<u8>,
) -> Result<Recorded, Unrecorded>
where
    S: tower_service::Service<Request<Body>, Response = Response, Error = Infallible>,
{
    let Ok(()) = std::future::poll_fn(|cx| inner.poll_ready(cx)).await;
    let Ok(response) = inner
        .call(Request::from_parts(parts, Body::from(bytes)))
        .await;
    if response.status().is_server_error() {
        return Err(Unrecorded::Released(response));
    }
    let (head, body) = response.into_parts();
    let headers = config
        .headers
        .iter()
        .flat_map(|name| {
            head.headers
                .get_all(name)
                .iter()
                .map(|value| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        })
        .collect();
    let (body, live) = match read_up_to(body, config.recording.max_response_body).await {
        Ok(Read::Whole(bytes)) => {
            let live = Body::from(Bytes::from(bytes.clone()));
            (RecordedBody::of(bytes), live)
        }
        Ok(Read::Over { chunks, rest }) => {
            tracing::warn!(
                scope = config.scope,
                limit = config.recording.max_response_body,
                "response body over the limit: delivered, not recorded"
            );
            let whole = futures_util::stream::iter(chunks.into_iter().map(Ok)).chain(rest);
            let body = RecordedBody::TooLarge {
                limit: config.recording.max_response_body,
            };
            (body, Body::from_stream(whole))
        }
        Err(e) => {
            // The route's body failed mid-way: nothing sensible to record or send.
            tracing::warn!(scope = config.scope, error = %e, "response body failed; key released");
            return Err(Unrecorded::Released(
                Problem::new(
                    502,
                    "response-failed",
                    "Response failed",
                    "the response body could not be produced; retry with the same key",
                )
                .into_response(),
            ));
        }
    };
    Ok(Recorded {
        status: head.status.as_u16(),
        headers,
        body,
        live: Some(Response::from_parts(head, live)),
    })
}
