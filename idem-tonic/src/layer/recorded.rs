//! A unary call's answer as the ledger keeps it, and its replay.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use idem_http::restore_headers;
use serde::{Deserialize, Serialize};
use tonic::Code;

use super::body::Answer;
use crate::key::IDEMPOTENT_REPLAYED;
use crate::status::IDEM_PROBLEM;

/// An answer as the ledger keeps it: its headers (initial metadata), its message frames and
/// its trailers (the status and trailing metadata; none for a trailers-only error).
#[derive(Serialize, Deserialize)]
pub(super) struct Recorded {
    pub(super) headers: Vec<(String, Vec<u8>)>,
    pub(super) body: RecordedBody,
    pub(super) trailers: Option<Vec<(String, Vec<u8>)>>,
    /// The method's own answer, for the client of the first execution (the whole body even
    /// when it was too large to record). Never recorded.
    #[serde(skip)]
    pub(super) live: Option<http::Response<tonic::body::Body>>,
}

#[derive(Serialize, Deserialize)]
pub(super) enum RecordedBody {
    /// The message frames, as sent.
    Frames(Vec<u8>),
    /// The answer was over the layer's limit (in bytes) and was not recorded.
    TooLarge { limit: usize },
}

/// The headers a replay does not repeat: they describe one transfer, not the answer.
fn per_transfer(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "content-length" | "date" | "transfer-encoding"
    )
}

/// `headers` as recorded.
pub(super) fn record(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .filter(|(name, _)| !per_transfer(name))
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect()
}

/// The gRPC status of an answer: in its trailers, or in its headers for a trailers-only
/// answer; `UNKNOWN` if neither has one.
pub(super) fn code_of(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Code {
    trailers
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| headers.get("grpc-status"))
        .and_then(|value| value.to_str().ok()?.parse::<i32>().ok())
        .map_or(Code::Unknown, Code::from_i32)
}

/// Whether an answer with `code` is recorded: success, and statuses that tell the client to
/// change its request (the same request would get them again). Every other status is
/// transient or a server fault, as a 5xx over HTTP: the key is released and a retry runs
/// the method again.
pub(super) fn is_final(code: Code) -> bool {
    matches!(
        code,
        Code::Ok
            | Code::InvalidArgument
            | Code::NotFound
            | Code::AlreadyExists
            | Code::PermissionDenied
            | Code::FailedPrecondition
            | Code::OutOfRange
            | Code::Unauthenticated
    )
}

impl Recorded {
    /// The first client's answer, or the replay of the recorded one.
    pub(super) fn into_response(self) -> http::Response<tonic::body::Body> {
        if let Some(live) = self.live {
            return live;
        }
        let mut response = match self.body {
            RecordedBody::Frames(frames) => {
                let trailers = self.trailers.map(restore_headers);
                let mut response = http::Response::new(tonic::body::Body::new(Answer::new(
                    Bytes::from(frames),
                    trailers,
                )));
                *response.headers_mut() = restore_headers(self.headers);
                response
            }
            RecordedBody::TooLarge { limit } => {
                let mut status = tonic::Status::internal(format!(
                    "the call with this key was carried out, but its answer was over the {limit} \
                     bytes this method records, so it cannot be replayed; do not retry it with \
                     this key"
                ));
                status.metadata_mut().insert(
                    IDEM_PROBLEM,
                    tonic::metadata::MetadataValue::from_static("response-not-recorded"),
                );
                status.into_http()
            }
        };
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        response
    }
}
