//! Answers whose type evolves: a recorded answer carries the version of the type that wrote
//! it, and a reader upcasts older versions to its own ([`Versioned`]).
//!
//! A payload written by a type of version 2 or more starts with the envelope `v<N>:`,
//! followed by the JSON; one written by an unversioned type (or version 1) is the JSON alone,
//! as every record was before versions existed. JSON never starts with `v`, so the two
//! cannot be confused, and version 1 records keep their bytes: old and new readers agree on
//! them.
//!
//! Reading a payload ([`AnswerVersion::read`]): its version equal to the reader's, the JSON
//! is decoded as it is; older, it is parsed as a JSON value and passed through
//! [`Versioned::upcast`] once per version up to the reader's; newer, the reader cannot know
//! its shape and answers [`AnswerError::Newer`] (a retry that reaches a newer deployment gets
//! the answer: [`Error::AnswerTooNew`](crate::Error::AnswerTooNew)).

use std::borrow::Cow;
use std::marker::PhantomData;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// How long a caller answered [`Error::AnswerTooNew`](crate::Error::AnswerTooNew) should wait
/// before retrying: long enough for a load balancer to pick another process, short against a
/// rolling deploy.
pub const NEWER_RETRY_AFTER: Duration = Duration::from_secs(2);

/// A type recorded as an answer (a handler's `Ok` type, or its [`FinalError`](crate::FinalError)
/// type) whose shape changes between deployments: it says which version it writes and how
/// the JSON of an older version becomes its own.
///
/// Types that do not implement it keep working unchanged: they write and read version 1.
/// Implement it when a change to the type would stop recorded answers from decoding (a new
/// required field, a renamed field or variant, a field of another type): bump
/// [`VERSION`](Self::VERSION) and turn the previous version's JSON into the new one in
/// [`upcast`](Self::upcast). Adding an `Option` field or one with `#[serde(default)]` needs no
/// new version.
///
/// ```
/// use serde::{Deserialize, Serialize};
/// use serde_json::Value;
///
/// #[derive(Serialize, Deserialize)]
/// struct Receipt {
///     amount_cents: i64,
///     currency: String, // version 2: new and required
/// }
///
/// impl idem_core::Versioned for Receipt {
///     const VERSION: u32 = 2;
///     fn upcast(from: u32, mut answer: Value) -> serde_json::Result<Value> {
///         if from == 1 {
///             answer["currency"] = "EUR".into(); // every version 1 receipt was in euros
///         }
///         Ok(answer)
///     }
/// }
/// ```
///
/// Before deploying a new version, run `idem::sea_orm::check_answers::<Receipt>(&db, scope)`
/// in a test or deploy job: it decodes every live record of the scope as the new type would.
#[diagnostic::on_unimplemented(
    message = "`{Self}` declares no answer version",
    label = "`answer_version` needs the answer type to implement `idem::Versioned`",
    note = "implement `idem::Versioned` for `{Self}` (`const VERSION: u32 = 2;` and an `upcast` from version 1), or remove `answer_version`"
)]
pub trait Versioned: Serialize + DeserializeOwned {
    /// The version this type writes: 1 for the shape it had before it was versioned, then one
    /// more for each change that older answers need an upcast for. At least 1.
    const VERSION: u32;

    /// Turns the JSON of an answer recorded as version `from` into the JSON of version
    /// `from + 1`. The engine applies it from the recorded version up to
    /// [`VERSION`](Self::VERSION), one version at a time, so each change is written once.
    /// The default keeps the JSON as it is (enough for a change serde absorbs). An error
    /// makes the answer unreadable ([`Error::AnswerUnreadable`](crate::Error::AnswerUnreadable)).
    fn upcast(from: u32, answer: Value) -> serde_json::Result<Value> {
        let _ = from;
        Ok(answer)
    }
}

/// The version an answer type writes and its upcast, without the type: what a call needs to
/// record and read its answers ([`Call::answer_versions`](crate::call::Call::answer_versions)).
#[derive(Clone, Copy)]
pub struct AnswerVersion {
    version: u32,
    upcast: fn(u32, Value) -> serde_json::Result<Value>,
}

impl std::fmt::Debug for AnswerVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AnswerVersion({})", self.version)
    }
}

/// Leaves an answer's JSON as it is: version 1 has nothing older to upcast.
fn unchanged(_from: u32, answer: Value) -> serde_json::Result<Value> {
    Ok(answer)
}

impl AnswerVersion {
    /// A type that does not implement [`Versioned`]: it writes version 1 (bare JSON).
    pub const UNVERSIONED: Self = Self {
        version: 1,
        upcast: unchanged,
    };

    /// The version `T` writes, with its upcast.
    pub const fn of<T: Versioned>() -> Self {
        const {
            assert!(
                T::VERSION >= 1,
                "`idem::Versioned::VERSION` must be at least 1 (1 is the shape the type had before it was versioned)"
            );
        }
        Self {
            version: T::VERSION,
            upcast: T::upcast,
        }
    }

    /// The version written.
    pub const fn version(self) -> u32 {
        self.version
    }

    /// The payload to record for `json`, an answer of this version: the JSON itself for
    /// version 1, else behind the envelope `v<N>:`.
    pub fn envelope(self, json: Vec<u8>) -> Vec<u8> {
        if self.version <= 1 {
            return json;
        }
        let mut payload = format!("v{}:", self.version).into_bytes();
        payload.extend_from_slice(&json);
        payload
    }

    /// The JSON of a recorded payload, as this version reads it: as recorded when the versions
    /// agree, else upcast from the recorded version.
    ///
    /// # Errors
    /// [`AnswerError::Newer`] for a payload of a later version; [`AnswerError::Unreadable`]
    /// for a malformed envelope, JSON that does not parse, or an upcast that fails.
    pub fn read(self, payload: &[u8]) -> Result<Cow<'_, [u8]>, AnswerError> {
        let (recorded, json) = split(payload)?;
        let unreadable = |message: String| AnswerError::Unreadable {
            recorded,
            expected: self.version,
            message,
        };
        if recorded == self.version {
            return Ok(Cow::Borrowed(json));
        }
        if recorded > self.version {
            return Err(AnswerError::Newer {
                recorded,
                known: self.version,
            });
        }
        let mut value: Value =
            serde_json::from_slice(json).map_err(|e| unreadable(e.to_string()))?;
        for from in recorded..self.version {
            value = (self.upcast)(from, value)
                .map_err(|e| unreadable(format!("upcast from version {from}: {e}")))?;
        }
        let json = serde_json::to_vec(&value).map_err(|e| unreadable(e.to_string()))?;
        Ok(Cow::Owned(json))
    }

    /// Decodes a recorded payload as `T` of this version (upcast when older).
    ///
    /// # Errors
    /// As [`read`](Self::read), and [`AnswerError::Unreadable`] when the JSON does not
    /// decode as `T`.
    pub fn decode<T: DeserializeOwned>(self, payload: &[u8]) -> Result<T, AnswerError> {
        self.decode_with(payload, |json| serde_json::from_slice(json))
    }

    /// Decodes a recorded payload of this version (upcast when older) with `decode`.
    pub(crate) fn decode_with<T>(
        self,
        payload: &[u8],
        decode: impl FnOnce(&[u8]) -> serde_json::Result<T>,
    ) -> Result<T, AnswerError> {
        let json = self.read(payload)?;
        decode(&json).map_err(|e| AnswerError::Unreadable {
            recorded: recorded_version(payload).unwrap_or(self.version),
            expected: self.version,
            message: e.to_string(),
        })
    }
}

/// The version a recorded payload was written as: 1 without an envelope; `None` for a
/// malformed envelope.
pub fn recorded_version(payload: &[u8]) -> Option<u32> {
    recorded_answer(payload).map(|(version, _)| version)
}

/// A recorded payload's version and its JSON (the payload itself when it has no envelope),
/// for tools that show records (`idem inspect`); `None` for a malformed envelope.
pub fn recorded_answer(payload: &[u8]) -> Option<(u32, &[u8])> {
    split(payload).ok()
}

/// Splits a payload into its version and its JSON.
fn split(payload: &[u8]) -> Result<(u32, &[u8]), AnswerError> {
    let Some(rest) = payload.strip_prefix(b"v") else {
        return Ok((1, payload));
    };
    let malformed = || AnswerError::Unreadable {
        recorded: 0,
        expected: 0,
        message: "the recorded answer starts with `v` but has no `v<N>:` version envelope".into(),
    };
    // `u32::MAX` has ten digits: the colon comes within eleven bytes.
    let colon = rest
        .iter()
        .take(11)
        .position(|&b| b == b':')
        .ok_or_else(malformed)?;
    let version = std::str::from_utf8(&rest[..colon])
        .ok()
        .filter(|digits| digits.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|digits| digits.parse::<u32>().ok())
        .filter(|&version| version >= 1)
        .ok_or_else(malformed)?;
    Ok((version, &rest[colon + 1..]))
}

/// Why a recorded answer cannot be read by a type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AnswerError {
    /// It was written by a later version of the type than the reader's.
    #[error("recorded as version {recorded}; this type reads up to version {known}")]
    Newer {
        /// The version recorded.
        recorded: u32,
        /// The reader's version.
        known: u32,
    },
    /// It does not decode as the reader's type (after the upcasts from its version).
    #[error("recorded as version {recorded}, it does not decode as version {expected}: {message}")]
    Unreadable {
        /// The version recorded (0 when the envelope is malformed).
        recorded: u32,
        /// The reader's version.
        expected: u32,
        /// What failed (serde's message, or the upcast's).
        message: String,
    },
}

/// Chooses a type's [`AnswerVersion`] by whether it implements [`Versioned`] (autoref
/// specialisation: the generated code calls `(&&VersionProbe::<T>::new()).answer_version()`).
#[derive(Debug)]
pub struct VersionProbe<T>(PhantomData<fn() -> T>);

impl<T> VersionProbe<T> {
    /// A probe for `T`.
    #[allow(clippy::new_without_default)] // only the generated code builds probes
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}

/// Chosen when `T: Versioned`.
pub trait ViaVersioned<T> {
    /// The version `T` declares.
    fn answer_version(&self) -> AnswerVersion;
}
impl<T: Versioned> ViaVersioned<T> for &VersionProbe<T> {
    fn answer_version(&self) -> AnswerVersion {
        AnswerVersion::of::<T>()
    }
}

/// Chosen for every other type.
pub trait ViaUnversioned<T> {
    /// Version 1.
    fn answer_version(&self) -> AnswerVersion;
}
impl<T> ViaUnversioned<T> for VersionProbe<T> {
    fn answer_version(&self) -> AnswerVersion {
        AnswerVersion::UNVERSIONED
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct V1 {
        amount: i64,
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct V3 {
        cents: i64,
        currency: String,
    }

    impl Versioned for V3 {
        const VERSION: u32 = 3;
        fn upcast(from: u32, mut answer: Value) -> serde_json::Result<Value> {
            match from {
                // version 2 renamed `amount` to `cents`
                1 => Ok(serde_json::json!({ "cents": answer["amount"] })),
                // version 3 added the currency
                2 => {
                    answer["currency"] = "EUR".into();
                    Ok(answer)
                }
                _ => Ok(answer),
            }
        }
    }

    #[test]
    fn unversioned_answers_keep_their_bytes_and_versioned_ones_carry_an_envelope() {
        let json = br#"{"amount":5}"#.to_vec();
        assert_eq!(AnswerVersion::UNVERSIONED.envelope(json.clone()), json);
        let v3 = AnswerVersion::of::<V3>();
        assert_eq!(v3.envelope(b"{}".to_vec()), b"v3:{}");
        assert_eq!(recorded_version(b"v3:{}"), Some(3));
        assert_eq!(recorded_version(&json), Some(1));
        assert_eq!(recorded_version(b"vx:{}"), None);
    }

    #[test]
    fn older_answers_are_upcast_one_version_at_a_time() {
        let v3 = AnswerVersion::of::<V3>();
        let from_v1: V3 = v3.decode(br#"{"amount":5}"#).expect("v1 upcasts");
        assert_eq!(
            from_v1,
            V3 {
                cents: 5,
                currency: "EUR".into()
            }
        );
        let from_v2: V3 = v3.decode(br#"v2:{"cents":7}"#).expect("v2 upcasts");
        assert_eq!(from_v2.cents, 7);
        let same: V3 = v3
            .decode(br#"v3:{"cents":1,"currency":"USD"}"#)
            .expect("v3");
        assert_eq!(same.currency, "USD");
    }

    #[test]
    fn a_newer_answer_is_told_apart_from_an_unreadable_one() {
        let v1 = AnswerVersion::UNVERSIONED;
        let newer = v1.decode::<V1>(br#"v2:{"amount":1}"#).unwrap_err();
        assert_eq!(
            newer,
            AnswerError::Newer {
                recorded: 2,
                known: 1
            }
        );
        let unreadable = v1.decode::<V1>(br#"{"cents":1}"#).unwrap_err();
        assert!(
            matches!(
                unreadable,
                AnswerError::Unreadable {
                    recorded: 1,
                    expected: 1,
                    ..
                }
            ),
            "{unreadable:?}"
        );
        let malformed = v1.decode::<V1>(b"v:{}").unwrap_err();
        assert!(matches!(malformed, AnswerError::Unreadable { .. }));
    }

    #[test]
    #[allow(clippy::needless_borrow)] // the autoref specialisation the generated code uses
    fn the_probe_picks_the_declared_version() {
        #[allow(unused_imports)]
        use super::{ViaUnversioned as _, ViaVersioned as _};
        assert_eq!((&&VersionProbe::<V3>::new()).answer_version().version(), 3);
        assert_eq!((&&VersionProbe::<V1>::new()).answer_version().version(), 1);
    }
}
