//! The problem+json answer (RFC 9457) of every idem [`Error`], with its status and
//! `Retry-After`.

use std::time::Duration;

use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, StatusCode};
use idem_core::{Error, ErrorKind};
use serde::Serialize;

/// An RFC 9457 problem document: how an [`Error`] (or any error of yours) is answered over
/// HTTP, as `application/problem+json`.
///
/// `Problem::from(&e).to_response()` answers an idem [`Error`] with the status of its kind (and
/// `Retry-After` where the error has one) as an [`http::Response`]; with feature `axum` it is
/// also axum's `IntoResponse`. A handler's own error type does that for its idem variant.
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
    /// When the client should retry, sent as `Retry-After` (whole seconds, at least 1); not
    /// part of the document.
    #[serde(skip)]
    pub retry_after: Option<Duration>,
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
            retry_after: None,
        }
    }
}

impl Problem {
    /// The problem as a complete HTTP response: its status, `Content-Type:
    /// application/problem+json`, `Retry-After` where it applies, and the document as the body.
    /// How a service on any framework answers an idem [`Error`] in one call:
    /// `Problem::from(&e).to_response()`.
    pub fn to_response(&self) -> http::Response<Vec<u8>> {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = http::Response::new(serde_json::to_vec(self).unwrap_or_default());
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(seconds) = self.retry_after_seconds() {
            headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }

    /// `Retry-After` in whole seconds (at least 1), where the problem has one.
    pub fn retry_after_seconds(&self) -> Option<u64> {
        self.retry_after
            .map(|retry_after| retry_after.as_secs_f64().ceil().max(1.0) as u64)
    }
}

impl From<&Error> for Problem {
    fn from(e: &Error) -> Self {
        let kind = e.kind();
        if !matches!(
            kind,
            ErrorKind::InvalidKey
                | ErrorKind::MissingKey
                | ErrorKind::PreconditionRequired
                | ErrorKind::InvalidPrecondition
        ) {
            // Not a malformed request: worth a line when debugging a service (the detail
            // sent to the client leaves store errors out).
            tracing::debug!(error = %e, "idem error answered over HTTP");
        }
        let (title, detail) = match kind {
            ErrorKind::InvalidKey => ("Invalid idempotency key", e.to_string()),
            ErrorKind::MissingKey => (
                "Missing idempotency key",
                "this request requires an `Idempotency-Key` header".to_owned(),
            ),
            ErrorKind::KeyReused => ("Idempotency key reused", e.to_string()),
            ErrorKind::InFlight => ("Request in flight", e.to_string()),
            ErrorKind::InvalidTransition => ("Invalid state transition", e.to_string()),
            ErrorKind::PreconditionRequired => ("Precondition required", e.to_string()),
            ErrorKind::PreconditionFailed => ("Precondition failed", e.to_string()),
            ErrorKind::InvalidPrecondition => ("Invalid precondition", e.to_string()),
            ErrorKind::ArgumentsTooLarge => ("Request too large to resume", e.to_string()),
            ErrorKind::GaveUp => ("Request given up", e.to_string()),
            // Neither detail names the key or the types' fields: the client learns what to do.
            ErrorKind::AnswerTooNew => (
                "Answer recorded by a newer version",
                "this request was carried out by a newer version of the service, whose answer this one cannot read; retry it with the same key (after Retry-After) to reach a newer one".to_owned(),
            ),
            ErrorKind::AnswerUnreadable => (
                "Recorded answer unreadable",
                "this request was carried out, but the service can no longer read the answer it recorded; do not send it again under a new key: it would be carried out again".to_owned(),
            ),
            ErrorKind::Unavailable => (
                "Service unavailable",
                "the idempotency store could not be reached in time; retry later".to_owned(),
            ),
            ErrorKind::Conflict => (
                "Conflict with a concurrent request",
                "the database kept aborting this request for conflicts with concurrent ones; nothing was done: retry later".to_owned(),
            ),
            ErrorKind::DeadlineExceeded => ("Request ran past its deadline", e.to_string()),
            ErrorKind::Store => (
                "Service unavailable",
                "the idempotency store is unavailable; retry later".to_owned(),
            ),
            _ => (
                "Internal error",
                "the request could not be processed".to_owned(),
            ),
        };
        let mut problem = Self::new(e.http_status(), kind.as_str(), title, detail);
        if let Error::InFlight { retry_after, .. }
        | Error::Unavailable { retry_after, .. }
        | Error::Conflict { retry_after, .. }
        | Error::AnswerTooNew { retry_after, .. }
        | Error::DeadlineExceeded { retry_after, .. } = e
        {
            problem.retry_after = Some(*retry_after);
        }
        problem
    }
}

impl From<Error> for Problem {
    fn from(e: Error) -> Self {
        Self::from(&e)
    }
}
