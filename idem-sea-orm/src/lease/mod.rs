//! Lease mode on the SeaORM ledger: the lease is the ledger row itself (state in progress,
//! `owner` = the fencing token, `expires_at_ms` = the lease end while in progress), and
//! recovery points live in the steps table ([`STEPS_TABLE`](crate::STEPS_TABLE)). Every write
//! of a holder locks the ledger row and checks its token first, so a holder whose lease was
//! taken over cannot record anything.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use idem_core::lease::{LeaseHandle, OpenPhase};
use idem_core::ledger::ids::random_token;
use idem_core::{BoxFuture, Error, LeaseClaim, LeaseStore, RecordStatus, Request, Ticket};
pub use idem_sql::{ExpiredLease, StuckLease};
use sea_orm::{ConnectionTrait, DatabaseConnection, DatabaseTransaction};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::atomic::{begin_within, detached, list_rows, within_connection_wait};
use crate::driver::error::{failed, store_error};
use crate::driver::port::{SeaOrm, connection_wait, on};
use crate::driver::{Bound, Sql, millis, statement};
use idem_sql::{LeaseStep, SqlStore};
use idem_sql::{LeaseWrite, LeaseWritten};

/// The ledger in lease mode on a SeaORM connection; `#[idempotent(..., lease = "…")]` builds
/// one from the handler's connection.
#[derive(Debug, Clone)]
pub struct SeaOrmLeaseStore {
    /// The features written once for every driver (the completer's) run on it.
    store: SqlStore<SeaOrm>,
}

impl SeaOrmLeaseStore {
    /// A lease store on `db` (cloning a connection shares its pool).
    pub fn new(db: DatabaseConnection) -> Self {
        Self {
            store: SqlStore::new(SeaOrm::new(db)),
        }
    }

    /// The connection.
    pub(crate) fn db(&self) -> &DatabaseConnection {
        self.store.driver().db()
    }

    /// The store written once for every driver.
    pub(crate) fn generic(&self) -> &SqlStore<SeaOrm> {
        &self.store
    }
}

/// Locks the ledger row of `ticket` in `tx` and checks the ticket still holds it
/// ([`idem_sql::fence`]).
async fn fence(tx: &DatabaseTransaction, sql: &'static Sql, ticket: &Ticket) -> Result<(), Error> {
    let holds = idem_sql::fence(&mut on(tx), sql, ticket)
        .await
        .map_err(failed)?;
    if holds { Ok(()) } else { Err(lost()) }
}

/// A lease claim as one statement outside a transaction (one round trip, one commit): the
/// insert of a new key, or the committed row it ran into when that row settles the answer
/// ([`LeaseStep::answer_at_once`]). `None` when it does not (an ended lease or record to take
/// over, a row purged in between): then [`claim`] decides under the row's lock. On SQLite the
/// statement commits with the group of its concurrent writes (`SqlStore::write_lease`).
async fn claim_at_once(
    db: &DatabaseConnection,
    d: &'static Sql,
    step: &LeaseStep,
) -> Result<Option<LeaseClaim>, Error> {
    let doing = "claiming a lease";
    let (claim, read) = step.at_once(d);
    let store = SqlStore::new(SeaOrm::new(db.clone()));
    let write = store.write_lease(LeaseWrite::Claim { claim, read });
    let written = within_connection_wait(db, async { Ok(write.await) })
        .await
        .map_err(|e| store_error(doing, e))?
        .map_err(|e| failed((doing, e)))?;
    let LeaseWritten::Row(row) = written else {
        return Ok(None);
    };
    Ok(step.answer_at_once(row))
}

/// The lease claim ([`idem_sql::claim_lease`]): at once where it can, else in a transaction
/// under the row's lock.
async fn claim(db: DatabaseConnection, step: LeaseStep) -> Result<LeaseClaim, Error> {
    let doing = "claiming a lease";
    let d = within_connection_wait(&db, async { Ok(crate::driver::of_server(&db).await) })
        .await
        .map_err(|e| store_error(doing, e))?;
    if step.claims_at_once(d)
        && let Some(answer) = claim_at_once(&db, d, &step).await?
    {
        return Ok(answer);
    }
    let (tx, _) = begin_within(&db, connection_wait())
        .await
        .map_err(|e| store_error(doing, e))?;
    let answer = idem_sql::claim_lease(&mut on(&tx), d, &step)
        .await
        .map_err(failed)?;
    tx.commit().await.map_err(|e| store_error(doing, e))?;
    Ok(answer)
}

/// Records a lease-mode call's outcome in `tx` if `ticket` still holds the lease
/// ([`idem_sql::complete`]: kept for `ttl` from now, its steps and, for a `resumable` call,
/// its stored call forgotten), and commits.
async fn record_completion(
    (tx, sql): (DatabaseTransaction, &'static Sql),
    ticket: Ticket,
    status: RecordStatus,
    payload: Vec<u8>,
    ttl: Duration,
    resumable: bool,
) -> Result<(), Error> {
    let held = idem_sql::complete(&mut on(&tx), sql, &ticket, status, payload, ttl, resumable)
        .await
        .map_err(failed)?;
    if !held {
        return Err(lost());
    }
    tx.commit()
        .await
        .map_err(|e| store_error("recording the result", e))
}

/// A final phase's transaction kept open for the call's result (P10) with its server's
/// statements, and whether the call is resumable.
struct OpenFinalPhase((DatabaseTransaction, &'static Sql), bool);

impl OpenPhase for OpenFinalPhase {
    fn complete(
        self: Box<Self>,
        ticket: Ticket,
        status: RecordStatus,
        payload: Vec<u8>,
        ttl: Duration,
    ) -> BoxFuture<'static, Result<(), Error>> {
        Box::pin(detached(record_completion(
            self.0, ticket, status, payload, ttl, self.1,
        )))
    }

    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<(), Error>> {
        Box::pin(detached(async move {
            self.0
                .0
                .commit()
                .await
                .map_err(|e| store_error("committing the final phase", e))
        }))
    }
}

/// Runs `update` (binds as given) and reports whether it changed the held record.
async fn fenced_update(
    db: &DatabaseConnection,
    update: Bound<'static>,
    doing: &'static str,
) -> Result<bool, Error> {
    let store = SqlStore::new(SeaOrm::new(db.clone()));
    let write = store.write_lease(LeaseWrite::Update(update));
    let written = within_connection_wait(db, async { Ok(write.await) })
        .await
        .map_err(|e| store_error(doing, e))?
        .map_err(|e| failed((doing, e)))?;
    Ok(matches!(written, LeaseWritten::Changed(1)))
}

fn lost() -> Error {
    // The scope is not known here; the engine's span carries it.
    Error::LeaseLost {
        scope: String::new(),
    }
}

impl LeaseStore for SeaOrmLeaseStore {
    fn claim_lease<'a>(
        &'a self,
        req: &'a Request,
        lease: Duration,
    ) -> BoxFuture<'a, Result<LeaseClaim, Error>> {
        // SQLite: an atomic body in this task holds the database's one write lock, which the
        // lease's claim would wait for. (Elsewhere the lease commits on its own, as it must.)
        if let Err(e) = crate::atomic::outside_open_claim_sqlite(self.db(), req.scope()) {
            return Box::pin(async move { Err(e) });
        }
        let step = claim(self.db().clone(), LeaseStep::of(req, random_token(), lease));
        Box::pin(detached(step))
    }

    fn renew<'a>(
        &'a self,
        ticket: &'a Ticket,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), Error>> {
        let renew = crate::driver::of(self.db().get_database_backend())
            .lease
            .renew(&ticket.id, ticket.token, millis(lease));
        let db = self.db().clone();
        Box::pin(detached(async move {
            if fenced_update(&db, renew, "renewing a lease").await? {
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
        let (db, ticket, name, payload) = (
            self.db().clone(),
            *ticket,
            name.to_owned(),
            payload.to_vec(),
        );
        Box::pin(detached(async move {
            let (tx, sql) = begin_within(&db, connection_wait())
                .await
                .map_err(|e| store_error("recording a step", e))?;
            let held = idem_sql::record_step(&mut on(&tx), sql, &ticket, &name, &payload)
                .await
                .map_err(failed)?;
            if !held {
                return Err(lost());
            }
            tx.commit()
                .await
                .map_err(|e| store_error("recording a step", e))
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
        let (db, ticket, payload, ttl) = (self.db().clone(), *ticket, payload.to_vec(), req.ttl());
        let resumable = req.stored_args().is_some();
        Box::pin(detached(async move {
            if !forget_steps && !resumable {
                // Nothing else to delete: the fenced update alone, outside a transaction.
                let sql = crate::driver::of(db.get_database_backend());
                let update = idem_sql::completion(sql, &ticket, status, payload, ttl);
                return if fenced_update(&db, update, "recording the result").await? {
                    Ok(())
                } else {
                    Err(lost())
                };
            }
            let begun = begin_within(&db, connection_wait())
                .await
                .map_err(|e| store_error("recording the result", e))?;
            record_completion(begun, ticket, status, payload, ttl, resumable).await
        }))
    }

    fn release_lease<'a>(&'a self, ticket: &'a Ticket) -> BoxFuture<'a, Result<(), Error>> {
        let release = crate::driver::of(self.db().get_database_backend())
            .lease
            .release(&ticket.id, ticket.token);
        let db = self.db().clone();
        Box::pin(detached(async move {
            fenced_update(&db, release, "ending a lease")
                .await
                .map(drop)
        }))
    }
}

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

/// A final phase's writes with idem switched off ([`idem_core::testing`]): committed if
/// they succeed, nothing recorded.
async fn unfenced<T, E, F>(db: &DatabaseConnection, writes: F) -> Result<T, E>
where
    E: From<Error>,
    F: for<'t> FnOnce(
        &'t DatabaseTransaction,
    ) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>,
{
    let (tx, _) = begin_within(db, connection_wait())
        .await
        .map_err(|e| store_error("beginning the final phase", e))?;
    let value = writes(&tx).await?;
    tx.commit()
        .await
        .map_err(|e| store_error("committing the final phase", e))?;
    Ok(value)
}

/// A final phase; with `keep_open` its transaction waits for the call's result.
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
    if idem_core::testing::is_disabled() {
        // Switched off, the call's lease is in memory: the writes alone, in a transaction.
        return unfenced(db, writes).await;
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
    let (tx, sql) = begin_within(db, connection_wait())
        .await
        .map_err(|e| lease.store_failed(store_error("beginning the final phase", e)))?;
    // Every failure on the phase's connection goes through `store_failed`: a server that went
    // away under the phase makes the call release its lease behind its answer.
    if let Err(e) = fence(&tx, sql, &ticket).await {
        let _ = tx.rollback().await;
        return Err(if e.kind() == idem_core::ErrorKind::LeaseLost {
            lease.lose()
        } else {
            lease.store_failed(e)
        }
        .into());
    }
    let value = match writes(&tx).await {
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
    idem_sql::record_final_step(
        &mut on(&tx),
        sql,
        &ticket,
        name,
        &payload,
        lease.is_resumable(),
    )
    .await
    .map_err(|e| lease.store_failed(failed(e)))?;
    if keep_open {
        // The engine records the call's result in this transaction when the handler
        // returns, or commits it alone if the handler does more first.
        lease.keep_open(Box::new(OpenFinalPhase((tx, sql), lease.is_resumable())));
    } else {
        tx.commit()
            .await
            .map_err(|e| lease.store_failed(store_error("committing the final phase", e)))?;
    }
    lease.note_recorded(name, payload);
    Ok(value)
}

/// Lists up to `limit` leases that ended without their call finishing, oldest first.
pub async fn expired_leases<C: ConnectionTrait>(
    db: &C,
    limit: u32,
) -> Result<Vec<ExpiredLease>, Error> {
    let calls_table = crate::inspect::has_calls_table(db).await?;
    let list = crate::driver::of(db.get_database_backend())
        .lease
        .expired_leases(i64::from(limit), calls_table);
    list_rows(db, list, "listing expired leases", ExpiredLease::from_row).await
}

/// Ends the lease of the call in progress under record `id` by hand (`idem release`), fenced:
/// the lease's token goes up by one, as a takeover's would, and the lease ends now. The holder,
/// if it still runs, is refused its next step, renewal and completion
/// ([`Error::LeaseLost`](idem_core::Error::LeaseLost)); the next client retry, or a completer
/// for a resumable call, takes the call over at once from its recorded steps. Returns whether
/// there was a live lease to release (`false`: no record, one that ended, or a lease that
/// already ended: the next retry takes that one over anyway).
///
/// For a holder that hangs (a step awaiting a call that never returns): its renewals keep the
/// lease alive for ever otherwise. [`stuck_leases`] lists such calls.
pub async fn release_lease<C: ConnectionTrait>(db: &C, id: &[u8]) -> Result<bool, Error> {
    let sql = crate::driver::of(db.get_database_backend());
    let released = db
        .execute_raw(statement(sql, sql.lease.release_by_hand(id)))
        .await
        .map_err(|e| store_error("releasing a lease", e))?;
    Ok(released.rows_affected() > 0)
}

/// Lists up to `limit` live leases held for longer than `held_for`, longest held first.
pub async fn stuck_leases<C: ConnectionTrait>(
    db: &C,
    held_for: Duration,
    limit: u32,
) -> Result<Vec<StuckLease>, Error> {
    let sql = crate::driver::of(db.get_database_backend());
    let calls_table = crate::inspect::has_calls_table(db).await?;
    let list = sql
        .lease
        .stuck_leases(millis(held_for), i64::from(limit), calls_table);
    list_rows(db, list, "listing stuck leases", StuckLease::from_row).await
}
