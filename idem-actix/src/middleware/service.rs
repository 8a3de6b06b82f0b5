//! The service [`IdempotencyMiddleware`](super::IdempotencyMiddleware) wraps a handler in:
//! checks, fingerprints, claims, runs and records each request.

use std::fmt;
use std::future::{Ready, ready};
use std::rc::Rc;
use std::sync::Arc;

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{Payload, Service, ServiceRequest, ServiceResponse, Transform, forward_ready};
use actix_web::{HttpMessage, HttpRequest, HttpResponse, ResponseError};
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use futures_util::future::LocalBoxFuture;
use idem_core::Error;
use idem_core::lease::{once, run_lease};
use idem_http::frameworks::actix::to_actix;
use idem_http::recording::fingerprint_request;
use idem_http::{Problem, RecordedBody, RecordedResponse, key_of_fields};

use super::{Config, IdempotencyMiddleware};

impl<S, B> Transform<S, ServiceRequest> for IdempotencyMiddleware
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<BoxBody>;
    type Error = actix_web::Error;
    type Transform = IdempotencyMiddlewareService<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, ()>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready(Ok(IdempotencyMiddlewareService {
            inner: Rc::new(service),
            config: Arc::clone(&self.config),
        }))
    }
}

/// The service [`IdempotencyMiddleware`](super::IdempotencyMiddleware) wraps a handler in.
pub struct IdempotencyMiddlewareService<S> {
    inner: Rc<S>,
    config: Arc<Config>,
}

impl<S> fmt::Debug for IdempotencyMiddlewareService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyMiddlewareService")
            .field("scope", &self.config.scope)
            .finish_non_exhaustive()
    }
}

impl<S, B> Service<ServiceRequest> for IdempotencyMiddlewareService<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<BoxBody>;
    type Error = actix_web::Error;
    type Future = LocalBoxFuture<'static, Result<ServiceResponse<BoxBody>, actix_web::Error>>;

    forward_ready!(inner);

    fn call(&self, request: ServiceRequest) -> Self::Future {
        let (inner, config) = (Rc::clone(&self.inner), Arc::clone(&self.config));
        Box::pin(async move {
            let http_request = request.request().clone();
            let response = answer(config, inner, request).await;
            Ok(ServiceResponse::new(http_request, response))
        })
    }
}

/// A response as the ledger keeps it, with the handler's own response for its first client.
type Recorded = RecordedResponse<HttpResponse>;

/// Why a request through the middleware recorded nothing.
enum Unrecorded {
    /// idem's own answer: a bad key, reuse, in flight, a store failure.
    Idem(Error),
    /// The handler answered 5xx or failed: passed through, the key released.
    Released(HttpResponse),
}

impl From<Error> for Unrecorded {
    fn from(e: Error) -> Self {
        Self::Idem(e)
    }
}

/// Reads the request body whole if it has at most `limit` bytes; `None` if it has more.
async fn read_up_to(payload: &mut Payload, limit: usize) -> Result<Option<Bytes>, Problem> {
    let mut bytes = BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| {
            Problem::new(
                400,
                "invalid-body",
                "Request body unreadable",
                format!("the request body could not be read: {e}"),
            )
        })?;
        if bytes.len() + chunk.len() > limit {
            return Ok(None);
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(Some(bytes.freeze()))
}

/// Answers one request: checks and fingerprints it, then claims, runs and records on a task
/// of the worker's own, which finishes whether or not the client waits.
async fn answer<S, B>(
    config: Arc<Config>,
    inner: Rc<S>,
    mut request: ServiceRequest,
) -> HttpResponse
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
{
    let fields = request
        .headers()
        .get_all(idem_http::IDEMPOTENCY_KEY.as_str());
    let key = match key_of_fields(fields.map(|value| value.as_bytes())) {
        Ok(Some(key)) => Ok(key),
        Ok(None) => Err(Error::MissingKey),
        Err(e) => Err(e),
    };
    let key_is_valid = key.is_ok();
    let principal = match &config.principal {
        Some(principal) if key_is_valid => principal(request.request()),
        _ => None,
    };
    let mut call = config.recording.call(config.site, key, principal);
    if key_is_valid {
        // Read the body only for a request the middleware will claim.
        let limit = config.recording.max_request_body;
        let bytes = match read_up_to(&mut request.take_payload(), limit).await {
            Ok(Some(bytes)) => bytes,
            Ok(None) => {
                return Problem::new(
                    413,
                    "request-too-large",
                    "Request body too large",
                    format!("this route reads request bodies of at most {limit} bytes"),
                )
                .error_response();
            }
            Err(problem) => return problem.error_response(),
        };
        let path_and_query = request.uri().path_and_query().map_or("/", |p| p.as_str());
        fingerprint_request(
            &mut call,
            request.method().as_str(),
            path_and_query,
            &content_type_of(request.request()),
            &bytes,
        );
        request.set_payload(Payload::from(bytes));
    }
    let store = Arc::clone(&config.recording.store);
    let lease = config.recording.lease;
    // actix-web's handlers are not `Send`: the call runs on the worker's own executor, where
    // a client that hangs up cannot drop it.
    let task = actix_web::rt::spawn(async move {
        // The request's first try consumes it: a conflict of a final phase kept open is
        // answered (503, `Retry-After`), and the client's retry runs it again.
        let body = async move || run_handler(&config, inner, request).await;
        run_lease(store, call, lease, None, once(body)).await
    });
    match task.await {
        Ok(Ok(recorded)) => match recorded.live {
            Some(live) => live,
            None => to_actix(recorded.replay()),
        },
        Ok(Err(Unrecorded::Released(response))) => response,
        Ok(Err(Unrecorded::Idem(e))) => Problem::from(e).error_response(),
        Err(e) => {
            // The handler panicked: its lease is left to expire, and a retry runs it again.
            tracing::error!(error = %e, "a handler under IdempotencyMiddleware panicked");
            Problem::new(
                500,
                "internal",
                "Internal error",
                "the request could not be processed",
            )
            .error_response()
        }
    }
}

/// The request's `Content-Type` as the `http` crate's headers (actix-web 4 has its own), which
/// tells the fingerprint whether the body is JSON.
fn content_type_of(request: &HttpRequest) -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    if let Some(value) = request.headers().get("content-type")
        && let Ok(value) = http::HeaderValue::from_bytes(value.as_bytes())
    {
        headers.insert(http::header::CONTENT_TYPE, value);
    }
    headers
}

/// Runs the handler and sorts its response: 5xx and failures released, the rest recorded
/// (the body up to the limit).
async fn run_handler<S, B>(
    config: &Config,
    inner: Rc<S>,
    request: ServiceRequest,
) -> Result<Recorded, Unrecorded>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody + 'static,
{
    let response = match inner.call(request).await {
        Ok(response) => response.into_parts().1,
        Err(e) => return Err(Unrecorded::Released(e.error_response())),
    };
    if response.status().is_server_error() {
        return Err(Unrecorded::Released(response.map_into_boxed_body()));
    }
    let (head, body) = response.into_parts();
    let bytes = match actix_web::body::to_bytes(body).await {
        Ok(bytes) => bytes,
        Err(e) => {
            // The handler's body failed mid-way: nothing sensible to record or send.
            let e: Box<dyn std::error::Error> = e.into();
            tracing::warn!(scope = config.scope, error = %e, "response body failed; key released");
            return Err(Unrecorded::Released(
                Problem::new(
                    502,
                    "response-failed",
                    "Response failed",
                    "the response body could not be produced; retry with the same key",
                )
                .error_response(),
            ));
        }
    };
    let headers = config
        .headers
        .iter()
        .flat_map(|name| {
            head.headers()
                .get_all(name.as_str())
                .map(|value| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        })
        .collect();
    let limit = config.recording.max_response_body;
    let body = if bytes.len() > limit {
        tracing::warn!(
            scope = config.scope,
            limit,
            "response body over the limit: delivered, not recorded"
        );
        RecordedBody::TooLarge { limit }
    } else {
        RecordedBody::of(bytes.to_vec())
    };
    Ok(Recorded {
        status: head.status().as_u16(),
        headers,
        body,
        live: Some(head.set_body(bytes).map_into_boxed_body()),
    })
}
