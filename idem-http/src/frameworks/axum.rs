//! axum 0.8: [`Problem`] as a response, [`IdempotencyKey`] as an extractor.

use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
use axum_core::response::{IntoResponse, Response};
use http::request::Parts;
use idem_core::Error;

use crate::key::IdempotencyKey;
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
