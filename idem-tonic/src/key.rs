//! The `idempotency-key` request metadata.

use idem_core::Error;
use tonic::metadata::MetadataMap;

use crate::status::status;

pub use idem_http::IdempotencyKey;

/// The request metadata carrying the key (HTTP/2 header `idempotency-key`, as over HTTP).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The response metadata marking a replayed answer: `idempotent-replayed: true`.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The validated `idempotency-key` of a gRPC request, required: a missing, malformed or
/// repeated key is `INVALID_ARGUMENT` (`idem-problem: missing-key` / `invalid-key`). Quoted
/// (RFC 8941) and bare keys are accepted, as with every idem front door, and the key is
/// idem's one [`IdempotencyKey`], so one `#[idempotent]` function can serve a gRPC method and
/// an HTTP route.
///
/// ```
/// # fn pay(request: tonic::Request<()>) -> Result<(), tonic::Status> {
/// let key = idem_tonic::idempotency_key(&request)?;
/// # let _ = key; Ok(()) }
/// ```
pub fn idempotency_key<T>(request: &tonic::Request<T>) -> Result<IdempotencyKey, tonic::Status> {
    optional_idempotency_key(request)?.ok_or_else(|| status(&Error::MissingKey))
}

/// The key of `request` where it is optional: `None` without the metadata,
/// `INVALID_ARGUMENT` for a malformed or repeated one.
pub fn optional_idempotency_key<T>(
    request: &tonic::Request<T>,
) -> Result<Option<IdempotencyKey>, tonic::Status> {
    key_of_metadata(request.metadata()).map_err(|e| status(&e))
}

/// The key in `metadata`: `None` without it, an idem error for a malformed or repeated one.
pub fn key_of_metadata(metadata: &MetadataMap) -> Result<Option<IdempotencyKey>, Error> {
    IdempotencyKey::of_headers(metadata.as_ref())
}
