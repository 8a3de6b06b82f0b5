//! The service [`IdempotencyLayer`](super::IdempotencyLayer) wraps a tonic server in: claims,
//! runs and records the calls of its methods.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http_body_util::{BodyExt, Full, Limited};
use idem_core::Error;
use idem_core::lease::{once, run_lease};
use idem_http::spawn_and_wait;
use tonic::{Code, Status};

use super::body::Answer;
use super::recorded::{Recorded, RecordedBody, code_of, is_final, record};
use super::{Config, Method};
use crate::key::IdempotencyKey;
use crate::status::status;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Response = http::Response<tonic::body::Body>;

/// The service [`IdempotencyLayer`](super::IdempotencyLayer) wraps a tonic server's routes in.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> IdempotencyService<S> {
    pub(super) fn new(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }
}

impl<S> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut methods: Vec<&String> = self.config.methods.keys().collect();
        methods.sort();
        f.debug_struct("IdempotencyService")
            .field("methods", &methods)
            .finish_non_exhaustive()
    }
}

impl<S, B> tower_service::Service<http::Request<tonic::body::Body>> for IdempotencyService<S>
where
    S: tower_service::Service<http::Request<tonic::body::Body>, Response = http::Response<B>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + Send,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        // The routes are called later (for a recorded method, on its own task after the
        // claim): readiness is awaited there.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let inner = self.inner.clone();
        let Some(method) = self.config.methods.get(request.uri().path()).copied() else {
            return Box::pin(async move {
                let response = ready_and_call(inner, request).await?;
                Ok(response.map(tonic::body::Body::new))
            });
        };
        let config = Arc::clone(&self.config);
        Box::pin(async move { Ok(answer(config, method, inner, request).await) })
    }
}

async fn ready_and_call<S, R>(mut inner: S, request: R) -> Result<S::Response, S::Error>
where
    S: tower_service::Service<R>,
{
    std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
    inner.call(request).await
}

/// Why a call through the layer recorded nothing.
enum Unrecorded {
    /// idem's own answer: a bad key, reuse, in flight, a store failure.
    Idem(Error),
    /// The method answered a status that is not recorded: passed through, the key released.
    Released(Response),
}

impl From<Error> for Unrecorded {
    fn from(e: Error) -> Self {
        Self::Idem(e)
    }
}

/// Answers one call of a recorded method: checks and fingerprints it, then claims, runs and
/// records on a task of its own, which finishes whether or not the client waits.
async fn answer<S, B>(
    config: Arc<Config>,
    method: Method,
    inner: S,
    request: http::Request<tonic::body::Body>,
) -> Response
where
    S: tower_service::Service<http::Request<tonic::body::Body>, Response = http::Response<B>>
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + Send,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (parts, body) = request.into_parts();
    let key = match IdempotencyKey::of_headers(&parts.headers) {
        Ok(Some(key)) => Ok(key.0),
        Ok(None) => Err(Error::MissingKey),
        Err(e) => Err(e),
    };
    // Observe mode runs the method whatever its key: the call reports the refusal.
    if let (Err(e), false) = (&key, config.recording.observing()) {
        return status(e).into_http();
    }
    let bytes = match Limited::new(body, config.recording.max_request_body)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Status::new(
                Code::ResourceExhausted,
                format!(
                    "this method reads requests of at most {} bytes",
                    config.recording.max_request_body
                ),
            )
            .into_http();
        }
        Err(e) => {
            return Status::new(
                Code::InvalidArgument,
                format!("the request could not be read: {e}"),
            )
            .into_http();
        }
    };
    let principal = config
        .principal
        .as_ref()
        .and_then(|principal| principal(&parts));
    let mut call = config.recording.call(method.site, key, principal);
    if let Err(refused) = (method.fingerprint)(&bytes, &mut call)
        && !config.recording.observing()
    {
        return refused.into_http();
    }
    let task = spawn_and_wait(Box::pin(run_lease(
        Arc::clone(&config.recording.store),
        call,
        config.recording.lease,
        None,
        // The request's first try consumes it: a conflict of a final phase kept open is
        // answered, and the client's retry runs it again.
        once(async move || run_method(&config, inner, parts, bytes).await),
    )));
    match task.await {
        Ok(Ok(recorded)) => recorded.into_response(),
        Ok(Err(Unrecorded::Released(response))) => response,
        Ok(Err(Unrecorded::Idem(e))) => status(&e).into_http(),
        Err(e) => {
            // The method panicked: its lease is left to expire, and a retry runs it again.
            tracing::error!(error = %e, "a method under IdempotencyLayer panicked");
            Status::internal("the call could not be processed").into_http()
        }
    }
}

/// Runs the method and sorts its answer: recorded if final (the body up to the limit),
/// released otherwise.
async fn run_method<S, B>(
    config: &Config,
    inner: S,
    parts: Parts,
    bytes: Bytes,
) -> Result<Recorded, Unrecorded>
where
    S: tower_service::Service<http::Request<tonic::body::Body>, Response = http::Response<B>>,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let request = http::Request::from_parts(parts, tonic::body::Body::new(Full::new(bytes)));
    let response = match ready_and_call(inner, request).await {
        Ok(response) => response,
        Err(e) => {
            let e: BoxError = e.into();
            tracing::warn!(error = %e, "a method under IdempotencyLayer failed; key released");
            return Err(Unrecorded::Released(Status::from_error(e).into_http()));
        }
    };
    let (head, body) = response.into_parts();
    let collected = match body.collect().await {
        Ok(collected) => collected,
        Err(e) => {
            // The answer failed mid-way: nothing sensible to record or send.
            let e: BoxError = e.into();
            tracing::warn!(error = %e, "an answer under IdempotencyLayer failed; key released");
            let mut status =
                Status::unavailable("the answer could not be produced; retry with the same key");
            status.metadata_mut().insert(
                crate::status::IDEM_PROBLEM,
                tonic::metadata::MetadataValue::from_static("response-failed"),
            );
            return Err(Unrecorded::Released(status.into_http()));
        }
    };
    let trailers = collected.trailers().cloned();
    let frames = collected.to_bytes();
    let live = http::Response::from_parts(
        head,
        tonic::body::Body::new(Answer::new(frames.clone(), trailers.clone())),
    );
    if !is_final(code_of(live.headers(), trailers.as_ref())) {
        return Err(Unrecorded::Released(live));
    }
    let limit = config.recording.max_response_body;
    let body = if frames.len() > limit {
        tracing::warn!(limit, "answer over the limit: delivered, not recorded");
        RecordedBody::TooLarge { limit }
    } else {
        RecordedBody::Frames(frames.to_vec())
    };
    Ok(Recorded {
        headers: record(live.headers()),
        body,
        trailers: trailers.as_ref().map(record),
        live: Some(live),
    })
}
