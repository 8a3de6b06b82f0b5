//! Every identifier idem derives: a record's ledger id, the keys a lease-mode step sends
//! downstream, the random tokens that own claims, leases and relay rounds, and the short hash
//! that names a key in logs.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

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

/// A random positive 63-bit token: record owners, lease owners, relay rounds (no extra
/// dependency: std's randomly keyed SipHash over a process-wide counter).
pub fn random_token() -> i64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::hash::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    (hasher.finish() >> 1) as i64
}

/// The first 8 bytes of a record id in hex: names a key in logs without revealing it.
pub(crate) struct KeyHash<'a>(pub(crate) &'a [u8; 32]);

impl std::fmt::Display for KeyHash<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0[..8].iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn record_ids_of_shifted_parts_differ_and_tokens_are_positive() {
        assert_ne!(record_id("ab", "", "c"), record_id("a", "", "bc"));
        assert_ne!(record_id("s", "p", "k"), record_id("s", "", "pk"));
        assert!((0..1000).all(|_| random_token() >= 0));
        assert_ne!(random_token(), random_token());
    }
}
