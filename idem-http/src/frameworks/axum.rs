//! axum 0.8: [`Problem`] as a response, [`IdempotencyKey`] and [`IfMatch`] as extractors,
//! [`ETag`] as a response part.

use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
use axum_core::response::{IntoResponse, IntoResponseParts, Response, ResponseParts};
use http::header::ETAG;
use http::request::Parts;
use idem_core::Error;

use crate::conditional::{ETag, IfMatch};
use crate::key::IdempotencyKey;
use crate::precondition::{etag_value, if_match};
use crate::problem::Problem;

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        self.to_response().map(axum_core::body::Body::from)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Problem> {
        Ok(Self::of_headers(&parts.headers)?.ok_or(Error::MissingKey)?)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyKey {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Option<Self>, Problem> {
        Ok(Self::of_headers(&parts.headers)?)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IfMatch {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Problem> {
        Ok(Self(
            if_match_of(parts)?.ok_or(Error::PreconditionRequired)?,
        ))
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IfMatch {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Option<Self>, Problem> {
        Ok(if_match_of(parts)?.map(Self))
    }
}

/// The `If-Match` of a request: `None` without the header.
fn if_match_of(parts: &Parts) -> Result<Option<idem_core::IfMatch>, Error> {
    if_match(&parts.headers)
}

impl IntoResponseParts for ETag {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut parts: ResponseParts) -> Result<ResponseParts, Self::Error> {
        if let Some(value) = etag_value(&self.0) {
            parts.headers_mut().insert(ETAG, value);
        }
        Ok(parts)
    }
}
