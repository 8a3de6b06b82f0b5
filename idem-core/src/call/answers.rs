//! Recent answers: the records this process completed, kept in memory until they expire, so
//! that a retry it receives is replayed without a round trip to the store.
//!
//! A completed record never changes until it expires (only the purge deletes records, and
//! only expired ones), so a copy is as good as the row for that long. Each copy expires
//! first: its deadline is taken before the store's own clock starts the record's TTL. A
//! retry that reaches another process, or this one after the copy was evicted, reads the
//! store as before. Memory is bounded by a byte budget; the oldest copies go first.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::ledger::{RecordStatus, Recorded};

/// What one copy costs besides its payload: the id twice, the fingerprint, the map's slot.
const ENTRY_OVERHEAD: usize = 128;

/// Completed records this process wrote, kept until they expire, within a byte budget.
/// Shared by every call that is given it ([`Call::remember_answers`](crate::call::Call::remember_answers)).
#[derive(Debug)]
pub struct RecentAnswers {
    budget: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    copies: HashMap<[u8; 32], Kept>,
    /// Ids in the order they were kept, each with its copy's number: the oldest is evicted
    /// first, and a number that no longer matches names a copy already replaced.
    order: VecDeque<([u8; 32], u64)>,
    bytes: usize,
    kept: u64,
}

#[derive(Debug)]
struct Kept {
    recorded: Arc<Recorded>,
    expires: Instant,
    number: u64,
}

fn cost(recorded: &Recorded) -> usize {
    recorded.payload.len() + ENTRY_OVERHEAD
}

impl RecentAnswers {
    /// Keeps at most `budget` bytes of recorded answers (payloads plus a small overhead per
    /// copy). An answer larger than an eighth of the budget is never kept.
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// The byte budget.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// How many answers are kept now (expired ones included until they are looked up or
    /// evicted).
    pub fn len(&self) -> usize {
        self.lock().copies.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The answer recorded under `id`, if it is kept and has not expired.
    pub(crate) fn get(&self, id: &[u8; 32]) -> Option<Arc<Recorded>> {
        let mut inner = self.lock();
        let copy = inner.copies.get(id)?;
        if copy.expires > Instant::now() {
            return Some(Arc::clone(&copy.recorded));
        }
        let gone = inner.copies.remove(id)?;
        inner.bytes -= cost(&gone.recorded);
        None
    }

    /// Keeps the answer just recorded under `id` for `ttl` from `since` (an instant taken
    /// before the store's clock started the record's TTL). Only completed records and
    /// final errors are kept: nothing else is an answer for good.
    pub(crate) fn keep(&self, id: [u8; 32], recorded: Recorded, since: Instant, ttl: Duration) {
        if !matches!(
            recorded.status,
            RecordStatus::Completed | RecordStatus::Failed
        ) {
            return;
        }
        let size = cost(&recorded);
        if size > self.budget / 8 {
            return;
        }
        let Some(expires) = since.checked_add(ttl) else {
            return;
        };
        let mut inner = self.lock();
        inner.kept += 1;
        let number = inner.kept;
        let copy = Kept {
            recorded: Arc::new(recorded),
            expires,
            number,
        };
        if let Some(old) = inner.copies.insert(id, copy) {
            inner.bytes -= cost(&old.recorded);
        }
        inner.bytes += size;
        inner.order.push_back((id, number));
        while inner.bytes > self.budget {
            let Some((oldest, number)) = inner.order.pop_front() else {
                break;
            };
            if inner
                .copies
                .get(&oldest)
                .is_some_and(|c| c.number == number)
                && let Some(gone) = inner.copies.remove(&oldest)
            {
                inner.bytes -= cost(&gone.recorded);
            }
        }
        // Ids whose copies were replaced or looked up expired pile up in `order` only until
        // it is twice the live copies: then it is rebuilt from them.
        if inner.order.len() > 2 * inner.copies.len() + 64 {
            let Inner { copies, order, .. } = &mut *inner;
            order.retain(|(id, number)| copies.get(id).is_some_and(|c| c.number == *number));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Fingerprint;

    fn answer(status: RecordStatus, bytes: usize) -> Recorded {
        Recorded {
            fingerprint: Fingerprint([7; 32]),
            status,
            payload: vec![b'x'; bytes],
        }
    }

    #[test]
    fn a_kept_answer_is_found_until_it_expires() {
        let answers = RecentAnswers::new(1 << 20);
        let now = Instant::now();
        answers.keep(
            [1; 32],
            answer(RecordStatus::Completed, 10),
            now,
            Duration::from_secs(60),
        );
        answers.keep(
            [2; 32],
            answer(RecordStatus::Completed, 10),
            now,
            Duration::ZERO,
        );
        assert_eq!(answers.get(&[1; 32]).unwrap().payload.len(), 10);
        assert!(answers.get(&[2; 32]).is_none(), "expired at once");
        assert!(answers.get(&[3; 32]).is_none(), "never kept");
        assert_eq!(
            answers.len(),
            1,
            "the expired copy is dropped when looked up"
        );
    }

    #[test]
    fn only_answers_for_good_are_kept() {
        let answers = RecentAnswers::new(1 << 20);
        let now = Instant::now();
        let ttl = Duration::from_secs(60);
        answers.keep([1; 32], answer(RecordStatus::Pending, 1), now, ttl);
        answers.keep([2; 32], answer(RecordStatus::GaveUp, 1), now, ttl);
        answers.keep([3; 32], answer(RecordStatus::Failed, 1), now, ttl);
        assert!(answers.get(&[1; 32]).is_none());
        assert!(answers.get(&[2; 32]).is_none());
        assert!(
            answers.get(&[3; 32]).is_some(),
            "a final error is an answer"
        );
    }

    #[test]
    fn the_budget_evicts_the_oldest_and_skips_the_too_large() {
        let budget = 10 * (100 + ENTRY_OVERHEAD);
        let answers = RecentAnswers::new(budget);
        let now = Instant::now();
        let ttl = Duration::from_secs(60);
        for i in 0..25_u8 {
            answers.keep([i; 32], answer(RecordStatus::Completed, 100), now, ttl);
        }
        assert_eq!(answers.len(), 10);
        assert!(answers.get(&[14; 32]).is_none(), "evicted");
        assert!(answers.get(&[15; 32]).is_some(), "one of the newest ten");
        answers.keep(
            [99; 32],
            answer(RecordStatus::Completed, budget / 8),
            now,
            ttl,
        );
        assert!(
            answers.get(&[99; 32]).is_none(),
            "over an eighth of the budget"
        );
        // Replacing one id many times keeps one copy and a bounded queue.
        for _ in 0..1_000 {
            answers.keep([42; 32], answer(RecordStatus::Completed, 100), now, ttl);
        }
        assert!(answers.get(&[42; 32]).is_some());
        let inner = answers.lock();
        assert!(inner.order.len() <= 2 * inner.copies.len() + 65);
        assert!(inner.bytes <= budget);
    }
}
