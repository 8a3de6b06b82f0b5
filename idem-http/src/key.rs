//! The `Idempotency-Key` request header and the `Idempotent-Replayed` response header.

use http::{HeaderMap, HeaderName, HeaderValue};
use idem_core::{Error, Key, KeyProblem};

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
