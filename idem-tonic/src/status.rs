//! The contract's answers as gRPC statuses: one code per kind of idem error, the kind itself
//! in `idem-problem`, and the retry delay where the error has one.

use idem_core::{Error, ErrorKind};
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

/// The response metadata naming the kind of an idem error (`in-flight`, `key-reused`, …, as
/// in the problem type `urn:idem:problem:<kind>` over HTTP): several kinds share a gRPC code.
pub const IDEM_PROBLEM: &str = "idem-problem";
/// The response metadata carrying the retry delay in whole seconds (at least 1), as HTTP's
/// `Retry-After`.
pub const RETRY_AFTER: &str = "retry-after";
/// gRPC's own retry delay (in milliseconds), which gRPC clients with a retry policy honour.
pub const GRPC_RETRY_PUSHBACK_MS: &str = "grpc-retry-pushback-ms";

/// The gRPC code of each kind of idem error (see the crate's table).
pub fn code(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::MissingKey | ErrorKind::InvalidKey | ErrorKind::InvalidPrecondition => {
            Code::InvalidArgument
        }
        ErrorKind::ArgumentsTooLarge => Code::ResourceExhausted,
        // The request can never succeed under this key, or in the resource's current state:
        // the client must change something first (a new key, a fresh read).
        ErrorKind::KeyReused
        | ErrorKind::InvalidTransition
        | ErrorKind::PreconditionRequired
        | ErrorKind::PreconditionFailed => Code::FailedPrecondition,
        // A concurrency issue: the same request again, later, succeeds.
        ErrorKind::InFlight | ErrorKind::Conflict => Code::Aborted,
        ErrorKind::GaveUp => Code::Aborted,
        ErrorKind::Unavailable
        | ErrorKind::AnswerTooNew
        | ErrorKind::DeadlineExceeded
        | ErrorKind::Store => Code::Unavailable,
        // Carried out, but its answer is lost to this version: never worth a new key.
        ErrorKind::AnswerUnreadable => Code::DataLoss,
        _ => Code::Internal,
    }
}

/// An idem error as the gRPC status a tonic method answers: the code of its kind (the
/// crate's table), the message of its problem document over HTTP (never SQL or driver text),
/// `idem-problem: <kind>`, and where the error has a retry delay `retry-after` (seconds) and
/// `grpc-retry-pushback-ms`.
///
/// ```
/// let status = idem_tonic::status(&idem_core::Error::MissingKey);
/// assert_eq!(status.code(), tonic::Code::InvalidArgument);
/// assert_eq!(status.metadata().get("idem-problem").unwrap(), "missing-key");
/// ```
pub fn status(e: &Error) -> Status {
    let kind = e.kind();
    let problem = idem_http::Problem::from(e);
    let mut status = Status::new(code(kind), problem.detail.clone());
    let metadata = status.metadata_mut();
    metadata.insert(IDEM_PROBLEM, MetadataValue::from_static(kind.as_str()));
    if let (Some(seconds), Some(delay)) = (problem.retry_after_seconds(), problem.retry_after) {
        metadata.insert(RETRY_AFTER, MetadataValue::from(seconds));
        let millis = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX).max(1);
        metadata.insert(GRPC_RETRY_PUSHBACK_MS, MetadataValue::from(millis));
    }
    status
}

/// An error a tonic method answers with: idem's [`Error`] (through [`status`]), tonic's own
/// [`Status`], or a service's error type (implement this trait for it, mapping its idem
/// variant with [`status`]).
pub trait IntoStatus {
    /// The status answered for this error.
    fn into_status(self) -> Status;
}

impl IntoStatus for Error {
    fn into_status(self) -> Status {
        status(&self)
    }
}

impl IntoStatus for Status {
    fn into_status(self) -> Status {
        self
    }
}
