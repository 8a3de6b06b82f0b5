//! Single flight: concurrent duplicates of a call in one process wait for the first in memory
//! instead of queueing on the database's lock, and replay its recorded answer. Across
//! processes the database still decides.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use tokio::sync::watch;

use crate::ledger::Recorded;

/// How a flight ended: `None` while it runs; then the recorded answer, or `None` inside when
/// the leader recorded nothing (released, failed, cancelled): followers go to the store.
type Landing = Option<Option<Recorded>>;

/// A call's identity across the stores of this process: the store's own identity and the
/// record id.
type FlightKey = (usize, [u8; 32]);

static FLIGHTS: LazyLock<Mutex<HashMap<FlightKey, watch::Receiver<Landing>>>> =
    LazyLock::new(Mutex::default);

fn flights() -> std::sync::MutexGuard<'static, HashMap<FlightKey, watch::Receiver<Landing>>> {
    FLIGHTS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What joining a flight made of this call.
pub(crate) enum Role {
    /// The first call: claim, and land the flight when done.
    Leader(Leader),
    /// A duplicate: wait for the leader's landing.
    Follower(watch::Receiver<Landing>),
}

/// Joins the flight of `id` on store `store`, or starts it.
pub(crate) fn join(store: usize, id: [u8; 32]) -> Role {
    let mut all = flights();
    if let Some(flight) = all.get(&(store, id)) {
        return Role::Follower(flight.clone());
    }
    let (sender, receiver) = watch::channel(None);
    all.insert((store, id), receiver);
    Role::Leader(Leader {
        key: (store, id),
        sender: Some(Arc::new(sender)),
    })
}

/// The leader's end of a flight. Dropped without [`Leader::land`] (an error, a cancelled
/// call), it lands empty, so followers claim for themselves.
#[derive(Debug)]
pub(crate) struct Leader {
    key: FlightKey,
    sender: Option<Arc<watch::Sender<Landing>>>,
}

impl Leader {
    /// Whether any duplicate is waiting (so the answer is worth copying).
    pub(crate) fn has_followers(&self) -> bool {
        self.sender.as_ref().is_some_and(|s| s.receiver_count() > 1)
    }

    /// Ends the flight with the recorded answer (committed): followers replay it.
    pub(crate) fn land(mut self, recorded: Option<Recorded>) {
        self.end(recorded);
    }

    fn end(&mut self, recorded: Option<Recorded>) {
        if let Some(sender) = self.sender.take() {
            flights().remove(&self.key);
            sender.send_replace(Some(recorded));
        }
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        self.end(None);
    }
}

/// Waits for a flight's landing: `Some(recorded)` to replay, `None` to claim in the store.
pub(crate) async fn landing(mut flight: watch::Receiver<Landing>) -> Option<Recorded> {
    match flight.wait_for(Option::is_some).await {
        Ok(landed) => landed.clone().flatten(),
        // The leader vanished without landing (cannot happen: it lands on drop).
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::RecordStatus;

    fn recorded() -> Recorded {
        Recorded {
            fingerprint: crate::Fingerprint([7; 32]),
            status: RecordStatus::Completed,
            payload: b"42".to_vec(),
        }
    }

    /// The first two joins of a flight: its leader and a follower.
    fn leader_and_follower(store: usize, id: [u8; 32]) -> (Leader, watch::Receiver<Landing>) {
        let Role::Leader(leader) = join(store, id) else {
            panic!("first is the leader")
        };
        let Role::Follower(follower) = join(store, id) else {
            panic!("second follows")
        };
        (leader, follower)
    }

    #[tokio::test]
    async fn followers_get_the_leaders_answer_and_the_flight_is_forgotten() {
        let (leader, follower) = leader_and_follower(1, [1; 32]);
        assert!(
            matches!(join(2, [1; 32]), Role::Leader(_)),
            "another store flies alone"
        );
        assert!(leader.has_followers());
        let waiting = tokio::spawn(landing(follower));
        leader.land(Some(recorded()));
        assert_eq!(waiting.await.expect("join").expect("answer").payload, b"42");
        assert!(
            matches!(join(1, [1; 32]), Role::Leader(_)),
            "a new flight after landing"
        );
    }

    #[tokio::test]
    async fn a_leader_dropped_without_an_answer_releases_its_followers() {
        let (leader, follower) = leader_and_follower(3, [2; 32]);
        drop(leader);
        assert!(landing(follower).await.is_none());
    }
}
