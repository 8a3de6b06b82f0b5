//! How the tool writes what it read: times on the database clock (ISO-8601 UTC, and relative
//! to the database's now), durations, hex, JSON payloads, and aligned tables.

use std::fmt::Write as _;
use std::time::Duration;

/// Epoch milliseconds as ISO-8601 UTC with milliseconds: `2026-11-24T07:43:00.123Z`.
pub(crate) fn iso8601(epoch_ms: i64) -> String {
    let seconds = epoch_ms.div_euclid(1000);
    let millis = epoch_ms.rem_euclid(1000);
    let (year, month, day) = civil_from_days(seconds.div_euclid(86_400));
    let second_of_day = seconds.rem_euclid(86_400);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        second_of_day / 3600,
        second_of_day % 3600 / 60,
        second_of_day % 60
    )
}

/// The proleptic Gregorian date of a day counted from 1970-01-01 (Howard Hinnant's
/// `civil_from_days`), so the tool needs no date library.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// `at_ms` relative to `now_ms` (both on the database clock): `in 3h 20m`, `12s ago`.
pub(crate) fn relative(at_ms: i64, now_ms: i64) -> String {
    let delta = at_ms.saturating_sub(now_ms);
    let span = span(delta.unsigned_abs());
    if delta >= 0 {
        format!("in {span}")
    } else {
        format!("{span} ago")
    }
}

/// A time at `at_ms` with where it stands from `now_ms`: `2026-…Z (12s ago)`.
pub(crate) fn when(at_ms: i64, now_ms: i64) -> String {
    format!("{} ({})", iso8601(at_ms), relative(at_ms, now_ms))
}

/// A span of milliseconds in its two largest units: `450ms`, `12s`, `1m 5s`, `3h 20m`, `2d 4h`.
pub(crate) fn span(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let seconds = ms / 1000;
    let units = [
        (seconds / 86_400, "d"),
        (seconds % 86_400 / 3600, "h"),
        (seconds % 3600 / 60, "m"),
        (seconds % 60, "s"),
    ];
    let first = units.iter().position(|&(n, _)| n > 0).unwrap_or(3);
    let mut out = format!("{}{}", units[first].0, units[first].1);
    if let Some(&(n, unit)) = units.get(first + 1)
        && n > 0
    {
        let _ = write!(out, " {n}{unit}");
    }
    out
}

/// Parses a duration as operators write it: a whole number and a unit, `500ms`, `45s`,
/// `30m`, `12h`, `7d`.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration: write a number and a unit, like 7d"))?;
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(format!(
                "`{text}`: the unit must be one of ms, s, m, h, d (like 7d)"
            ));
        }
    };
    number
        .checked_mul(unit_ms)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("`{text}` is too long"))
}

/// Lowercase hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        })
}

/// The key inside an RFC 8941 structured-field string (`"k-1"`, with `\"` and `\\` escaped),
/// as a client's `Idempotency-Key` header carries it and as operators paste it from a request
/// log; `None` when `text` is not one, or holds nothing.
pub(crate) fn unquoted_key(text: &str) -> Option<String> {
    let inner = text.strip_prefix('"')?.strip_suffix('"')?;
    let mut key = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                escaped @ ('"' | '\\') => key.push(escaped),
                _ => return None,
            },
            '"' => return None,
            c => key.push(c),
        }
    }
    (!key.is_empty()).then_some(key)
}

/// A stored payload (JSON bytes) as a JSON value; a payload that is not JSON (it always is,
/// unless something else wrote the row) becomes a string that says so.
pub(crate) fn json_payload(bytes: &[u8]) -> serde_json::Value {
    // An answer of a versioned type is recorded behind its `v<N>:` envelope.
    let json = idem_core::versioned::recorded_answer(bytes).map_or(bytes, |(_, json)| json);
    serde_json::from_slice(json).unwrap_or_else(|_| {
        serde_json::Value::String(format!(
            "(not JSON: {} bytes, hex {})",
            bytes.len(),
            hex(bytes)
        ))
    })
}

/// A response recorded by idem's tower layer (`idem::axum::IdempotencyLayer`), read from its
/// answer's JSON (`{"status": 201, "headers": [[name, bytes]…], "body": {"Text": …}}`) and put
/// as HTTP: the status, the headers as text, the body as JSON when it is JSON, else as text.
/// `None` for any other answer.
pub(crate) fn http_answer(answer: &serde_json::Value) -> Option<serde_json::Value> {
    use serde_json::{Map, Value};
    let fields = answer.as_object()?;
    if fields.len() != 3 {
        return None;
    }
    let status = fields
        .get("status")?
        .as_u64()
        .filter(|s| (100..=599).contains(s))?;
    let mut headers = Map::new();
    for header in fields.get("headers")?.as_array()? {
        let [name, value] = header.as_array()?.as_slice() else {
            return None;
        };
        let bytes: Vec<u8> = value
            .as_array()?
            .iter()
            .map(|b| b.as_u64().and_then(|b| u8::try_from(b).ok()))
            .collect::<Option<_>>()?;
        let value = Value::String(String::from_utf8_lossy(&bytes).into_owned());
        match headers.get_mut(name.as_str()?) {
            // A header set more than once (set-cookie): its values in order.
            Some(Value::Array(values)) => values.push(value),
            Some(first) => *first = Value::Array(vec![first.take(), value]),
            None => {
                headers.insert(name.as_str()?.to_owned(), value);
            }
        }
    }
    let body = fields.get("body")?.as_object()?;
    let (kind, value) = body.iter().next()?;
    let body = match (kind.as_str(), value) {
        ("Text", Value::String(text)) => {
            serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.clone()))
        }
        ("Bytes", Value::Array(bytes)) => {
            Value::String(format!("({} bytes that are not UTF-8)", bytes.len()))
        }
        ("TooLarge", Value::Object(limit)) => Value::String(format!(
            "(not recorded: over the route's limit of {} bytes)",
            limit.get("limit")?
        )),
        _ => return None,
    };
    Some(serde_json::json!({ "status": status, "headers": headers, "body": body }))
}

/// A JSON value pretty-printed, every line indented by `indent` spaces.
pub(crate) fn indented_json(value: &serde_json::Value, indent: usize) -> String {
    let pretty = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    let pad = " ".repeat(indent);
    pretty
        .lines()
        .map(|line| format!("{pad}{line}\n"))
        .collect()
}

/// Text on one line: line breaks and runs of whitespace become one space.
pub(crate) fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Rows under headers, each column as wide as its widest cell (the last is not padded).
pub(crate) fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let headers: Vec<String> = headers.iter().map(|&h| h.to_owned()).collect();
    let mut out = String::new();
    for row in std::iter::once(&headers).chain(rows) {
        let last = row.len().saturating_sub(1);
        let mut line = String::new();
        for (i, (cell, width)) in row.iter().zip(&widths).enumerate() {
            if i == last {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<width$}  ");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_iso_8601_utc_on_any_date() {
        assert_eq!(iso8601(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(iso8601(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(iso8601(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(iso8601(-1), "1969-12-31T23:59:59.999Z");
    }

    #[test]
    fn relative_times_use_the_two_largest_units() {
        assert_eq!(relative(12_000, 0), "in 12s");
        assert_eq!(relative(0, 12_400), "12s ago");
        assert_eq!(
            relative(3 * 3_600_000 + 20 * 60_000 + 5_000, 0),
            "in 3h 20m"
        );
        assert_eq!(relative(3 * 3_600_000 + 5_000, 0), "in 3h");
        assert_eq!(span(450), "450ms");
        assert_eq!(span(65_000), "1m 5s");
        assert_eq!(span(2 * 86_400_000 + 4 * 3_600_000), "2d 4h");
    }

    #[test]
    fn durations_parse_with_a_unit_only() {
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert!(parse_duration("7").is_err());
        assert!(parse_duration("d").is_err());
        assert!(parse_duration("7 weeks").is_err());
    }

    #[test]
    fn hex_is_lowercase_two_digits_a_byte() {
        assert_eq!(hex(&[0xab, 0x01, 0x00]), "ab0100");
    }

    #[test]
    fn a_structured_field_string_is_unquoted_and_anything_else_is_not() {
        assert_eq!(unquoted_key(r#""k-1""#).as_deref(), Some("k-1"));
        assert_eq!(
            unquoted_key(r#""a \"b\" \\ c""#).as_deref(),
            Some(r#"a "b" \ c"#)
        );
        for not_quoted in [
            "k-1",
            r#""open"#,
            r#""bad \x escape""#,
            r#""inner " quote""#,
            "\"\"",
        ] {
            assert_eq!(unquoted_key(not_quoted), None, "{not_quoted}");
        }
    }

    #[test]
    fn tables_align_columns_and_leave_the_last_unpadded() {
        let out = table(
            &["A", "LONG HEADER", "LAST"],
            &[vec!["xyz".into(), "1".into(), "free text".into()]],
        );
        assert_eq!(out, "A    LONG HEADER  LAST\nxyz  1            free text\n");
    }
}
