//! actix-web 4: [`Problem`] as a `ResponseError`, [`Answer`] as a `Responder`,
//! [`IdempotencyKey`], [`Keyed`] and [`IfMatch`] as extractors, [`ETag`] as a header, and
//! an answer of the `http` crate as actix's (actix-web 4 has its own HTTP types).

use std::future::{Future, Ready, ready};
use std::pin::Pin;

use actix_web::http::StatusCode;
use actix_web::http::header::{
    self, HeaderName, HeaderValue, InvalidHeaderValue, TryIntoHeaderPair,
};
use actix_web::{FromRequest, HttpRequest, HttpResponse, Responder, ResponseError, dev::Payload};
use actix_web::{body::BoxBody, web::Bytes};
use idem_core::Error;

use crate::answer::Answer;
use crate::conditional::{ETag, IfMatch};
use crate::key::{IDEMPOTENCY_KEY, IdempotencyKey, key_of_fields};
use crate::keyed::{Keyed, key_of_request, unread_body};
use crate::precondition::if_match;
use crate::problem::Problem;

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.title, self.detail)
    }
}

/// As a handler's error type, `?` on an idem call answers the error's status (400, 409, 412,
/// 422, 428, 503…), `application/problem+json` and `Retry-After` where it applies.
impl ResponseError for Problem {
    fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    fn error_response(&self) -> HttpResponse {
        to_actix(self.to_response())
    }
}

/// The key of `request`: `None` without the header, an error for a malformed or repeated one.
fn key_of(request: &HttpRequest) -> Result<Option<IdempotencyKey>, Error> {
    let fields = request.headers().get_all(IDEMPOTENCY_KEY.as_str());
    Ok(key_of_fields(fields.map(|value| value.as_bytes()))?.map(IdempotencyKey))
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

impl<E: FromRequest + 'static> FromRequest for Keyed<E> {
    type Error = actix_web::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self, actix_web::Error>>>>;

    fn from_request(request: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let request = request.clone();
        // Up to the app's `PayloadConfig` limit, as `E` would read it.
        let body = Bytes::from_request(&request, payload);
        Box::pin(async move {
            let bytes = body.await.map_err(|e| {
                let status = e.as_response_error().status_code().as_u16();
                unread_body(status, &e.to_string())
            })?;
            let headers = request.headers();
            let key = key_of_request(
                headers
                    .get_all(IDEMPOTENCY_KEY.as_str())
                    .map(|value| value.as_bytes()),
                Some(request.query_string()).filter(|query| !query.is_empty()),
                headers.get("content-type").map(|value| value.as_bytes()),
                &bytes,
            )?;
            let inner = E::from_request(&request, &mut Payload::from(bytes))
                .await
                .map_err(Into::into)?;
            Ok(Self(IdempotencyKey(key), inner))
        })
    }
}

/// An answer outside an idempotent call (a first execution's: no replay marker).
impl Responder for Answer {
    type Body = BoxBody;

    fn respond_to(self, _: &HttpRequest) -> HttpResponse {
        to_actix(self.to_response(false))
    }
}

/// A response of the `http` crate (what this crate builds) as actix-web's.
pub fn to_actix(response: http::Response<Vec<u8>>) -> HttpResponse {
    let (parts, body) = response.into_parts();
    let status =
        StatusCode::from_u16(parts.status.as_u16()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut builder = HttpResponse::build(status);
    for (name, value) in &parts.headers {
        builder.append_header((name.as_str(), value.as_bytes()));
    }
    builder.body(body)
}

impl FromRequest for IfMatch {
    type Error = Problem;
    type Future = Ready<Result<Self, Problem>>;

    /// 428 `precondition-required` without the header, 400 `invalid-precondition` for a
    /// malformed one; take `Option<IfMatch>` where the precondition is optional.
    fn from_request(request: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(match if_match_of(request) {
            Ok(Some(precondition)) => Ok(IfMatch(precondition)),
            Ok(None) => Err(Problem::from(Error::PreconditionRequired)),
            Err(e) => Err(Problem::from(e)),
        })
    }
}

/// The `If-Match` of `request` (every field line, one list): `None` without the header.
fn if_match_of(request: &HttpRequest) -> Result<Option<idem_core::IfMatch>, Error> {
    let mut headers = http::HeaderMap::new();
    for value in request.headers().get_all("if-match") {
        let value = http::HeaderValue::from_bytes(value.as_bytes()).map_err(|_| {
            Error::InvalidPrecondition {
                problem: "the `If-Match` header is not a valid field value".to_owned(),
            }
        })?;
        headers.append(http::header::IF_MATCH, value);
    }
    if_match(&headers)
}

impl TryIntoHeaderPair for ETag {
    type Error = InvalidHeaderValue;

    fn try_into_pair(self) -> Result<(HeaderName, HeaderValue), InvalidHeaderValue> {
        Ok((header::ETAG, HeaderValue::from_str(&self.0.to_string())?))
    }
}
