//! idem-core's atomic-mode [`Store`] on a driver's pool, once for every driver: the claim
//! begins a transaction of its own, the handler's body runs in it, the record commits it.

use idem_core::ledger::ids::random_token;
use idem_core::{Claim, Concurrency, Error, RecordStatus, Request, Store, detached};

use super::{ClaimRow, ClaimStep, Claimed};
use crate::store::within;
use crate::store::{db_error, failed};
use crate::{Dialect, Driver, Failure, NewRecord, Sql, SqlStore, fetch_first};

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
    let claimed = super::claim::<D, _>(&mut tx, sql, &step)
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

/// The claim's values and decisions for `req`.
pub(super) fn claim_step(req: &Request, savepoint: bool) -> ClaimStep {
    ClaimStep {
        row: NewRecord::of(req, random_token(), req.ttl()),
        reject: req.concurrency() == Concurrency::Reject,
        savepoint,
    }
}

/// Whether a MySQL claim's own uncommitted row is gone, so the body's error only reports
/// a conflict that rolled the transaction back. MySQL and MariaDB roll a deadlock victim's
/// (or a Galera brute-force abort's) whole transaction back, and other statement errors only
/// the statement: the row is gone exactly when the transaction is. PostgreSQL aborts the
/// transaction on any error and SQLite's writers never conflict: no question there.
pub(super) async fn claim_aborted<D: Driver>(
    conn: &mut impl crate::Connection<Error = D::Error>,
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
            use crate::{Connection, Transaction};
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
