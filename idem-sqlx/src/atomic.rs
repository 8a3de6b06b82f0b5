//! The sqlx [`Store`]: the claim, record and release steps on a sqlx pool.

use std::future::Future;
use std::time::Duration;

use idem_core::ledger::ids::random_token;
use idem_core::{Claim, Concurrency, Error, RecordStatus, Request, Store, detached};
use idem_sql::{ClaimRow, ClaimStep, Claimed, Dialect, Failure, NewRecord, Sql};
use sqlx::{Pool, Transaction};

use crate::driver::Backend;
use crate::driver::error::{classify, failed, store_error};
use crate::driver::port::on;

/// The ledger on a sqlx pool (PostgreSQL, MySQL/MariaDB, SQLite).
///
/// `#[idempotent]` builds one from the handler's `&PgPool` (`&MySqlPool`, `&SqlitePool`);
/// you rarely name it. The handler's body runs in the claim's transaction, lent to it as
/// `&mut PgConnection` (what sqlx's executors take: `query.execute(&mut *db)`), so the claim,
/// the body's writes and the recorded result commit together or not at all.
pub struct SqlxStore<'p, DB: Backend> {
    pool: &'p Pool<DB>,
}

impl<'p, DB: Backend> SqlxStore<'p, DB> {
    /// A store on `pool`. The ledger table must exist ([`crate::create_tables`], or
    /// `idem schema` in your migrations).
    pub fn new(pool: &'p Pool<DB>) -> Self {
        SqlxStore { pool }
    }
}

impl<DB: Backend> Clone for SqlxStore<'_, DB> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<DB: Backend> Copy for SqlxStore<'_, DB> {}

impl<DB: Backend> std::fmt::Debug for SqlxStore<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxStore")
            .field("database", &DB::NAME)
            .finish_non_exhaustive()
    }
}

/// A key claimed on the sqlx ledger: the claim's transaction (the handler body runs in it),
/// the owner token its record is written under, and the statements of its server.
pub struct ClaimedTx<DB: Backend> {
    tx: Transaction<'static, DB>,
    owner: i64,
    sql: &'static Sql,
    /// Whether statements are named ([`crate::through_transaction_pooler`]).
    named: bool,
}

impl<DB: Backend> std::fmt::Debug for ClaimedTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimedTx")
            .field("database", &DB::NAME)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

/// How long a claim waits for a connection: the pool's own acquire timeout, kept under the
/// call's wait bound ([`Concurrency::connection_wait`]). SQLite is not bounded: an embedded
/// database cannot go away, and its connections are queued for.
pub(crate) fn connection_wait<DB: Backend>(
    pool: &Pool<DB>,
    concurrency: Concurrency,
) -> Option<Duration> {
    (DB::DIALECT != Dialect::Sqlite)
        .then(|| concurrency.connection_wait(pool.options().get_acquire_timeout()))
}

/// `work` (a `BEGIN`, a connection's acquire), failing as a pool timeout after `wait` (a
/// [`connection_wait`]): an outage told promptly.
pub(crate) async fn within<T>(
    wait: Option<Duration>,
    work: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    match wait {
        Some(wait) => tokio::time::timeout(wait, work)
            .await
            .unwrap_or(Err(sqlx::Error::PoolTimedOut)),
        None => work.await,
    }
}

/// Refuses a claim through the pool while an atomic-mode body runs in this task on the same
/// pool: the call would commit on its own instead of with the body, or wait for the body's
/// own lock.
fn outside_open_claim<DB: Backend>(store: &SqlxStore<'_, DB>, what: &str) -> Result<(), Error> {
    if !idem_core::atomic::inside_open_claim(store.ledger_identity()) {
        return Ok(()); // no open claim, or one on another database
    }
    Err(Error::Store {
        message: format!(
            "{what} was called through the pool inside the body of another `#[idempotent]` call, whose transaction is open: it would commit on its own, or wait for the body's own lock; pass the body's `db` to a function whose connection is an `idem::sqlx::Conn` (`(&mut *db).into()`), so it claims in a savepoint and commits with the outer call, or call it before or after the outer call"
        ),
        source: None,
    })
}

/// The claim, owned: it runs to completion even when its caller stops waiting
/// ([`detached`]), so it cannot borrow the request.
async fn claim_step<DB: Backend>(
    pool: Pool<DB>,
    step: ClaimStep,
    wait: Option<Duration>,
) -> Result<Claim<ClaimedTx<DB>>, Error> {
    let sql = Sql::of(DB::flavour(&pool).await);
    let named = crate::driver::pooler::named(&pool);
    let mut tx = within(wait, crate::driver::port::begin_claim(&pool))
        .await
        .map_err(|e| store_error("beginning the claim transaction", e))?;
    let claimed = idem_sql::claim(&mut on::<DB>(&mut tx, named), sql, &step)
        .await
        .map_err(failed)?;
    let row = match claimed {
        Claimed::Execute => {
            return Ok(Claim::Execute(ClaimedTx {
                tx,
                owner: step.row.owner,
                sql,
                named,
            }));
        }
        Claimed::InFlight => return Ok(Claim::InFlight),
        // Under `reject`, MySQL's claim holds the key's row lock: roll back before answering,
        // so the client's next call (another pooled connection) does not meet it and hear "in
        // flight". Otherwise dropping the transaction queues its rollback on the connection.
        Claimed::LiveLocked(row) if step.reject && sql.dialect == Dialect::MySql => {
            let _ = tx.rollback().await;
            row
        }
        Claimed::Live(row) | Claimed::LiveLocked(row) => row,
    };
    row.answer().ok_or_else(|| Error::Store {
        message: "the ledger row has an unknown state (written by a newer version of idem?)"
            .to_owned(),
        source: None,
    })
}

impl<DB: Backend> Store for SqlxStore<'_, DB> {
    type Tx<'t> = &'t mut DB::Connection;
    type Claimed = ClaimedTx<DB>;

    fn tx(claimed: &mut ClaimedTx<DB>) -> &mut DB::Connection {
        &mut claimed.tx
    }

    async fn claim(&self, req: &Request) -> Result<Claim<ClaimedTx<DB>>, Error> {
        outside_open_claim(self, &format!("`{}`", req.scope()))?;
        let step = ClaimStep {
            row: NewRecord::of(req, random_token(), req.ttl()),
            reject: req.concurrency() == Concurrency::Reject,
            savepoint: req.savepoint(),
        };
        let wait = connection_wait(self.pool, req.concurrency());
        detached(claim_step(self.pool.clone(), step, wait)).await
    }

    async fn record(
        &self,
        ClaimedTx {
            mut tx,
            owner,
            sql,
            named,
        }: ClaimedTx<DB>,
        req: &Request,
        status: RecordStatus,
        payload: &[u8],
    ) -> Result<(), Error> {
        // Where the claim wrote nothing (SQLite), the record writes the whole row.
        let row = NewRecord::of(req, owner, req.ttl());
        let record = sql.ledger.record(&row, status.code(), payload);
        // A final error keeps only the recorded error: back to the claim's savepoint first.
        let undo_body = status == RecordStatus::Failed;
        detached(async move {
            if undo_body {
                let undo = sql.ledger.rollback_to_savepoint();
                DB::execute_unprepared(&mut tx, &undo.sql)
                    .await
                    .map_err(|e| store_error("rolling back the handler's writes", e))?;
            }
            let updated = DB::execute(&mut tx, record, named)
                .await
                .map_err(|e| store_error("recording the result", e))?;
            if updated != 1 {
                return Err(idem_sql::claim_lost());
            }
            tx.commit()
                .await
                .map_err(|e| store_error("committing the result", e))
        })
        .await
    }

    async fn release(&self, claimed: ClaimedTx<DB>) -> Result<(), Error> {
        detached(async move {
            claimed
                .tx
                .rollback()
                .await
                .map_err(|e| store_error("releasing the key", e))
        })
        .await
    }

    async fn aborted(&self, claimed: &mut ClaimedTx<DB>, req: &Request) -> bool {
        // MySQL and MariaDB roll a deadlock victim's (or a Galera brute-force abort's) whole
        // transaction back, and other statement errors only the statement: the claim's own
        // uncommitted row is gone exactly when the transaction is. PostgreSQL aborts the
        // transaction on any error and SQLite's writers never conflict: no question there.
        if claimed.sql.dialect != Dialect::MySql {
            return false;
        }
        let read = claimed.sql.ledger.read_locked(req.id());
        match DB::fetch_first(&mut claimed.tx, read, claimed.named, ClaimRow::from_row).await {
            Ok(Some(row)) => row.owner != claimed.owner,
            Ok(None) => true,
            Err(e) => classify(&e) == Failure::Transient,
        }
    }

    async fn begin(&self) -> Result<ClaimedTx<DB>, Error> {
        outside_open_claim(self, "a call run with idem switched off")?;
        let sql = Sql::of(DB::flavour(self.pool).await);
        let tx = crate::driver::port::begin_claim(self.pool)
            .await
            .map_err(|e| store_error("beginning the handler's transaction", e))?;
        Ok(ClaimedTx {
            tx,
            owner: 0,
            sql,
            named: crate::driver::pooler::named(self.pool),
        })
    }

    async fn commit(&self, claimed: ClaimedTx<DB>) -> Result<(), Error> {
        claimed
            .tx
            .commit()
            .await
            .map_err(|e| store_error("committing the handler's writes", e))
    }

    fn ledger_identity(&self) -> Option<usize> {
        Some(crate::driver::pooler::identity(self.pool))
    }
}
