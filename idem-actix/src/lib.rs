//! actix-web 4 glue for [`idem`](https://docs.rs/idempotence), over the framework-neutral
//! HTTP contract of `idem-http` (the IETF Idempotency-Key draft): the
//! [`IdempotencyKey`] extractor (400 `missing-key` / `invalid-key`), [`Problem`] as actix's
//! `ResponseError` (every idem error with its status, problem+json and `Retry-After`), and
//! [`respond`], which runs a call to completion on a task of its own (a client that hangs
//! up cannot cut it off) and answers its JSON value, marking replays with
//! `Idempotent-Replayed: true`.
//!
//! ```no_run
//! use actix_web::{App, HttpResponse, http::StatusCode, web};
//! use idem_actix::{IdempotencyKey, Problem, respond};
//! # #[derive(serde::Serialize)] struct Receipt;
//! # async fn pay_order(key: IdempotencyKey, order: String) -> Result<Receipt, Problem> { Ok(Receipt) }
//!
//! async fn pay(key: IdempotencyKey, id: web::Path<String>) -> HttpResponse {
//!     let id = id.into_inner();
//!     respond(StatusCode::OK, async move { pay_order(key, id).await }).await
//! }
//!
//! let app = App::new().route("/orders/{id}/pay", web::post().to(pay));
//! ```
//!
//! This is an implementation crate of idem: applications use it as `idem::actix` (feature
//! `actix`).

use std::future::{Ready, ready};

use actix_web::http::StatusCode;
use actix_web::{FromRequest, HttpRequest, HttpResponse, ResponseError, dev::Payload};
use idem_core::{Error, Key, KeySource, Outcome, with_outcome};
use idem_http::ReplayStatus;
use serde::Serialize;

pub use idem_http::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};

/// The validated `Idempotency-Key` of a request. As an extractor it rejects a missing key
/// with 400 (`missing-key`) and a malformed one with 400 (`invalid-key`); use
/// `Option<IdempotencyKey>` where the key is optional. Quoted (RFC 8941) and bare keys are
/// accepted, as with every idem front door.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(pub Key);

impl KeySource for IdempotencyKey {
    fn to_key(&self) -> Result<Key, Error> {
        Ok(self.0.clone())
    }
}

impl serde::Serialize for IdempotencyKey {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

/// The key of `request`: `None` without the header, an error for a malformed or repeated one.
fn key_of(request: &HttpRequest) -> Result<Option<IdempotencyKey>, Error> {
    let fields = request.headers().get_all(IDEMPOTENCY_KEY.as_str());
    Ok(idem_http::key_of_fields(fields.map(|value| value.as_bytes()))?.map(IdempotencyKey))
}

impl FromRequest for IdempotencyKey {
    type Error = Problem;
    type Future = Ready<Result<Self, Problem>>;

    fn from_request(request: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(match key_of(request) {
            Ok(Some(key)) => Ok(key),
            Ok(None) => Err(Problem::from(Error::MissingKey)),
            Err(e) => Err(Problem::from(e)),
        })
    }
}

/// An RFC 9457 problem as actix answers it: `Problem::from(e)` for an idem [`Error`], or any
/// `idem_http::Problem` of yours. As a handler's error type, `?` on an idem call answers the
/// error's status (400, 409, 412, 422, 428, 503…), `application/problem+json` and
/// `Retry-After` where it applies.
#[derive(Debug, Clone)]
pub struct Problem(pub idem_http::Problem);

impl From<Error> for Problem {
    fn from(e: Error) -> Self {
        Problem(idem_http::Problem::from(&e))
    }
}

impl From<&Error> for Problem {
    fn from(e: &Error) -> Self {
        Problem(idem_http::Problem::from(e))
    }
}

impl From<idem_http::Problem> for Problem {
    fn from(problem: idem_http::Problem) -> Self {
        Problem(problem)
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.0.title, self.0.detail)
    }
}

impl ResponseError for Problem {
    fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.0.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    fn error_response(&self) -> HttpResponse {
        to_actix(self.0.to_response())
    }
}

/// A response of the `http` crate (what idem-http builds) as actix's.
fn to_actix(response: http::Response<Vec<u8>>) -> HttpResponse {
    let (parts, body) = response.into_parts();
    let status =
        StatusCode::from_u16(parts.status.as_u16()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut builder = HttpResponse::build(status);
    for (name, value) in &parts.headers {
        builder.append_header((name.as_str(), value.as_bytes()));
    }
    builder.body(body)
}

/// Runs an idempotent call to completion on a task of its own and answers it: its JSON value
/// with `status` (the first execution's status for its replays too, with
/// `Idempotent-Replayed: true`), or its error's response. A client that hangs up does not cut
/// the call off: it finishes and records, and the client's retry replays it.
pub async fn respond<T, E, F>(status: StatusCode, call: F) -> HttpResponse
where
    F: Future<Output = Result<T, E>> + Send + 'static,
    T: Serialize + Send + 'static,
    E: ResponseError + Send + 'static,
{
    let (answer, outcome) = idem_http::run_to_completion(with_outcome(call)).await;
    match answer {
        Ok(value) => {
            let status =
                http::StatusCode::from_u16(status.as_u16()).unwrap_or(http::StatusCode::OK);
            let replayed = outcome == Some(Outcome::Replayed);
            to_actix(idem_http::json_answer(
                &value,
                status,
                ReplayStatus::Original,
                replayed,
                None,
            ))
        }
        Err(e) => e.error_response(),
    }
}
