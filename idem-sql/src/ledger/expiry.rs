//! The purge of expired records, once for every store: which statement each step runs, where
//! the next step starts, and when the purge has finished. A store supplies the connection
//! ([`PurgeConnection`]) and wraps [`ExpiredPurge`] in its own type.

use std::future::Future;
use std::time::Instant;

use crate::{Bound, CALLS_TABLE, Purge, STEPS_TABLE, Sql};

/// A connection (or pool) the purge's statements run on, each on its own.
pub trait PurgeConnection: Send {
    /// The driver's error.
    type Error: Send;

    /// Runs `statement` and returns the number of rows it changed.
    fn execute(
        &mut self,
        statement: Bound<'static>,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send;

    /// Runs `statement` and reads the one key (bytes) it selects, if any.
    fn fetch_key(
        &mut self,
        statement: Bound<'static>,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, Self::Error>> + Send;

    /// Runs `statement` and reads the one text column of each row it returns.
    fn fetch_texts(
        &mut self,
        statement: Bound<'static>,
    ) -> impl Future<Output = Result<Vec<String>, Self::Error>> + Send;
}

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

    /// Runs the purge to its end on `conn` ([`step`](Self::step) after step), pausing after
    /// each statement for as long as it took, so it never holds more than half of the
    /// database's write time: claims queue behind at most one batch. Returns the records
    /// deleted.
    pub async fn run<C: PurgeConnection>(
        &mut self,
        conn: &mut C,
        sql: &'static Sql,
        batch: u32,
    ) -> Result<u64, (&'static str, C::Error)> {
        loop {
            let started = Instant::now();
            self.step(conn, sql, batch).await?;
            if self.finished {
                return Ok(self.deleted);
            }
            tokio::time::sleep(started.elapsed()).await;
        }
    }

    /// Runs one statement of `sql` on `conn` (`batch` rows at most, at least 1) and returns
    /// the records it deleted, or `None` once the purge has finished (then nothing runs). With
    /// [`with_orphans`](Self::with_orphans), the step that finishes also deletes steps and
    /// stored calls left without their record. An error says what the step was doing.
    pub async fn step<C: PurgeConnection>(
        &mut self,
        conn: &mut C,
        sql: &'static Sql,
        batch: u32,
    ) -> Result<Option<u64>, (&'static str, C::Error)> {
        if self.finished {
            return Ok(None);
        }
        let batch = batch.max(1);
        let (steps, calls) = match self.tables {
            Some(tables) => tables,
            None => {
                let existing = conn
                    .fetch_texts(sql.inspect.existing_tables())
                    .await
                    .map_err(|e| ("listing idem's tables", e))?;
                let has = |table: &str| existing.iter().any(|name| name == table);
                *self.tables.insert((has(STEPS_TABLE), has(CALLS_TABLE)))
            }
        };
        let purging = "purging expired records";
        let deleted = match sql.ledger.purge(calls) {
            Purge::ByIndex(purge) => {
                let deleted = conn
                    .execute(purge.delete(i64::from(batch)))
                    .await
                    .map_err(|e| (purging, e))?;
                self.finished = deleted < u64::from(batch);
                deleted
            }
            Purge::Sweep(sweep) => {
                let last = conn
                    .fetch_key(sweep.bound(&self.after, i64::from(batch - 1)))
                    .await
                    .map_err(|e| ("finding the next records to purge", e))?;
                let delete = match &last {
                    Some(last) => sweep.delete(&self.after, last),
                    None => sweep.delete_rest(&self.after),
                };
                let deleted = conn.execute(delete).await.map_err(|e| (purging, e))?;
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
                conn.execute(orphans)
                    .await
                    .map_err(|e| ("purging the steps and calls of purged records", e))?;
            }
        }
        Ok(Some(deleted))
    }
}
