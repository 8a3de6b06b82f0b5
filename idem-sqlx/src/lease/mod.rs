//! Lease mode on a sqlx pool: the lease is the ledger row itself (state in progress, `owner`
//! the fencing token, `expires_at_ms` the lease end while in progress), and recovery points
//! live in the steps table. The claim, the fence, the steps and the completion are
//! idem-sql's ([`idem_sql::claim_lease`] and its neighbours), the same the SeaORM lease store
//! runs; this file begins, commits and binds.

mod operator;

pub use operator::{expired_leases, release_lease, stuck_leases};

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use idem_core::lease::{LeaseHandle, OpenPhase};
use idem_core::ledger::ids::random_token;
use idem_core::{
    BoxFuture, Error, LeaseClaim, LeaseStore, RecordStatus, Request, Ticket, detached,
};
use idem_sql::{Bound, Dialect, LeaseStep, LeaseWrite, LeaseWritten, Sql, SqlStore};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::{Pool, Transaction};

use crate::atomic::{connection_wait, within};
use crate::driver::Backend;
use crate::driver::error::{failed, store_error};
use crate::driver::port::{Sqlx, on};

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
    /// The features written once for every driver (the completer's) run on it.
    store: SqlStore<Sqlx<DB>>,
}

impl<DB: Backend> SqlxLeaseStore<DB> {
    /// A lease store on `pool` (cloning a pool shares it).
    pub fn new(pool: Pool<DB>) -> Self {
        SqlxLeaseStore {
            store: SqlStore::new(Sqlx::new(pool)),
        }
    }

    /// The pool the store runs on.
    pub(crate) fn pool(&self) -> &Pool<DB> {
        self.store.driver().pool()
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

fn lost() -> Error {
    // The scope is not known here; the engine's span carries it.
    Error::LeaseLost {
        scope: String::new(),
    }
}

/// The statements of `pool`'s server, and whether they run named
/// ([`crate::through_transaction_pooler`]).
pub(crate) async fn statements<DB: Backend>(pool: &Pool<DB>) -> (&'static Sql, bool) {
    (
        Sql::of(DB::flavour(pool).await),
        crate::driver::pooler::named(pool),
    )
}

/// A connection of `pool`, auto-committed, and the statements of its server; `doing` names
/// an acquire that fails.
pub(crate) async fn acquire<DB: Backend>(
    pool: &Pool<DB>,
    doing: &'static str,
) -> Result<(sqlx::pool::PoolConnection<DB>, &'static Sql, bool), Error> {
    let (sql, named) = statements(pool).await;
    let conn = pool.acquire().await.map_err(|e| store_error(doing, e))?;
    Ok((conn, sql, named))
}

/// The lease claim ([`idem_sql::claim_lease`]): first as one auto-committed statement where
/// it can settle the answer (one round trip, one commit), else in a transaction under the
/// row's lock.
async fn claim<DB: Backend>(
    pool: Pool<DB>,
    step: LeaseStep,
    wait: Option<Duration>,
) -> Result<LeaseClaim, Error> {
    let doing = "claiming a lease";
    let (d, named) = statements(&pool).await;
    if step.claims_at_once(d) {
        let (claim, read) = step.at_once(d);
        let store = SqlStore::new(Sqlx::new(pool.clone()));
        let write = store.write_lease(LeaseWrite::Claim { claim, read });
        let written = within(wait, async { Ok(write.await) })
            .await
            .map_err(|e| store_error(doing, e))?
            .map_err(|e| failed((doing, e)))?;
        if let LeaseWritten::Row(row) = written
            && let Some(answer) = step.answer_at_once(row)
        {
            return Ok(answer);
        }
    }
    let mut tx = within(wait, crate::driver::port::begin_claim(&pool))
        .await
        .map_err(|e| store_error(doing, e))?;
    let answer = idem_sql::claim_lease(&mut on::<DB>(&mut tx, named), d, &step)
        .await
        .map_err(failed)?;
    tx.commit().await.map_err(|e| store_error(doing, e))?;
    Ok(answer)
}

/// Runs the fenced `update` on its own and answers whether it changed the held record.
async fn fenced_update<DB: Backend>(
    pool: Pool<DB>,
    update: Bound<'static>,
    doing: &'static str,
) -> Result<bool, Error> {
    SqlStore::new(Sqlx::new(pool))
        .write_lease(LeaseWrite::Update(update))
        .await
        .map(|written| matches!(written, LeaseWritten::Changed(1)))
        .map_err(|e| failed((doing, e)))
}

/// Records a lease-mode call's outcome in `tx` if `ticket` still holds the lease
/// ([`idem_sql::complete`]), and commits.
async fn record_completion<DB: Backend>(
    mut tx: Transaction<'static, DB>,
    (d, named): (&'static Sql, bool),
    ticket: Ticket,
    (status, payload, ttl): (RecordStatus, Vec<u8>, Duration),
    resumable: bool,
) -> Result<(), Error> {
    let mut conn = on::<DB>(&mut tx, named);
    let held = idem_sql::complete(&mut conn, d, &ticket, status, payload, ttl, resumable)
        .await
        .map_err(failed)?;
    if !held {
        return Err(lost());
    }
    tx.commit()
        .await
        .map_err(|e| store_error("recording the result", e))
}

impl<DB: Backend> LeaseStore for SqlxLeaseStore<DB> {
    fn claim_lease<'a>(
        &'a self,
        req: &'a Request,
        lease: Duration,
    ) -> BoxFuture<'a, Result<LeaseClaim, Error>> {
        // SQLite: an atomic body in this task holds the database's one write lock, which the
        // lease's claim would wait for. (Elsewhere the lease commits on its own, as it must.)
        if DB::DIALECT == Dialect::Sqlite
            && let Err(e) = idem_core::atomic::lease_outside_open_sqlite_claim(
                Some(crate::driver::pooler::identity(self.pool())),
                req.scope(),
            )
        {
            return Box::pin(async move { Err(e) });
        }
        let step = LeaseStep::of(req, random_token(), lease);
        let wait = connection_wait(self.pool(), req.concurrency());
        Box::pin(detached(claim(self.pool().clone(), step, wait)))
    }

    fn renew<'a>(
        &'a self,
        ticket: &'a Ticket,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), Error>> {
        let (pool, ticket) = (self.pool().clone(), *ticket);
        Box::pin(detached(async move {
            let (d, _) = statements(&pool).await;
            let renew = d
                .lease
                .renew(&ticket.id, ticket.token, idem_sql::millis(lease));
            if fenced_update(pool, renew, "renewing a lease").await? {
                Ok(())
            } else {
                Err(lost())
            }
        }))
    }

    fn record_step<'a>(
        &'a self,
        ticket: &'a Ticket,
        name: &'a str,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<(), Error>> {
        let (pool, ticket, name, payload) = (
            self.pool().clone(),
            *ticket,
            name.to_owned(),
            payload.to_vec(),
        );
        Box::pin(detached(async move {
            let doing = "recording a step";
            let (d, named) = statements(&pool).await;
            let mut tx = crate::driver::port::begin_claim(&pool)
                .await
                .map_err(|e| store_error(doing, e))?;
            let mut conn = on::<DB>(&mut tx, named);
            let held = idem_sql::record_step(&mut conn, d, &ticket, &name, &payload)
                .await
                .map_err(failed)?;
            if !held {
                return Err(lost());
            }
            tx.commit().await.map_err(|e| store_error(doing, e))
        }))
    }

    fn complete<'a>(
        &'a self,
        ticket: &'a Ticket,
        req: &'a Request,
        status: RecordStatus,
        payload: &'a [u8],
        forget_steps: bool,
    ) -> BoxFuture<'a, Result<(), Error>> {
        let (pool, ticket, payload, ttl) =
            (self.pool().clone(), *ticket, payload.to_vec(), req.ttl());
        let resumable = req.stored_args().is_some();
        Box::pin(detached(async move {
            let doing = "recording the result";
            let statements = statements(&pool).await;
            if !forget_steps && !resumable {
                // Nothing else to delete: the fenced update alone, outside a transaction.
                let update = idem_sql::completion(statements.0, &ticket, status, payload, ttl);
                return if fenced_update(pool, update, doing).await? {
                    Ok(())
                } else {
                    Err(lost())
                };
            }
            let tx = crate::driver::port::begin_claim(&pool)
                .await
                .map_err(|e| store_error(doing, e))?;
            let outcome = (status, payload, ttl);
            record_completion(tx, statements, ticket, outcome, resumable).await
        }))
    }

    fn release_lease<'a>(&'a self, ticket: &'a Ticket) -> BoxFuture<'a, Result<(), Error>> {
        let (pool, ticket) = (self.pool().clone(), *ticket);
        Box::pin(detached(async move {
            let (d, _) = statements(&pool).await;
            let release = d.lease.release(&ticket.id, ticket.token);
            fenced_update(pool, release, "ending a lease")
                .await
                .map(drop)
        }))
    }
}

/// A final phase's transaction kept open for the call's result, its statements, and whether
/// the call is resumable.
struct OpenFinalPhase<DB: Backend> {
    tx: Transaction<'static, DB>,
    statements: (&'static Sql, bool),
    resumable: bool,
}

impl<DB: Backend> OpenPhase for OpenFinalPhase<DB> {
    fn complete(
        self: Box<Self>,
        ticket: Ticket,
        status: RecordStatus,
        payload: Vec<u8>,
        ttl: Duration,
    ) -> BoxFuture<'static, Result<(), Error>> {
        let this = *self;
        Box::pin(detached(record_completion(
            this.tx,
            this.statements,
            ticket,
            (status, payload, ttl),
            this.resumable,
        )))
    }

    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<(), Error>> {
        Box::pin(detached(async move {
            self.tx
                .commit()
                .await
                .map_err(|e| store_error("committing the final phase", e))
        }))
    }
}

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
    final_phase(pool, name, writes, "idem::sqlx::final_step", false).await
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
    final_phase(pool, name, writes, "idem::sqlx::finish", true).await
}

/// A final phase; with `keep_open` its transaction waits for the call's result.
async fn final_phase<DB, T, E, F>(
    pool: &Pool<DB>,
    name: &str,
    writes: F,
    what: &str,
    keep_open: bool,
) -> Result<T, E>
where
    DB: Backend,
    T: Serialize + DeserializeOwned,
    E: From<Error>,
    F: for<'t> FnOnce(
        &'t mut DB::Connection,
    ) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>,
{
    let begin = |e| store_error("beginning the final phase", e);
    let committing = |e| store_error("committing the final phase", e);
    if idem_core::testing::is_disabled() {
        // Switched off, the call's lease is in memory: the writes alone, in a transaction.
        let mut tx = crate::driver::port::begin_claim(pool)
            .await
            .map_err(begin)?;
        let value = writes(&mut tx).await?;
        tx.commit().await.map_err(committing)?;
        return Ok(value);
    }
    let lease = LeaseHandle::current(what)?;
    if let Some(value) = lease.recorded::<T>(name)? {
        return Ok(value);
    }
    lease.commit_open_phase().await?;
    if lease.is_lost() {
        return Err(lease.lose().into());
    }
    let ticket = lease.ticket();
    let (d, named) = statements(pool).await;
    let mut tx = crate::driver::port::begin_claim(pool)
        .await
        .map_err(|e| lease.store_failed(begin(e)))?;
    let mut conn = on::<DB>(&mut tx, named);
    // Every failure on the phase's connection goes through `store_failed`: a server that went
    // away under the phase makes the call release its lease behind its answer.
    match idem_sql::fence(&mut conn, d, &ticket).await {
        Ok(true) => {}
        Ok(false) => {
            let _ = tx.rollback().await;
            return Err(lease.lose().into());
        }
        Err(e) => {
            let _ = tx.rollback().await;
            return Err(lease.store_failed(failed(e)).into());
        }
    }
    let value = match writes(&mut tx).await {
        Ok(value) => value,
        Err(e) => {
            // The handler's error says nothing idem can read; a rollback that finds no
            // connection says the server went away.
            if let Err(rollback) = tx.rollback().await {
                lease.store_failed(store_error("rolling back the final phase", rollback));
            }
            return Err(e);
        }
    };
    let payload = lease.encode(&value)?;
    lease.recording_step();
    let mut conn = on::<DB>(&mut tx, named);
    let resumable = lease.is_resumable();
    idem_sql::record_final_step(&mut conn, d, &ticket, name, &payload, resumable)
        .await
        .map_err(|e| lease.store_failed(failed(e)))?;
    if keep_open {
        // The engine records the call's result in this transaction when the handler
        // returns, or commits it alone if the handler does more first.
        lease.keep_open(Box::new(OpenFinalPhase {
            tx,
            statements: (d, named),
            resumable,
        }));
    } else {
        tx.commit()
            .await
            .map_err(|e| lease.store_failed(committing(e)))?;
    }
    lease.note_recorded(name, payload);
    Ok(value)
}
