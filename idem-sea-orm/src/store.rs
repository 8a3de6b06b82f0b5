//! The SeaORM [`Store`]: the claim, record and release steps on a [`DatabaseConnection`].

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use idem_core::ids::random_token;
use idem_core::{Claim, Concurrency, Error, Fingerprint, RecordStatus, Recorded, Request, Store};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, QueryResult,
    SqliteTransactionMode, TransactionOptions, TransactionTrait,
};

use crate::error::{Failure, classify, store_error};
use crate::sql::{Bound, NewRecord, Sql, millis, statement};

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

/// [`outside_open_claim`] for a lease-mode call on SQLite; elsewhere a lease claimed inside
/// an atomic body commits on its own, as lease mode's claims always do.
pub(crate) fn outside_open_claim_sqlite(db: &DatabaseConnection, scope: &str) -> Result<(), Error> {
    if db.get_database_backend() != DbBackend::Sqlite {
        return Ok(());
    }
    outside_open_claim(db, &format!("the lease-mode `{scope}`")).map_err(|_| Error::Store {
        message: format!(
            "the lease-mode `{scope}` was called inside the body of an atomic-mode `#[idempotent]` call on the same SQLite database, whose write lock that body holds: the lease's claim would wait for it; call it before or after the atomic call (a lease commits on its own and cannot take the body's transaction)"
        ),
        source: None,
    })
}

/// Refuses a claim through the pool `db` while an atomic-mode body runs in this task on the
/// same pool: the call would commit on its own instead of with the body (PostgreSQL, MySQL),
/// or wait for the body's own write lock (SQLite). `what` names the call's kind.
pub(crate) fn outside_open_claim(db: &DatabaseConnection, what: &str) -> Result<(), Error> {
    let Some(open) = idem_core::atomic::open_claim() else {
        return Ok(());
    };
    let pool = SeaOrmStore::new(db).ledger_identity();
    if open.ledger.is_some() && open.ledger != pool {
        return Ok(()); // another database: nothing shared with the open claim
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
    read: impl Fn(&QueryResult) -> Result<T, DbErr>,
) -> Result<Vec<T>, Error> {
    let d = crate::sql::of(db.get_database_backend());
    let rows = db
        .query_all_raw(statement(d, list))
        .await
        .map_err(|e| store_error(doing, e))?;
    rows.iter()
        .map(read)
        .collect::<Result<_, DbErr>>()
        .map_err(|e| store_error(doing, e))
}

/// A ledger row's values, in the order every statement that writes a whole row binds them:
/// id, scope, principal, key, owner, fingerprint, and the time it lives from now (the TTL, or
/// the lease). Built once per statement from the call's one request.
pub(crate) fn ledger_row(req: &Request, owner: i64, lives: std::time::Duration) -> NewRecord {
    NewRecord {
        id: req.id().to_vec(),
        scope: req.scope().to_owned(),
        principal: req.principal().to_owned(),
        key: req.key().to_owned(),
        owner,
        fingerprint: req.fingerprint().0.to_vec(),
        ttl_ms: millis(lives),
    }
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
}

/// The longest a claim waits for a pooled connection, in milliseconds ([`set_connection_wait`]).
static CONNECTION_WAIT_MS: AtomicU64 = AtomicU64::new(5_000);

/// Sets how long a claim waits for a pooled connection before the call fails with
/// [`Error::Unavailable`](idem_core::Error::Unavailable) (HTTP 503 with `Retry-After`): a dead or
/// unreachable database, or a pool whose connections are all busy, is an outage, told
/// promptly, not a duplicate in flight. Default 5 s; process-wide. In atomic mode the wait is
/// also kept under the call's wait bound (`on_concurrent = wait("…")`), so a missing connection
/// is never mistaken for another call holding the key. PostgreSQL and MySQL only: an embedded
/// SQLite database cannot go away, and its one pooled connection is queued for under load.
pub fn set_connection_wait(wait: Duration) {
    let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1);
    CONNECTION_WAIT_MS.store(ms, Ordering::Relaxed);
}

/// The connection wait of a call whose own bound is `call_bound`.
pub(crate) fn connection_wait(call_bound: Option<Duration>) -> Duration {
    let wait = Duration::from_millis(CONNECTION_WAIT_MS.load(Ordering::Relaxed));
    // Leave a fifth of the call's bound for the lock wait that follows.
    call_bound.map_or(wait, |bound| wait.min(bound.mul_f64(0.8)))
}

/// Begins a claim's transaction, waiting at most `wait` for a connection.
pub(crate) async fn begin_within(
    db: &DatabaseConnection,
    wait: Duration,
) -> Result<DatabaseTransaction, DbErr> {
    bounded(db, wait, begin(db)).await
}

/// Runs `work` (auto-committed statements on the pool), giving up after the connection wait:
/// a server that died makes sqlx retry its connection until the pool's own acquire timeout
/// (30 s by default), and a lease's holder must hear of the outage as promptly as a claim.
pub(crate) async fn within_connection_wait<T>(
    db: &DatabaseConnection,
    work: impl Future<Output = Result<T, DbErr>>,
) -> Result<T, DbErr> {
    bounded(db, connection_wait(None), work).await
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

pub(crate) async fn begin(db: &DatabaseConnection) -> Result<DatabaseTransaction, DbErr> {
    match db.get_database_backend() {
        DbBackend::MySql => {
            crate::flavour::detect(db).await;
            db.begin().await
        }
        // Take SQLite's write lock up front: a deferred transaction that reads and then writes
        // fails with SQLITE_BUSY instead of waiting.
        DbBackend::Sqlite => {
            db.begin_with_options(TransactionOptions {
                sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
                ..TransactionOptions::default()
            })
            .await
        }
        // PostgreSQL stays at READ COMMITTED (REPEATABLE READ turns the race into 40001);
        // MySQL's REPEATABLE READ is fine because the claim reads with FOR UPDATE.
        _ => db.begin().await,
    }
}

use sea_orm::DbErr;

/// A row of the ledger, as the claim reads it back.
pub(crate) struct Row {
    pub(crate) owner: i64,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) status: Option<RecordStatus>,
    pub(crate) response: Option<Vec<u8>>,
    pub(crate) expires_at_ms: i64,
    pub(crate) now_ms: i64,
}

pub(crate) fn read_row(row: &QueryResult) -> Result<Row, DbErr> {
    let fingerprint: Vec<u8> = row.try_get_by_index(1)?;
    let state: i16 = row.try_get_by_index(2)?;
    Ok(Row {
        owner: row.try_get_by_index(0)?,
        fingerprint: Fingerprint(fingerprint.try_into().unwrap_or([0; 32])),
        status: RecordStatus::from_code(state),
        response: row.try_get_by_index(3)?,
        expires_at_ms: row.try_get_by_index(4)?,
        now_ms: row.try_get_by_index(5)?,
    })
}

/// Runs one store step to completion, whatever its caller does.
///
/// A caller may stop waiting at any point (a timeout, a client that disconnects, the wait
/// bound). If the step's future were dropped with it, sqlx 0.9 can leave the pooled
/// connection inside a transaction (a `BEGIN` cut off in flight) or, on MySQL, with a
/// half-prepared statement. So the step runs in place while its caller waits (no task
/// hand-off on the common path), and if the caller goes away first, the unfinished step is
/// handed to a task that finishes it; if nobody takes its transaction, it is dropped after its
/// last statement completed, which rolls it back cleanly.
pub(crate) async fn detached<T: Send + 'static>(
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

/// The claim's statement values and decisions, owned: a claim runs to completion even when
/// its caller stops waiting ([`detached`]), so it cannot borrow the request.
#[derive(Clone)]
struct ClaimStep {
    /// The row the claim inserts ([`ledger_row`]; SQLite's atomic claim only reads its id).
    row: NewRecord,
    reject: bool,
    savepoint: bool,
    /// The longest wait for a connection.
    connection_wait: Duration,
}

async fn claim_step(db: DatabaseConnection, step: ClaimStep) -> Result<Claim<ClaimedTx>, Error> {
    // A conflict (InnoDB can deadlock two waiters for a key whose holder rolled back; Galera
    // certifies at COMMIT) is returned as such: the engine runs the call again.
    try_claim(&db, &step)
        .await
        .map_err(|(doing, e)| store_error(doing, e))
}

/// One claim attempt; an error says what it was doing.
async fn try_claim(
    db: &DatabaseConnection,
    step: &ClaimStep,
) -> Result<Claim<ClaimedTx>, (&'static str, DbErr)> {
    let tx = begin_within(db, step.connection_wait)
        .await
        .map_err(|e| ("beginning the claim transaction", e))?;
    claim_in(tx, step).await
}

/// A nested claim: a savepoint in the outer call's transaction, then the claim as usual. The
/// body gets a savepoint of its own when a final error may need to undo its writes.
async fn try_claim_nested(
    outer: &DatabaseTransaction,
    step: &ClaimStep,
) -> Result<Claim<ClaimedTx>, (&'static str, DbErr)> {
    let tx = outer
        .begin()
        .await
        .map_err(|e| ("beginning the nested claim's savepoint", e))?;
    let step_in = ClaimStep {
        savepoint: false,
        ..step.clone()
    };
    match claim_in(tx, &step_in).await? {
        Claim::Execute(mut claimed) if step.savepoint => {
            let body = claimed
                .tx
                .begin()
                .await
                .map_err(|e| ("taking the claim savepoint", e))?;
            claimed.body = Some(body);
            Ok(Claim::Execute(claimed))
        }
        claim => Ok(claim),
    }
}

/// The claim in `tx`, which has just begun.
async fn claim_in(
    tx: DatabaseTransaction,
    step: &ClaimStep,
) -> Result<Claim<ClaimedTx>, (&'static str, DbErr)> {
    // After `begin`, which learns which MySQL family the server is.
    let d = crate::sql::of(tx.get_database_backend());
    if step.reject
        && let Some(sql) = d.ledger.before_nowait
    {
        tx.execute_unprepared(sql)
            .await
            .map_err(|e| ("setting the lock timeout", e))?;
    }
    if d.ledger.claim_by_read {
        // SQLite: `BEGIN IMMEDIATE` already holds the only write lock, so nobody can claim
        // the key before this transaction ends. A plain read decides, and the record step
        // writes the whole row once (an upsert over an expired record).
        let row = tx
            .query_one_raw(statement(d, d.ledger.read_locked(&step.row.id)))
            .await
            .and_then(|row| row.map(|row| read_row(&row)).transpose())
            .map_err(|e| ("reading the key", e))?;
        if let Some(row) = row
            && row.expires_at_ms > row.now_ms
        {
            end_unwritten(tx);
            return live_record(row);
        }
        return savepoint(tx, step).await;
    }
    let insert = statement(
        d,
        if step.reject {
            d.ledger.claim_nowait(&step.row)
        } else {
            d.ledger.claim(&step.row)
        },
    );
    let seen = tx
        .query_one_raw(insert)
        .await
        .and_then(|row| row.map(|row| read_row(&row)).transpose());
    if step.reject
        && let Some(sql) = d.ledger.after_nowait
    {
        tx.execute_unprepared(sql)
            .await
            .map_err(|e| ("resetting the lock timeout", e))?;
    }
    let seen = match seen {
        Ok(seen) => seen,
        Err(e) if classify(&e) == Failure::LockTimeout => {
            end_unwritten(tx);
            return Ok(Claim::InFlight);
        }
        Err(e) => return Err(("claiming the key", e)),
    };
    match seen {
        // Our new row, or (MariaDB) the current row, locked: it decides.
        Some(row) if row.owner == step.row.owner || d.ledger.claim_locks_row => {
            return settle(tx, d, row, step).await;
        }
        // A committed final record never changes before it expires: it answers as the
        // statement saw it, without a lock or a second read.
        Some(row)
            if row.expires_at_ms > row.now_ms
                && matches!(
                    row.status,
                    Some(RecordStatus::Completed | RecordStatus::Failed | RecordStatus::GaveUp)
                ) =>
        {
            end_unwritten(tx);
            return live_record(row);
        }
        _ => {}
    }
    // Another owner's row, seen without a lock: read it locked, as it is now.
    let row = tx
        .query_one_raw(statement(d, d.ledger.read_locked(&step.row.id)))
        .await
        .and_then(|row| match row {
            Some(row) => read_row(&row),
            None => Err(DbErr::RecordNotFound("the claimed ledger row".into())),
        })
        .map_err(|e| ("reading the claimed key", e))?;
    settle(tx, d, row, step).await
}

/// Decides on the current, locked row of the key: ours, another owner's live record, or an
/// expired record this claim takes over.
async fn settle(
    tx: DatabaseTransaction,
    d: &Sql,
    row: Row,
    step: &ClaimStep,
) -> Result<Claim<ClaimedTx>, (&'static str, DbErr)> {
    if row.owner != step.row.owner {
        if row.expires_at_ms > row.now_ms {
            // A live record: nothing was written.
            end_locked(tx, step).await;
            return live_record(row);
        }
        // An expired record is a new execution: take it over in this transaction.
        let row = &step.row;
        tx.execute_raw(statement(
            d,
            d.ledger
                .take_over(&row.id, row.owner, &row.fingerprint, row.ttl_ms),
        ))
        .await
        .map_err(|e| ("taking over an expired key", e))?;
    }
    savepoint(tx, step).await
}

/// Ends a claim transaction that wrote nothing but holds the key's row lock (MySQL's claim
/// locks the row it runs into). Under `reject` it rolls back before answering: a client's
/// next call for the key, on another pooled connection, must not meet this call's lock and be
/// told "in flight" (a lock wait of 0 s). Otherwise it is dropped ([`end_unwritten`]); a
/// waiting claim waits the moment it takes.
async fn end_locked(tx: DatabaseTransaction, step: &ClaimStep) {
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
fn live_record(row: Row) -> Result<Claim<ClaimedTx>, (&'static str, DbErr)> {
    match row.status {
        Some(RecordStatus::Pending) => Ok(Claim::InFlight),
        Some(status) => Ok(Claim::Recorded(Recorded {
            fingerprint: row.fingerprint,
            status,
            payload: row.response.unwrap_or_default(),
        })),
        None => Err((
            "reading a ledger row with an unknown state",
            DbErr::Custom("the ledger row has an unknown state".into()),
        )),
    }
}

/// Hands out the claimed transaction, after a savepoint if a final error may need one.
async fn savepoint(
    tx: DatabaseTransaction,
    step: &ClaimStep,
) -> Result<Claim<ClaimedTx>, (&'static str, DbErr)> {
    if step.savepoint {
        let sql = crate::sql::of(tx.get_database_backend()).ledger.savepoint();
        tx.execute_unprepared(&sql.sql)
            .await
            .map_err(|e| ("taking the claim savepoint", e))?;
    }
    Ok(Claim::Execute(ClaimedTx {
        body: None,
        tx,
        owner: step.row.owner,
    }))
}

async fn record_step(
    body: Option<DatabaseTransaction>,
    tx: DatabaseTransaction,
    record: Bound<'static>,
    undo_body: bool,
) -> Result<(), Error> {
    let d = crate::sql::of(tx.get_database_backend());
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
        return Err(Error::Store {
            message: "the claim was lost before its result was recorded".to_owned(),
            source: None,
        });
    }
    tx.commit()
        .await
        .map_err(|e| store_error("committing the result", e))
}

impl Store for SeaOrmStore<'_> {
    type Tx = DatabaseTransaction;
    type Claimed = ClaimedTx;

    fn tx(claimed: &ClaimedTx) -> &DatabaseTransaction {
        claimed.body.as_ref().unwrap_or(&claimed.tx)
    }

    async fn claim(&self, req: &Request) -> Result<Claim<ClaimedTx>, Error> {
        if let Conn::Pool(db) = self.db {
            outside_open_claim(db, &format!("`{}`", req.scope()))?;
        }
        let owner = random_token();
        let step = ClaimStep {
            row: ledger_row(req, owner, req.ttl()),
            reject: req.concurrency() == Concurrency::Reject,
            savepoint: req.savepoint(),
            connection_wait: connection_wait(match req.concurrency() {
                Concurrency::Wait { bound } => Some(bound),
                _ => None,
            }),
        };
        match self.db {
            Conn::Pool(db) => detached(claim_step(db.clone(), step)).await,
            // Not detached: the outer transaction is borrowed, and a caller that stops
            // waiting drops the outer call with it.
            Conn::Tx(outer) => try_claim_nested(outer, &step)
                .await
                .map_err(|(doing, e)| store_error(doing, e)),
        }
    }

    async fn record(
        &self,
        ClaimedTx { body, tx, owner }: ClaimedTx,
        req: &Request,
        status: RecordStatus,
        payload: &[u8],
    ) -> Result<(), Error> {
        // Where the claim wrote nothing (SQLite), the record writes the whole row.
        let row = ledger_row(req, owner, req.ttl());
        let values = crate::sql::of(self.backend())
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
        // The pool's shared options live once per pool, whichever clone reaches them. Other
        // connection kinds (mock, proxy) fly without single flight.
        #[allow(unused_imports)]
        use sea_orm::DatabaseConnectionType as Kind;
        match &db.inner {
            #[cfg(feature = "sqlite")]
            Kind::SqlxSqlitePoolConnection(_) => {
                Some(std::ptr::from_ref(db.get_sqlite_connection_pool().options()) as usize)
            }
            #[cfg(feature = "postgres")]
            Kind::SqlxPostgresPoolConnection(_) => {
                Some(std::ptr::from_ref(db.get_postgres_connection_pool().options()) as usize)
            }
            #[cfg(feature = "mysql")]
            Kind::SqlxMySqlPoolConnection(_) => {
                Some(std::ptr::from_ref(db.get_mysql_connection_pool().options()) as usize)
            }
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    async fn aborted(&self, claimed: &ClaimedTx, req: &Request) -> bool {
        // MySQL and MariaDB roll a deadlock victim's (or a Galera brute-force abort's) whole
        // transaction back, and other statement errors only the statement: the claim's own
        // uncommitted row is gone exactly when the transaction is. PostgreSQL aborts the
        // transaction on any error and SQLite's writers never conflict: no question there.
        let backend = claimed.tx.get_database_backend();
        if backend != DbBackend::MySql {
            return false;
        }
        let d = crate::sql::of(backend);
        let read = claimed
            .tx
            .query_one_raw(statement(d, d.ledger.read_locked(req.id())))
            .await;
        match read {
            Ok(Some(row)) => read_row(&row).map_or(true, |row| row.owner != claimed.owner),
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
