//! Validated idempotency keys, the trait that turns argument values into keys, and what a key
//! derives: its record's ledger id and the keys its lease-mode steps send downstream.

use sha2::{Digest, Sha256};

use crate::error::Error;
use crate::key_rules::{KeyProblem, refusal};

/// A validated idempotency key: 1..=255 bytes of UTF-8 without control characters.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(Box<str>);

impl Key {
    /// Validates `key`.
    ///
    /// ```
    /// # use idem_core::{Key, ErrorKind};
    /// assert_eq!(Key::new("order-42").unwrap().as_str(), "order-42");
    /// assert_eq!(Key::new("").unwrap_err().kind(), ErrorKind::InvalidKey);
    /// assert_eq!(Key::new("a\nb").unwrap_err().kind(), ErrorKind::InvalidKey);
    /// ```
    pub fn new(key: impl AsRef<str> + Into<Box<str>>) -> Result<Self, Error> {
        check(key.as_ref())?;
        Ok(Self(key.into()))
    }

    /// Validates raw bytes, which must be UTF-8.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, Error> {
        let text = std::str::from_utf8(bytes).map_err(|_| Error::InvalidKey {
            problem: KeyProblem::NotUtf8,
        })?;
        Self::new(text)
    }

    /// The key text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn check(key: &str) -> Result<(), Error> {
    match refusal(key) {
        Some(problem) => Err(Error::InvalidKey { problem }),
        None => Ok(()),
    }
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0, f)
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for Key {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl serde::Serialize for Key {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for Key {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::new(text).map_err(serde::de::Error::custom)
    }
}

impl TryFrom<&str> for Key {
    type Error = Error;
    fn try_from(value: &str) -> Result<Self, Error> {
        Self::new(value)
    }
}

impl TryFrom<String> for Key {
    type Error = Error;
    fn try_from(value: String) -> Result<Self, Error> {
        Self::new(value)
    }
}

/// A value an idempotency key (or principal) can be taken from: `key = <expr>` in
/// `#[idempotent]` must evaluate to one.
///
/// Implemented for strings, byte strings (UTF-8 only), integers, [`Key`], references to any of
/// them and `Option` of any of them (`None` is [`Error::MissingKey`]). Implement it for your
/// own key newtypes.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be used as an idempotency key",
    label = "not a key source",
    note = "keys are strings, integers or `idem::Key`; convert with `.to_string()` or implement `idem::KeySource` for `{Self}`"
)]
pub trait KeySource {
    /// Produces the validated key.
    fn to_key(&self) -> Result<Key, Error>;
}

impl KeySource for str {
    fn to_key(&self) -> Result<Key, Error> {
        Key::new(self)
    }
}

impl KeySource for String {
    fn to_key(&self) -> Result<Key, Error> {
        Key::new(self.as_str())
    }
}

impl KeySource for Key {
    fn to_key(&self) -> Result<Key, Error> {
        Ok(self.clone())
    }
}

impl KeySource for [u8] {
    fn to_key(&self) -> Result<Key, Error> {
        Key::from_bytes(self)
    }
}

impl KeySource for Vec<u8> {
    fn to_key(&self) -> Result<Key, Error> {
        Key::from_bytes(self)
    }
}

impl<T: KeySource + ?Sized> KeySource for &T {
    fn to_key(&self) -> Result<Key, Error> {
        (**self).to_key()
    }
}

impl<T: KeySource + ?Sized> KeySource for Box<T> {
    fn to_key(&self) -> Result<Key, Error> {
        (**self).to_key()
    }
}

impl<T: KeySource> KeySource for Option<T> {
    fn to_key(&self) -> Result<Key, Error> {
        match self {
            Some(inner) => inner.to_key(),
            None => Err(Error::MissingKey),
        }
    }
}

macro_rules! integer_keys {
    ($($t:ty)*) => {$(
        impl KeySource for $t {
            fn to_key(&self) -> Result<Key, Error> {
                Key::new(self.to_string())
            }
        }
    )*};
}
integer_keys!(u8 u16 u32 u64 u128 usize i8 i16 i32 i64 i128 isize);

/// SHA-256 over length-prefixed parts: no two different lists of parts share a digest
/// (`("ab", "c")` and `("a", "bc")` differ).
fn digest(parts: &[&str]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    hasher.finalize().into()
}

/// The ledger id of `(scope, principal, key)`: SHA-256 over the length-prefixed parts, so no
/// two different triples share an id.
pub fn record_id(scope: &str, principal: &str, key: &str) -> [u8; 32] {
    digest(&[scope, principal, key])
}

/// The key a lease-mode step sends downstream (`Idempotency-Key`): SHA-256 over scope,
/// principal, key and step name (length-prefixed), as `idem-` and 64 hex digits. Stable across
/// attempts and takeovers, distinct per step, 69 bytes.
pub fn derived_key(scope: &str, principal: &str, key: &str, step: &str) -> String {
    let mut out = String::with_capacity(69);
    out.push_str("idem-");
    for b in digest(&[scope, principal, key, step]) {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn accepts_the_boundaries() {
        assert!(Key::new("k").is_ok());
        assert!(Key::new("x".repeat(255)).is_ok());
        assert!(Key::new("ключ-🔑").is_ok());
    }

    #[test]
    fn refuses_bad_keys_with_the_reason() {
        let cases: [(&[u8], KeyProblem); 5] = [
            (b"", KeyProblem::Empty),
            (&[b'a'; 256], KeyProblem::TooLong { len: 256 }),
            (b"ab\0", KeyProblem::ControlCharacter { at: 2 }),
            (b"\x7f", KeyProblem::ControlCharacter { at: 0 }),
            (b"\xff\xfe", KeyProblem::NotUtf8),
        ];
        for (bytes, expected) in cases {
            match Key::from_bytes(bytes) {
                Err(Error::InvalidKey { problem }) => assert_eq!(problem, expected),
                other => panic!("{bytes:?}: expected {expected:?}, got {other:?}"),
            }
        }
    }

    #[test]
    fn none_is_missing() {
        let key: Option<String> = None;
        assert_eq!(key.to_key().unwrap_err().kind(), ErrorKind::MissingKey);
        assert_eq!(Some(7_u64).to_key().unwrap().as_str(), "7");
    }

    #[test]
    fn derived_keys_are_stable_distinct_per_step_and_short() {
        let a = derived_key("shop.pay", "", "k-1", "charge");
        assert_eq!(a, derived_key("shop.pay", "", "k-1", "charge"));
        assert_ne!(a, derived_key("shop.pay", "", "k-1", "refund"));
        assert_ne!(a, derived_key("shop.pay", "p", "k-1", "charge"));
        // Shifted boundaries give other keys (length-prefixed parts).
        assert_ne!(
            derived_key("ab", "", "c", "d"),
            derived_key("a", "", "bc", "d")
        );
        let long = derived_key(&"s".repeat(255), &"p".repeat(255), &"k".repeat(255), "x");
        assert_eq!(long.len(), 69);
        assert!(
            crate::Key::new(long).is_ok(),
            "usable as an idempotency key"
        );
    }

    #[test]
    fn record_ids_of_shifted_parts_differ() {
        assert_ne!(record_id("ab", "", "c"), record_id("a", "", "bc"));
        assert_ne!(record_id("s", "p", "k"), record_id("s", "", "pk"));
    }
}
