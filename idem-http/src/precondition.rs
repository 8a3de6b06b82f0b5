//! `If-Match` requests and `ETag` answers (RFC 9110 §8.8.3, §13.1.1).

use http::header::IF_MATCH;
use http::{HeaderMap, HeaderValue};
use idem_core::{EntityTag, Error, IfMatch};

/// The `If-Match` precondition of a request with `headers`: `None` without the header, an
/// error for a malformed one (`Error::InvalidPrecondition`, answered 400). Several `If-Match`
/// field lines are one list.
pub fn if_match(headers: &HeaderMap) -> Result<Option<IfMatch>, Error> {
    let mut lines = Vec::new();
    for value in headers.get_all(IF_MATCH) {
        lines.push(
            value
                .to_str()
                .map_err(|_| Error::InvalidPrecondition {
                    problem: "the `If-Match` header is not visible ASCII".to_owned(),
                })?
                .to_owned(),
        );
    }
    if lines.is_empty() {
        return Ok(None);
    }
    parse_if_match(&lines.join(", ")).map(Some)
}

fn invalid(problem: String) -> Error {
    Error::InvalidPrecondition { problem }
}

/// A tag as its client sent it, refused with the fix.
fn not_a_tag(text: &str) -> Error {
    invalid(format!(
        "`{text}` is not an entity tag; send it as the `ETag` header gave it, quotes included (e.g. `\"3\"`)"
    ))
}

/// Parses an entity tag in its header form, `"…"` or `W/"…"` (the `W/` is case-sensitive),
/// surrounding spaces ignored.
pub fn parse_entity_tag(text: &str) -> Result<EntityTag, Error> {
    let text = text.trim_matches([' ', '\t']);
    let (weak, quoted) = match text.strip_prefix("W/") {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let Some(opaque) = quoted
        .strip_prefix('"')
        .and_then(|rest| rest.strip_suffix('"'))
    else {
        return Err(not_a_tag(text));
    };
    tag(weak, opaque)
}

fn tag(weak: bool, opaque: &str) -> Result<EntityTag, Error> {
    let tag = if weak {
        EntityTag::weak(opaque)
    } else {
        EntityTag::strong(opaque)
    };
    Ok(tag?)
}

/// Parses an `If-Match` field value: `*` or a comma-separated list of entity tags. Several
/// field lines of one request are one list: join them with `", "` first ([`if_match`] does).
/// Empty list elements are ignored, as RFC 9110 §5.6.1 asks; a list with no tag at all is
/// refused. A comma inside a tag's quotes belongs to the tag (`"a,b"` is one tag).
pub fn parse_if_match(value: &str) -> Result<IfMatch, Error> {
    const OWS: [char; 2] = [' ', '\t'];
    if value.trim_matches(OWS) == "*" {
        return Ok(IfMatch::Any);
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
            return Err(not_a_tag(element));
        };
        tags.push(tag(weak, opaque)?);
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
            "the `If-Match` header is empty; send the `ETag` of your last read, or `*`".to_owned(),
        ));
    }
    Ok(IfMatch::Tags(tags))
}

/// The `ETag` header value of `tag`; always `Some`, since a tag holds visible ASCII only,
/// checked when it was made.
pub fn etag_value(tag: &EntityTag) -> Option<HeaderValue> {
    HeaderValue::from_str(&tag.to_string()).ok()
}

#[cfg(test)]
mod tests {
    use idem_core::ErrorKind;

    use super::*;

    fn tag(text: &str) -> EntityTag {
        parse_entity_tag(text).expect("a valid entity tag")
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
            let err = parse_entity_tag(bad).expect_err(bad);
            assert_eq!(err.kind(), ErrorKind::InvalidPrecondition, "{bad}");
        }
    }

    #[test]
    fn if_match_parses_lists_and_star() {
        assert_eq!(parse_if_match("*").expect("star"), IfMatch::Any);
        assert_eq!(parse_if_match(" * ").expect("star"), IfMatch::Any);
        assert_eq!(
            parse_if_match("\"1\", W/\"2\",,\t\"3\"").expect("list"),
            IfMatch::Tags(vec![tag("\"1\""), tag("W/\"2\""), tag("\"3\"")])
        );
        assert_eq!(parse_if_match("\"4\"").expect("one"), IfMatch::version(4));
        assert_eq!(
            parse_if_match("\"a,b\", \"c\"").expect("a comma inside quotes"),
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
            let err = parse_if_match(bad).expect_err(bad);
            assert_eq!(err.kind(), ErrorKind::InvalidPrecondition, "{bad:?}");
            assert_eq!(err.http_status(), 400);
        }
        let value = parse_if_match("\"1\",W/\"2\"").expect("list");
        assert_eq!(
            value.to_string(),
            "\"1\", W/\"2\"",
            "displayed in header form"
        );
    }
}
