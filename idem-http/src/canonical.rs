//! What the tower layer fingerprints of a request, canonicalised so that a client that
//! writes the same request again in another form (JSON members reordered, other whitespace,
//! query parameters in another order) is still recognised as retrying it.
//!
//! Only forms that cannot change a request's meaning are merged: JSON numbers and strings keep
//! their exact text (after unescaping strings), a repeated query parameter keeps the order of
//! its values, percent-encoding is compared as sent. A body that is not JSON (by its content
//! type, or because it does not parse, or has a duplicate member) is fingerprinted as its
//! bytes.

use std::collections::BTreeMap;

use http::HeaderMap;
use http::header::CONTENT_TYPE;
use serde::{Serialize, Serializer};

/// JSON nested deeper than this is fingerprinted as its bytes (as serde_json's own limit).
const MAX_DEPTH: usize = 128;

/// The path and query, the query's parameters in order of name (a repeated name keeps the
/// order of its values, which may mean a list).
pub fn target(path_and_query: &str) -> String {
    let Some((path, query)) = path_and_query.split_once('?') else {
        return path_and_query.to_owned();
    };
    let mut params: Vec<&str> = query.split('&').collect();
    params.sort_by_key(|param| param.split_once('=').map_or(*param, |(name, _)| name));
    format!("{path}?{}", params.join("&"))
}

/// A request body as the layer fingerprints it.
#[derive(Debug, PartialEq)]
pub enum Body<'a> {
    /// A JSON body (by its content type) that parses: compared as JSON.
    Json(Json<'a>),
    /// Any other body: compared byte for byte.
    Bytes(&'a [u8]),
}

impl<'a> Body<'a> {
    /// The body as JSON when `headers` say it is (`application/json`, or a `+json` type) and
    /// it parses; its bytes otherwise.
    pub fn of(headers: &HeaderMap, bytes: &'a [u8]) -> Self {
        let json = headers
            .get(CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .is_some_and(is_json);
        json.then(|| Parser { text: bytes, at: 0 }.document())
            .flatten()
            .map_or(Self::Bytes(bytes), Self::Json)
    }
}

impl Serialize for Body<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Json(json) => serializer.serialize_newtype_variant("Body", 0, "json", json),
            Self::Bytes(bytes) => {
                serializer.serialize_newtype_variant("Body", 1, "bytes", &Raw(bytes))
            }
        }
    }
}

/// Bytes serialized as bytes, not as a sequence of numbers.
#[derive(Debug)]
pub struct Raw<'a>(pub &'a [u8]);

impl Serialize for Raw<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(self.0)
    }
}

/// Whether a `Content-Type` names JSON: `application/json` or any `+json` subtype.
fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || essence
            .split_once('/')
            .is_some_and(|(_, subtype)| subtype.ends_with("+json"))
}

/// A JSON value with its members sorted (a map), numbers as written.
#[derive(Debug, PartialEq)]
pub enum Json<'a> {
    /// `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A number's text, exactly as sent: `1` and `1.0` stay apart.
    Number(&'a str),
    /// A string, unescaped.
    String(String),
    /// An array, in order.
    Array(Vec<Json<'a>>),
    /// An object, its members by name.
    Object(BTreeMap<String, Json<'a>>),
}

impl Serialize for Json<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // Variants, so no two kinds of value can encode alike (`"1"` and `1`).
        match self {
            Self::Null => serializer.serialize_unit_variant("Json", 0, "null"),
            Self::Bool(b) => serializer.serialize_newtype_variant("Json", 1, "bool", b),
            Self::Number(n) => serializer.serialize_newtype_variant("Json", 2, "number", n),
            Self::String(s) => serializer.serialize_newtype_variant("Json", 3, "string", s),
            Self::Array(items) => serializer.serialize_newtype_variant("Json", 4, "array", items),
            Self::Object(members) => {
                serializer.serialize_newtype_variant("Json", 5, "object", members)
            }
        }
    }
}

/// A small JSON reader (RFC 8259) that keeps numbers as written: serde_json's `Value` turns
/// large integers into floats, so two different bodies could compare equal.
struct Parser<'a> {
    text: &'a [u8],
    at: usize,
}

impl<'a> Parser<'a> {
    /// The whole text as one value, or `None` if it is not exactly one JSON value.
    fn document(mut self) -> Option<Json<'a>> {
        let value = self.value(0)?;
        self.whitespace();
        (self.at == self.text.len()).then_some(value)
    }

    fn whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.at += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    fn literal(&mut self, word: &[u8], value: Json<'a>) -> Option<Json<'a>> {
        let end = self.at + word.len();
        (self.text.get(self.at..end)? == word).then(|| {
            self.at = end;
            value
        })
    }

    fn value(&mut self, depth: usize) -> Option<Json<'a>> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.whitespace();
        match self.peek()? {
            b'n' => self.literal(b"null", Json::Null),
            b't' => self.literal(b"true", Json::Bool(true)),
            b'f' => self.literal(b"false", Json::Bool(false)),
            b'"' => self.string().map(Json::String),
            b'[' => {
                self.at += 1;
                let mut items = Vec::new();
                self.whitespace();
                if self.peek()? == b']' {
                    self.at += 1;
                    return Some(Json::Array(items));
                }
                loop {
                    items.push(self.value(depth + 1)?);
                    self.whitespace();
                    match self.peek()? {
                        b',' => self.at += 1,
                        b']' => break,
                        _ => return None,
                    }
                }
                self.at += 1;
                Some(Json::Array(items))
            }
            b'{' => {
                self.at += 1;
                let mut members = BTreeMap::new();
                self.whitespace();
                if self.peek()? == b'}' {
                    self.at += 1;
                    return Some(Json::Object(members));
                }
                loop {
                    self.whitespace();
                    let name = self.string()?;
                    self.whitespace();
                    if self.peek()? != b':' {
                        return None;
                    }
                    self.at += 1;
                    let value = self.value(depth + 1)?;
                    // A duplicate member means different things to different readers:
                    // compare such a body as its bytes.
                    if members.insert(name, value).is_some() {
                        return None;
                    }
                    self.whitespace();
                    match self.peek()? {
                        b',' => self.at += 1,
                        b'}' => break,
                        _ => return None,
                    }
                }
                self.at += 1;
                Some(Json::Object(members))
            }
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    /// A string token, unescaped (serde_json reads the token, escapes and all).
    fn string(&mut self) -> Option<String> {
        let start = self.at;
        if self.peek()? != b'"' {
            return None;
        }
        self.at += 1;
        loop {
            match self.peek()? {
                b'"' => break,
                b'\\' => self.at += 2,
                _ => self.at += 1,
            }
        }
        self.at += 1;
        serde_json::from_slice(self.text.get(start..self.at)?).ok()
    }

    /// A number token, checked by serde_json and kept as written.
    fn number(&mut self) -> Option<Json<'a>> {
        let start = self.at;
        while let Some(b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9') = self.peek() {
            self.at += 1;
        }
        let token = self.text.get(start..self.at)?;
        serde_json::from_slice::<serde::de::IgnoredAny>(token).ok()?;
        std::str::from_utf8(token).ok().map(Json::Number)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(text: &str) -> Option<Json<'_>> {
        Parser {
            text: text.as_bytes(),
            at: 0,
        }
        .document()
    }

    #[test]
    fn member_order_and_whitespace_do_not_matter() {
        assert_eq!(
            json(r#"{"a":1,"b":[true,null,"x"]}"#),
            json(" {\n \"b\" : [ true , null , \"\\u0078\" ] ,\t\"a\": 1 } ")
        );
        assert!(json(r#"{"a":1}"#).is_some());
    }

    #[test]
    fn values_that_differ_stay_apart() {
        assert_ne!(json("1"), json("1.0"));
        assert_ne!(
            json("12345678901234567890123"),
            json("12345678901234567890124")
        );
        assert_ne!(json(r#"["a","b"]"#), json(r#"["b","a"]"#));
        assert_ne!(json(r#""1""#), json("1"));
    }

    #[test]
    fn what_is_not_one_json_value_is_not_json() {
        for text in [
            "",
            "{",
            r#"{"a":1,"a":2}"#,
            "[1,]",
            "01x",
            "1 2",
            "nul",
            r#"{"a" 1}"#,
            "\"",
        ] {
            assert_eq!(json(text), None, "{text:?}");
        }
        let deep = "[".repeat(MAX_DEPTH + 2) + &"]".repeat(MAX_DEPTH + 2);
        assert_eq!(json(&deep), None);
    }

    #[test]
    fn content_types_that_name_json() {
        assert!(is_json("application/json"));
        assert!(is_json("Application/JSON; charset=utf-8"));
        assert!(is_json("application/problem+json"));
        assert!(!is_json("text/plain"));
        assert!(!is_json("application/jsonl"));
    }

    #[test]
    fn query_parameters_are_sorted_by_name_keeping_repeated_values_in_order() {
        assert_eq!(target("/p?b=2&a=1"), target("/p?a=1&b=2"));
        assert_eq!(target("/p?b=2&a=1&b=1"), "/p?a=1&b=2&b=1");
        assert_ne!(target("/p?a=1&a=2"), target("/p?a=2&a=1"));
        assert_eq!(target("/p"), "/p");
    }
}
