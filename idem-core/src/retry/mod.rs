//! The one backoff: exponential delays with a ceiling, and how much of each is random. The
//! relay and the inbox runner wait [`Backoff::delay`] (half jitter), a conflict's retry waits
//! a fully jittered delay (duplicates that collided spread out instead of meeting again), a
//! completer's next attempt at one call none (its due time is stored).

pub mod conflict;

use std::time::Duration;

pub use crate::error::CONFLICT_RETRY_AFTER;

/// Exponential backoff: `initial · 2^(attempt − 1)`, at most `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Delay after the first failure.
    pub initial: Duration,
    /// Longest delay.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(500),
            max: Duration::from_secs(60),
        }
    }
}

/// How much of a delay is random.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Jitter {
    /// The whole ceiling, every time.
    None,
    /// Uniform in [ceiling / 2, ceiling): waits grow, retries of many messages spread out.
    Half,
    /// Uniform in [0, ceiling) ("full jitter").
    Full,
}

impl Backoff {
    /// The delay after failed attempt `attempt` (1-based): `initial · 2^(attempt-1)`, at most
    /// `max`, scaled by a random factor in [0.5, 1) so retries of many messages spread out.
    pub fn delay(&self, attempt: u32) -> Duration {
        self.jittered(attempt, Jitter::Half)
    }

    /// The delay after failed attempt `attempt` (1-based), with `jitter`.
    pub(crate) fn jittered(&self, attempt: u32, jitter: Jitter) -> Duration {
        let ceiling = self.ceiling(attempt);
        match jitter {
            Jitter::None => ceiling,
            Jitter::Half => ceiling.mul_f64(0.5 + 0.5 * unit_random()),
            Jitter::Full => ceiling.mul_f64(unit_random()),
        }
    }

    /// `initial · 2^(attempt − 1)`, at most `max`.
    fn ceiling(&self, attempt: u32) -> Duration {
        let exponent = attempt.saturating_sub(1).min(30);
        self.initial.saturating_mul(1u32 << exponent).min(self.max)
    }
}

/// A random number in `[0, 1)`, for jitter (std's randomly keyed SipHash; no extra
/// dependency).
pub(crate) fn unit_random() -> f64 {
    (crate::ledger::ids::random_token() >> 10) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const BACKOFF: Backoff = Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_secs(1),
    };

    #[test]
    fn delays_double_up_to_the_ceiling_with_their_jitter() {
        for (attempt, ceiling_ms) in [
            (1, 100),
            (2, 200),
            (3, 400),
            (4, 800),
            (5, 1000),
            (40, 1000),
        ] {
            let ceiling = Duration::from_millis(ceiling_ms);
            assert_eq!(
                BACKOFF.jittered(attempt, Jitter::None),
                ceiling,
                "{attempt}"
            );
            for _ in 0..20 {
                let half = BACKOFF.delay(attempt);
                assert!(half >= ceiling / 2 && half < ceiling, "{attempt}: {half:?}");
                let full = BACKOFF.jittered(attempt, Jitter::Full);
                assert!(full < ceiling, "{attempt}: {full:?}");
            }
        }
        let spread: std::collections::BTreeSet<_> = (0..32).map(|_| BACKOFF.delay(3)).collect();
        assert!(spread.len() > 1, "jitter spreads retries");
        let spread: std::collections::BTreeSet<_> =
            (0..32).map(|_| BACKOFF.jittered(3, Jitter::Full)).collect();
        assert!(spread.len() > 10, "full jitter spreads wider");
    }

    #[test]
    fn an_attempt_zero_or_a_huge_one_stays_within_the_bounds() {
        assert_eq!(BACKOFF.jittered(0, Jitter::None), BACKOFF.initial);
        assert_eq!(BACKOFF.jittered(u32::MAX, Jitter::None), BACKOFF.max);
        assert!(
            (0..1000)
                .map(|_| unit_random())
                .all(|r| (0.0..1.0).contains(&r))
        );
    }
}
