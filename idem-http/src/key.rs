//! The `Idempotency-Key` request header and the `Idempotent-Replayed` response header.

use http::{HeaderMap, HeaderName, HeaderValue};
use idem_core::{Error, Key, KeyProblem, KeySource};

/// The request header carrying the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// The response header marking a replayed answer.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Parses an `Idempotency-Key` value: an RFC 8941 string (quoted, `\"` and `\\` escapes), as
/// the draft defines the header, or a bare token, as most clients send it; either way the
/// result must be a valid [`Key`].
pub fn parse_key(value: &[u8]) -> Result<Key, Error> {
    let invalid = |problem| Error::InvalidKey { problem };
    let text = std::str::from_utf8(value)
        .map_err(|_| invalid(KeyProblem::NotUtf8))?
        .trim_matches(' ');
    let Some(inner) = text
        .strip_prefix('"')
        .and_then(|rest| rest.strip_suffix('"'))
    else {
        return Key::new(text);
    };
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.char_indices();
    while let Some((at, c)) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some((_, escaped @ ('"' | '\\'))) => out.push(escaped),
                _ => return Err(invalid(KeyProblem::ControlCharacter { at })),
            },
            '"' => return Err(invalid(KeyProblem::ControlCharacter { at })),
            c => out.push(c),
        }
    }
    Key::new(out)
}

/// The key of a request with `headers`: `None` without the header, an error for a malformed
/// or repeated one (`Error::InvalidKey`, answered 400). Where the key is required, `None` is
/// `Error::MissingKey` (400 too).
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<Key>, Error> {
    key_of_fields(
        headers
            .get_all(IDEMPOTENCY_KEY)
            .iter()
            .map(HeaderValue::as_bytes),
    )
}

/// [`idempotency_key`] from the values of a request's `Idempotency-Key` fields, for a
/// framework whose header map is not the `http` crate's (actix-web 4).
pub fn key_of_fields<'v>(mut fields: impl Iterator<Item = &'v [u8]>) -> Result<Option<Key>, Error> {
    let Some(value) = fields.next() else {
        return Ok(None);
    };
    let more = fields.count();
    if more > 0 {
        return Err(Error::InvalidKey {
            problem: KeyProblem::Repeated { count: more + 1 },
        });
    }
    parse_key(value).map(Some)
}

/// The validated idempotency key of a request, the same type behind every idem front door
/// (`idem::axum`, `idem::actix`, `idem::tonic`), so one `#[idempotent]` function can serve an
/// HTTP route and a gRPC method. As an axum or actix-web extractor (features `axum`, `actix`)
/// it rejects a missing key with 400 (`missing-key`) and a malformed one with 400
/// (`invalid-key`); take `Option<IdempotencyKey>` where the key is optional.
///
/// The draft defines the header as a structured-field string (`Idempotency-Key: "8e03…"`);
/// bare tokens (`Idempotency-Key: 8e03…`) are accepted too, as most clients send them.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct IdempotencyKey(pub Key);

impl IdempotencyKey {
    /// Parses a header value: an RFC 8941 string (quoted, `\"` and `\\` escapes) or a bare
    /// token; either way the result must be a valid [`Key`].
    pub fn parse(value: &[u8]) -> Result<Self, Error> {
        parse_key(value).map(Self)
    }

    /// The key of a request with `headers` (or gRPC metadata, which are headers): `None`
    /// without it, an error for a malformed or repeated one.
    pub fn of_headers(headers: &HeaderMap) -> Result<Option<Self>, Error> {
        Ok(idempotency_key(headers)?.map(Self))
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
