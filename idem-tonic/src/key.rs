//! The `idempotency-key` request metadata.

use idem_core::{Error, Key, KeySource};
use tonic::metadata::MetadataMap;

use crate::status::status;

/// The request metadata carrying the key (HTTP/2 header `idempotency-key`, as over HTTP).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The response metadata marking a replayed answer: `idempotent-replayed: true`.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The validated `idempotency-key` of a gRPC request. Quoted (RFC 8941) and bare keys are
/// accepted, as with every idem front door; a missing, malformed or repeated key is
/// `INVALID_ARGUMENT` (`idem-problem: missing-key` / `invalid-key`).
///
/// ```
/// # fn pay(request: tonic::Request<()>) -> Result<(), tonic::Status> {
/// let key = idem_tonic::IdempotencyKey::of(&request)?;
/// # let _ = key; Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(pub Key);

impl IdempotencyKey {
    /// The key of `request`, required: its absence is `INVALID_ARGUMENT`.
    pub fn of<T>(request: &tonic::Request<T>) -> Result<Self, tonic::Status> {
        match Self::optional(request)? {
            Some(key) => Ok(key),
            None => Err(status(&Error::MissingKey)),
        }
    }

    /// The key of `request` where it is optional: `None` without the metadata, an error
    /// (`INVALID_ARGUMENT`) for a malformed or repeated one.
    pub fn optional<T>(request: &tonic::Request<T>) -> Result<Option<Self>, tonic::Status> {
        Self::of_metadata(request.metadata()).map_err(|e| status(&e))
    }

    /// The key in `metadata`: `None` without it, an idem error for a malformed or repeated one.
    pub fn of_metadata(metadata: &MetadataMap) -> Result<Option<Self>, Error> {
        let fields = metadata.get_all(IDEMPOTENCY_KEY).iter();
        Ok(idem_http::key_of_fields(fields.map(|value| value.as_bytes()))?.map(Self))
    }
}

impl KeySource for IdempotencyKey {
    fn to_key(&self) -> Result<Key, Error> {
        Ok(self.0.clone())
    }
}

impl serde::Serialize for IdempotencyKey {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}
