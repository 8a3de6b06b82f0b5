//! axum 0.8: [`Problem`] and [`Answer`] as responses, [`IdempotencyKey`], [`Keyed`] and
//! [`IfMatch`] as extractors, [`ETag`] as a response part.

use axum_core::body::Body;
use axum_core::extract::{FromRequest, FromRequestParts, OptionalFromRequestParts, Request};
use axum_core::response::{IntoResponse, IntoResponseParts, Response, ResponseParts};
use bytes::Bytes;
use http::HeaderValue;
use http::header::{CONTENT_TYPE, ETAG};
use http::request::Parts;
use idem_core::Error;

use crate::answer::Answer;
use crate::conditional::{ETag, IfMatch};
use crate::key::{IDEMPOTENCY_KEY, IdempotencyKey};
use crate::keyed::{Keyed, ViaKeyed, key_of_request, unread_body};
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

/// An answer outside an idempotent call (a first execution's: no replay marker).
impl IntoResponse for Answer {
    fn into_response(self) -> Response {
        self.to_response(false).map(Body::from)
    }
}

impl<S, M, E> FromRequest<S, ViaKeyed<M>> for Keyed<E>
where
    S: Send + Sync,
    E: FromRequest<S, M>,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Response> {
        let (parts, body) = request.into_parts();
        // Read with the request's extensions, where `DefaultBodyLimit` keeps the route's limit.
        let mut reading = Request::new(body);
        *reading.extensions_mut() = parts.extensions.clone();
        let bytes = Bytes::from_request(reading, state)
            .await
            .map_err(|rejection| {
                unread_body(rejection.status().as_u16(), &rejection.body_text()).into_response()
            })?;
        let key = key_of_request(
            parts
                .headers
                .get_all(IDEMPOTENCY_KEY)
                .iter()
                .map(HeaderValue::as_bytes),
            parts.uri.query(),
            parts.headers.get(CONTENT_TYPE).map(HeaderValue::as_bytes),
            &bytes,
        )
        .map_err(IntoResponse::into_response)?;
        let request = Request::from_parts(parts, Body::from(bytes));
        let inner = E::from_request(request, state)
            .await
            .map_err(IntoResponse::into_response)?;
        Ok(Self(IdempotencyKey(key), inner))
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
