//! Conditional writes (RFC 9110 §8.8.3 and §13.1.1): entity tags and `If-Match`, so that a
//! write applies only to the version of a resource its client last read.
//!
//! A resource with an integer version column gets the strong tag `"<version>"`
//! ([`EntityTag::from_version`]); a write names the tag it expects in `If-Match`, and the store
//! compares it in the same statement that writes (`idem::sea_orm::Stateful::update_if_match`).
//! No HTTP here: the header grammar (parsing `If-Match` and `ETag` values) lives in
//! `idem-http`, the extractor in `idem::axum`; a tag's `Display` is its header form.

use std::fmt;

use serde::{Serialize, Serializer};

/// An entity tag: an opaque validator of one representation of a resource, strong (`"3"`) or
/// weak (`W/"3"`).
///
/// Its `Display` is the header form (`"3"`, `W/"3"`); `idem_http::parse_entity_tag` parses
/// it back.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EntityTag {
    weak: bool,
    opaque: String,
}

impl EntityTag {
    /// A strong tag; `opaque` is the text between the quotes. Refused when it holds a `"`,
    /// a space, a control or a non-ASCII character (RFC 9110 `etagc`, without `obs-text`).
    pub fn strong(opaque: impl Into<String>) -> Result<Self, InvalidEntityTag> {
        Self::new(false, opaque.into())
    }

    /// A weak tag (`W/"…"`): "semantically equivalent" only. `If-Match` uses the strong
    /// comparison, so a weak tag never satisfies it.
    pub fn weak(opaque: impl Into<String>) -> Result<Self, InvalidEntityTag> {
        Self::new(true, opaque.into())
    }

    fn new(weak: bool, opaque: String) -> Result<Self, InvalidEntityTag> {
        if let Some(at) = opaque.find(|c: char| !is_etagc(c)) {
            return Err(InvalidEntityTag { opaque, at });
        }
        Ok(Self { weak, opaque })
    }

    /// The strong tag of a row at `version`: `"7"` for version 7. [`EntityTag::version`] reads
    /// it back.
    pub fn from_version(version: i64) -> Self {
        Self {
            weak: false,
            opaque: version.to_string(),
        }
    }

    /// The version a strong tag made by [`EntityTag::from_version`] stands for; `None` for a
    /// weak tag or one that is not a decimal integer (no row version can match it).
    pub fn version(&self) -> Option<i64> {
        if self.weak {
            return None;
        }
        let version: i64 = self.opaque.parse().ok()?;
        // `"+7"` and `"07"` parse to 7 but are other tags: a strong match is byte for byte.
        (version.to_string() == self.opaque).then_some(version)
    }

    /// Whether this is a weak tag.
    pub const fn is_weak(&self) -> bool {
        self.weak
    }

    /// The text between the quotes.
    pub fn opaque(&self) -> &str {
        &self.opaque
    }

    /// RFC 9110 strong comparison: both tags strong and their opaque texts equal. This is
    /// the comparison `If-Match` uses.
    pub fn strong_eq(&self, other: &Self) -> bool {
        !self.weak && !other.weak && self.opaque == other.opaque
    }

    /// RFC 9110 weak comparison: the opaque texts equal, strong or weak alike.
    pub fn weak_eq(&self, other: &Self) -> bool {
        self.opaque == other.opaque
    }
}

/// RFC 9110 `etagc`: `%x21 / %x23-7E`, i.e. visible ASCII except `"` (`obs-text` is refused:
/// a tag is text this service made, and its bytes need not be UTF-8).
fn is_etagc(c: char) -> bool {
    c == '!' || ('#'..='~').contains(&c)
}

/// A tag's text that RFC 9110 does not allow: [`EntityTag::strong`] and [`EntityTag::weak`]
/// refuse it. `?` turns it into [`Error::InvalidPrecondition`](crate::Error::InvalidPrecondition)
/// (answered 400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidEntityTag {
    opaque: String,
    at: usize,
}

impl fmt::Display for InvalidEntityTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the entity tag `{}` has a character not allowed in a tag at byte {} (a quote, space, control or non-ASCII character)",
            self.opaque, self.at
        )
    }
}

impl std::error::Error for InvalidEntityTag {}

impl fmt::Display for EntityTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.weak {
            f.write_str("W/")?;
        }
        write!(f, "\"{}\"", self.opaque)
    }
}

/// Fingerprinted (and logged) in its header form.
impl Serialize for EntityTag {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// The `If-Match` precondition of a write: `*` (any current representation) or a list of
/// entity tags, one of which must strongly match the resource's current tag.
///
/// Pass it to the idempotent domain function as an argument, so it is part of the request's
/// fingerprint: a retry with the same key and the same `If-Match` replays the recorded
/// answer even after the version moved on (the write it describes already happened).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum IfMatch {
    /// `If-Match: *`: the write applies to whatever version exists, but not to a missing
    /// resource.
    Any,
    /// `If-Match: "3", "4"`: the write applies only when the current tag is one of these
    /// (strong comparison; weak tags never match).
    Tags(Vec<EntityTag>),
}

impl IfMatch {
    /// The precondition that the current version is `version` (`If-Match: "<version>"`).
    pub fn version(version: i64) -> Self {
        Self::Tags(vec![EntityTag::from_version(version)])
    }

    /// Whether a resource whose current tag is `current` satisfies the precondition; `None`
    /// for a resource that does not exist, which satisfies nothing.
    pub fn matches(&self, current: Option<&EntityTag>) -> bool {
        match (self, current) {
            (_, None) => false,
            (Self::Any, Some(_)) => true,
            (Self::Tags(tags), Some(current)) => tags.iter().any(|tag| tag.strong_eq(current)),
        }
    }

    /// The row versions a list of tags accepts (strong tags made by
    /// [`EntityTag::from_version`]); `None` for `*`, which accepts any version.
    pub fn versions(&self) -> Option<Vec<i64>> {
        match self {
            Self::Any => None,
            Self::Tags(tags) => Some(tags.iter().filter_map(EntityTag::version).collect()),
        }
    }
}

impl fmt::Display for IfMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Any => f.write_str("*"),
            Self::Tags(tags) => {
                for (i, tag) in tags.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{tag}")?;
                }
                Ok(())
            }
        }
    }
}

/// Fingerprinted (and logged) in its header form.
impl Serialize for IfMatch {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparison_follows_rfc_9110() {
        // The table of RFC 9110 §8.8.3.2.
        let weak = |o: &str| EntityTag::weak(o).expect("weak");
        let strong = |o: &str| EntityTag::strong(o).expect("strong");
        let cases = [
            (weak("1"), weak("1"), false, true),
            (weak("1"), weak("2"), false, false),
            (weak("1"), strong("1"), false, true),
            (strong("1"), strong("1"), true, true),
        ];
        for (a, b, is_strong, is_weak) in cases {
            assert_eq!(a.strong_eq(&b), is_strong, "{a} {b}");
            assert_eq!(a.weak_eq(&b), is_weak, "{a} {b}");
        }
    }

    #[test]
    fn versions_read_back_only_from_their_own_tags() {
        assert_eq!(EntityTag::from_version(7).version(), Some(7));
        assert_eq!(EntityTag::from_version(7).to_string(), "\"7\"");
        assert_eq!(EntityTag::weak("7").expect("weak").version(), None, "weak");
        for other in ["07", "+7", "v7"] {
            assert_eq!(
                EntityTag::strong(other).expect("tag").version(),
                None,
                "{other}"
            );
        }
        assert!(EntityTag::strong("a b").is_err(), "a space is not etagc");
    }

    #[test]
    fn if_match_uses_the_strong_comparison() {
        let current = EntityTag::from_version(2);
        assert!(IfMatch::Any.matches(Some(&current)));
        assert!(
            !IfMatch::Any.matches(None),
            "`*` needs a current representation"
        );
        let tags = |tags: Vec<EntityTag>| IfMatch::Tags(tags);
        assert!(
            tags(vec![EntityTag::from_version(1), EntityTag::from_version(2)])
                .matches(Some(&current))
        );
        assert!(!IfMatch::version(1).matches(Some(&current)));
        assert!(
            !tags(vec![EntityTag::weak("2").expect("weak")]).matches(Some(&current)),
            "a weak tag never satisfies If-Match"
        );
        assert_eq!(
            tags(vec![
                EntityTag::from_version(1),
                EntityTag::weak("2").expect("weak"),
                EntityTag::strong("x").expect("x"),
                EntityTag::from_version(3),
            ])
            .versions(),
            Some(vec![1, 3])
        );
        assert_eq!(IfMatch::Any.versions(), None);
    }

    #[test]
    fn fingerprints_and_displays_in_header_form() {
        let value = IfMatch::Tags(vec![
            EntityTag::from_version(1),
            EntityTag::weak("2").expect("weak"),
        ]);
        assert_eq!(value.to_string(), "\"1\", W/\"2\"");
        assert_eq!(
            serde_json::to_string(&value).expect("json"),
            r#""\"1\", W/\"2\"""#
        );
        assert_eq!(IfMatch::Any.to_string(), "*");
    }
}
