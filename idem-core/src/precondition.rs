//! Conditional writes (RFC 9110 §8.8.3 and §13.1.1): entity tags and `If-Match`, so that a
//! write applies only to the version of a resource its client last read.
//!
//! A resource with an integer version column gets the strong tag `"<version>"`
//! ([`EntityTag::from_version`]); a write names the tag it expects in `If-Match`, and the store
//! compares it in the same statement that writes (`idem::sea_orm::Stateful::update_if_match`).
//! No HTTP types here: the axum extractor lives in `idem::axum`.

use std::fmt;
use std::str::FromStr;

use serde::{Serialize, Serializer};

use crate::error::Error;

/// An entity tag: an opaque validator of one representation of a resource, strong (`"3"`) or
/// weak (`W/"3"`).
///
/// Its `Display` is the header form (`"3"`, `W/"3"`), and [`FromStr`] parses it back.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EntityTag {
    weak: bool,
    opaque: String,
}

impl EntityTag {
    /// A strong tag; `opaque` is the text between the quotes. Refused when it holds a `"`,
    /// a space, a control or a non-ASCII character (RFC 9110 `etagc`, without `obs-text`).
    pub fn strong(opaque: impl Into<String>) -> Result<Self, Error> {
        Self::new(false, opaque.into())
    }

    /// A weak tag (`W/"…"`): "semantically equivalent" only. `If-Match` uses the strong
    /// comparison, so a weak tag never satisfies it.
    pub fn weak(opaque: impl Into<String>) -> Result<Self, Error> {
        Self::new(true, opaque.into())
    }

    fn new(weak: bool, opaque: String) -> Result<Self, Error> {
        if let Some(at) = opaque.find(|c: char| !is_etagc(c)) {
            return Err(invalid(format!(
                "the entity tag `{opaque}` has a character not allowed in a tag at byte {at} (a quote, space, control or non-ASCII character)"
            )));
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

fn invalid(problem: String) -> Error {
    Error::InvalidPrecondition { problem }
}

impl fmt::Display for EntityTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.weak {
            f.write_str("W/")?;
        }
        write!(f, "\"{}\"", self.opaque)
    }
}

impl FromStr for EntityTag {
    type Err = Error;

    /// Parses `"…"` or `W/"…"` (the `W/` is case-sensitive), surrounding spaces ignored.
    fn from_str(text: &str) -> Result<Self, Error> {
        let text = text.trim_matches([' ', '\t']);
        let (weak, quoted) = match text.strip_prefix("W/") {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let Some(opaque) = quoted
            .strip_prefix('"')
            .and_then(|rest| rest.strip_suffix('"'))
        else {
            return Err(invalid(format!(
                "`{text}` is not an entity tag; send it as the `ETag` header gave it, quotes included (e.g. `\"3\"`)"
            )));
        };
        Self::new(weak, opaque.to_owned())
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

    /// Parses a field value: `*` or a comma-separated list of entity tags. Several field
    /// lines of one request are one list: join them with `", "` first. Empty list elements
    /// are ignored, as RFC 9110 §5.6.1 asks; a list with no tag at all is refused. A comma
    /// inside a tag's quotes belongs to the tag (`"a,b"` is one tag).
    pub fn parse(value: &str) -> Result<Self, Error> {
        const OWS: [char; 2] = [' ', '\t'];
        if value.trim_matches(OWS) == "*" {
            return Ok(Self::Any);
        }
        let mut tags = Vec::new();
        let mut rest = value;
        loop {
            rest = rest.trim_start_matches([' ', '\t', ',']);
            if rest.is_empty() {
                break;
            }
            let element = rest.split(',').next().unwrap_or(rest).trim_end_matches(OWS);
            if element == "*" {
                return Err(invalid(
                    "`If-Match` mixes `*` with entity tags; send either `*` or tags".to_owned(),
                ));
            }
            let (weak, quoted) = match rest.strip_prefix("W/") {
                Some(after) => (true, after),
                None => (false, rest),
            };
            let Some((opaque, after)) = quoted
                .strip_prefix('"')
                .and_then(|inner| inner.split_once('"'))
            else {
                return Err(invalid(format!(
                    "`{element}` is not an entity tag; send it as the `ETag` header gave it, quotes included (e.g. `\"3\"`)"
                )));
            };
            tags.push(EntityTag::new(weak, opaque.to_owned())?);
            rest = after.trim_start_matches(OWS);
            if !rest.is_empty() && !rest.starts_with(',') {
                return Err(invalid(format!(
                    "`If-Match` has `{}` after an entity tag; separate tags with commas",
                    rest.split(',').next().unwrap_or(rest).trim_end_matches(OWS)
                )));
            }
        }
        if tags.is_empty() {
            return Err(invalid(
                "the `If-Match` header is empty; send the `ETag` of your last read, or `*`"
                    .to_owned(),
            ));
        }
        Ok(Self::Tags(tags))
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

impl FromStr for IfMatch {
    type Err = Error;

    fn from_str(value: &str) -> Result<Self, Error> {
        Self::parse(value)
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
    use crate::ErrorKind;

    fn tag(text: &str) -> EntityTag {
        text.parse().expect("a valid entity tag")
    }

    #[test]
    fn parses_strong_and_weak_tags() {
        assert_eq!(tag("\"3\""), EntityTag::from_version(3));
        assert!(!tag("\"3\"").is_weak());
        assert!(tag("W/\"3\"").is_weak());
        assert_eq!(tag("W/\"xyzzy\"").opaque(), "xyzzy");
        assert_eq!(tag("\"\"").opaque(), "", "an empty opaque tag is valid");
        assert_eq!(tag(" \"a!#~\" ").opaque(), "a!#~");
        assert_eq!(tag("W/\"3\"").to_string(), "W/\"3\"");
        for bad in [
            "3", "\"3", "3\"", "w/\"3\"", "W/3", "\"a b\"", "\"a\"b\"", "\"é\"", "\"a\tb\"",
        ] {
            let err = bad.parse::<EntityTag>().expect_err(bad);
            assert_eq!(err.kind(), ErrorKind::InvalidPrecondition, "{bad}");
        }
    }

    #[test]
    fn comparison_follows_rfc_9110() {
        // The table of RFC 9110 §8.8.3.2.
        let cases = [
            ("W/\"1\"", "W/\"1\"", false, true),
            ("W/\"1\"", "W/\"2\"", false, false),
            ("W/\"1\"", "\"1\"", false, true),
            ("\"1\"", "\"1\"", true, true),
        ];
        for (a, b, strong, weak) in cases {
            assert_eq!(tag(a).strong_eq(&tag(b)), strong, "{a} {b}");
            assert_eq!(tag(a).weak_eq(&tag(b)), weak, "{a} {b}");
        }
    }

    #[test]
    fn versions_read_back_only_from_their_own_tags() {
        assert_eq!(EntityTag::from_version(7).version(), Some(7));
        assert_eq!(EntityTag::from_version(7).to_string(), "\"7\"");
        assert_eq!(tag("W/\"7\"").version(), None, "weak");
        assert_eq!(tag("\"07\"").version(), None, "another tag than \"7\"");
        assert_eq!(tag("\"+7\"").version(), None);
        assert_eq!(tag("\"v7\"").version(), None);
    }

    #[test]
    fn if_match_parses_lists_and_star() {
        assert_eq!(IfMatch::parse("*").expect("star"), IfMatch::Any);
        assert_eq!(IfMatch::parse(" * ").expect("star"), IfMatch::Any);
        assert_eq!(
            IfMatch::parse("\"1\", W/\"2\",,\t\"3\"").expect("list"),
            IfMatch::Tags(vec![tag("\"1\""), tag("W/\"2\""), tag("\"3\"")])
        );
        assert_eq!(IfMatch::parse("\"4\"").expect("one"), IfMatch::version(4));
        assert_eq!(
            IfMatch::parse("\"a,b\", \"c\"").expect("a comma inside quotes"),
            IfMatch::Tags(vec![tag("\"a,b\""), tag("\"c\"")])
        );
        for bad in [
            "",
            " , ",
            "*, \"1\"",
            "\"1\", *",
            "1",
            "\"1\" \"2\"",
            "\"1\"x",
            "\"1",
            "w/\"1\"",
            "**",
            "\"a b\"",
        ] {
            let err = IfMatch::parse(bad).expect_err(bad);
            assert_eq!(err.kind(), ErrorKind::InvalidPrecondition, "{bad:?}");
            assert_eq!(err.http_status(), 400);
        }
    }

    #[test]
    fn if_match_uses_the_strong_comparison() {
        let current = EntityTag::from_version(2);
        assert!(IfMatch::Any.matches(Some(&current)));
        assert!(
            !IfMatch::Any.matches(None),
            "`*` needs a current representation"
        );
        assert!(
            IfMatch::parse("\"1\", \"2\"")
                .expect("list")
                .matches(Some(&current))
        );
        assert!(
            !IfMatch::parse("\"1\"")
                .expect("one")
                .matches(Some(&current))
        );
        assert!(
            !IfMatch::parse("W/\"2\"")
                .expect("weak")
                .matches(Some(&current)),
            "a weak tag never satisfies If-Match"
        );
        assert_eq!(
            IfMatch::parse("\"1\", W/\"2\", \"x\", \"3\"")
                .expect("list")
                .versions(),
            Some(vec![1, 3])
        );
        assert_eq!(IfMatch::Any.versions(), None);
    }

    #[test]
    fn fingerprints_and_displays_in_header_form() {
        let value = IfMatch::parse("\"1\",W/\"2\"").expect("list");
        assert_eq!(value.to_string(), "\"1\", W/\"2\"");
        assert_eq!(
            serde_json::to_string(&value).expect("json"),
            r#""\"1\", W/\"2\"""#
        );
        assert_eq!(IfMatch::Any.to_string(), "*");
    }
}
