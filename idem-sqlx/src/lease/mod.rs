//! Lease mode on a sqlx pool: the lease is the ledger row itself (state in progress, `owner`
//! the fencing token, `expires_at_ms` the lease end while in progress), and recovery points
//! live in the steps table. Everything the lease store does is idem-sql's, written once for
//! every driver ([`idem_sql::SqlStore`]: the claim, the fence, the steps, the completion, the
//! final phase); this file names the store and the final phase for sqlx's users.

use std::future::Future;
use std::pin::Pin;

use idem_core::Error;
use idem_sql::{Driver, SqlStore};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::Pool;

use crate::driver::Backend;
use crate::driver::port::{Sqlx, SqlxTx};

/// The ledger in lease mode on a sqlx pool (PostgreSQL, MySQL/MariaDB, SQLite);
/// `#[idempotent(..., lease = "…")]` builds one from the handler's `&PgPool` (`&MySqlPool`,
/// `&SqlitePool`). The ledger and steps tables must exist
/// ([`create_tables`](crate::create_tables) with [`Family::Ledger`](crate::Family::Ledger)
/// and [`Family::Lease`](crate::Family::Lease), or `idem schema` in your migrations).
///
/// The lease commits at once and outlives any transaction: the body runs on the pool, its
/// [`idem::step`](idem_core::lease::step)s are recorded fenced by the lease's token, and its
/// database writes go in [`final_step`] or [`finish`], which record them with a step in one
/// fenced transaction.
pub struct SqlxLeaseStore<DB: Backend> {
    /// Everything the store does is written once for every driver, on it.
    store: SqlStore<Sqlx<DB>>,
}

impl<DB: Backend> SqlxLeaseStore<DB> {
    /// A lease store on `pool` (cloning a pool shares it).
    pub fn new(pool: Pool<DB>) -> Self {
        SqlxLeaseStore {
            store: SqlStore::new(Sqlx::new(pool)),
        }
    }

    /// The store written once for every driver.
    pub(crate) fn generic(&self) -> &SqlStore<Sqlx<DB>> {
        &self.store
    }
}

impl<DB: Backend> Clone for SqlxLeaseStore<DB> {
    fn clone(&self) -> Self {
        SqlxLeaseStore {
            store: self.store.clone(),
        }
    }
}

impl<DB: Backend> std::fmt::Debug for SqlxLeaseStore<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxLeaseStore")
            .field("database", &DB::NAME)
            .finish_non_exhaustive()
    }
}

idem_sql::lend_store!([DB: Backend] SqlxLeaseStore<DB>);

/// The final phase of a lease-mode handler on a sqlx pool: runs `writes` in one transaction
/// that also checks the lease and records the step `name`, so the database effects (the
/// payment row, a state change) commit exactly once even across takeovers. A takeover that
/// finds the step recorded returns its value without running `writes` again. A holder that
/// lost its lease gets [`Error::LeaseLost`] and its writes roll back.
///
/// When the phase is the handler's last work, [`finish`] saves a write transaction.
///
/// ```text
/// let receipt = idem::sqlx::final_step(db, "record-payment", |tx| Box::pin(async move {
///     sqlx::query("INSERT INTO payments (order_id) VALUES ($1)").bind(id).execute(&mut *tx).await?;
///     Ok(receipt)
/// })).await?;
/// ```
pub async fn final_step<DB, T, E, F>(pool: &Pool<DB>, name: &str, writes: F) -> Result<T, E>
where
    DB: Backend,
    T: Serialize + DeserializeOwned,
    E: From<Error>,
    F: for<'t> FnOnce(
        &'t mut DB::Connection,
    ) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>,
{
    let store = SqlStore::<Sqlx<DB>>::new(pool);
    // The handler's writes get the transaction's connection, as sqlx's executors take it.
    idem_sql::final_phase(
        &store,
        name,
        "idem::sqlx::final_step",
        false,
        |tx: &mut SqlxTx<DB>| writes(Sqlx::body(tx)),
    )
    .await
}

/// [`final_step`] as the handler's last work: the phase's transaction stays open until the
/// handler returns, and the call's result is recorded in it, so a call takes three write
/// transactions (claim, steps, this) instead of four. Return its value (or something made
/// from it, with no database work in between).
///
/// Its writes become visible to other connections when the handler returns, together with
/// the recorded result: read them back inside `writes`, not after. Database work after it
/// waits at most 50 ms, after which the phase commits alone (and the result is recorded in a
/// transaction of its own, as after [`final_step`]).
pub async fn finish<DB, T, E, F>(pool: &Pool<DB>, name: &str, writes: F) -> Result<T, E>
where
    DB: Backend,
    T: Serialize + DeserializeOwned,
    E: From<Error>,
    F: for<'t> FnOnce(
        &'t mut DB::Connection,
    ) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>,
{
    let store = SqlStore::<Sqlx<DB>>::new(pool);
    // The handler's writes get the transaction's connection, as sqlx's executors take it.
    idem_sql::final_phase(
        &store,
        name,
        "idem::sqlx::finish",
        true,
        |tx: &mut SqlxTx<DB>| writes(Sqlx::body(tx)),
    )
    .await
}
