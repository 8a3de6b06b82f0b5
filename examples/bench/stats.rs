//! Medians, percentiles and the alternating order every figure uses.

use std::time::Duration;

use serde_json::json;

pub(crate) fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

pub(crate) fn percentile(values: &[f64], p: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

pub(crate) fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Rounds to 3 decimals for the JSON (`null` when not finite).
pub(crate) fn r3(x: f64) -> serde_json::Value {
    rounded(x).map_or(serde_json::Value::Null, |x| json!(x))
}

/// `x` rounded to 3 decimals, `None` when not finite: what the JSON holds, so the profile's
/// table prints the same numbers as the JSON.
pub(crate) fn rounded(x: f64) -> Option<f64> {
    x.is_finite().then(|| (x * 1000.0).round() / 1000.0)
}

/// A value with `decimals` decimals, or `n/a`.
pub(crate) fn fmt_opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.decimals$}"))
}

/// Alternating order: ABCD, DCBA, ABCD, …
pub(crate) fn alternate<T: Copy>(items: &[T], round: usize) -> Vec<T> {
    if round.is_multiple_of(2) {
        items.to_vec()
    } else {
        items.iter().rev().copied().collect()
    }
}
