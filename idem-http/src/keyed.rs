//! The key of a request that carries it in a form field, a query parameter or a JSON member
//! (a server-rendered form's hidden field, a link), as well as or instead of the
//! `Idempotency-Key` header; and [`Keyed`], the extractor that reads it on axum and actix-web.

use std::fmt;

use idem_core::Key;
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};

use crate::key::{IdempotencyKey, key_of_fields};
use crate::problem::Problem;

/// The name of the form field, query parameter and JSON member that carries the key:
/// `idempotency_key` (zero2prod's hidden field, and serde's name for a field
/// `idempotency_key`).
pub const IDEMPOTENCY_KEY_FIELD: &str = "idempotency_key";

/// An extractor `E` and the request's idempotency key, found in the `Idempotency-Key` header,
/// the `idempotency_key` query parameter, or the body's `idempotency_key` form field
/// (`application/x-www-form-urlencoded`) or JSON member (`application/json`, `+json`),
/// whichever the request carries. With features `axum` and `actix` it is an extractor on both
/// frameworks:
///
/// ```text
/// async fn publish(Keyed(key, Form(form)): Keyed<Form<PublishForm>>) -> Response   // axum
/// async fn publish(Keyed(key, form): Keyed<web::Form<PublishForm>>) -> HttpResponse // actix-web
/// ```
///
/// The body is read once, up to the framework's own limit (axum's `DefaultBodyLimit`,
/// actix-web's `PayloadConfig`), and `E` is given the whole of it, so `E` may be `Form`,
/// `Json`, `Query`, `String` or any extractor of the framework; the key field may stay in the
/// type `E` reads or not (serde skips unknown fields). It takes the body as `E` would: on axum
/// it is the handler's last argument, and on actix-web the extractors after it find no body.
///
/// | request | answer |
/// |---|---|
/// | no key in any of those places | 400 `missing-key` |
/// | a key that is not valid (empty, over 255 bytes, a control character) | 400 `invalid-key` |
/// | the key sent twice in one place, or two places carrying different keys | 400 `invalid-key` |
/// | a body over the framework's limit | 413 `request-too-large` |
/// | a body `E` refuses | `E`'s own rejection |
///
/// The key is only the key: a `#[idempotent]` function fingerprints the arguments it is given
/// (the form), so the same key with another form is answered 422 as with the header.
#[derive(Debug, Clone)]
pub struct Keyed<E>(pub IdempotencyKey, pub E);

/// How [`Keyed`] extracts on axum: `M` is how `E` does (from the body, like `Form` and `Json`,
/// or from the request's parts, like `Query`), so `Keyed` wraps both. Not API.
#[doc(hidden)]
#[derive(Debug)]
pub struct ViaKeyed<M>(std::marker::PhantomData<M>);

/// The problem answered when the body a key is looked for in cannot be read: `status` is the
/// framework's (413 over its limit, 400 otherwise), `why` its reason.
#[cfg(any(feature = "axum", feature = "actix"))]
pub(crate) fn unread_body(status: u16, why: &str) -> Problem {
    if status == 413 {
        Problem::new(
            413,
            "request-too-large",
            "Request body too large",
            format!("the request body is over this route's limit: {why}"),
        )
    } else {
        Problem::new(
            status,
            "invalid-body",
            "Request body unreadable",
            format!("the request body could not be read: {why}"),
        )
    }
}

/// The one key a request carries in its `Idempotency-Key` header fields, its query (the part
/// after `?`, if any) and its body (read by its `Content-Type`: a form or JSON), as [`Keyed`]
/// reads it on every framework. Every place that carries a key must carry the same one.
pub fn key_of_request<'v>(
    header_fields: impl Iterator<Item = &'v [u8]>,
    query: Option<&str>,
    content_type: Option<&[u8]>,
    body: &[u8],
) -> Result<Key, Problem> {
    let mut found: Vec<(&'static str, Key)> = Vec::new();
    if let Some(key) = key_of_fields(header_fields)? {
        found.push(("`Idempotency-Key` header", key));
    }
    if let Some(query) = query
        && let Some(key) = form_field(query.as_bytes(), "query parameter")?
    {
        found.push(("query parameter", key));
    }
    match content_type.map(BodyKind::of) {
        Some(BodyKind::Form) => {
            if let Some(key) = form_field(body, "form field")? {
                found.push(("form field", key));
            }
        }
        Some(BodyKind::Json) => {
            if let Some(key) = json_member(body)? {
                found.push(("JSON member", key));
            }
        }
        Some(BodyKind::Other) | None => {}
    }
    let mut found = found.into_iter();
    let Some((first_place, key)) = found.next() else {
        return Err(Problem::new(
            400,
            "missing-key",
            "Missing idempotency key",
            format!(
                "this request requires an idempotency key: send it in the `Idempotency-Key` \
                 header, or as the `{IDEMPOTENCY_KEY_FIELD}` form field, query parameter or \
                 JSON member"
            ),
        ));
    };
    if let Some((other_place, _)) = found.find(|(_, other)| *other != key) {
        return Err(invalid(format!(
            "the {first_place} and the {other_place} carry different idempotency keys; send \
             one key, or the same key in both"
        )));
    }
    Ok(key)
}

/// A 400 `invalid-key` problem saying `detail`.
fn invalid(detail: String) -> Problem {
    Problem::new(400, "invalid-key", "Invalid idempotency key", detail)
}

/// The body types a key is looked for in.
enum BodyKind {
    Form,
    Json,
    Other,
}

impl BodyKind {
    /// The kind a `Content-Type` value names (its parameters, such as a charset, ignored).
    fn of(content_type: &[u8]) -> Self {
        let text = String::from_utf8_lossy(content_type);
        let essence = text
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        if essence == "application/x-www-form-urlencoded" {
            Self::Form
        } else if essence == "application/json"
            || essence
                .split_once('/')
                .is_some_and(|(_, subtype)| subtype.ends_with("+json"))
        {
            Self::Json
        } else {
            Self::Other
        }
    }
}

/// The key in the `idempotency_key` field of URL-encoded `pairs` (a query or a form body):
/// `None` without it; a field sent twice or an invalid key is refused.
fn form_field(pairs: &[u8], place: &str) -> Result<Option<Key>, Problem> {
    let mut values = form_urlencoded::parse(pairs)
        .filter(|(name, _)| name == IDEMPOTENCY_KEY_FIELD)
        .map(|(_, value)| value);
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let more = values.count();
    if more > 0 {
        return Err(invalid(format!(
            "the `{IDEMPOTENCY_KEY_FIELD}` {place} was sent {} times; send it once",
            more + 1
        )));
    }
    Ok(Some(Key::new(value.into_owned())?))
}

/// The key in a JSON object's `idempotency_key` member: `None` without it, or when the body is
/// not a JSON object (the extractor that reads the body says what is wrong with it).
fn json_member(body: &[u8]) -> Result<Option<Key>, Problem> {
    let member = serde_json::Deserializer::from_slice(body)
        .deserialize_map(MemberVisitor)
        .unwrap_or(Member::Absent);
    match member {
        Member::Absent => Ok(None),
        Member::Text(text) => Ok(Some(Key::new(text)?)),
        Member::NotText => Err(invalid(format!(
            "the `{IDEMPOTENCY_KEY_FIELD}` JSON member is not a string; send the key as a string"
        ))),
        Member::Repeated(count) => Err(invalid(format!(
            "the `{IDEMPOTENCY_KEY_FIELD}` JSON member was sent {count} times; send it once"
        ))),
    }
}

/// What a JSON object holds under the key's name.
enum Member {
    Absent,
    Text(String),
    NotText,
    Repeated(usize),
}

/// Reads an object's members, keeping the key's and skipping the rest unparsed into values.
struct MemberVisitor;

impl<'de> Visitor<'de> for MemberVisitor {
    type Value = Member;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Member, A::Error> {
        let (mut member, mut count) = (Member::Absent, 0);
        while let Some(name) = map.next_key::<String>()? {
            if name != IDEMPOTENCY_KEY_FIELD {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            count += 1;
            member = match map.next_value::<serde_json::Value>()? {
                serde_json::Value::String(text) => Member::Text(text),
                _ => Member::NotText,
            };
        }
        // A member sent twice means different things to different readers: refuse it.
        Ok(if count > 1 {
            Member::Repeated(count)
        } else {
            member
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORM: &[u8] = b"application/x-www-form-urlencoded";
    const JSON: &[u8] = b"application/json; charset=utf-8";

    fn key(
        header: &[&str],
        query: Option<&str>,
        content_type: Option<&[u8]>,
        body: &str,
    ) -> Result<String, Problem> {
        key_of_request(
            header.iter().map(|h| h.as_bytes()),
            query,
            content_type,
            body.as_bytes(),
        )
        .map(|key| key.as_str().to_owned())
    }

    #[test]
    fn the_key_is_found_wherever_the_request_carries_it() {
        assert_eq!(key(&["\"h-1\""], None, None, "").unwrap(), "h-1");
        assert_eq!(
            key(&[], Some("a=1&idempotency_key=q%2D1"), None, "").unwrap(),
            "q-1"
        );
        let form = "title=Hi+there&idempotency_key=f-1";
        assert_eq!(key(&[], None, Some(FORM), form).unwrap(), "f-1");
        let json = r#"{"title": {"nested": [1, 2]}, "idempotency_key": "j-1"}"#;
        assert_eq!(key(&[], None, Some(JSON), json).unwrap(), "j-1");
        let problem = key(&[], None, Some(b"application/vnd.api+json"), json);
        assert_eq!(problem.unwrap(), "j-1", "a +json type is JSON");
        // The same key in two places is one key.
        assert_eq!(key(&["f-1"], None, Some(FORM), form).unwrap(), "f-1");
    }

    #[test]
    fn no_key_is_a_400_that_names_every_place() {
        for (content_type, body) in [
            (None, ""),
            (Some(FORM), "title=T"),
            (Some(JSON), "[1, 2]"),
            (Some(JSON), "{not json"),
            (Some(&b"text/plain"[..]), "idempotency_key=k"),
        ] {
            let problem = key(&[], Some("idempotency=k"), content_type, body).unwrap_err();
            assert_eq!(problem.status, 400);
            assert_eq!(problem.kind, "urn:idem:problem:missing-key");
            assert!(problem.detail.contains("form field"), "{}", problem.detail);
        }
    }

    #[test]
    fn a_key_sent_twice_or_two_keys_or_a_bad_key_is_a_400() {
        let refused = [
            key(&[], Some("idempotency_key=a&idempotency_key=a"), None, ""),
            key(&[], None, Some(FORM), "idempotency_key=a&idempotency_key=b"),
            key(
                &[],
                None,
                Some(JSON),
                r#"{"idempotency_key": "a", "idempotency_key": "a"}"#,
            ),
            key(&[], None, Some(JSON), r#"{"idempotency_key": 7}"#),
            key(&["h-1"], None, Some(FORM), "idempotency_key=f-1"),
            key(&[], Some("idempotency_key="), None, ""),
            key(&[], None, Some(FORM), "idempotency_key=a%0Ab"),
            key(&["a", "b"], None, None, ""),
        ];
        for problem in refused {
            let problem = problem.unwrap_err();
            assert_eq!(
                (problem.status, problem.kind.as_str()),
                (400, "urn:idem:problem:invalid-key"),
                "{}",
                problem.detail
            );
        }
        let two = key(&["h-1"], None, Some(FORM), "idempotency_key=f-1").unwrap_err();
        assert!(two.detail.contains("different"), "{}", two.detail);
    }
}
