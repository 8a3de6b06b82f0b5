//! actix-web 4: [`Problem`] as a `ResponseError`, [`IdempotencyKey`] and [`IfMatch`] as
//! extractors, [`ETag`] as a header, and
//! an answer of the `http` crate as actix's (actix-web 4 has its own HTTP types).

use std::future::{Ready, ready};

use actix_web::http::StatusCode;
use actix_web::http::header::{
    self, HeaderName, HeaderValue, InvalidHeaderValue, TryIntoHeaderPair,
};
use actix_web::{FromRequest, HttpRequest, HttpResponse, ResponseError, dev::Payload};
use idem_core::Error;

use crate::conditional::{ETag, IfMatch};
use crate::key::{IDEMPOTENCY_KEY, IdempotencyKey, key_of_fields};
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
