//! The SeaORM [`Store`]: the claim, record and release steps on a [`DatabaseConnection`].

use std::future::Future;
use std::time::Duration;

use idem_core::ledger::ids::random_token;
use idem_core::{Claim, Concurrency, Error, RecordStatus, Request, Store};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, TransactionTrait,
};

use crate::driver::error::{Failure, classify, failed, store_error};
use crate::driver::port::{connection_wait, on};
use crate::driver::{Bound, NewRecord, Sql, fetch_each, fetch_first, statement};
use idem_sql::{Claimed, Fault};

/// The ledger on a SeaORM connection (SQLite, PostgreSQL, MySQL/MariaDB).
///
/// `#[idempotent]` builds one from the handler's `&DatabaseConnection`; you rarely name it.
/// The handler's body runs in the claim's [`DatabaseTransaction`], so the claim, the body's
/// writes and the recorded result commit together or not at all.
///
/// Built on a transaction ([`SeaOrmStore::nested`]: an `#[idempotent]` function called with
/// another one's body `db`), the claim is a savepoint inside that transaction: the inner
/// call's claim, writes and record commit with the outer call, or not at all.
#[derive(Debug, Clone, Copy)]
pub struct SeaOrmStore<'c> {
    db: Conn<'c>,
}

/// Where a store's claims begin: a new transaction on the pool, or a savepoint.
#[derive(Debug, Clone, Copy)]
enum Conn<'c> {
    Pool(&'c DatabaseConnection),
    Tx(&'c DatabaseTransaction),
}

impl<'c> SeaOrmStore<'c> {
    /// A store on `db`. The ledger table must exist ([`crate::create_tables`]).
    pub fn new(db: &'c DatabaseConnection) -> Self {
        Self { db: Conn::Pool(db) }
    }

    /// A store whose claims are savepoints inside `tx` (the body of an outer call): they
    /// commit when `tx` does. Its records are not shared with this process's duplicates
    /// before then (no single flight).
    pub fn nested(tx: &'c DatabaseTransaction) -> Self {
        Self { db: Conn::Tx(tx) }
    }

    fn backend(&self) -> DbBackend {
        match self.db {
            Conn::Pool(db) => db.get_database_backend(),
            Conn::Tx(tx) => tx.get_database_backend(),
        }
    }
}

/// Refuses a claim through the pool `db` while an atomic-mode body runs in this task on the
/// same pool: the call would commit on its own instead of with the body (PostgreSQL, MySQL),
/// or wait for the body's own write lock (SQLite). `what` names the call's kind.
pub(crate) fn outside_open_claim(db: &DatabaseConnection, what: &str) -> Result<(), Error> {
    if !idem_core::atomic::inside_open_claim(SeaOrmStore::new(db).ledger_identity()) {
        return Ok(()); // no open claim, or one on another database
    }
    Err(Error::Store {
        message: format!(
            "{what} was called through the pool (`&DatabaseConnection`) inside the body of another `#[idempotent]` call, whose transaction is open: it would commit on its own, or wait for the body's own lock; pass the body's `db` (its `&DatabaseTransaction`) so the call commits with the outer one"
        ),
        source: None,
    })
}

/// Runs `sql`, which binds a row limit, and reads each row it returns with `read`; an error
/// says it happened while `doing`.
pub(crate) async fn list_rows<C: ConnectionTrait, T>(
    db: &C,
    list: Bound<'_>,
    doing: &str,
    read: fn(idem_sql::Row) -> Result<T, idem_sql::Decode>,
) -> Result<Vec<T>, Error> {
    let d = crate::driver::of(db.get_database_backend());
    fetch_each(db, d, list, read)
        .await
        .map_err(|e| store_error(doing, e))
}

/// A key claimed on the SeaORM ledger: the claim's transaction (the handler body runs in it)
/// and the owner token its record is written under.
#[derive(Debug)]
pub struct ClaimedTx {
    /// A nested claim's body runs in a savepoint of its own, so a final error can undo the
    /// body's writes without a named savepoint (MySQL would replace the outer call's).
    body: Option<DatabaseTransaction>,
    tx: DatabaseTransaction,
    owner: i64,
    /// The statements of the server the claim runs on (its MySQL family's claim).
    sql: &'static Sql,
}

/// Begins a claim's transaction, waiting at most `wait` for a connection (and, the first time
/// on a MySQL server, for its answer to which family it is), with every statement of its
/// server.
pub(crate) async fn begin_within(
    db: &DatabaseConnection,
    wait: Duration,
) -> Result<(DatabaseTransaction, &'static Sql), DbErr> {
    bounded(db, wait, async {
        let sql = crate::driver::of_server(db).await;
        Ok((begin(db).await?, sql))
    })
    .await
}

/// `work`, failing as a connection timeout after `wait`. SQLite is not bounded: an embedded
/// database cannot go away, and its one connection is queued for under load.
async fn bounded<T>(
    db: &DatabaseConnection,
    wait: Duration,
    work: impl Future<Output = Result<T, DbErr>>,
) -> Result<T, DbErr> {
    if db.get_database_backend() == DbBackend::Sqlite {
        return work.await;
    }
    tokio::time::timeout(wait, work)
        .await
        .unwrap_or(Err(DbErr::ConnectionAcquire(
            sea_orm::ConnAcquireErr::Timeout,
        )))
}

/// Begins a claim's (or a lease write's, a final phase's) transaction on `db`: idem-sql's
/// [`Begin::Write`](idem_sql::Begin::Write), which takes SQLite's write lock up front.
pub(crate) async fn begin(db: &DatabaseConnection) -> Result<DatabaseTransaction, DbErr> {
    crate::driver::port::begin(db, idem_sql::Begin::Write).await
}

use sea_orm::DbErr;

/// A row of the ledger, as the claim reads it back.
pub(crate) use idem_sql::ClaimRow as Row;

pub(crate) use idem_core::detached;

/// The claim's statement values and decisions, owned: a claim runs to completion even when
/// its caller stops waiting ([`detached`]), so it cannot borrow the request.
#[derive(Clone)]
struct ClaimStep {
    /// The row, `reject` and `savepoint` ([`idem_sql::claim`]).
    claim: idem_sql::ClaimStep,
    /// The longest wait for a connection.
    connection_wait: Duration,
}

async fn claim_step(db: DatabaseConnection, step: ClaimStep) -> Result<Claim<ClaimedTx>, Error> {
    // A conflict (InnoDB can deadlock two waiters for a key whose holder rolled back; Galera
    // certifies at COMMIT) is returned as such: the engine runs the call again.
    try_claim(&db, &step).await.map_err(failed)
}

/// One claim attempt; an error says what it was doing.
async fn try_claim(
    db: &DatabaseConnection,
    step: &ClaimStep,
) -> Result<Claim<ClaimedTx>, (&'static str, Fault<DbErr>)> {
    let (tx, sql) = begin_within(db, step.connection_wait)
        .await
        .map_err(|e| ("beginning the claim transaction", Fault::Db(e)))?;
    claim_in(tx, sql, &step.claim).await
}

/// A nested claim: a savepoint in the outer call's transaction, then the claim as usual. The
/// body gets a savepoint of its own when a final error may need to undo its writes.
async fn try_claim_nested(
    outer: &DatabaseTransaction,
    step: &ClaimStep,
) -> Result<Claim<ClaimedTx>, (&'static str, Fault<DbErr>)> {
    let tx = outer
        .begin()
        .await
        .map_err(|e| ("beginning the nested claim's savepoint", Fault::Db(e)))?;
    let sql = Sql::of(crate::driver::flavour::of_transaction(&tx).await);
    let step_in = idem_sql::ClaimStep {
        savepoint: false,
        ..step.claim.clone()
    };
    match claim_in(tx, sql, &step_in).await? {
        Claim::Execute(mut claimed) if step.claim.savepoint => {
            let body = claimed
                .tx
                .begin()
                .await
                .map_err(|e| ("taking the claim savepoint", Fault::Db(e)))?;
            claimed.body = Some(body);
            Ok(Claim::Execute(claimed))
        }
        claim => Ok(claim),
    }
}

/// The claim ([`idem_sql::claim`]) in `tx`, which has just begun, and the end of `tx` its
/// decision asks for.
async fn claim_in(
    tx: DatabaseTransaction,
    sql: &'static Sql,
    step: &idem_sql::ClaimStep,
) -> Result<Claim<ClaimedTx>, (&'static str, Fault<DbErr>)> {
    match idem_sql::claim(&mut on(&tx), sql, step).await? {
        Claimed::Execute => Ok(Claim::Execute(ClaimedTx {
            body: None,
            tx,
            owner: step.row.owner,
            sql,
        })),
        Claimed::Live(row) => {
            end_unwritten(tx);
            live_record(row)
        }
        Claimed::LiveLocked(row) => {
            end_locked(tx, step).await;
            live_record(row)
        }
        Claimed::InFlight => {
            end_unwritten(tx);
            Ok(Claim::InFlight)
        }
    }
}

/// Ends a claim transaction that wrote nothing but holds the key's row lock (MySQL's claim
/// locks the row it runs into). Under `reject` it rolls back before answering: a client's
/// next call for the key, on another pooled connection, must not meet this call's lock and be
/// told "in flight" (a lock wait of 0 s). Otherwise it is dropped ([`end_unwritten`]); a
/// waiting claim waits the moment it takes.
async fn end_locked(tx: DatabaseTransaction, step: &idem_sql::ClaimStep) {
    if step.reject && tx.get_database_backend() == DbBackend::MySql {
        let _ = tx.rollback().await;
    } else {
        end_unwritten(tx);
    }
}

/// Ends a claim transaction that wrote nothing, without waiting for it. Dropping it queues the
/// rollback on its connection (sqlx's `start_rollback`): the rollback runs before the
/// connection serves anyone else, and on PostgreSQL and MySQL it travels with the pool's
/// release check instead of costing the caller a round trip of its own.
fn end_unwritten(tx: DatabaseTransaction) {
    drop(tx);
}

/// What a live record found by the claim answers.
fn live_record(row: Row) -> Result<Claim<ClaimedTx>, (&'static str, Fault<DbErr>)> {
    row.answer().ok_or_else(|| {
        let unknown = "the ledger row has an unknown state (written by a newer version of idem?)";
        (
            "reading the claimed key",
            Fault::Undecodable(unknown.to_owned()),
        )
    })
}

async fn record_step(
    body: Option<DatabaseTransaction>,
    tx: DatabaseTransaction,
    record: Bound<'static>,
    undo_body: bool,
) -> Result<(), Error> {
    let d = crate::driver::of(tx.get_database_backend());
    let undone = match body {
        Some(body) if undo_body => body.rollback().await,
        Some(body) => body.commit().await,
        None if undo_body => tx
            .execute_unprepared(&d.ledger.rollback_to_savepoint().sql)
            .await
            .map(drop),
        None => Ok(()),
    };
    undone.map_err(|e| store_error("rolling back the handler's writes", e))?;
    let updated = tx
        .execute_raw(statement(d, record))
        .await
        .map_err(|e| store_error("recording the result", e))?;
    if updated.rows_affected() != 1 {
        return Err(idem_sql::claim_lost());
    }
    tx.commit()
        .await
        .map_err(|e| store_error("committing the result", e))
}

impl Store for SeaOrmStore<'_> {
    type Tx<'t> = &'t DatabaseTransaction;
    type Claimed = ClaimedTx;

    fn tx(claimed: &mut ClaimedTx) -> &DatabaseTransaction {
        claimed.body.as_ref().unwrap_or(&claimed.tx)
    }

    async fn claim(&self, req: &Request) -> Result<Claim<ClaimedTx>, Error> {
        if let Conn::Pool(db) = self.db {
            outside_open_claim(db, &format!("`{}`", req.scope()))?;
        }
        let owner = random_token();
        let step = ClaimStep {
            claim: idem_sql::ClaimStep {
                row: NewRecord::of(req, owner, req.ttl()),
                reject: req.concurrency() == Concurrency::Reject,
                savepoint: req.savepoint(),
            },
            connection_wait: req.concurrency().connection_wait(connection_wait()),
        };
        match self.db {
            Conn::Pool(db) => detached(claim_step(db.clone(), step)).await,
            // Not detached: the outer transaction is borrowed, and a caller that stops
            // waiting drops the outer call with it.
            Conn::Tx(outer) => try_claim_nested(outer, &step).await.map_err(failed),
        }
    }

    async fn record(
        &self,
        ClaimedTx {
            body, tx, owner, ..
        }: ClaimedTx,
        req: &Request,
        status: RecordStatus,
        payload: &[u8],
    ) -> Result<(), Error> {
        // Where the claim wrote nothing (SQLite), the record writes the whole row.
        let row = NewRecord::of(req, owner, req.ttl());
        let values = crate::driver::of(self.backend())
            .ledger
            .record(&row, status.code(), payload);
        // A final error keeps only the recorded error: back to the claim's savepoint first.
        let undo_body = status == RecordStatus::Failed;
        match self.db {
            Conn::Pool(_) => detached(record_step(body, tx, values, undo_body)).await,
            Conn::Tx(_) => record_step(body, tx, values, undo_body).await,
        }
    }

    async fn begin(&self) -> Result<ClaimedTx, Error> {
        let sql = crate::driver::of(self.backend());
        let tx = match self.db {
            Conn::Pool(db) => {
                outside_open_claim(db, "a call run with idem switched off")?;
                begin(db).await
            }
            Conn::Tx(outer) => outer.begin().await,
        };
        Ok(ClaimedTx {
            body: None,
            tx: tx.map_err(|e| store_error("beginning the handler's transaction", e))?,
            owner: 0,
            // A call with idem switched off claims nothing.
            sql,
        })
    }

    async fn commit(&self, ClaimedTx { body, tx, .. }: ClaimedTx) -> Result<(), Error> {
        if let Some(body) = body {
            body.commit()
                .await
                .map_err(|e| store_error("committing the handler's writes", e))?;
        }
        tx.commit()
            .await
            .map_err(|e| store_error("committing the handler's writes", e))
    }

    fn ledger_identity(&self) -> Option<usize> {
        // A nested claim's record is seen by others only when the outer call commits: its
        // duplicates in this process cannot wait for it in memory.
        let Conn::Pool(db) = self.db else {
            return None;
        };
        crate::driver::pool_identity(db)
    }

    async fn aborted(&self, claimed: &mut ClaimedTx, req: &Request) -> bool {
        // MySQL and MariaDB roll a deadlock victim's (or a Galera brute-force abort's) whole
        // transaction back, and other statement errors only the statement: the claim's own
        // uncommitted row is gone exactly when the transaction is. PostgreSQL aborts the
        // transaction on any error and SQLite's writers never conflict: no question there.
        let backend = claimed.tx.get_database_backend();
        if backend != DbBackend::MySql {
            return false;
        }
        let d = claimed.sql;
        let read = fetch_first(
            &claimed.tx,
            d,
            d.ledger.read_locked(req.id()),
            Row::from_row,
        )
        .await;
        match read {
            Ok(Some(row)) => row.owner != claimed.owner,
            Ok(None) => true,
            Err(e) => classify(&e) == Failure::Transient,
        }
    }

    async fn release(&self, ClaimedTx { body, tx, .. }: ClaimedTx) -> Result<(), Error> {
        let rollback = async move {
            if let Some(body) = body {
                body.rollback()
                    .await
                    .map_err(|e| store_error("releasing the key", e))?;
            }
            tx.rollback()
                .await
                .map_err(|e| store_error("releasing the key", e))
        };
        match self.db {
            Conn::Pool(_) => detached(rollback).await,
            Conn::Tx(_) => rollback.await,
        }
    }
}
