//! A response as a whole-response layer records it in the ledger, and its replay. The axum
//! layer and the actix-web middleware share the form, so a route moved from one framework to
//! the other keeps its records.

use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};

use crate::problem::Problem;
use crate::replay::mark_replayed;

/// A response as the ledger keeps it, with `live`, the framework's own response for the
/// client of the first execution (every header the route set, the whole body even when it was
/// too large to record), which is never recorded.
#[derive(Serialize, Deserialize)]
// `live` is never (de)serialized: `L` needs no bound (serde would ask `L: Default`).
#[serde(bound(serialize = "", deserialize = ""))]
pub struct RecordedResponse<L> {
    /// The status.
    pub status: u16,
    /// The recorded headers, in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body.
    pub body: RecordedBody,
    /// The first execution's own response; `None` once read back from the ledger.
    #[serde(skip)]
    pub live: Option<L>,
}

impl<L> std::fmt::Debug for RecordedResponse<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordedResponse")
            .field("status", &self.status)
            .field("headers", &self.headers.len())
            .field("body", &self.body)
            .field("live", &self.live.is_some())
            .finish()
    }
}

/// A recorded response body.
#[derive(Debug, Serialize, Deserialize)]
pub enum RecordedBody {
    /// A UTF-8 body (JSON, text), kept as text.
    Text(String),
    /// Any other body.
    Bytes(Vec<u8>),
    /// The body was over the layer's limit (in bytes) and was not recorded.
    TooLarge {
        /// The limit.
        limit: usize,
    },
}

impl RecordedBody {
    /// `bytes` as recorded: text if they are UTF-8.
    pub fn of(bytes: Vec<u8>) -> Self {
        match String::from_utf8(bytes) {
            Ok(text) => Self::Text(text),
            Err(e) => Self::Bytes(e.into_bytes()),
        }
    }
}

impl<L> RecordedResponse<L> {
    /// The recorded response as a replay, marked `Idempotent-Replayed: true`; a body that was
    /// too large to record is a 500 `response-not-recorded` (never a second execution).
    pub fn replay(self) -> http::Response<Vec<u8>> {
        let mut response = match self.body {
            RecordedBody::Text(text) => http::Response::new(text.into_bytes()),
            RecordedBody::Bytes(bytes) => http::Response::new(bytes),
            RecordedBody::TooLarge { limit } => {
                let mut response = Problem::new(
                    500,
                    "response-not-recorded",
                    "Response not recorded",
                    format!(
                        "the request with this key was executed (status {}), but its response \
                         body was over the {limit} bytes this route records, so it cannot be \
                         replayed; do not retry it with this key",
                        self.status
                    ),
                )
                .to_response();
                mark_replayed(response.headers_mut());
                return response;
            }
        };
        *response.status_mut() =
            StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        *response.headers_mut() = restore_headers(self.headers);
        mark_replayed(response.headers_mut());
        response
    }
}

/// Recorded headers (name, value), in order, as a header map; a pair that is no longer a
/// valid header is left out.
pub fn restore_headers(recorded: Vec<(String, Vec<u8>)>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in recorded {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(name), HeaderValue::from_bytes(&value))
        {
            headers.append(name, value);
        }
    }
    headers
}
