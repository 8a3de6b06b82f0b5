//! The contract between the engine and a ledger store (SeaORM, in-memory, or your own): the
//! atomic-mode [`Store`], the lease-mode [`LeaseStore`], and what their claims answer.

pub(crate) mod memory;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::call::Request;
use crate::error::Error;
use crate::ledger::{BoxFuture, Claim, LeaseClaim, RecordStatus, Ticket};

/// A ledger store for atomic mode. The engine drives it; handlers never call it directly.
///
/// A claim opens a transaction and returns it, claimed, in [`Claim::Execute`]; the handler's
/// body runs in what [`Store::tx`] lends of it; then exactly one of [`record`](Store::record) (commit) or
/// [`release`](Store::release) (roll back) ends it. Dropping a claimed transaction must roll
/// back. The claimed value carries whatever the store needs to finish (its owner token, say),
/// and the call's [`Request`] is passed by reference to every step, so nothing is rebuilt.
pub trait Store: Sync {
    /// What the handler's body gets as its connection, borrowed from the claim for as long
    /// as the body runs: the claim's transaction, shared (`&DatabaseTransaction` for SeaORM)
    /// or exclusive (`&mut PgConnection` for sqlx, whose executors take `&mut`).
    type Tx<'t>: Send;
    /// A claimed key: the transaction and what recording needs besides the request.
    type Claimed: Send;

    /// Lends the transaction inside a claimed key to the body.
    fn tx(claimed: &mut Self::Claimed) -> Self::Tx<'_>;

    /// Claims `req.id()`: either hands out a transaction that owns the key, or reports the
    /// live record. Expired records count as absent. With [`Request::savepoint`] the store
    /// takes a savepoint after the claim, so a final error can undo the body's writes.
    fn claim(
        &self,
        req: &Request,
    ) -> impl Future<Output = Result<Claim<Self::Claimed>, Error>> + Send;

    /// Records `payload` with `status` for the claimed key and commits. For
    /// [`RecordStatus::Failed`] (a final error) the store first undoes the handler's writes,
    /// back to the savepoint it took at claim time, so only the recorded error commits.
    fn record(
        &self,
        claimed: Self::Claimed,
        req: &Request,
        status: RecordStatus,
        payload: &[u8],
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Rolls the claim back entirely: the key is free again.
    fn release(&self, claimed: Self::Claimed) -> impl Future<Output = Result<(), Error>> + Send;

    /// Asked after the body returned an error that records nothing: whether the database had
    /// already aborted the claim's transaction for a conflict (a deadlock victim, a Galera
    /// brute-force abort by another node's write), which the body's error then only reports.
    /// If so the engine runs the call again, as for any [`Error::Conflict`]. The default,
    /// `false`, answers with the body's error.
    fn aborted(
        &self,
        claimed: &mut Self::Claimed,
        req: &Request,
    ) -> impl Future<Output = bool> + Send {
        let _ = (claimed, req);
        async { false }
    }

    /// Opens a transaction that claims nothing, for a call run with idem switched off
    /// ([`testing`](crate::testing)) or observed (`mode = observe`, whose body runs every
    /// time): the body runs in what [`Store::tx`] lends of it, then
    /// [`commit`](Store::commit) or [`release`](Store::release) ends it. The default answers
    /// that this store cannot run bodies switched off.
    fn begin(&self) -> impl Future<Output = Result<Self::Claimed, Error>> + Send {
        async { Err(cannot_run_unclaimed()) }
    }

    /// Commits a transaction from [`begin`](Store::begin), recording nothing.
    fn commit(&self, claimed: Self::Claimed) -> impl Future<Output = Result<(), Error>> + Send {
        drop(claimed);
        async { Err(cannot_run_unclaimed()) }
    }

    /// Which ledger this store writes to, as a number that two stores of this process share
    /// exactly when they reach the same ledger. With it, concurrent duplicates in this
    /// process wait for the first call in memory (single flight) instead of queueing on the
    /// database's lock. `None` (the default) turns that off.
    fn ledger_identity(&self) -> Option<usize> {
        None
    }
}

fn cannot_run_unclaimed() -> Error {
    Error::Store {
        message: "idem is switched off (idem::testing), but this store cannot run a body without a claim: implement `Store::begin` and `Store::commit` for it".to_owned(),
        source: None,
    }
}

/// A ledger store for lease mode. Owned and shareable (`'static`), because the lease outlives
/// the claim: the renewal task and the steps reach it while the body runs.
pub trait LeaseStore: Send + Sync + 'static {
    /// Claims `req.id()` with a lease of `lease` and commits: a new record (a random owner
    /// token from [`random_token`](crate::ledger::ids::random_token)), a takeover of an in-progress
    /// record whose lease ended (token + 1, its steps), the completed record, or the live
    /// lease's remaining time.
    fn claim_lease<'a>(
        &'a self,
        req: &'a Request,
        lease: Duration,
    ) -> BoxFuture<'a, Result<LeaseClaim, Error>>;

    /// Extends the lease to `lease` from now, if `ticket` still holds it.
    fn renew<'a>(&'a self, ticket: &'a Ticket, lease: Duration)
    -> BoxFuture<'a, Result<(), Error>>;

    /// Records step `name` with `payload`, if `ticket` still holds the lease.
    fn record_step<'a>(
        &'a self,
        ticket: &'a Ticket,
        name: &'a str,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<(), Error>>;

    /// Records the call's outcome (kept for the request's TTL from now), if `ticket` still
    /// holds the lease, and forgets its steps. `steps` names every step that may be recorded
    /// under the call's key (handed over at the claim, or recorded or about to be by this
    /// holder; the lease fenced out every other writer): a store may delete them by key
    /// instead of looking for them, and skip that when there are none.
    fn complete<'a>(
        &'a self,
        ticket: &'a Ticket,
        req: &'a Request,
        status: RecordStatus,
        payload: &'a [u8],
        steps: &'a [String],
    ) -> BoxFuture<'a, Result<(), Error>>;

    /// Ends the lease now, keeping the steps: a retry takes over at once and resumes.
    fn release_lease<'a>(&'a self, ticket: &'a Ticket) -> BoxFuture<'a, Result<(), Error>>;
}

/// Runs one store step to completion, whatever its caller does: for store authors, around
/// every step that holds a pooled connection.
///
/// A caller may stop waiting at any point (a timeout, a client that disconnects, the wait
/// bound). If the step's future were dropped with it, sqlx 0.9 can leave the pooled
/// connection inside a transaction (a `BEGIN` cut off in flight) or, on MySQL, with a
/// half-prepared statement. So the step runs in place while its caller waits (no task
/// hand-off on the common path), and if the caller goes away first, the unfinished step is
/// handed to a task that finishes it; if nobody takes its transaction, it is dropped after its
/// last statement completed, which rolls it back cleanly.
pub async fn detached<T: Send + 'static>(
    step: impl Future<Output = Result<T, Error>> + Send + 'static,
) -> Result<T, Error> {
    FinishOnDrop(Some(Box::pin(step))).await
}

/// A step that, dropped before it completed, finishes on a task of its own.
struct FinishOnDrop<F: Future + Send + 'static>(Option<Pin<Box<F>>>)
where
    F::Output: Send + 'static;

impl<F: Future + Send + 'static> Future for FinishOnDrop<F>
where
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let Some(step) = self.0.as_mut() else {
            return Poll::Pending; // polled after completion: never again ready
        };
        let output = std::task::ready!(step.as_mut().poll(cx));
        self.0 = None;
        Poll::Ready(output)
    }
}

impl<F: Future + Send + 'static> Drop for FinishOnDrop<F>
where
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        if let Some(step) = self.0.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(step);
        }
    }
}
