//! actix-web 4: [`Problem`] as a `ResponseError`, [`IdempotencyKey`] as an extractor, and
//! an answer of the `http` crate as actix's (actix-web 4 has its own HTTP types).

use std::future::{Ready, ready};

use actix_web::http::StatusCode;
use actix_web::{FromRequest, HttpRequest, HttpResponse, ResponseError, dev::Payload};
use idem_core::Error;

use crate::key::{IDEMPOTENCY_KEY, IdempotencyKey, key_of_fields};
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
