//! The contract between the engine and a ledger store (SeaORM, in-memory, or your own).

use std::future::Future;
use std::time::Duration;

use crate::error::Error;
use crate::fingerprint::Fingerprint;

/// How a call treats a concurrent duplicate of itself (same scope, principal and key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Concurrency {
    /// Wait for the other call to finish, then replay its result. If it takes longer than
    /// `bound`, fail with [`Error::InFlight`].
    Wait {
        /// Longest wait for the other call.
        bound: Duration,
    },
    /// Fail at once with [`Error::InFlight`]: always for a duplicate in the same process (single
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
}

/// Everything a store needs to claim one key.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClaimRequest<'a> {
    /// The operation's scope, e.g. `orders.pay`.
    pub scope: &'a str,
    /// Tenant, user or client the key belongs to; empty when the scope has none.
    pub principal: &'a str,
    /// The idempotency key.
    pub key: &'a str,
    /// Record id: SHA-256 over scope, principal and key (length-prefixed).
    pub id: [u8; 32],
    /// Fingerprint of the call's arguments.
    pub fingerprint: Fingerprint,
    /// Random token of this attempt; the record's owner while it is being executed.
    pub owner: i64,
    /// How long a recorded result is kept (measured on the store's clock).
    pub ttl: Duration,
    /// The concurrency policy.
    pub concurrency: Concurrency,
    /// Whether the store must take a savepoint after the claim, so a final error can roll
    /// back the handler's writes and still record itself.
    pub savepoint: bool,
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
}

impl RecordStatus {
    /// The integer stored in the ledger's `state` column.
    pub const fn code(self) -> i16 {
        match self {
            Self::Pending => 0,
            Self::Completed => 1,
            Self::Failed => 2,
        }
    }

    /// Reads a `state` column value.
    pub const fn from_code(code: i16) -> Option<Self> {
        match code {
            0 => Some(Self::Pending),
            1 => Some(Self::Completed),
            2 => Some(Self::Failed),
            _ => None,
        }
    }
}

/// A ledger store. The engine drives it; handlers never call it directly.
///
/// A claim opens a transaction and returns it in [`Claim::Execute`]; the handler's body runs
/// in it; then exactly one of [`record`](Store::record) (commit) or
/// [`release`](Store::release) (roll back) ends it. Dropping the transaction must roll back.
pub trait Store: Sync {
    /// The transaction the handler body runs in.
    type Tx: Send + Sync;

    /// Claims `req.id`: either hands out a transaction that owns the key, or reports the live
    /// record. Expired records count as absent.
    fn claim(
        &self,
        req: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim<Self::Tx>, Error>> + Send;

    /// Records `payload` with `status` for the claimed key and commits `tx`. For
    /// [`RecordStatus::Failed`] (a final error) the store first undoes the handler's writes,
    /// back to the savepoint it took at claim time, so only the recorded error commits.
    fn record(
        &self,
        tx: Self::Tx,
        req: &ClaimRequest<'_>,
        status: RecordStatus,
        payload: &[u8],
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Rolls `tx` back entirely: the key is free again.
    fn release(&self, tx: Self::Tx) -> impl Future<Output = Result<(), Error>> + Send;

    /// Which ledger this store writes to, as a number that two stores of this process share
    /// exactly when they reach the same ledger. With it, concurrent duplicates in this
    /// process wait for the first call in memory (single flight) instead of queueing on the
    /// database's lock. `None` (the default) turns that off.
    fn ledger_identity(&self) -> Option<usize> {
        None
    }
}

impl<S: Store + ?Sized> Store for &S {
    type Tx = S::Tx;

    fn claim(
        &self,
        req: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim<Self::Tx>, Error>> + Send {
        (**self).claim(req)
    }

    fn record(
        &self,
        tx: Self::Tx,
        req: &ClaimRequest<'_>,
        status: RecordStatus,
        payload: &[u8],
    ) -> impl Future<Output = Result<(), Error>> + Send {
        (**self).record(tx, req, status, payload)
    }

    fn release(&self, tx: Self::Tx) -> impl Future<Output = Result<(), Error>> + Send {
        (**self).release(tx)
    }

    fn ledger_identity(&self) -> Option<usize> {
        (**self).ledger_identity()
    }
}
