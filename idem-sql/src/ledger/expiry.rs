//! The purge of expired records, once for every store: which statement each step runs, where
//! the next step starts, and when the purge has finished. A store supplies the connection
//! (any driver's [`Connection`], each statement committing on its own) and wraps
//! [`ExpiredPurge`] in its own type.

use std::time::Instant;

use crate::driver::{fetch_each, fetch_first};
use crate::{CALLS_TABLE, Connection, Fault, Purge, Row, STEPS_TABLE, Sql};

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
    pub async fn run<C: Connection>(
        &mut self,
        conn: &mut C,
        sql: &'static Sql,
        batch: u32,
    ) -> Done<u64, C> {
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
    pub async fn step<C: Connection>(
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
                let existing = fetch_each(conn, sql.inspect.existing_tables(), Row::into_text)
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
