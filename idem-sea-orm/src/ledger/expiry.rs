//! Expiry: the database's clock, and purging the records that ended and expired, in bounded
//! batches, never a call not finished.

use idem_core::Error;
use sea_orm::ConnectionTrait;

use crate::driver::error::store_error;
use crate::driver::{Bound, Purge, statement};
use crate::{CALLS_TABLE, STEPS_TABLE, inspect, lease};

/// A purge of expired records, one bounded statement at a time. [`purge_expired`] runs one to
/// the end; step one yourself to pace it your own way.
///
/// Only records that ended are purged: completed, failed, or given up with no hook owed,
/// and past their TTL. A call not finished is kept however old (a lease-mode call in
/// progress, one whose lease ended unfinished, a resumable call awaiting its completer, a
/// give-up whose hook is owed): deleting it would delete the recorded steps that keep its
/// retry or completer from repeating their effects. [`expired_leases`](crate::expired_leases) lists those.
///
/// PostgreSQL and MySQL find expired records by their expiry index: a step deletes up to
/// `batch` of them (PostgreSQL skips rows a claim holds locked). SQLite's ledger has no expiry
/// index, because on SQLite every commit waits for its pages to reach the disk and the index
/// page was a fifth of a first execution's; there a step examines the next `batch` records in
/// key order and deletes the expired ones among them, so one purge reads the ledger once.
///
/// ```
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # idem_sea_orm::create_tables(&db).await?;
/// let mut purge = idem_sea_orm::ExpiredPurge::new();
/// while let Some(deleted) = purge.step(&db, 500).await? {
///     tracing::debug!(deleted, "purged a batch of expired records");
///     tokio::time::sleep(std::time::Duration::from_millis(5)).await;
/// }
/// assert!(purge.is_finished());
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(run()).unwrap();
/// ```
#[derive(Debug, Default, Clone)]
pub struct ExpiredPurge {
    /// SQLite: the last key a step examined (empty before the first step: below every key).
    after: Vec<u8>,
    /// Which of the steps and calls tables exist, learnt at the first step: a schema of
    /// atomic calls has the ledger alone (`idem schema --only ledger`).
    tables: Option<OptionalTables>,
    finished: bool,
    deleted: u64,
}

impl ExpiredPurge {
    /// A purge that has not started.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records deleted so far.
    pub fn deleted(&self) -> u64 {
        self.deleted
    }

    /// Whether the purge has finished: every record that had ended and expired when it
    /// started is gone.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Runs one statement (`batch` rows at most, at least 1) and returns the records it
    /// deleted, or `None` once the purge has finished (then nothing runs). The step that
    /// finishes also deletes steps and stored calls left without their record.
    pub async fn step<C: ConnectionTrait>(
        &mut self,
        db: &C,
        batch: u32,
    ) -> Result<Option<u64>, Error> {
        if self.finished {
            return Ok(None);
        }
        let batch = batch.max(1);
        let d = crate::driver::of(db.get_database_backend());
        let tables = match self.tables {
            Some(tables) => tables,
            None => *self.tables.insert(OptionalTables::of(db).await?),
        };
        let delete = |bound: Bound<'static>| {
            let delete = statement(d, bound);
            async move {
                db.execute_raw(delete)
                    .await
                    .map(|done| done.rows_affected())
                    .map_err(|e| store_error("purging expired records", e))
            }
        };
        let deleted = match d.ledger.purge(tables.calls) {
            Purge::ByIndex(purge) => {
                let deleted = delete(purge.delete(i64::from(batch))).await?;
                self.finished = deleted < u64::from(batch);
                deleted
            }
            Purge::Sweep(sweep) => {
                let last = db
                    .query_one_raw(statement(d, sweep.bound(&self.after, i64::from(batch - 1))))
                    .await
                    .and_then(|row| {
                        row.map(|row| row.try_get_by_index::<Vec<u8>>(0))
                            .transpose()
                    })
                    .map_err(|e| store_error("finding the next records to purge", e))?;
                match last {
                    Some(last) => {
                        let deleted = delete(sweep.delete(&self.after, &last)).await?;
                        self.after = last;
                        deleted
                    }
                    None => {
                        self.finished = true;
                        delete(sweep.delete_rest(&self.after)).await?
                    }
                }
            }
        };
        self.deleted += deleted;
        if self.finished {
            lease::purge_orphaned_steps(db, tables.steps, tables.calls).await?;
        }
        Ok(Some(deleted))
    }
}

/// Which of the tables that only some features use exist.
#[derive(Debug, Clone, Copy)]
struct OptionalTables {
    steps: bool,
    calls: bool,
}

impl OptionalTables {
    async fn of<C: ConnectionTrait>(db: &C) -> Result<Self, Error> {
        let missing = inspect::missing_tables(db).await?;
        Ok(Self {
            steps: !missing.contains(&STEPS_TABLE),
            calls: !missing.contains(&CALLS_TABLE),
        })
    }
}

/// Deletes every record that ended and whose TTL passed, `batch` rows per statement (see
/// [`ExpiredPurge`]), and returns how many it deleted. Calls not finished (a lease that ended
/// unfinished, a resumable call awaiting its completer, a give-up whose hook is owed) are
/// kept however old; [`expired_leases`](crate::expired_leases) lists them.
///
/// Each statement is its own short transaction, and after each one the purge pauses for as
/// long as the statement took, so it never holds more than half of the database's write time:
/// claims queue behind at most one batch. Small batches keep that wait short (the benchmark's
/// P7: about 150 rows per statement on PostgreSQL keep a statement near 2 ms).
pub async fn purge_expired<C: ConnectionTrait>(db: &C, batch: u32) -> Result<u64, Error> {
    let mut purge = ExpiredPurge::new();
    loop {
        let started = std::time::Instant::now();
        purge.step(db, batch).await?;
        if purge.is_finished() {
            return Ok(purge.deleted());
        }
        tokio::time::sleep(started.elapsed()).await;
    }
}

/// The database's clock, in milliseconds since the Unix epoch (what expiry is measured on).
pub async fn database_now_ms<C: ConnectionTrait>(db: &C) -> Result<i64, Error> {
    let d = crate::driver::of(db.get_database_backend());
    let row = db
        .query_one_raw(statement(d, d.ledger.select_now()))
        .await
        .map_err(|e| store_error("reading the database clock", e))?;
    row.ok_or_else(|| Error::Store {
        message: "the database clock query returned no row".to_owned(),
        source: None,
    })?
    .try_get_by_index::<i64>(0)
    .map_err(|e| store_error("reading the database clock", e))
}
