//! Lease mode on the SeaORM ledger: the lease is the ledger row itself (state in progress,
//! `owner` = the fencing token, `expires_at_ms` = the lease end while in progress), and
//! recovery points live in the steps table ([`STEPS_TABLE`](crate::STEPS_TABLE)). Every write
//! of a holder locks the ledger row and checks its token first, so a holder whose lease was
//! taken over cannot record anything. All of it is idem-sql's, written once for every driver
//! ([`idem_sql::SqlStore`]); this file names the store, the final phase and the operator's
//! lists for SeaORM's users.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use idem_core::Error;
use idem_core::lease::LeaseHandle;
use idem_sql::{Driver, SqlStore};
pub use idem_sql::{ExpiredLease, StuckLease};
use sea_orm::{ConnectionTrait, DatabaseConnection, DatabaseTransaction};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::driver::port::{On, SeaOrm};

/// The ledger in lease mode on a SeaORM connection; `#[idempotent(..., lease = "…")]` builds
/// one from the handler's connection.
#[derive(Debug, Clone)]
pub struct SeaOrmLeaseStore {
    /// Everything the store does is written once for every driver, on it.
    store: SqlStore<SeaOrm>,
}

impl SeaOrmLeaseStore {
    /// A lease store on `db` (cloning a connection shares its pool).
    pub fn new(db: DatabaseConnection) -> Self {
        Self {
            store: SqlStore::new(SeaOrm::new(db)),
        }
    }

    /// The store written once for every driver.
    pub(crate) fn generic(&self) -> &SqlStore<SeaOrm> {
        &self.store
    }
}

idem_sql::lend_store!([] SeaOrmLeaseStore);

/// The final phase of a lease-mode handler: runs `writes` in one transaction that also checks
/// the lease and records the step `name`, so the database effects (the guarded transition,
/// the payment row, an outbox message) commit exactly once even across takeovers. A takeover
/// that finds the step recorded returns its value without running `writes` again. A holder
/// that lost its lease gets [`Error::LeaseLost`] and its writes roll back.
///
/// When the phase is the handler's last work, [`finish`] saves a write transaction.
///
/// ```text
/// let view = idem::sea_orm::final_step(db, "record-payment", |tx| Box::pin(async move {
///     order::Entity::apply_transition(tx, id, transition!(OrderStatus: Pending -> Paid)).await?;
///     payment::Entity::insert(..).exec(tx).await?;
///     Ok(view)
/// })).await?;
/// ```
pub async fn final_step<T, E, F>(db: &DatabaseConnection, name: &str, writes: F) -> Result<T, E>
where
    T: Serialize + DeserializeOwned,
    E: From<Error>,
    F: for<'t> FnOnce(
        &'t DatabaseTransaction,
    ) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>,
{
    final_phase(db, name, writes, "idem::sea_orm::final_step", false).await
}

/// [`final_step`] as the handler's last work: the phase's transaction stays open until the
/// handler returns, and the call's result is recorded in it, so a call takes three write
/// transactions (claim, steps, this) instead of four. Return its value (or something made
/// from it, with no database work in between):
///
/// ```text
/// idem::sea_orm::finish(db, "record-payment", |tx| Box::pin(async move { ... Ok(view) })).await
/// ```
///
/// Its writes become visible to other connections when the handler returns, together with
/// the recorded result: read them back inside `writes`, not after. Database work after it
/// waits at most 50 ms, after which the phase commits alone (and the result is recorded in a
/// transaction of its own, as after [`final_step`]).
pub async fn finish<T, E, F>(db: &DatabaseConnection, name: &str, writes: F) -> Result<T, E>
where
    T: Serialize + DeserializeOwned,
    E: From<Error>,
    F: for<'t> FnOnce(
        &'t DatabaseTransaction,
    ) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>,
{
    final_phase(db, name, writes, "idem::sea_orm::finish", true).await
}

/// A final phase; with `keep_open` its transaction waits for the call's result. The value's
/// type is known here: a recorded step returns it; the rest is idem-sql's
/// ([`idem_sql::final_phase`]).
async fn final_phase<T, E, F>(
    db: &DatabaseConnection,
    name: &str,
    writes: F,
    what: &str,
    keep_open: bool,
) -> Result<T, E>
where
    T: Serialize + DeserializeOwned,
    E: From<Error>,
    F: for<'t> FnOnce(
        &'t DatabaseTransaction,
    ) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>,
{
    let store = SqlStore::new(SeaOrm::new(db.clone()));
    // The handler's writes get the phase's `DatabaseTransaction`.
    if idem_core::testing::is_disabled() {
        // Switched off, the call's lease is in memory: the writes alone, in a transaction.
        return idem_sql::unfenced::<SeaOrm, T, E, _>(
            &store,
            |tx: &mut On<DatabaseTransaction>| writes(SeaOrm::body(tx)),
        )
        .await;
    }
    let lease = LeaseHandle::current(what)?;
    if let Some(value) = lease.recorded::<T>(name)? {
        return Ok(value);
    }
    let encode = |value: &T| lease.encode(value);
    idem_sql::final_phase::<SeaOrm, T, E, _>(
        &store,
        &lease,
        name,
        |tx: &mut On<DatabaseTransaction>| writes(SeaOrm::body(tx)),
        encode,
        keep_open,
    )
    .await
}

/// Lists up to `limit` leases that ended without their call finishing, oldest first.
pub async fn expired_leases<C: ConnectionTrait + Sync>(
    db: &C,
    limit: u32,
) -> Result<Vec<ExpiredLease>, Error> {
    let sql = crate::driver::of(db.get_database_backend());
    idem_sql::expired_leases::<SeaOrm>(&mut On(db), sql, limit).await
}

/// Ends the lease of the call in progress under record `id` by hand (`idem release`), fenced
/// ([`idem_sql::release_lease`]): the lease's token goes up by one, as a takeover's would, and
/// the lease ends now. The holder, if it still runs, is refused its next step, renewal and
/// completion ([`Error::LeaseLost`](idem_core::Error::LeaseLost)); the next client retry, or a
/// completer for a resumable call, takes the call over at once from its recorded steps.
/// Returns whether there was a live lease to release. For a holder that hangs (a step
/// awaiting a call that never returns): [`stuck_leases`] lists such calls.
pub async fn release_lease<C: ConnectionTrait + Sync>(db: &C, id: &[u8]) -> Result<bool, Error> {
    let sql = crate::driver::of(db.get_database_backend());
    idem_sql::release_lease::<SeaOrm>(&mut On(db), sql, id).await
}

/// Lists up to `limit` live leases held for longer than `held_for`, longest held first.
pub async fn stuck_leases<C: ConnectionTrait + Sync>(
    db: &C,
    held_for: Duration,
    limit: u32,
) -> Result<Vec<StuckLease>, Error> {
    let sql = crate::driver::of(db.get_database_backend());
    idem_sql::stuck_leases::<SeaOrm>(&mut On(db), sql, held_for, limit).await
}
