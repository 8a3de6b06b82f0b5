//! Lease mode on the SeaORM ledger: the lease is the ledger row itself (state in progress,
//! `owner` = the fencing token, `expires_at_ms` = the lease end while in progress), and
//! recovery points live in the steps table ([`STEPS_TABLE`](crate::STEPS_TABLE)). Every write
//! of a holder locks the ledger row and checks its token first, so a holder whose lease was
//! taken over cannot record anything. All of it is idem-sql's, written once for every driver
//! ([`idem_sql::SqlStore`]); this file names the store, the final phase and the operator's
//! lists for SeaORM's users.

use std::future::Future;
use std::pin::Pin;

use idem_core::Error;
use idem_sql::{Driver, SqlStore};
use sea_orm::{DatabaseConnection, DatabaseTransaction};
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
    let store = SqlStore::<SeaOrm>::new(db);
    // The handler's writes get the phase's `DatabaseTransaction`.
    idem_sql::final_phase(
        &store,
        name,
        "idem::sea_orm::final_step",
        false,
        |tx: &mut On<DatabaseTransaction>| writes(SeaOrm::body(tx)),
    )
    .await
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
    let store = SqlStore::<SeaOrm>::new(db);
    // The handler's writes get the phase's `DatabaseTransaction`.
    idem_sql::final_phase(
        &store,
        name,
        "idem::sea_orm::finish",
        true,
        |tx: &mut On<DatabaseTransaction>| writes(SeaOrm::body(tx)),
    )
    .await
}
