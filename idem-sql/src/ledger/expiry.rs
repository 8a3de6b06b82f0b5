//! The purge of expired records, once for every store and driver: which statement each step
//! runs, where the next step starts, and when the purge has finished, on any driver's
//! [`Handle`] (each statement committing on its own); and the database clock expiry is
//! measured on.

use std::time::Instant;

use idem_core::Error;

use crate::driver::failed;
use crate::driver::{connect, fetch_first};
use crate::inspect::existing_tables;
use crate::{CALLS_TABLE, Connection, Driver, Fault, Handle, Purge, Row, STEPS_TABLE, Sql};

/// What a purge does, as its errors say.
const PURGING: &str = "purging expired records";

/// What a purge step returns: its answer, or what it was doing when the statement failed.
type Done<T, C> = Result<T, (&'static str, Fault<<C as Connection>::Error>)>;

/// A purge of expired records, one bounded statement at a time.
///
/// Only records that ended are purged: completed, failed, or given up with no hook owed,
/// and past their TTL. A call not finished is kept however old (a lease-mode call in
/// progress, one whose lease ended unfinished, a resumable call awaiting its completer, a
/// give-up whose hook is owed): deleting it would delete the recorded steps that keep its
/// retry or completer from repeating their effects.
///
/// PostgreSQL and MySQL find expired records by their expiry index: a step deletes up to
/// `batch` of them (PostgreSQL skips rows a claim holds locked). SQLite's ledger has no expiry
/// index, because on SQLite every commit waits for its pages to reach the disk and the index
/// page was a fifth of a first execution's; there a step examines the next `batch` records in
/// key order and deletes the expired ones among them, so one purge reads the ledger once.
///
/// `expired_leases` lists the calls not finished. [`purge_expired`] runs a purge to the end;
/// step one yourself to pace it your own way:
///
/// ```text
/// let mut purge = idem::sea_orm::ExpiredPurge::new(); // or idem::sqlx::ExpiredPurge
/// while let Some(deleted) = purge.step(&db, 500).await? {
///     tracing::debug!(deleted, "purged a batch of expired records");
///     tokio::time::sleep(std::time::Duration::from_millis(5)).await;
/// }
/// assert!(purge.is_finished());
/// ```
#[derive(Debug, Default, Clone)]
pub struct ExpiredPurge {
    /// SQLite: the last key a step examined (empty before the first step: below every key).
    after: Vec<u8>,
    /// Whether the steps and calls tables exist, learnt at the first step: a schema of atomic
    /// calls has the ledger alone (`idem schema --only ledger`).
    tables: Option<(bool, bool)>,
    /// Whether the step that finishes also sweeps orphans ([`ExpiredPurge::with_orphans`]).
    orphans: bool,
    finished: bool,
    deleted: u64,
}

impl ExpiredPurge {
    /// A purge that has not started.
    pub fn new() -> Self {
        Self::default()
    }

    /// This purge, whose last step also deletes the steps and stored calls whose record no
    /// longer exists: rows left by records deleted by hand, or by an earlier version's purge,
    /// which deleted unfinished calls (this purge deletes only records with neither).
    /// Finding them reads the whole ledger, so it is for the operator (`idem purge` does
    /// it), not for a purge run every few seconds, which should read only what it deletes.
    pub fn with_orphans(mut self) -> Self {
        self.orphans = true;
        self
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

    /// Runs one statement on `db` (`batch` rows at most, at least 1) and returns the records
    /// it deleted, or `None` once the purge has finished (then nothing runs). With
    /// [`with_orphans`](Self::with_orphans), the step that finishes also deletes steps and
    /// stored calls left without their record.
    pub async fn step<D: Driver, H: Handle<D>>(
        &mut self,
        db: &H,
        batch: u32,
    ) -> Result<Option<u64>, Error> {
        let (mut conn, sql) = connect(db, PURGING).await?;
        self.step_on(&mut conn, sql, batch)
            .await
            .map_err(failed::<D>)
    }

    /// Runs the purge to its end on `conn` ([`step_on`](Self::step_on) after step), pausing
    /// after each statement for as long as it took. Returns the records deleted.
    async fn run_on<C: Connection>(
        &mut self,
        conn: &mut C,
        sql: &'static Sql,
        batch: u32,
    ) -> Done<u64, C> {
        loop {
            let started = Instant::now();
            self.step_on(conn, sql, batch).await?;
            if self.finished {
                return Ok(self.deleted);
            }
            tokio::time::sleep(started.elapsed()).await;
        }
    }

    /// [`step`](Self::step) on `conn`, whose statements are `sql`'s. An error says what the
    /// step was doing.
    async fn step_on<C: Connection>(
        &mut self,
        conn: &mut C,
        sql: &'static Sql,
        batch: u32,
    ) -> Done<Option<u64>, C> {
        if self.finished {
            return Ok(None);
        }
        let batch = batch.max(1);
        let (steps, calls) = match self.tables {
            Some(tables) => tables,
            None => {
                let existing = existing_tables(conn, sql)
                    .await
                    .map_err(|e| ("listing idem's tables", e))?;
                let has = |table: &str| existing.iter().any(|name| name == table);
                *self.tables.insert((has(STEPS_TABLE), has(CALLS_TABLE)))
            }
        };
        let purging = PURGING;
        let deleted = match sql.ledger.purge(calls) {
            Purge::ByIndex(purge) => {
                let deleted = conn
                    .execute(purge.delete(i64::from(batch)))
                    .await
                    .map_err(|e| (purging, Fault::Db(e)))?;
                self.finished = deleted < u64::from(batch);
                deleted
            }
            Purge::Sweep(sweep) => {
                let next = sweep.bound(&self.after, i64::from(batch - 1));
                let last = fetch_first(conn, next, Row::into_bytes)
                    .await
                    .map_err(|e| ("finding the next records to purge", e))?;
                let delete = match &last {
                    Some(last) => sweep.delete(&self.after, last),
                    None => sweep.delete_rest(&self.after),
                };
                let deleted = conn
                    .execute(delete)
                    .await
                    .map_err(|e| (purging, Fault::Db(e)))?;
                match last {
                    Some(last) => self.after = last,
                    None => self.finished = true,
                }
                deleted
            }
        };
        self.deleted += deleted;
        if self.finished && self.orphans {
            // Steps and stored calls whose record no longer exists (deleted by hand, or by the
            // purge of versions that purged unfinished calls). This purge deletes only
            // records with neither, so it finds nothing in a ledger it alone purged; and each
            // statement reads the whole ledger (R22's soak: a purge every 10 s read it whole
            // every time), so only on demand.
            let orphans = [
                steps.then(|| sql.lease.purge_orphaned_steps()),
                calls.then(|| sql.completer.purge_orphaned_calls()),
            ];
            for orphans in orphans.into_iter().flatten() {
                conn.execute(orphans).await.map_err(|e| {
                    (
                        "purging the steps and calls of purged records",
                        Fault::Db(e),
                    )
                })?;
            }
        }
        Ok(Some(deleted))
    }
}

/// Deletes every record that ended and whose TTL passed, `batch` rows per statement (see
/// [`ExpiredPurge`]), and returns how many it deleted. Calls not finished (a lease that ended
/// unfinished, a resumable call awaiting its completer, a give-up whose hook is owed) are
/// kept however old; `expired_leases` lists them.
///
/// Each statement is its own short transaction, and after each one the purge pauses for as
/// long as the statement took, so it never holds more than half of the database's write time:
/// claims queue behind at most one batch. Small batches keep that wait short (the benchmark's
/// P7: about 150 rows per statement on PostgreSQL keep a statement near 2 ms). On a pool it
/// holds one connection until it ends (SeaORM's: one per statement).
pub async fn purge_expired<D: Driver, H: Handle<D>>(db: &H, batch: u32) -> Result<u64, Error> {
    let (mut conn, sql) = connect(db, PURGING).await?;
    ExpiredPurge::new()
        .run_on(&mut conn, sql, batch)
        .await
        .map_err(failed::<D>)
}

/// The database's clock, in milliseconds since the Unix epoch (what expiry is measured on).
pub async fn database_now_ms<D: Driver, H: Handle<D>>(db: &H) -> Result<i64, Error> {
    let doing = "reading the database clock";
    let (mut conn, sql) = connect(db, doing).await?;
    fetch_first(&mut conn, sql.ledger.select_now(), Row::into_i64)
        .await
        .map_err(|fault| failed::<D>((doing, fault)))?
        .ok_or_else(|| Error::Store {
            message: "the database clock query returned no row".to_owned(),
            source: None,
        })
}
