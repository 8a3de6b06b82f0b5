//! HTTP glue for axum 0.8 (feature `axum`): the `Idempotency-Key` header, problem+json
//! errors, and replay-aware responses, as the IETF Idempotency-Key draft describes them.
//!
//! | situation | status |
//! |---|---|
//! | missing or invalid `Idempotency-Key` | 400 |
//! | key reused with a different payload | 422 |
//! | same key still in flight | 409 + `Retry-After` |
//! | invalid state transition | 409 |
//! | store failure | 503 (no SQL in the body) |
//! | replay | the recorded status and body + `Idempotent-Replayed: true` |

use std::future::Future;

use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
use axum_core::response::{IntoResponse, Response};
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::request::Parts;
use http::{HeaderName, HeaderValue, StatusCode};
use serde::Serialize;

use crate::error::{Error, ErrorKind};
use crate::key::{Key, KeySource};
use crate::outcome::{Outcome, with_outcome};

/// The request header carrying the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// The response header marking a replayed answer.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The validated `Idempotency-Key` of a request. As an extractor it rejects a missing key
/// with 400 (`missing-key`) and a malformed one with 400 (`invalid-key`); use
/// `Option<IdempotencyKey>` where the key is optional.
///
/// The draft defines the header as a structured-field string (`Idempotency-Key: "8e03…"`);
/// bare tokens (`Idempotency-Key: 8e03…`) are accepted too, as most clients send them.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct IdempotencyKey(pub Key);

impl IdempotencyKey {
    /// Parses a header value: an RFC 8941 string (quoted, `\"` and `\\` escapes) or a bare
    /// token; either way the result must be a valid [`Key`].
    pub fn parse(value: &[u8]) -> Result<Self, Error> {
        let invalid = |problem| Error::InvalidKey { problem };
        let text = std::str::from_utf8(value)
            .map_err(|_| invalid(crate::KeyProblem::NotUtf8))?
            .trim_matches(' ');
        let Some(inner) = text
            .strip_prefix('"')
            .and_then(|rest| rest.strip_suffix('"'))
        else {
            return Key::new(text).map(Self);
        };
        let mut out = String::with_capacity(inner.len());
        let mut chars = inner.char_indices();
        while let Some((at, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, escaped @ ('"' | '\\'))) => out.push(escaped),
                    _ => return Err(invalid(crate::KeyProblem::ControlCharacter { at })),
                },
                '"' => return Err(invalid(crate::KeyProblem::ControlCharacter { at })),
                c => out.push(c),
            }
        }
        Key::new(out).map(Self)
    }

    /// The key.
    pub fn key(&self) -> &Key {
        &self.0
    }
}

impl KeySource for IdempotencyKey {
    fn to_key(&self) -> Result<Key, Error> {
        Ok(self.0.clone())
    }
}

impl IdempotencyKey {
    /// The key of a request: `None` without the header, an error for a malformed or repeated
    /// one.
    fn of_request(parts: &Parts) -> Result<Option<Self>, Error> {
        let mut fields = parts.headers.get_all(IDEMPOTENCY_KEY).iter();
        let Some(value) = fields.next() else {
            return Ok(None);
        };
        let more = fields.count();
        if more > 0 {
            return Err(Error::InvalidKey {
                problem: crate::KeyProblem::Repeated { count: more + 1 },
            });
        }
        Self::parse(value.as_bytes()).map(Some)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Error> {
        Self::of_request(parts)?.ok_or(Error::MissingKey)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyKey {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Option<Self>, Error> {
        Self::of_request(parts)
    }
}

/// An RFC 9457 problem document.
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    /// A stable URI for the kind of problem: `urn:idem:problem:<kind>`.
    #[serde(rename = "type")]
    pub kind: String,
    /// A short summary of the kind.
    pub title: String,
    /// The HTTP status.
    pub status: u16,
    /// What happened in this case; never SQL or driver text.
    pub detail: String,
}

impl Problem {
    /// A problem of kind `kind` (kebab-case), e.g. `Problem::new(404, "not-found", "Not found", "no order o-9")`.
    pub fn new(
        status: u16,
        kind: &str,
        title: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            kind: format!("urn:idem:problem:{kind}"),
            title: title.into(),
            status,
            detail: detail.into(),
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self).unwrap_or_default();
        (
            status,
            [(
                CONTENT_TYPE,
                HeaderValue::from_static("application/problem+json"),
            )],
            body,
        )
            .into_response()
    }
}

impl From<&Error> for Problem {
    fn from(e: &Error) -> Self {
        let kind = e.kind();
        let (title, detail) = match kind {
            ErrorKind::InvalidKey => ("Invalid idempotency key", e.to_string()),
            ErrorKind::MissingKey => (
                "Missing idempotency key",
                "this request requires an `Idempotency-Key` header".to_owned(),
            ),
            ErrorKind::KeyReused => ("Idempotency key reused", e.to_string()),
            ErrorKind::InFlight => ("Request in flight", e.to_string()),
            ErrorKind::InvalidTransition => ("Invalid state transition", e.to_string()),
            ErrorKind::Store => (
                "Service unavailable",
                "the idempotency store is unavailable; retry later".to_owned(),
            ),
            _ => (
                "Internal error",
                "the request could not be processed".to_owned(),
            ),
        };
        Self::new(e.http_status(), kind.as_str(), title, detail)
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        if !matches!(self.kind(), ErrorKind::InvalidKey | ErrorKind::MissingKey) {
            tracing::debug!(error = %self, "idem error answered over HTTP");
        }
        let mut response = Problem::from(&self).into_response();
        if let Error::InFlight { retry_after, .. } = &self {
            let seconds = retry_after.as_secs_f64().ceil().max(1.0) as u64;
            if let Ok(value) = HeaderValue::from_str(&seconds.to_string()) {
                response.headers_mut().insert(RETRY_AFTER, value);
            }
        }
        response
    }
}

/// Runs an idempotent call and answers it: `Ok(value)` as JSON with `status`, `Err(e)` as
/// `e`'s response; a replayed answer (value or recorded final error) carries
/// `Idempotent-Replayed: true`, a first execution does not.
///
/// Because the recorded value is replayed and rendered the same way, a replay returns the
/// originally recorded status and body.
pub async fn respond<T, E, F>(status: StatusCode, call: F) -> Response
where
    F: Future<Output = Result<T, E>>,
    T: Serialize,
    E: IntoResponse,
{
    let (result, outcome) = with_outcome(call).await;
    let mut response = match result {
        Ok(value) => match serde_json::to_vec(&value) {
            Ok(body) => (
                status,
                [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
                body,
            )
                .into_response(),
            Err(e) => Error::Encode {
                scope: "http response".to_owned(),
                source: Box::new(e),
            }
            .into_response(),
        },
        Err(e) => e.into_response(),
    };
    if outcome == Some(Outcome::Replayed) {
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_structured_field_strings_and_tokens() {
        let parse = |v: &str| IdempotencyKey::parse(v.as_bytes()).map(|k| k.0.as_str().to_owned());
        assert_eq!(parse("\"8e03978e-40d5\"").unwrap(), "8e03978e-40d5");
        assert_eq!(parse("8e03978e-40d5").unwrap(), "8e03978e-40d5");
        assert_eq!(parse(r#""a\"b\\c""#).unwrap(), r#"a"b\c"#);
        assert!(parse("\"\"").is_err());
        assert!(parse(r#""bad\escape""#).is_err());
        assert!(parse(r#""in"side""#).is_err());
        assert!(IdempotencyKey::parse(b"\xff").is_err());
    }

    #[test]
    fn problems_have_stable_types_and_statuses() {
        let p = Problem::from(&Error::KeyReused { scope: "s".into() });
        assert_eq!(
            (p.status, p.kind.as_str()),
            (422, "urn:idem:problem:key-reused")
        );
        let store = Error::store("x", std::io::Error::other("SELECT secret FROM t"));
        let p = Problem::from(&store);
        assert_eq!(p.status, 503);
        assert!(!p.detail.contains("SELECT"));
    }
}
