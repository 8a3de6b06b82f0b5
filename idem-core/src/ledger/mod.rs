//! The ledger's data, the bottom layer of the engine: what a claim finds ([`Claim`],
//! [`LeaseClaim`]), a recorded outcome and its status codes ([`Recorded`], [`RecordStatus`]),
//! a lease's fencing [`Ticket`], how duplicates are treated ([`Concurrency`]). It depends on no
//! other part of the engine; the store contracts (`store.rs`) and the call (`call.rs`) build on it.

pub mod ids;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::fingerprint::Fingerprint;

/// How a call treats a concurrent duplicate of itself (same scope, principal and key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Concurrency {
    /// Wait for the other call to finish, then replay its result. If it takes longer than
    /// `bound`, fail with [`Error::InFlight`](crate::Error::InFlight).
    Wait {
        /// Longest wait for the other call.
        bound: Duration,
    },
    /// Fail at once with [`Error::InFlight`](crate::Error::InFlight): always for a duplicate in the same process (single
    /// flight), and across processes where the store can tell (PostgreSQL, MySQL; SQLite
    /// serialises all writers, so a duplicate from another process waits).
    Reject,
}

impl Concurrency {
    /// The wait bound of [`Concurrency::DEFAULT`], and the safety bound of `Reject` on stores
    /// that cannot fail fast.
    pub const DEFAULT_BOUND: Duration = Duration::from_secs(5);

    /// The default: wait up to [`Concurrency::DEFAULT_BOUND`].
    pub const DEFAULT: Self = Self::Wait {
        bound: Self::DEFAULT_BOUND,
    };

    /// How long a store's claim may wait for a pooled connection, at most `wait`: under
    /// `Wait`, four fifths of its bound at most, leaving a fifth for the lock wait that
    /// follows, so that a missing connection is an outage told promptly, never mistaken for
    /// another call holding the key.
    pub fn connection_wait(self, wait: Duration) -> Duration {
        match self {
            Self::Wait { bound } => wait.min(bound.mul_f64(0.8)),
            Self::Reject => wait,
        }
    }
}

/// What a claim found.
#[derive(Debug)]
#[non_exhaustive]
pub enum Claim<Tx> {
    /// The key is ours: run the handler inside `Tx`, then record or release.
    Execute(Tx),
    /// The key has a live record; the store has already ended its transaction.
    Recorded(Recorded),
    /// Another attempt holds the key (only stores that can tell say this).
    InFlight,
}

impl<Tx> Claim<Tx> {
    /// The same claim with its transaction wrapped by `wrap`: for a store that wraps
    /// another's claims (one kind of store for several connections).
    pub fn map_execute<U>(self, wrap: impl FnOnce(Tx) -> U) -> Claim<U> {
        match self {
            Claim::Execute(tx) => Claim::Execute(wrap(tx)),
            Claim::Recorded(recorded) => Claim::Recorded(recorded),
            Claim::InFlight => Claim::InFlight,
        }
    }
}

/// A recorded outcome, as read back from the store.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// Fingerprint of the arguments that produced it.
    pub fingerprint: Fingerprint,
    /// Whether it is a result or a final error.
    pub status: RecordStatus,
    /// The serialised value.
    pub payload: Vec<u8>,
}

/// The kind of a recorded outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordStatus {
    /// A claim that is being executed (never visible to others in atomic mode).
    Pending,
    /// `Ok(value)` was recorded.
    Completed,
    /// A final `Err(error)` was recorded.
    Failed,
    /// A completer gave the call up ([`Error::GaveUp`](crate::Error::GaveUp)); the payload says how often it
    /// tried and why it failed.
    GaveUp,
}

impl RecordStatus {
    /// The integer stored in the ledger's `state` column.
    pub const fn code(self) -> i16 {
        match self {
            Self::Pending => 0,
            Self::Completed => 1,
            Self::Failed => 2,
            Self::GaveUp => 3,
        }
    }

    /// Reads a `state` column value.
    pub const fn from_code(code: i16) -> Option<Self> {
        match code {
            0 => Some(Self::Pending),
            1 => Some(Self::Completed),
            2 => Some(Self::Failed),
            3 => Some(Self::GaveUp),
            _ => None,
        }
    }
}

/// A boxed, sendable future (lease stores are used behind `dyn`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a lease claim hands out: the record, the fencing token and the lease end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Ticket {
    /// The record id (SHA-256 of scope, principal, key).
    pub id: [u8; 32],
    /// The fencing token: a random owner token for the first holder, one more for every
    /// takeover. Every write of the holder is checked against it.
    pub token: i64,
    /// When the lease ends, in epoch milliseconds on the store's clock.
    pub lease_end_ms: i64,
}

impl Ticket {
    /// A ticket (stores build them).
    pub fn new(id: [u8; 32], token: i64, lease_end_ms: i64) -> Self {
        Self {
            id,
            token,
            lease_end_ms,
        }
    }
}

/// What a lease claim found.
#[derive(Debug)]
#[non_exhaustive]
pub enum LeaseClaim {
    /// The key is ours (new, or taken over after its lease ended): run the body. `steps` are
    /// the recovery points an earlier holder recorded, by name.
    Execute {
        /// The lease.
        ticket: Ticket,
        /// Recorded steps: name and serialised value.
        steps: Vec<(String, Vec<u8>)>,
    },
    /// The key has a completed record (or, with another fingerprint, any record: the engine
    /// answers `KeyReused`).
    Recorded(Recorded),
    /// Another holder's lease is live.
    InFlight {
        /// Until its lease ends.
        retry_after: Duration,
    },
}
