//! idem-core's atomic-mode [`Store`] on a driver's pool, once for every driver: the claim
//! begins a transaction of its own, the handler's body runs in it, the record commits it.
//!
//! The claim itself ([`claim`]) is here too, so a key is followed from [`Store::claim`] to
//! the ledger's statement in one file: which statements run, in which order, and what their
//! rows decide. The store supplies the connection (its claim transaction, begun, on any
//! driver's [`Connection`]) and ends the transaction as the [`Claimed`] it gets back says; the
//! nested store (`nested.rs`) runs the same claim in a body's transaction.

use idem_core::ledger::ids::random_token;
use idem_core::{Claim, Concurrency, Error, RecordStatus, Request, Store, detached};

use crate::ClaimRow;
use crate::driver::{db_error, failed};
use crate::store::within;
use crate::{
    Connection, Dialect, Driver, Failure, Fault, NewRecord, Sql, SqlStore, fetch_first, read_first,
};

/// A key claimed on the pool: the claim's transaction (the handler's body runs in it), the
/// owner token its record is written under, and the statements of its server.
pub struct ClaimedTx<D: Driver> {
    tx: D::Tx,
    owner: i64,
    sql: &'static Sql,
}

impl<D: Driver> std::fmt::Debug for ClaimedTx<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimedTx")
            .field("flavour", &self.sql.flavour)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

impl<D: Driver> SqlStore<D> {
    /// Refuses a claim through the pool while an atomic-mode body runs in this task on the
    /// same pool: the call would commit on its own instead of with the body, or wait for the
    /// body's own lock. `what` names the call.
    pub(crate) fn outside_open_claim(&self, what: &str) -> Result<(), Error> {
        if !idem_core::atomic::inside_open_claim(self.driver().identity()) {
            return Ok(()); // no open claim, or one on another database
        }
        Err(Error::Store {
            message: format!(
                "{what} was called through the pool inside the body of another `#[idempotent]` call, whose transaction is open: it would commit on its own, or wait for the body's own lock; {}, or call it before or after the outer call",
                D::NESTED_CALL
            ),
            source: None,
        })
    }

    /// A write transaction and the statements of its server, each waited for at most `wait`
    /// (the connection, and the first time on a MySQL server its answer to which family it
    /// is): an outage is told promptly.
    async fn begin_claim(
        &self,
        wait: Option<std::time::Duration>,
        doing: &'static str,
    ) -> Result<(D::Tx, &'static Sql), Error> {
        within(wait, doing, async {
            let sql = self.server_statements(doing).await?;
            Ok((self.begin_write(doing).await?, sql))
        })
        .await
    }
}

/// The claim, owned: it runs to completion even when its caller stops waiting
/// ([`detached`]), so it cannot borrow the request.
async fn claim_on_pool<D: Driver>(
    store: SqlStore<D>,
    step: ClaimStep,
    wait: Option<std::time::Duration>,
) -> Result<Claim<ClaimedTx<D>>, Error> {
    let (mut tx, sql) = store
        .begin_claim(wait, "beginning the claim transaction")
        .await?;
    let claimed = claim::<D, _>(&mut tx, sql, &step)
        .await
        .map_err(failed::<D>)?;
    let row = match claimed {
        Claimed::Execute => {
            return Ok(Claim::Execute(ClaimedTx {
                tx,
                owner: step.row.owner,
                sql,
            }));
        }
        Claimed::InFlight => return Ok(Claim::InFlight),
        // Under `reject`, MySQL's claim holds the key's row lock: roll back before answering,
        // so the client's next call (another pooled connection) does not meet it and hear "in
        // flight". Otherwise dropping the transaction queues its rollback on the connection,
        // which travels with the pool's release instead of costing a round trip here.
        Claimed::LiveLocked(row) if step.reject && sql.dialect == Dialect::MySql => {
            let _ = crate::Transaction::rollback(tx).await;
            row
        }
        Claimed::Live(row) | Claimed::LiveLocked(row) => row,
    };
    live_answer(row)
}

/// What a live record found by a claim answers.
pub(super) fn live_answer<T>(row: ClaimRow) -> Result<Claim<T>, Error> {
    row.answer().ok_or_else(|| Error::Store {
        message: "the ledger row has an unknown state (written by a newer version of idem?)"
            .to_owned(),
        source: None,
    })
}

/// What a claim decided, and so how its store ends the transaction.
#[derive(Debug)]
pub enum Claimed {
    /// The key is this claim's: the body runs in the transaction.
    Execute,
    /// A live record answers (see [`ClaimRow::answer`]); the transaction wrote nothing and
    /// can be dropped.
    Live(ClaimRow),
    /// A live record answers, and the transaction holds its row lock: under `reject` on the
    /// MySQL protocol the store rolls back before answering, so the client's next call does
    /// not meet this call's lock.
    LiveLocked(ClaimRow),
    /// Another transaction holds the key and the claim would not wait (`reject`).
    InFlight,
}

/// One claim's values and decisions.
#[derive(Clone, Debug)]
pub struct ClaimStep {
    /// The row the claim inserts ([`NewRecord::of`]; SQLite's atomic claim only reads its id).
    pub row: NewRecord,
    /// `on_concurrent = reject`: fail at once instead of waiting for the key's lock.
    pub reject: bool,
    /// Take a savepoint after the claim, so a final error can undo the body's writes.
    pub savepoint: bool,
}

/// The claim's values and decisions for `req`.
pub(super) fn claim_step(req: &Request, savepoint: bool) -> ClaimStep {
    ClaimStep {
        row: NewRecord::of(req, random_token(), req.ttl()),
        reject: req.concurrency() == Concurrency::Reject,
        savepoint,
    }
}

/// What a claim's step returns: its answer, or what it was doing when a statement failed.
type Done<T, C> = Result<T, (&'static str, Fault<<C as Connection>::Error>)>;

/// Claims `step.row` in `conn`, a transaction of driver `D` that has just begun, with `d`'s
/// statements. An error says what the claim was doing.
pub async fn claim<D: Driver, C: Connection<Error = D::Error>>(
    conn: &mut C,
    d: &'static Sql,
    step: &ClaimStep,
) -> Done<Claimed, C> {
    if step.reject
        && let Some(sql) = d.ledger.before_nowait
    {
        conn.execute_unprepared(sql)
            .await
            .map_err(|e| ("setting the lock timeout", Fault::Db(e)))?;
    }
    if d.ledger.claim_by_read {
        // SQLite: `BEGIN IMMEDIATE` already holds the only write lock, so nobody can claim
        // the key before this transaction ends. A plain read decides, and the record step
        // writes the whole row once (an upsert over an expired record).
        let row = fetch_first(conn, d.ledger.read_locked(&step.row.id), ClaimRow::from_row)
            .await
            .map_err(|e| ("reading the key", e))?;
        if let Some(row) = row
            && row.is_live()
        {
            return Ok(Claimed::Live(row));
        }
        return savepoint(conn, d, step).await;
    }
    let insert = if step.reject {
        d.ledger.claim_nowait(&step.row)
    } else {
        d.ledger.claim(&step.row)
    };
    // The insert's answer is read here, straight from the driver: at most the key's one row
    // or, under `reject`, an error for a lock wait that gave up, which is the claim's answer
    // (in flight), not a failure.
    let seen = conn.fetch_all(insert).await;
    if step.reject
        && let Some(sql) = d.ledger.after_nowait
    {
        conn.execute_unprepared(sql)
            .await
            .map_err(|e| ("resetting the lock timeout", Fault::Db(e)))?;
    }
    let seen = match seen {
        Ok(rows) => read_first(rows, ClaimRow::from_row)
            .map_err(|e| ("claiming the key", Fault::Decode(e)))?,
        Err(e) if D::classify(&e) == Failure::LockTimeout => return Ok(Claimed::InFlight),
        Err(e) => return Err(("claiming the key", Fault::Db(e))),
    };
    match seen {
        // Our new row, or (MariaDB) the current row, locked: it decides.
        Some(row) if row.owner == step.row.owner || d.ledger.claim_locks_row => {
            return settle(conn, d, row, step).await;
        }
        // A committed final record never changes before it expires: it answers as the
        // statement saw it, without a lock or a second read.
        Some(row)
            if row.is_live()
                && matches!(
                    row.status,
                    Some(RecordStatus::Completed | RecordStatus::Failed | RecordStatus::GaveUp)
                ) =>
        {
            return Ok(Claimed::Live(row));
        }
        _ => {}
    }
    // Another owner's row, seen without a lock: read it locked, as it is now.
    let doing = "reading the claimed key";
    let row = fetch_first(conn, d.ledger.read_locked(&step.row.id), ClaimRow::from_row)
        .await
        .map_err(|e| (doing, e))?
        .ok_or((doing, Fault::Missing("the claimed ledger row")))?;
    settle(conn, d, row, step).await
}

/// Decides on the current, locked row of the key: ours, another owner's live record, or an
/// expired record this claim takes over.
async fn settle<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    row: ClaimRow,
    step: &ClaimStep,
) -> Done<Claimed, C> {
    if row.owner != step.row.owner {
        if row.is_live() {
            return Ok(Claimed::LiveLocked(row));
        }
        // An expired record is a new execution: take it over in this transaction.
        let new = &step.row;
        conn.execute(
            d.ledger
                .take_over(&new.id, new.owner, &new.fingerprint, new.ttl_ms),
        )
        .await
        .map_err(|e| ("taking over an expired key", Fault::Db(e)))?;
    }
    savepoint(conn, d, step).await
}

/// The key is the claim's: a savepoint first if a final error may need one.
async fn savepoint<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    step: &ClaimStep,
) -> Done<Claimed, C> {
    if step.savepoint {
        conn.execute_unprepared(&d.ledger.savepoint().sql)
            .await
            .map_err(|e| ("taking the claim savepoint", Fault::Db(e)))?;
    }
    Ok(Claimed::Execute)
}

/// Whether a MySQL claim's own uncommitted row is gone, so the body's error only reports
/// a conflict that rolled the transaction back. MySQL and MariaDB roll a deadlock victim's
/// (or a Galera brute-force abort's) whole transaction back, and other statement errors only
/// the statement: the row is gone exactly when the transaction is. PostgreSQL aborts the
/// transaction on any error and SQLite's writers never conflict: no question there.
pub(super) async fn claim_aborted<D: Driver>(
    conn: &mut impl Connection<Error = D::Error>,
    sql: &'static Sql,
    owner: i64,
    req: &Request,
) -> bool {
    if sql.dialect != Dialect::MySql {
        return false;
    }
    match fetch_first(conn, sql.ledger.read_locked(req.id()), ClaimRow::from_row).await {
        Ok(Some(row)) => row.owner != owner,
        Ok(None) => true,
        Err(fault) => fault.failure(D::classify) == Failure::Transient,
    }
}

impl<D: Driver> Store for SqlStore<D> {
    type Tx<'t> = D::Body<'t>;
    type Claimed = ClaimedTx<D>;

    fn tx(claimed: &mut ClaimedTx<D>) -> D::Body<'_> {
        D::body(&mut claimed.tx)
    }

    async fn claim(&self, req: &Request) -> Result<Claim<ClaimedTx<D>>, Error> {
        self.outside_open_claim(&format!("`{}`", req.scope()))?;
        let step = claim_step(req, req.savepoint());
        let wait = self
            .driver()
            .connection_wait()
            .map(|wait| req.concurrency().connection_wait(wait));
        detached(claim_on_pool(self.clone(), step, wait)).await
    }

    async fn record(
        &self,
        ClaimedTx { mut tx, owner, sql }: ClaimedTx<D>,
        req: &Request,
        status: RecordStatus,
        payload: &[u8],
    ) -> Result<(), Error> {
        // Where the claim wrote nothing (SQLite), the record writes the whole row.
        let row = NewRecord::of(req, owner, req.ttl());
        // A driver that pipelines, on PostgreSQL: the record fails rather than change no row,
        // so the `COMMIT` goes out with it, in one flight, and rolls a lost claim back.
        let pipelined = <D::Tx as crate::Transaction>::PIPELINES;
        let with_commit =
            pipelined.then(|| sql.ledger.record_or_fail(&row, status.code(), payload));
        let (record, with_commit) = match with_commit.flatten() {
            Some(record) => (record, true),
            None => (sql.ledger.record(&row, status.code(), payload), false),
        };
        // A final error keeps only the recorded error: back to the claim's savepoint first.
        let undo_body = status == RecordStatus::Failed;
        detached(async move {
            use crate::Transaction;
            use idem_core::testing::crash_points::{CrashPoint, fault};
            if undo_body {
                let undo = sql.ledger.rollback_to_savepoint();
                tx.execute_unprepared(&undo.sql)
                    .await
                    .map_err(|e| db_error::<D>("rolling back the handler's writes", e))?;
            }
            if with_commit {
                // Before the flight that commits: a crash test's crash here leaves nothing.
                fault(CrashPoint::BeforeCommit)?;
                return tx
                    .commit_after(record)
                    .await
                    .map(drop)
                    .map_err(|e| db_error::<D>("recording the result", e));
            }
            let updated = tx
                .execute(record)
                .await
                .map_err(|e| db_error::<D>("recording the result", e))?;
            if updated != 1 {
                return Err(crate::claim_lost());
            }
            // Inside a step that finishes on its own task once dropped: a crash test's crash
            // here fails it, the transaction dropped uncommitted.
            fault(CrashPoint::BeforeCommit)?;
            tx.commit()
                .await
                .map_err(|e| db_error::<D>("committing the result", e))
        })
        .await
    }

    async fn release(&self, claimed: ClaimedTx<D>) -> Result<(), Error> {
        detached(async move {
            crate::Transaction::rollback(claimed.tx)
                .await
                .map_err(|e| db_error::<D>("releasing the key", e))
        })
        .await
    }

    async fn aborted(&self, claimed: &mut ClaimedTx<D>, req: &Request) -> bool {
        claim_aborted::<D>(&mut claimed.tx, claimed.sql, claimed.owner, req).await
    }

    async fn begin(&self) -> Result<ClaimedTx<D>, Error> {
        // Unclaimed: idem switched off, or an observed call that runs its body anyway.
        self.outside_open_claim(
            "a call whose body runs unclaimed (idem switched off, or `mode = observe`)",
        )?;
        let (mut tx, sql) = self
            .begin_claim(None, "beginning the handler's transaction")
            .await?;
        // Lent to the body before any statement of idem's: a deferred `BEGIN` goes out now.
        crate::Transaction::begun(&mut tx)
            .await
            .map_err(|e| db_error::<D>("beginning the handler's transaction", e))?;
        // It claims nothing.
        Ok(ClaimedTx { tx, owner: 0, sql })
    }

    async fn commit(&self, claimed: ClaimedTx<D>) -> Result<(), Error> {
        crate::Transaction::commit(claimed.tx)
            .await
            .map_err(|e| db_error::<D>("committing the handler's writes", e))
    }

    fn ledger_identity(&self) -> Option<usize> {
        self.driver().identity()
    }
}
