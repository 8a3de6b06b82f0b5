//! The random tokens that own claims, leases and relay rounds, and the short hash that names
//! a key in logs. (What a key itself derives, its record id and its steps' downstream keys, is
//! beside the key: `call/key.rs`.)

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

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
    fn tokens_are_positive_and_differ() {
        assert!((0..1000).all(|_| random_token() >= 0));
        assert_ne!(random_token(), random_token());
    }
}
